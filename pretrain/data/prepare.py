"""`python -m pretrain.data.prepare --input 'GLOB' --output DIR --tokenizer MODEL`: text files -> webdataset shards.

Reads C4 json.gz, other JSON lines, plain text and Parquet (pretrain/data/documents.py: `--format`,
`--text-field`, `--text-documents`). Each input file is cut into shards of about `--shard-tokens` tokens
(`shard-NNNNNN.tar` for its first, `shard-NNNNNN-PPPP.tar` for part P > 0; N the file's position in the sorted
glob; documents in packs of `--pack-tokens` tokens, see pretrain/data/shards.py), tokenized with the
SentencePiece model, plus a sidecar `shard-NNNNNN.json` per input file (documents, tokens, packs, bad input,
format, and its shards under "parts") and `index.json` gathering them (an entry per shard). Parallel over files with
a process pool (`--workers`) and across machines as a SLURM array job (`--task-index/--num-tasks`, default from
SLURM_ARRAY_TASK_ID/COUNT). Idempotent: a file's shards are written under temporary names and renamed once the file
is done (removed on any failure or signal: SIGTERM/SIGINT end every worker at once), and files already prepared in
the current format are skipped. Bad input (including documents that encode to no token) is skipped, counted and
reported at the end and in the index; it never stops the run, but input with no document at all is an error.
"""
from __future__ import annotations

import argparse
import contextlib
import hashlib
import json
import logging
import os
import signal
import sys
from collections import Counter
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

from tqdm import tqdm
from webdataset import TarWriter

from pretrain.core.config import UsageError
from pretrain.core.files import describe_storage_failure, storage_failure, writing
from pretrain.core.signals import die_with_parent
from pretrain.data.documents import (
    BAD_KINDS,
    Document,
    InputLayout,
    add_layout_arguments,
    expand_glob,
    layout_from_args,
    read_documents,
)
from pretrain.data.shards import (
    FORMAT_VERSION,
    INDEX,
    PACK_TOKENS,
    SHARD_TOKENS,
    encode_pack,
    part_name,
    shard_name,
    token_suffix,
    write_json,
)
from tokenizer.spm import Tokenizer

log = logging.getLogger(__name__)

ENCODE_BATCH = 512  # documents per sentencepiece call: amortises the call, bounds memory
_WORKING: list[Path] = []  # the folder this process writes into: a signal to a worker removes its temporary files


def _remove_temporary(folder: Path) -> None:
    """This process's temporary files in `folder`: shards and a sidecar or index being written (`NAME.tmpPID`)."""
    for tmp in folder.glob(f"*.tmp{os.getpid()}"):
        tmp.unlink(missing_ok=True)


def _sidecar(tar: Path) -> Path:
    return tar.with_suffix(".json")


