"""`python -m bench.documents`: input-format throughput on one core, reading documents and preparing shards.

The fetched real text (pretrain.data.fetch, all of it) is rewritten into every input format that
pretrain/data/documents.py reads (`write_formats`, which the format tests use too). For each format it measures
the reader alone (documents out of the file, every check included) and `prepare_file` (read, tokenize with an
8,000-piece tokenizer trained on the same text, write the shard), as MB per second of the file and of its text
(UTF-8) and as documents per second, all per second of this process's CPU time (everything measured runs on
one thread), so other load on a shared machine does not skew the comparison.
"""
from __future__ import annotations

import argparse
import gzip
import json
import os
import re
from collections import Counter
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq

from bench.data import bench_text, cpu_rate
from pretrain.data.documents import Document, InputLayout, read_documents
from pretrain.data.prepare import prepare_file


def block_text(text: str) -> str:
    """A document as a blank-line-separated block: its own blank lines collapsed."""
    return re.sub(r"\n\s*\n", "\n", text)


def write_formats(
    docs: list[Document], folder: Path, row_group_size: int = 1000,
) -> dict[str, tuple[Path, InputLayout]]:
    """`docs` in each input format (name -> file, layout), the text in a field named `body`; plain text holds
    one document per line (its newlines as spaces) or per block (`block_text`), without urls."""
    folder.mkdir(parents=True, exist_ok=True)
    records = "".join(json.dumps({"body": d.text, "url": d.url}) + "\n" for d in docs)
    (folder / "docs.jsonl").write_text(records)
    for name in ("docs.jsonl.gz", "docs.json.gz"):
        with gzip.open(folder / name, "wt") as f:
            f.write(records)
    (folder / "lines.txt").write_text("".join(d.text.replace("\n", " ") + "\n" for d in docs))
    (folder / "blocks.txt").write_text("\n\n".join(block_text(d.text) for d in docs) + "\n")
    table = pa.table({"id": list(range(len(docs))), "body": [d.text for d in docs], "url": [d.url for d in docs]})
    pq.write_table(table, folder / "docs.parquet", row_group_size=row_group_size)  # snappy, pyarrow's default
    body = InputLayout(text_field="body")
    return {
        "jsonl": (folder / "docs.jsonl", body),
        "jsonl.gz": (folder / "docs.jsonl.gz", body),
        "json.gz": (folder / "docs.json.gz", body),
        "text lines": (folder / "lines.txt", InputLayout()),
        "text blocks": (folder / "blocks.txt", InputLayout(text_documents="block")),
        "parquet": (folder / "docs.parquet", body),
    }


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m bench.documents", description=__doc__.splitlines()[0])
    p.add_argument("--vocab-size", type=int, default=8000, help="pieces of the tokenizer trained for the bench")
    p.add_argument("--seconds", type=float, default=3.0, help="CPU seconds per measurement")
    args = p.parse_args(argv)
    files, work, model = bench_text(args.vocab_size, "bench-documents")
    docs = [d for f in files for d in read_documents(f, Counter())]
    formats = write_formats(docs, work / "in")
    del formats["json.gz"]  # the same bytes as jsonl.gz
    print(f"{len(docs)} documents; MB/s of the file (of its text), documents/s; per CPU second, one core")
    print("| format | file MB | read: MB/s | read: docs/s | prepare: MB/s | prepare: docs/s |")
    print("|---|---|---|---|---|---|")
    for name, (path, layout) in formats.items():
        got = list(read_documents(path, Counter(), layout))
        file_mb, text_mb = path.stat().st_size / 1e6, sum(len(d.text.encode()) for d in got) / 1e6
        reads = cpu_rate(lambda: sum(1 for _ in read_documents(path, Counter(), layout)), 1, args.seconds)
        tar = work / "out" / f"shard-{name.replace(' ', '_')}.tar"
        tar.parent.mkdir(exist_ok=True)
        prepares = cpu_rate(lambda: prepare_file(str(path), tar, model, layout=layout), 1, args.seconds)
        print(f"| {name} | {file_mb:.2f} | {reads * file_mb:.1f} ({reads * text_mb:.1f}) | {reads * len(got):,.0f} "
              f"| {prepares * file_mb:.2f} ({prepares * text_mb:.2f}) | {prepares * len(got):,.0f} |")
    print(f"load average {os.getloadavg()[0]:.1f}")


if __name__ == "__main__":
    main()
