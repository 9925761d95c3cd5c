"""`python -m pretrain.data.prepare --input 'GLOB' --output DIR --tokenizer MODEL`: C4 json.gz -> webdataset shards.

One shard per input file (`shard-NNNNNN.tar`, N the file's position in the sorted glob), tokenized with the
SentencePiece model, plus a sidecar `shard-NNNNNN.json` (documents, tokens, bad input) and `index.json`
gathering them. Parallel over files with a process pool (`--workers`) and across machines as a SLURM array
job (`--task-index/--num-tasks`, default from SLURM_ARRAY_TASK_ID/COUNT). Idempotent: a shard is written
under a temporary name and renamed, and shards already present are skipped. Bad input is skipped, counted
and reported at the end and in the index; it never stops the run.
"""
from __future__ import annotations

import argparse
import hashlib
import json
import logging
import os
from collections import Counter
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

from tqdm import tqdm
from webdataset import TarWriter

from pretrain.data.c4 import BAD_KINDS, expand_glob, read_documents
from pretrain.data.shards import INDEX, encode_sample, shard_name, token_suffix, write_json
from tokenizer.spm import Tokenizer

log = logging.getLogger(__name__)

ENCODE_BATCH = 512  # documents per sentencepiece call: amortises the call, bounds memory


def _sidecar(tar: Path) -> Path:
    return tar.with_suffix(".json")


def prepare_file(source: str, tar: Path, tokenizer_path: str) -> dict:
    """Tokenize one C4 file into one shard (temporary name, then rename); returns its sidecar record."""
    tok = Tokenizer(tokenizer_path)
    suffix = token_suffix(tok.num_ids)
    bad: Counter = Counter()
    stats = {"source": os.path.basename(source), "documents": 0, "tokens": 0, "bytes": os.path.getsize(source)}
    tmp = tar.with_name(tar.name + f".tmp{os.getpid()}")

    def flush(writer: TarWriter, batch: list[dict]) -> None:
        for doc, ids in zip(batch, tok.encode_batch([d["text"] for d in batch])):
            writer.write(encode_sample(f"{tar.stem}_{stats['documents']:09d}", ids, doc.get("url", ""), suffix))
            stats["documents"] += 1
            stats["tokens"] += len(ids)

    with open(tmp, "wb") as f, TarWriter(f, encoder=False, mtime=0) as writer:
        batch: list[dict] = []
        for doc in read_documents(source, bad):
            batch.append(doc)
            if len(batch) == ENCODE_BATCH:
                flush(writer, batch)
                batch = []
        flush(writer, batch)
    stats["bad"] = {k: bad[k] for k in BAD_KINDS}
    write_json(_sidecar(tar), stats)  # sidecar first: a finished tar always has its record
    tmp.replace(tar)
    return stats


def write_index(output: Path, shards: list[Path], tokenizer_path: str) -> dict:
    """index.json over every shard whose sidecar exists; `complete` says whether all shards are done."""
    entries = {}
    for tar in shards:
        if tar.is_file() and _sidecar(tar).is_file():
            entries[tar.name] = json.loads(_sidecar(tar).read_text())
    tok = Tokenizer(tokenizer_path)
    index = {
        "complete": len(entries) == len(shards),
        "tokenizer_sha256": hashlib.sha256(Path(tokenizer_path).read_bytes()).hexdigest(),
        "num_ids": tok.num_ids,
        "documents": sum(e["documents"] for e in entries.values()),
        "tokens": sum(e["tokens"] for e in entries.values()),
        "bad": {k: sum(e["bad"][k] for e in entries.values()) for k in BAD_KINDS},
        "shards": entries,
    }
    write_json(output / INDEX, index)
    return index


def prepare(
    files: list[str], output: Path, tokenizer_path: str, workers: int = 1, task_index: int = 0, num_tasks: int = 1
) -> dict:
    """Prepare this task's share of `files` (every num_tasks-th, from task_index); returns the index."""
    output.mkdir(parents=True, exist_ok=True)
    shards = [output / shard_name(i) for i in range(len(files))]
    todo = [(f, s) for f, s in list(zip(files, shards))[task_index::num_tasks] if not s.is_file()]
    skipped = len(files[task_index::num_tasks]) - len(todo)
    if skipped:
        log.info("%d shards already present, skipped", skipped)
    bar = tqdm(total=sum(os.path.getsize(f) for f, _ in todo), unit="B", unit_scale=True, desc="prepare")
    with ProcessPoolExecutor(max_workers=workers) as pool:
        futures = [pool.submit(prepare_file, f, s, tokenizer_path) for f, s in todo]
        for fut in futures:
            bar.update(fut.result()["bytes"])
    bar.close()
    return write_index(output, shards, tokenizer_path)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m pretrain.data.prepare", description=__doc__.splitlines()[0])
    p.add_argument("--input", required=True, help="quoted glob of C4 json.gz files")
    p.add_argument("--output", required=True, type=Path, help="folder for the shards and index.json")
    p.add_argument("--tokenizer", required=True, help="spiece.model from `python -m tokenizer.train`")
    p.add_argument("--workers", type=int, default=os.cpu_count() or 1, help="processes (default: all cores)")
    # array ids may start anywhere (--array=1-8): the task index counts from SLURM_ARRAY_TASK_MIN
    array_id, array_min = (int(os.environ.get(k, 0)) for k in ("SLURM_ARRAY_TASK_ID", "SLURM_ARRAY_TASK_MIN"))
    p.add_argument("--task-index", type=int, default=array_id - array_min)
    p.add_argument("--num-tasks", type=int, default=int(os.environ.get("SLURM_ARRAY_TASK_COUNT", 1)))
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    if not 0 <= args.task_index < args.num_tasks:
        p.error(f"--task-index ({args.task_index}) must be in [0, --num-tasks ({args.num_tasks}))")
    if args.workers < 1:
        p.error(f"--workers must be at least 1, got {args.workers}")
    try:
        files = expand_glob(args.input)
        Tokenizer(args.tokenizer)
    except ValueError as e:
        p.error(str(e))
    index = prepare(files, args.output, args.tokenizer, args.workers, args.task_index, args.num_tasks)
    bad = ", ".join(f"{k}={v}" for k, v in index["bad"].items() if v) or "none"
    state = "complete" if index["complete"] else "partial (other tasks still running)"
    print(f"{args.output}: {len(index['shards'])} shards, {index['documents']} documents, "
          f"{index['tokens']} tokens; bad input skipped: {bad}; index {state}")


if __name__ == "__main__":
    main()