def prepare_file(
    source: str, tar: Path, tokenizer_path: str, pack_tokens: int = PACK_TOKENS, layout: InputLayout = InputLayout(),
    shard_tokens: int = SHARD_TOKENS,
) -> dict:
    """Tokenize one input file into shards of document packs, a new shard once one holds `shard_tokens` tokens
    (`tar` and its parts, part_name; temporary names, renamed once the file is done, removed on any failure);
    returns its sidecar record. A pack is written once it holds `pack_tokens` tokens, so memory stays bounded."""
    tok = Tokenizer(tokenizer_path)
    suffix = token_suffix(tok.num_ids)
    bad: Counter = Counter()
    stats = {"source": os.path.basename(source), "documents": 0, "tokens": 0, "packs": 0,
             "bytes": os.path.getsize(source), "format": FORMAT_VERSION, "parts": {}}
    pack: dict = {"ids": [], "urls": [], "tokens": 0}  # the pack being filled
    part: dict = {}  # the shard being filled: its name, temporary file, writer and counts
    temporary: list[Path] = []  # the shards written so far, renamed once the file is done
    _WORKING[:] = [tar.parent]

    def open_part() -> None:
        name = part_name(tar, len(stats["parts"]))
        tmp = tar.with_name(name + f".tmp{os.getpid()}")
        temporary.append(tmp)
        f = open(tmp, "wb")
        part.update(name=name, file=f, writer=TarWriter(f, encoder=False, mtime=0), documents=0, tokens=0, packs=0)
        stats["parts"][name] = {"documents": 0, "tokens": 0, "packs": 0}

    def close_part() -> None:
        with writing(temporary[-1]):
            part["writer"].close()
        stats["parts"][part["name"]] = {k: part[k] for k in ("documents", "tokens", "packs")}
        part.clear()

    def write_pack() -> None:
        if not part:
            open_part()
        key = f"{Path(part['name']).stem}_{part['packs']:06d}"
        with writing(temporary[-1]):  # a full disk names the file
            part["writer"].write(encode_pack(key, pack["ids"], pack["urls"], suffix))
        part["documents"] += len(pack["ids"])
        part["tokens"] += pack["tokens"]
        part["packs"] += 1
        stats["packs"] += 1
        pack.update(ids=[], urls=[], tokens=0)
        if part["tokens"] >= shard_tokens:
            close_part()

    def encode(batch: list[Document]) -> None:
        for doc, ids in zip(batch, tok.encode_batch([d.text for d in batch])):
            if not ids:  # text that normalises to nothing (zero-width spaces, control characters)
                bad["empty_text"] += 1
                continue
            pack["ids"].append(ids)
            pack["urls"].append(doc.url)
            pack["tokens"] += len(ids)
            stats["documents"] += 1
            stats["tokens"] += len(ids)
            if pack["tokens"] >= pack_tokens:
                write_pack()

    try:
        batch: list[Document] = []
        for doc in read_documents(source, bad, layout):
            batch.append(doc)
            if len(batch) == ENCODE_BATCH:
                encode(batch)
                batch = []
        encode(batch)
        if pack["ids"]:
            write_pack()
        if not stats["parts"]:  # a file of no document still gets its (empty) shard: the file is done
            open_part()
        if part:
            close_part()
        stats["bad"] = {k: bad[k] for k in BAD_KINDS}
        write_json(_sidecar(tar), stats)  # sidecar first: finished shards always have their record
        for tmp in temporary:
            tmp.replace(tmp.with_name(tmp.name.rsplit(".tmp", 1)[0]))
        temporary.clear()
    except BaseException as e:
        if part:
            with contextlib.suppress(OSError):  # its buffer's flush fails as the write did
                part["file"].close()
        _remove_temporary(tar.parent)
        if (failure := storage_failure(e)) is not None and failure.filename:  # its filename must cross to the pool's
            raise OSError(failure.errno, failure.strerror, failure.filename) from None  # parent: in the arguments
        e.add_note(f"while preparing {source} into {tar}")  # a bug's traceback names the file too
        raise
    return stats


def _parts(tar: Path, sidecar: dict) -> dict[str, dict]:
    """The shards of a prepared input file by name, from its sidecar (one written before files were cut into parts
    describes its one shard)."""
    return sidecar.get("parts") or {tar.name: {k: sidecar[k] for k in ("documents", "tokens", "packs")}}


def _finished(tar: Path) -> dict | None:
    """The sidecar of an input file prepared in the current format whose shards all exist, else None (shards of an
    older format are rebuilt)."""
    if not _sidecar(tar).is_file():
        return None
    sidecar = json.loads(_sidecar(tar).read_text())
    done = sidecar.get("format") == FORMAT_VERSION and all((tar.parent / n).is_file() for n in _parts(tar, sidecar))
    return sidecar if done else None


