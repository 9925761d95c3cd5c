"""Shard preparation: token ids and urls round-trip, each kind of bad input is counted, idempotence, array split."""
import gzip
import json
import subprocess
import sys

import numpy as np
import sentencepiece as spm

from pretrain.data.c4 import expand_glob
from pretrain.data.prepare import main, prepare
from pretrain.data.shards import decode_pack, pack_urls, read_packs

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
    assert "bad input skipped: invalid_json=1, non_utf8=1, missing_text=3, truncated_gzip=1" in out
    index = json.loads((tmp_path / "out" / "index.json").read_text())
    assert index["bad"] == {"invalid_json": 1, "non_utf8": 1, "missing_text": 3, "truncated_gzip": 1}
    assert index["shards"]["shard-000000.tar"]["bad"]["invalid_json"] == 1
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
