"""Shard preparation: token ids and urls round-trip from every input format, each kind of bad input is counted,
no temporary file is left on a failure, idempotence, array split."""
import gzip
import json
import re
import subprocess
import sys

import numpy as np
import sentencepiece as spm
import torch

from bench.documents import write_formats
from pretrain.data.documents import expand_glob
from pretrain.data.prepare import main, prepare
from pretrain.data.shards import decode_pack, pack_urls, read_packs
from tests.test_documents import real_documents

GOOD = [{"text": f"Document number {i} talks about the court of appeals.", "timestamp": "t", "url": f"u{i}"}
        for i in range(6)]


def write_c4(path, lines: list[bytes]):
    with gzip.open(path, "wb") as f:
        f.write(b"".join(line + b"\n" for line in lines))


def read_shard(path) -> list[tuple[np.ndarray, str]]:
    """(token ids, url) per document of a shard."""
    errors = []
    docs = []
    for pack in read_packs(str(path), errors.append):
        tokens, lengths = decode_pack(pack)
        docs += list(zip(np.split(tokens, np.cumsum(lengths)[:-1]), pack_urls(pack)))
    assert not errors
    return docs


def test_bad_input_is_skipped_counted_and_reported(tmp_path, tokenizer_model, capsys):
    src = tmp_path / "in"
    src.mkdir()
    good = [json.dumps(d).encode() for d in GOOD]
    write_c4(src / "c4-train.00000-of-00002.json.gz", [
        good[0], b"{not json", good[1], b'{"text": "caf\xe9 bytes", "url": "x"}', good[2],
        b'{"url": "no text"}', b'{"text": "   ", "url": "blank"}', b'["a list"]', good[3],
    ])
    whole = gzip.compress(b"".join(line + b"\n" for line in good[4:] * 400))
    (src / "c4-train.00001-of-00002.json.gz").write_bytes(whole[: len(whole) // 2])  # truncated gzip
    main(["--input", str(src / "*.json.gz"), "--output", str(tmp_path / "out"), "--tokenizer", tokenizer_model,
          "--workers", "2", "--pack-tokens", "1000"])
    out = capsys.readouterr().out
    assert "bad input skipped: invalid_json=1, non_utf8=1, missing_text=2, empty_text=1, truncated_gzip=1" in out
    index = json.loads((tmp_path / "out" / "index.json").read_text())
    assert {k: v for k, v in index["bad"].items() if v} == {"invalid_json": 1, "non_utf8": 1, "missing_text": 2,
                                                            "empty_text": 1, "truncated_gzip": 1}
    assert index["inputs"]["shard-000000.tar"]["bad"]["invalid_json"] == 1
    assert index["complete"] and index["num_ids"] == 1100

    sp = spm.SentencePieceProcessor(model_file=tokenizer_model)
    docs = read_shard(tmp_path / "out" / "shard-000000.tar")
    assert [url for _, url in docs] == ["u0", "u1", "u2", "u3"]
    for (ids, _), doc in zip(docs, GOOD):
        assert ids.dtype == np.dtype("<u2")  # 2 bytes per id
        np.testing.assert_array_equal(ids, sp.encode(doc["text"]))
    # the documents before the damage in the truncated file were kept
    truncated = read_shard(tmp_path / "out" / "shard-000001.tar")
    assert 0 < len(truncated) < 800
    assert index["shards"]["shard-000001.tar"]["documents"] == len(truncated)
    assert index["shards"]["shard-000001.tar"]["packs"] > 1  # documents round-trip across pack boundaries
    assert index["documents"] == 4 + len(truncated)
    assert index["tokens"] == sum(len(ids) for ids, _ in docs + truncated)


def test_every_format_gives_the_shard_of_the_c4_file(tmp_path, c4_dir, tokenizer_model, capsys):
    original = c4_dir / "c4-validation.00000-of-00001.json.gz"
    main(["--input", str(original), "--output", str(tmp_path / "c4"), "--tokenizer", tokenizer_model, "--workers", "1"])
    want = read_shard(tmp_path / "c4" / "shard-000000.tar")
    formats = write_formats(real_documents(c4_dir), tmp_path / "in")
    (tmp_path / "in" / "docs.data").write_bytes((tmp_path / "in" / "docs.jsonl").read_bytes())
    formats["--format jsonl"] = (tmp_path / "in" / "docs.data", None)
    flags = {"text blocks": ["--text-documents", "block"], "--format jsonl": ["--format", "jsonl"]}
    for name, (path, _) in formats.items():
        out = tmp_path / name.replace(" ", "_")
        main(["--input", str(path), "--output", str(out), "--tokenizer", tokenizer_model, "--workers", "1",
              "--text-field", "body", *flags.get(name, [])])
        assert "bad input skipped: none" in capsys.readouterr().out, name
        got = read_shard(out / "shard-000000.tar")
        assert len(got) == len(want) == 104, name
        for (ids, url), (want_ids, want_url) in zip(got, want):
            np.testing.assert_array_equal(ids, want_ids)  # sentencepiece reads a newline as a space
            assert url == ("" if name.startswith("text") else want_url), name
        if not name.startswith("text"):  # the same documents and urls: the same shard, byte for byte
            assert (out / "shard-000000.tar").read_bytes() == (tmp_path / "c4" / "shard-000000.tar").read_bytes()


def test_a_lone_surrogate_is_counted_and_skipped(tmp_path, tokenizer_model, capsys):
    """A document holding "\ud800" (valid JSON) ended prepare with a TypeError naming no file, leaving a temp file."""
    write_c4(tmp_path / "c4-train.00000-of-00001.json.gz", [
        json.dumps(GOOD[0]).encode(), b'{"text": "half a pair \\ud800 of surrogates", "url": "s"}',
        json.dumps(GOOD[1]).encode()])
    main(["--input", str(tmp_path / "*.json.gz"), "--output", str(tmp_path / "out"), "--tokenizer", tokenizer_model,
          "--workers", "1"])
    assert "2 documents" in capsys.readouterr().out
    index = json.loads((tmp_path / "out" / "index.json").read_text())
    assert index["documents"] == 2 and index["bad"]["lone_surrogate"] == 1
    assert [url for _, url in read_shard(tmp_path / "out" / "shard-000000.tar")] == ["u0", "u1"]
    assert not list((tmp_path / "out").glob("*.tmp*"))


def test_empty_documents_are_counted_and_dropped(tmp_path, tokenizer_model, capsys):
    """Zero-length, whitespace-only and zero-width-space documents (no token at all) are counted, never stored."""
    write_c4(tmp_path / "c4-train.00000-of-00001.json.gz", [json.dumps(d).encode() for d in [
        GOOD[0], {"text": "", "url": "e1"}, {"text": " \n\t ", "url": "e2"}, {"text": "\u200b\u200b", "url": "e3"},
        GOOD[1]]])
    main(["--input", str(tmp_path / "*.json.gz"), "--output", str(tmp_path / "out"), "--tokenizer", tokenizer_model,
          "--workers", "1"])
    assert "2 documents" in capsys.readouterr().out
    index = json.loads((tmp_path / "out" / "index.json").read_text())
    assert index["documents"] == 2 and index["bad"]["empty_text"] == 3
    docs = read_shard(tmp_path / "out" / "shard-000000.tar")
    assert [url for _, url in docs] == ["u0", "u1"] and all(len(ids) for ids, _ in docs)


def test_a_file_that_cannot_be_read_is_one_line_and_leaves_no_temporary_file(tmp_path, tokenizer_model):
    (tmp_path / "c4-train.00000-of-00001.json.gz").write_text(json.dumps(GOOD[0]) + "\n")  # not gzip
    r = subprocess.run([sys.executable, "-m", "pretrain.data.prepare", "--input", str(tmp_path / "*.json.gz"),
                        "--output", str(tmp_path / "out"), "--tokenizer", tokenizer_model, "--workers", "1"],
                       capture_output=True, text=True)
    assert r.returncode == 2 and "Traceback" not in r.stderr
    last = r.stderr.strip().splitlines()[-1]  # the progress bar is not drawn again after it, at exit
    assert last.startswith("python -m pretrain.data.prepare: error: ") and "00001.json.gz is not a gzip file" in last
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == []  # no shard, no temporary file, no index


def test_idempotent_and_split_across_array_tasks(tmp_path, c4_dir, tokenizer_model):
    files = expand_glob(str(c4_dir / "c4-train.*.json.gz"))[:4]
    first = prepare(files, tmp_path / "a", tokenizer_model, task_index=0, num_tasks=2)
    assert not first["complete"] and sorted(first["shards"]) == ["shard-000000.tar", "shard-000002.tar"]
    second = prepare(files, tmp_path / "a", tokenizer_model, task_index=1, num_tasks=2)
    assert second["complete"] and len(second["shards"]) == 4
    whole = prepare(files, tmp_path / "b", tokenizer_model, workers=2)
    assert whole["shards"] == second["shards"]
    for name in whole["shards"]:
        assert (tmp_path / "a" / name).read_bytes() == (tmp_path / "b" / name).read_bytes()
    # finished shards are skipped; a missing one is rebuilt; no temporary files remain
    mtimes = {p.name: p.stat().st_mtime_ns for p in (tmp_path / "b").glob("*.tar")}
    (tmp_path / "b" / "shard-000001.tar").unlink()
    prepare(files, tmp_path / "b", tokenizer_model)
    again = {p.name: p.stat().st_mtime_ns for p in (tmp_path / "b").glob("*.tar")}
    assert {k for k in mtimes if mtimes[k] != again[k]} == {"shard-000001.tar"}
    assert not list((tmp_path / "b").glob("*.tmp*"))


def test_array_task_defaults_from_slurm(tmp_path, c4_dir, tokenizer_model, monkeypatch):
    monkeypatch.setenv("SLURM_ARRAY_TASK_ID", "3")
    monkeypatch.setenv("SLURM_ARRAY_TASK_MIN", "2")
    monkeypatch.setenv("SLURM_ARRAY_TASK_COUNT", "2")
    main(["--input", str(c4_dir / "c4-train.0000[0-3]-*.json.gz"), "--output", str(tmp_path),
          "--tokenizer", tokenizer_model, "--workers", "1"])
    assert sorted(p.name for p in tmp_path.glob("*.tar")) == ["shard-000001.tar", "shard-000003.tar"]


def test_glob_matching_nothing_is_one_line(tmp_path, tokenizer_model):
    r = subprocess.run([sys.executable, "-m", "pretrain.data.prepare", "--input", str(tmp_path / "none*.gz"),
                        "--output", str(tmp_path), "--tokenizer", tokenizer_model], capture_output=True, text=True)
    assert r.returncode == 2 and "Traceback" not in r.stderr
    assert r.stderr.strip().splitlines()[-1].startswith("python -m pretrain.data.prepare: error: no files match")


def test_a_corpus_of_empty_lines_is_one_line_in_both_tools(tmp_path, tokenizer_model):
    (tmp_path / "empty.txt").write_text("\n" * 50 + "   \n" * 10)
    for cmd in (["tokenizer.train", "--output", str(tmp_path / "tok"), "--vocab-size", "100"],
                ["pretrain.data.prepare", "--output", str(tmp_path / "out"), "--tokenizer", tokenizer_model,
                 "--workers", "1"]):
        r = subprocess.run([sys.executable, "-m", *cmd, "--input", str(tmp_path / "empty.txt")], capture_output=True,
                           text=True)
        last = r.stderr.strip().splitlines()[-1]
        assert r.returncode == 2 and "Traceback" not in r.stderr and "INTERNAL" not in r.stderr, r.stderr
        assert last.startswith(f"python -m {cmd[0]}: error: no ") and "empty" in last, last


def test_sigterm_ends_every_worker_at_once_and_a_rerun_continues(tmp_path, c4_dir, tokenizer_model):
    import signal
    import time

    import psutil

    src = tmp_path / "in"
    src.mkdir()
    for i, f in enumerate(sorted(c4_dir.glob("c4-train.*.json.gz")) * 3):
        (src / f"c4-train.{i:05d}-of-00024.json.gz").symlink_to(f)
    cmd = [sys.executable, "-m", "pretrain.data.prepare", "--input", str(src / "*.json.gz"), "--output",
           str(tmp_path / "out"), "--tokenizer", tokenizer_model, "--workers", "2"]
    proc = subprocess.Popen(cmd, stderr=subprocess.PIPE, text=True)
    workers = []
    while proc.poll() is None and not (len(workers) == 2 and list((tmp_path / "out").glob("*.tmp*"))):
        workers = psutil.Process(proc.pid).children() if proc.poll() is None else workers
        time.sleep(0.05)
    assert proc.poll() is None, "prepare ended before a worker started writing"
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 128 + signal.SIGTERM and "Traceback" not in err, err
    assert err.strip().splitlines()[-1] == ("pretrain.data.prepare: stopped by SIGTERM; the input files done are kept "
                                            "and the same command continues")
    psutil.wait_procs(workers, timeout=30)
    assert not [w for w in workers if w.is_running() and w.status() != psutil.STATUS_ZOMBIE]  # no orphan
    assert not list((tmp_path / "out").glob("*.tmp*"))
    done = sum(p.with_suffix(".tar").is_file() for p in (tmp_path / "out").glob("shard-*.json"))  # sidecar, then tar
    assert done < 24
    r = subprocess.run(cmd, capture_output=True, text=True)
    assert r.returncode == 0 and (not done or f"{done} input files already prepared, skipped" in r.stderr), r.stderr
    index = json.loads((tmp_path / "out" / "index.json").read_text())
    assert index["complete"] and len(index["shards"]) == 24


def test_a_full_disk_is_one_line_naming_the_errno_and_the_file(tmp_path, c4_dir, tokenizer_model):
    from tests.distributed import disk_full

    r = subprocess.run([sys.executable, "-m", "pretrain.data.prepare", "--input", str(c4_dir / "c4-train.0000[0-1]*"),
                        "--output", str(tmp_path / "out"), "--tokenizer", tokenizer_model, "--workers", "2",
                        "--pack-tokens", "20000"], capture_output=True, text=True,
                       preexec_fn=lambda: (disk_full(), __import__("resource").setrlimit(
                           __import__("resource").RLIMIT_FSIZE, (100_000, 100_000))))
    last = r.stderr.strip().splitlines()[-1]
    assert r.returncode == 1 and "Traceback" not in r.stderr, r.stderr
    assert re.fullmatch(rf"pretrain.data.prepare: file too large \(EFBIG\): {tmp_path}/out/shard-00000[01].tar.tmp\d+; "
                        r"the input files done are kept: free space and run the same command again", last), last
    assert not list((tmp_path / "out").glob("*.tmp*"))


def test_a_folder_prepared_before_shards_were_cut_by_size_is_kept_and_loads(tmp_path, c4_dir, tokenizer_model):
    # one shard per input file, sidecars without "parts", an index without "inputs": prepare counts the files as
    # done, and the loader reads the folder as before (the same batches as the folder prepared today)
    from pretrain.core.config import DataConfig
    from pretrain.data.loader import build_train_loader

    files = expand_glob(str(c4_dir / "c4-train.*.json.gz"))[:3]
    for name in ("old", "new"):
        prepare(files, tmp_path / name, tokenizer_model)
    old = tmp_path / "old"
    for sidecar in old.glob("shard-*.json"):
        record = json.loads(sidecar.read_text())
        del record["parts"]
        sidecar.write_text(json.dumps(record))
    index = json.loads((old / "index.json").read_text())
    index["shards"] = index.pop("inputs")  # the sidecars by shard, as prepare wrote them then
    (old / "index.json").write_text(json.dumps(index))
    mtimes = {p.name: p.stat().st_mtime_ns for p in old.glob("*.tar")}
    assert prepare(files, old, tokenizer_model)["complete"]
    assert {p.name: p.stat().st_mtime_ns for p in old.glob("*.tar")} == mtimes  # nothing prepared again
    (old / "index.json").write_text(json.dumps(index))
    batches = {}
    for name in ("old", "new"):
        cfg = DataConfig(train=str(tmp_path / name), tokenizer=tokenizer_model, input_length=64, workers=0)
        loader = iter(build_train_loader(cfg, seed=0, dp_rank=0, dp_size=2, micro_batch=4))
        batches[name] = [next(loader)["input_ids"] for _ in range(3)]
    for a, b in zip(batches["old"], batches["new"]):
        assert torch.equal(a, b)