def write_index(output: Path, shards: list[Path], tokenizer_path: str) -> dict:
    """index.json over every prepared input file: "inputs" (each file's sidecar, by its first shard's name: source,
    bytes, bad input, its shards under "parts") and "shards" (an entry per shard: documents, tokens, packs, source);
    `complete` says whether all input files are done."""
    files = {tar: sidecar for tar in shards if (sidecar := _finished(tar)) is not None}  # each sidecar read once
    entries = {name: {**counts, "source": sidecar["source"]} for tar, sidecar in files.items()
               for name, counts in _parts(tar, sidecar).items()}
    tok = Tokenizer(tokenizer_path)
    index = {
        "complete": len(files) == len(shards),
        "format": FORMAT_VERSION,
        "tokenizer_sha256": hashlib.sha256(Path(tokenizer_path).read_bytes()).hexdigest(),
        "num_ids": tok.num_ids,
        "inputs": {tar.name: sidecar for tar, sidecar in files.items()},
        "documents": sum(e["documents"] for e in files.values()),
        "tokens": sum(e["tokens"] for e in files.values()),
        # .get: a shard prepared before a kind was added lacks it (its sidecar's format is the same)
        "bad": {k: sum(e["bad"].get(k, 0) for e in files.values()) for k in BAD_KINDS},
        "shards": entries,
    }
    write_json(output / INDEX, index)
    return index


def _check_output(output: Path, shards: list[Path], tokenizer_path: str) -> None:
    """Refuse a folder whose existing shards would be kept but do not belong to this run: finished shards are
    skipped, not compared, and the loader reads every tar in the folder."""
    ours = {p.stem for p in shards}
    extra = sorted(p.name for p in output.glob("shard-*.tar") if p.name[: len("shard-000000")] not in ours)
    if extra:
        raise UsageError(f"{output} holds {len(extra)} shards beyond the {len(shards)} input files ({extra[0]}, ...); "
                         "remove them or choose another --output")
    index = output / INDEX
    sha = hashlib.sha256(Path(tokenizer_path).read_bytes()).hexdigest()
    if index.is_file() and json.loads(index.read_text()).get("tokenizer_sha256") != sha:
        raise UsageError(f"the shards in {output} were prepared with another tokenizer than {tokenizer_path}; "
                         "remove them or choose another --output")


class Stopped(Exception):
    """A signal ended the preparation (SIGTERM, SIGINT): the files done are kept, a rerun continues."""


def _stop(signum: int, frame) -> None:
    raise Stopped(signal.Signals(signum).name)


def _worker_exit(signum: int, frame) -> None:
    """A worker's SIGTERM: its temporary files removed, then gone at once (an exception would end one file, and the
    pool's worker would go on with the next one queued)."""
    for folder in _WORKING:
        _remove_temporary(folder)
    os._exit(128 + signum)


def _worker_start(parent: int) -> None:
    """A worker ends with the command however it ends (SIGKILL included: the kernel sends it SIGTERM), and leaves
    no temporary shard; Ctrl-C is the command's to handle."""
    signal.signal(signal.SIGTERM, _worker_exit)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    die_with_parent(signal.SIGTERM, parent)


