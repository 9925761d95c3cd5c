"""Optimizer recipes against each other on the same data and steps: final training loss (mean of the last
quarter of logged steps) and validation loss, one process, fp32, ZeRO 0 (where torch's Adafactor sees each
parameter whole, as T5 trained it, and AdamW computes the same update as under ZeRO 1-3).

    OMP_NUM_THREADS=2 .venv/bin/python -m bench.recipe data.train=SHARDS data.valid=SHARDS data.tokenizer=spiece.model

Runs `pretrain.train.train` for each recipe of RECIPES in turn on `--config` (default: configs/small.yaml, the
size configs' shared recipe) with its dimensions shrunk to MODEL (a model that takes a CPU ~0.5 s a step),
the schedule's warm-up scaled to the run (T5: 10^4 of 65536 steps). Extra `key=value` arguments override every
run (data paths, steps). Run folders go under --out.
"""
from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
from pathlib import Path

from pretrain.core.config import Config, load_config
from pretrain.train import train

MODEL = ["model.d_model=64", "model.d_ff=128", "model.num_heads=2", "model.d_kv=32", "model.num_layers=2",
         "model.num_decoder_layers=2", "data.input_length=64", "model.max_length=64"]
# the shipped Adafactor recipe (configs/_t5_v1_1.yaml before the switch) and AdamW at a sweep of peak LRs
ADAFACTOR = ["train.optimizer=adafactor", "train.lr=1e-2", "train.schedule=inverse_sqrt", "train.grad_clip=0",
             "train.weight_decay=0"]
RECIPES = {
    "adafactor 1e-2 inverse_sqrt": ADAFACTOR,
    **{f"adamw {lr} cosine": ["train.optimizer=adamw", f"train.lr={lr}", f"train.min_lr={float(lr) / 10}",
                              "train.schedule=cosine", "train.grad_clip=1.0", "train.weight_decay=0.01",
                              "train.beta2=0.999"]
       for lr in ("1e-3", "3e-3", "1e-2", "2e-2")},
}


def _final(run_dir: Path) -> tuple[float, float]:
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    losses = [r["loss"] for r in rows if "loss" in r]
    evals = [r["eval_loss"] for r in rows if "eval_loss" in r]
    return statistics.mean(losses[-max(len(losses) // 4, 1):]), evals[-1]


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m bench.recipe", description=__doc__.splitlines()[0])
    p.add_argument("--config", default="configs/small.yaml")
    p.add_argument("--steps", type=int, default=100)
    p.add_argument("--out", default="/tmp/bench-recipe")
    p.add_argument("--only", nargs="*", default=list(RECIPES), help="recipe names (default: all)")
    p.add_argument("overrides", nargs="*", help="key=value for every run (data paths)")
    args = p.parse_args(argv)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", LOCAL_WORLD_SIZE="1", MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=str(port))
    warmup = max(args.steps * 10_000 // 65_536, 1)
    common = [*MODEL, "zero.stage=0", "precision=fp32", "parallel.backend=gloo", f"train.steps={args.steps}",
              f"train.warmup_steps={warmup}", "train.micro_batch=16", "train.global_batch=16", "log.every=10",
              f"eval.every={args.steps}", "eval.batches=4", "checkpoint.every=0", "checkpoint.resume=none",
              "data.workers=0", "run.seed=0"]
    results = {}
    for name in args.only:
        run_dir = Path(args.out) / name.replace(" ", "_")
        cfg = load_config(Config, args.config, [*common, *RECIPES[name], f"run.dir={run_dir}", *args.overrides])
        assert train(cfg) == 0, name
        results[name] = _final(run_dir)
        print(f"{name}: train loss {results[name][0]:.3f}  eval loss {results[name][1]:.3f}", flush=True)
    print(f"\n{args.steps} steps x {cfg.train.global_batch} sequences x ({cfg.data.input_length} + targets) tokens, "
          f"warm-up {warmup}, {args.config} shrunk to d_model 64, 2 heads of 32, 2 + 2 layers")
    print("| recipe | train loss (last quarter) | eval loss |\n|---|---|---|")
    for name, (loss, eval_loss) in results.items():
        print(f"| {name} | {loss:.3f} | {eval_loss:.3f} |")


if __name__ == "__main__":
    main()
