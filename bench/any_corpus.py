"""`python -m bench.any_corpus`: a corpus that arrives as one file, and a mixture with a source of one small shard,
on several DP sizes, with the default 64 lanes (issue 44).

    OMP_NUM_THREADS=1 .venv/bin/python -m bench.any_corpus [--batches 12 --global-batch 64]

Measures, on the fetched real text (pretrain.data.fetch) joined into one json.gz and prepared into one shard,
with a tokenizer trained on it:
- the global batches at DP 1, 2, 4 and 8 (every rank's loader, its examples put back at their global index):
  a digest of each layout's examples and whether they equal DP 1's;
- a mixture of that shard at 0.9 and a source of 100 sentences in one text file at 0.1 at DP 4: the small
  source's realised share of the examples, against 0.1, and how many lanes drew from it.
"""
from __future__ import annotations

import argparse
import gzip
import hashlib
import itertools
from pathlib import Path

import numpy as np

from bench.data import bench_text
from pretrain.core.config import DataConfig, SourceConfig
from pretrain.data.loader import build_train_loader
from pretrain.data.prepare import prepare


def global_rows(cfg: DataConfig, dp: int, micro: int, batches: int, global_batch: int) -> list[tuple]:
    """(source, input ids) of `batches` global batches, every DP rank's example j at global index j * dp + r."""
    per_rank = []
    for rank in range(dp):
        loader = build_train_loader(cfg, seed=0, dp_rank=rank, dp_size=dp, micro_batch=micro)
        got = list(itertools.islice(loader, batches * global_batch // (dp * micro)))
        per_rank.append([tuple(row.tolist()) for b in got for row in b["input_ids"]])
    return [per_rank[i % dp][i // dp] for i in range(batches * global_batch)]


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m bench.any_corpus", description=__doc__.splitlines()[0])
    p.add_argument("--batches", type=int, default=12, help="global batches per layout")
    p.add_argument("--global-batch", type=int, default=64)
    p.add_argument("--vocab-size", type=int, default=2000)
    args = p.parse_args(argv)
    files, work, model = bench_text(args.vocab_size, "bench-any-corpus")
    one = work / "corpus.json.gz"
    with gzip.open(one, "wb") as out:
        for f in sorted(files):
            out.write(gzip.decompress(Path(f).read_bytes()))
    index = prepare([str(one)], work / "one", model, workers=1)
    print(f"one file ({one.stat().st_size / 1e6:.1f} MB json.gz) -> {len(index['shards'])} shard, "
          f"{index['documents']} documents, {index['tokens']} tokens; the default 64 lanes")
    cfg = DataConfig(train=str(work / "one"), tokenizer=model, input_length=128, workers=0, shuffle_buffer=100)
    reference = None
    for dp in (1, 2, 4, 8):
        rows = global_rows(cfg, dp, args.global_batch // dp, args.batches, args.global_batch)
        digest = hashlib.sha256(repr(rows).encode()).hexdigest()[:16]
        reference = reference or rows
        print(f"DP {dp}: {len(rows)} examples, {len(set(rows))} distinct, digest {digest}, "
              f"{'equal to' if rows == reference else 'DIFFERENT from'} DP 1's")

    small = work / "small"
    small.mkdir()
    (small / "sentences.txt").write_text("".join(f"Sentence number {i} of the small corpus, zebra quokka {i % 7}.\n"
                                                 for i in range(100)))
    prepare([str(small / "sentences.txt")], work / "small_shards", model, workers=1)
    mix = DataConfig(tokenizer=model, input_length=128, workers=0, shuffle_buffer=100, sources=[
        SourceConfig("c4", str(work / "one"), 0.9), SourceConfig("small", str(work / "small_shards"), 0.1)])
    loader = build_train_loader(mix, seed=0, dp_rank=0, dp_size=4, micro_batch=16)
    n = args.batches * 4
    list(itertools.islice(loader, n))
    counts = loader.source_counts().tolist()
    print(f"mixture c4 0.9 + small 0.1 (100 sentences, one shard) at DP 4: after {sum(counts)} examples of the run "
          f"({n * 16} on DP rank 0) small {counts[1]} ({counts[1] / sum(counts):.4f}, target 0.1); rank 0's "
          f"{len(loader.lanes)} lanes, "
          f"each drew from it: {bool(np.all([p['epoch'] > 0 or p['block'] > 0 or p['next'] > 0 for p in loader.positions[1].values()]))}")


if __name__ == "__main__":
    main()