def prepare(
    files: list[str], output: Path, tokenizer_path: str, workers: int = 1, task_index: int = 0, num_tasks: int = 1,
    pack_tokens: int = PACK_TOKENS, layout: InputLayout = InputLayout(), shard_tokens: int = SHARD_TOKENS,
) -> dict:
    """Prepare this task's share of `files` (every num_tasks-th, from task_index); returns the index. Any way out
    (a failure, a signal turned into `Stopped`) ends every worker at once; the rerun writes the index."""
    output.mkdir(parents=True, exist_ok=True)
    shards = [output / shard_name(i) for i in range(len(files))]
    _check_output(output, shards, tokenizer_path)
    todo = [(f, s) for f, s in list(zip(files, shards))[task_index::num_tasks] if _finished(s) is None]
    skipped = len(files[task_index::num_tasks]) - len(todo)
    if skipped:
        log.info("%d input files already prepared, skipped", skipped)
    # the bar closes on a failure too: otherwise it is drawn again at exit, after the one-line error
    with tqdm(total=sum(os.path.getsize(f) for f, _ in todo), unit="B", unit_scale=True, desc="prepare",
              disable=None) as bar:
        pool = ProcessPoolExecutor(max_workers=workers, initializer=_worker_start, initargs=(os.getpid(),))
        try:
            futures = [pool.submit(prepare_file, f, s, tokenizer_path, pack_tokens, layout, shard_tokens)
                       for f, s in todo]
            for fut in futures:
                bar.update(fut.result()["bytes"])
        except BaseException:
            for process in list(getattr(pool, "_processes", {}).values()):
                process.terminate()  # not the queue's turn: queued files would run to the end first
            pool.shutdown(wait=True, cancel_futures=True)
            raise
        pool.shutdown(wait=True)
    return write_index(output, shards, tokenizer_path)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m pretrain.data.prepare", description=__doc__.splitlines()[0])
    p.add_argument("--input", required=True, help="quoted glob of input files (C4 json.gz, .jsonl, .txt, .parquet)")
    p.add_argument("--output", required=True, type=Path, help="folder for the shards and index.json")
    p.add_argument("--tokenizer", required=True, help="spiece.model from `python -m tokenizer.train`")
    p.add_argument("--pack-tokens", type=int, default=PACK_TOKENS,
                   help=f"tokens per document pack (tar member) (default {PACK_TOKENS})")
    p.add_argument("--shard-tokens", type=int, default=SHARD_TOKENS,
                   help=f"tokens per shard: a larger input file is cut into several (default {SHARD_TOKENS}, "
                        "~256 MB)")
    p.add_argument("--workers", type=int, default=os.cpu_count() or 1, help="processes (default: all cores)")
    # array ids may start anywhere (--array=1-8): the task index counts from SLURM_ARRAY_TASK_MIN
    array_id, array_min = (int(os.environ.get(k, 0)) for k in ("SLURM_ARRAY_TASK_ID", "SLURM_ARRAY_TASK_MIN"))
    p.add_argument("--task-index", type=int, default=array_id - array_min)
    p.add_argument("--num-tasks", type=int, default=int(os.environ.get("SLURM_ARRAY_TASK_COUNT", 1)))
    add_layout_arguments(p)
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    if not 0 <= args.task_index < args.num_tasks:
        p.error(f"--task-index ({args.task_index}) must be in [0, --num-tasks ({args.num_tasks}))")
    if args.pack_tokens < 1:
        p.error(f"--pack-tokens must be at least 1, got {args.pack_tokens}")
    if args.shard_tokens < 1:
        p.error(f"--shard-tokens must be at least 1, got {args.shard_tokens}")
    if args.workers < 1:
        p.error(f"--workers must be at least 1, got {args.workers}")
    try:
        layout = layout_from_args(args)
        files = expand_glob(args.input, layout)
        Tokenizer(args.tokenizer)
    except ValueError as e:
        p.error(str(e))
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, _stop)
    try:
        index = prepare(files, args.output, args.tokenizer, args.workers, args.task_index, args.num_tasks,
                        args.pack_tokens, layout, args.shard_tokens)
    except ValueError as e:
        p.error(str(e))
    except Stopped as e:
        _remove_temporary(args.output)  # an index being written
        print(f"pretrain.data.prepare: stopped by {e}; the input files done are kept and the same command continues",
              file=sys.stderr)
        sys.exit(128 + signal.Signals[str(e)].value)
    except Exception as e:
        if (failure := storage_failure(e)) is None:
            raise
        _remove_temporary(args.output)
        print(f"pretrain.data.prepare: {describe_storage_failure(failure)}; the input files done are kept: free space "
              "and run the same command again", file=sys.stderr)
        sys.exit(1)
    if index["complete"] and not index["documents"]:
        p.error(f"no document in {args.input}: every record was empty or unreadable (bad input: "
                f"{', '.join(f'{k}={v}' for k, v in index['bad'].items() if v) or 'none'}); check --format / "
                "--text-field")
    bad = ", ".join(f"{k}={v}" for k, v in index["bad"].items() if v) or "none"
    state = "complete" if index["complete"] else "partial (other tasks still running)"
    print(f"{args.output}: {len(index['shards'])} shards, {index['documents']} documents, "
          f"{index['tokens']} tokens; bad input skipped: {bad}; index {state}")


if __name__ == "__main__":
    main()
