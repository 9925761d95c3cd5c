"""`python -m pretrain.data.prepare --input 'GLOB' --output DIR --tokenizer MODEL`: text files -> webdataset shards.

Reads C4 json.gz, other JSON lines, plain text and Parquet (pretrain/data/documents.py: `--format`,
`--text-field`, `--text-documents`). One shard per input file (`shard-NNNNNN.tar`, N the file's position in the
sorted glob; documents in packs of `--pack-tokens` tokens, see pretrain/data/shards.py), tokenized with the
SentencePiece model, plus a sidecar `shard-NNNNNN.json` (documents, tokens, packs, bad input, format) and
`index.json` gathering them. Parallel over files with a process pool (`--workers`) and across machines as a
SLURM array job (`--task-index/--num-tasks`, default from SLURM_ARRAY_TASK_ID/COUNT). Idempotent: a shard is
written under a temporary name and renamed (and removed on any failure), and shards already present in the
current format are skipped. Bad input (including documents that encode to no token) is skipped, counted and
reported at the end and in the index; it never stops the run.
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

from pretrain.core.config import UsageError
from pretrain.data.documents import (
    BAD_KINDS,
    Document,
    InputLayout,
    add_layout_arguments,
    expand_glob,
    layout_from_args,
    read_documents,
)
from pretrain.data.shards import FORMAT_VERSION, INDEX, PACK_TOKENS, encode_pack, shard_name, token_suffix, write_json
from tokenizer.spm import Tokenizer

log = logging.getLogger(__name__)

ENCODE_BATCH = 512  # documents per sentencepiece call: amortises the call, bounds memory


def _sidecar(tar: Path) -> Path:
    return tar.with_suffix(".json")


def prepare_file(
    source: str, tar: Path, tokenizer_path: str, pack_tokens: int = PACK_TOKENS, layout: InputLayout = InputLayout(),
) -> dict:
    """Tokenize one input file into one shard of document packs (temporary name, then rename; removed on any
    failure); returns its sidecar record. A pack is written once it holds `pack_tokens` tokens, so memory stays
    bounded."""
    tok = Tokenizer(tokenizer_path)
    suffix = token_suffix(tok.num_ids)
    bad: Counter = Counter()
    stats = {"source": os.path.basename(source), "documents": 0, "tokens": 0, "packs": 0,
             "bytes": os.path.getsize(source), "format": FORMAT_VERSION}
    tmp = tar.with_name(tar.name + f".tmp{os.getpid()}")
    pack: dict = {"ids": [], "urls": [], "tokens": 0}  # the pack being filled

    def write_pack(writer: TarWriter) -> None:
        writer.write(encode_pack(f"{tar.stem}_{stats['packs']:06d}", pack["ids"], pack["urls"], suffix))
        stats["packs"] += 1
        pack.update(ids=[], urls=[], tokens=0)

    def encode(writer: TarWriter, batch: list[Document]) -> None:
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
                write_pack(writer)

    try:
        with open(tmp, "wb") as f, TarWriter(f, encoder=False, mtime=0) as writer:
            batch: list[Document] = []
            for doc in read_documents(source, bad, layout):
                batch.append(doc)
                if len(batch) == ENCODE_BATCH:
                    encode(writer, batch)
                    batch = []
            encode(writer, batch)
            if pack["ids"]:
                write_pack(writer)
    except BaseException as e:
        tmp.unlink(missing_ok=True)
        e.add_note(f"while preparing {source} into {tar}")  # a bug's traceback names the file too
        raise
    stats["bad"] = {k: bad[k] for k in BAD_KINDS}
    write_json(_sidecar(tar), stats)  # sidecar first: a finished tar always has its record
    tmp.replace(tar)
    return stats


def _finished(tar: Path) -> bool:
    """A shard of the current format whose sidecar exists (shards of an older format are rebuilt)."""
    return (tar.is_file() and _sidecar(tar).is_file()
            and json.loads(_sidecar(tar).read_text()).get("format") == FORMAT_VERSION)


def write_index(output: Path, shards: list[Path], tokenizer_path: str) -> dict:
    """index.json over every shard whose sidecar exists; `complete` says whether all shards are done."""
    entries = {}
    for tar in shards:
        if _finished(tar):
            entries[tar.name] = json.loads(_sidecar(tar).read_text())
    tok = Tokenizer(tokenizer_path)
    index = {
        "complete": len(entries) == len(shards),
        "format": FORMAT_VERSION,
        "tokenizer_sha256": hashlib.sha256(Path(tokenizer_path).read_bytes()).hexdigest(),
        "num_ids": tok.num_ids,
        "documents": sum(e["documents"] for e in entries.values()),
        "tokens": sum(e["tokens"] for e in entries.values()),
        # .get: a shard prepared before a kind was added lacks it (its sidecar's format is the same)
        "bad": {k: sum(e["bad"].get(k, 0) for e in entries.values()) for k in BAD_KINDS},
        "shards": entries,
    }
    write_json(output / INDEX, index)
    return index


def _check_output(output: Path, shards: list[Path], tokenizer_path: str) -> None:
    """Refuse a folder whose existing shards would be kept but do not belong to this run: finished shards are
    skipped, not compared, and the loader reads every tar in the folder."""
    extra = sorted(p.name for p in output.glob("shard-*.tar") if p not in shards)
    if extra:
        raise UsageError(f"{output} holds {len(extra)} shards beyond the {len(shards)} input files ({extra[0]}, ...); "
                         "remove them or choose another --output")
    index = output / INDEX
    sha = hashlib.sha256(Path(tokenizer_path).read_bytes()).hexdigest()
    if index.is_file() and json.loads(index.read_text()).get("tokenizer_sha256") != sha:
        raise UsageError(f"the shards in {output} were prepared with another tokenizer than {tokenizer_path}; "
                         "remove them or choose another --output")


def prepare(
    files: list[str], output: Path, tokenizer_path: str, workers: int = 1, task_index: int = 0, num_tasks: int = 1,
    pack_tokens: int = PACK_TOKENS, layout: InputLayout = InputLayout(),
) -> dict:
    """Prepare this task's share of `files` (every num_tasks-th, from task_index); returns the index."""
    output.mkdir(parents=True, exist_ok=True)
    shards = [output / shard_name(i) for i in range(len(files))]
    _check_output(output, shards, tokenizer_path)
    todo = [(f, s) for f, s in list(zip(files, shards))[task_index::num_tasks] if not _finished(s)]
    skipped = len(files[task_index::num_tasks]) - len(todo)
    if skipped:
        log.info("%d shards already present, skipped", skipped)
    # the bar closes on a failure too: otherwise it is drawn again at exit, after the one-line error
    with tqdm(total=sum(os.path.getsize(f) for f, _ in todo), unit="B", unit_scale=True, desc="prepare") as bar, \
            ProcessPoolExecutor(max_workers=workers) as pool:
        futures = [pool.submit(prepare_file, f, s, tokenizer_path, pack_tokens, layout) for f, s in todo]
        for fut in futures:
            bar.update(fut.result()["bytes"])
    return write_index(output, shards, tokenizer_path)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m pretrain.data.prepare", description=__doc__.splitlines()[0])
    p.add_argument("--input", required=True, help="quoted glob of input files (C4 json.gz, .jsonl, .txt, .parquet)")
    p.add_argument("--output", required=True, type=Path, help="folder for the shards and index.json")
    p.add_argument("--tokenizer", required=True, help="spiece.model from `python -m tokenizer.train`")
    p.add_argument("--pack-tokens", type=int, default=PACK_TOKENS,
                   help=f"tokens per document pack (tar member) (default {PACK_TOKENS})")
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
    if args.workers < 1:
        p.error(f"--workers must be at least 1, got {args.workers}")
    try:
        layout = layout_from_args(args)
        files = expand_glob(args.input, layout)
        Tokenizer(args.tokenizer)
    except ValueError as e:
        p.error(str(e))
    try:
        index = prepare(files, args.output, args.tokenizer, args.workers, args.task_index, args.num_tasks,
                        args.pack_tokens, layout)
    except ValueError as e:
        p.error(str(e))
    bad = ", ".join(f"{k}={v}" for k, v in index["bad"].items() if v) or "none"
    state = "complete" if index["complete"] else "partial (other tasks still running)"
    print(f"{args.output}: {len(index['shards'])} shards, {index['documents']} documents, "
          f"{index['tokens']} tokens; bad input skipped: {bad}; index {state}")


if __name__ == "__main__":
    main()
