"""`python -m bench.data_order`: the train loader of this checkout against another checkout's (a baseline commit's
data order), on the same shards, in the same run; CPU time on one core, rounds alternating.

    git worktree add /tmp/baseline COMMIT
    OMP_NUM_THREADS=1 .venv/bin/python -m bench.data_order --baseline /tmp/baseline --shards DIR --tokenizer MODEL

Each measurement is a fresh process (`--measure --tree DIR`) that imports the loader from its checkout, builds it with
workers 0 (the main process does the work) over the shards (`--streams` lanes, both orders take it), draws one
batch to warm up and then batches for `--seconds` of CPU time: encoder tokens per CPU second. Prints each round's
rates and the median of the rounds' ratios (this checkout / baseline). Target for issue 44's order: >= 0.9x.
"""
from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def measure(shards: str, tokenizer: str, streams: int, micro_batch: int, seconds: float) -> float:
    import time

    from pretrain.core.config import DataConfig
    from pretrain.data.loader import build_train_loader

    cfg = DataConfig(train=shards, tokenizer=tokenizer, input_length=512, workers=0, streams=streams)
    loader = iter(build_train_loader(cfg, seed=0, dp_rank=0, dp_size=1, micro_batch=micro_batch))
    next(loader)
    tokens, start = 0, time.process_time()
    while time.process_time() - start < seconds:
        tokens += next(loader)["input_ids"].numel()
    return tokens / (time.process_time() - start)


def run(tree: Path, args: argparse.Namespace) -> float:
    """One measurement in a fresh process that imports `pretrain` from `tree`."""
    out = subprocess.run([sys.executable, __file__, "--measure", "--tree", str(tree), "--shards", args.shards,
                          "--tokenizer", args.tokenizer, "--streams", str(args.streams),
                          "--micro-batch", str(args.micro_batch), "--seconds", str(args.seconds)],
                         cwd=tree, capture_output=True, text=True, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])["rate"]


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m bench.data_order", description=__doc__.splitlines()[0])
    p.add_argument("--baseline", type=Path, help="a checkout of the baseline commit (git worktree add DIR COMMIT)")
    p.add_argument("--shards", required=True, help="prepared shards (a folder with index.json)")
    p.add_argument("--tokenizer", required=True)
    p.add_argument("--streams", type=int, default=8, help="lanes; the baseline's order needs shards >= streams")
    p.add_argument("--micro-batch", type=int, default=32)
    p.add_argument("--seconds", type=float, default=5.0, help="CPU seconds per measurement")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--measure", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--tree", type=Path, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.measure:
        sys.path.insert(0, str(args.tree))
        print(json.dumps({"rate": measure(args.shards, args.tokenizer, args.streams, args.micro_batch, args.seconds)}))
        return
    if args.baseline is None:
        p.error("--baseline is required")
    ratios = []
    for r in range(args.rounds):  # alternating: a change of load on a shared machine hits both alike
        base, new = run(args.baseline, args), run(REPO, args)
        ratios.append(new / base)
        print(f"round {r + 1}: baseline {base / 1e6:.2f}M, this checkout {new / 1e6:.2f}M encoder tokens/s per core "
              f"({new / base:.3f}x)", flush=True)
    median = statistics.median(ratios)
    print(f"this checkout / baseline: {median:.3f}x (median of {args.rounds} rounds; target >= 0.9x: "
          f"{'met' if median >= 0.9 else 'NOT met'})")


if __name__ == "__main__":
    main()
