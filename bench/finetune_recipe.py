"""Fine-tuning learning rates against each other on the same export, data and steps: dev accuracy (greedy
generation and rank classification) and the final training loss, per peak LR and seed, one process, fp32.

    OMP_NUM_THREADS=1 .venv/bin/python -m bench.finetune_recipe --init EXPORT --data POLARITY_DIR [--seeds 0 1]

Runs `pretrain.finetune.finetune` for each LR of `--lrs` (`train.lr`; `auto` is the shipped width rule,
pretrain.runtime.schedule.with_finetune_lr) and each seed (`run.seed`: the order of the examples, and with
`--scratch` the initialisation) in turn on `--config` (default configs/finetune/polarity.yaml, the CPU-sized form of
the GLUE configs), from the export `--init` (`--scratch`: from a random initialisation of its model instead). Extra
`key=value` arguments override every run (train.steps, eval.method); they go before --lrs and --seeds, which take
every value after them. The table's last column is the LR at d_model 64 that the width rule would scale to this one,
LR x d_model / 64: the constant a sweep fixes. Run folders go under --out; a run folder that exists is refused
(checkpoint.resume=none), so give each sweep its own --out.
"""
from __future__ import annotations

import argparse
import json
import math
import statistics
from pathlib import Path

from pretrain.core.config import load_config
from pretrain.core.finetune_config import FinetuneConfig
from pretrain.finetune import finetune
from pretrain.model.pretrained import export_config


def _final(run_dir: Path, task: str) -> tuple[float, float, float]:
    """(generation accuracy, rank accuracy, mean training loss over the last quarter of the logged steps); NaN for
    a method `eval.method` left out."""
    scores = json.loads((run_dir / "results.json").read_text())[task]
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    losses = [r["loss"] for r in rows if "loss" in r]
    return (scores.get("accuracy", math.nan), scores.get("accuracy_rank", math.nan),
            statistics.mean(losses[-max(len(losses) // 4, 1):]))


def _majority(data: Path) -> float:
    """The majority class's share of the dev file (SST-2's layout: `sentence\\tlabel`)."""
    labels = [line.rsplit("\t", 1)[1] for line in (data / "dev.tsv").read_text().splitlines()[1:]]
    return max(labels.count(v) for v in set(labels)) / len(labels)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m bench.finetune_recipe", description=__doc__.splitlines()[0])
    p.add_argument("--init", required=True, help="export folder (python -m pretrain.export)")
    p.add_argument("--data", required=True, help="the polarity folder (python -m pretrain.tasks.polarity)")
    p.add_argument("--config", default="configs/finetune/polarity.yaml")
    p.add_argument("--lrs", nargs="+", default=["1e-4", "3e-4", "1e-3", "3e-3", "1e-2"])
    p.add_argument("--seeds", nargs="+", type=int, default=[0, 1])
    p.add_argument("--scratch", action="store_true", help="from a random initialisation of the export's model")
    p.add_argument("--out", default="/tmp/bench-finetune-recipe")
    p.add_argument("overrides", nargs="*", help="key=value for every run (train.steps, eval.limit)")
    args = p.parse_args(argv)  # a lone process: the first run's process group (a free port) serves every run
    d_model = export_config(args.init).d_model
    common = [f"init={args.init}", f"data.dir={args.data}", f"from_scratch={args.scratch}", "precision=fp32",
              "parallel.backend=gloo", "checkpoint.every=0", "checkpoint.resume=none", "eval.submission=false"]
    results: dict[str, list[tuple[float, float, float]]] = {}
    for lr in args.lrs:
        for seed in args.seeds:
            run_dir = Path(args.out) / f"lr{lr}-s{seed}{'-scratch' if args.scratch else ''}"
            cfg = load_config(FinetuneConfig, args.config,
                              [*common, f"train.lr={lr}", f"run.seed={seed}", f"run.dir={run_dir}", *args.overrides])
            assert finetune(cfg) == 0, (lr, seed)
            results.setdefault(lr, []).append(_final(run_dir, cfg.task.name))
            acc, rank, loss = results[lr][-1]
            print(f"lr {lr} seed {seed}: accuracy {acc:.4f}  accuracy_rank {rank:.4f}  train loss {loss:.4f}",
                  flush=True)
    print(f"\n{args.config} from {args.init} (d_model {d_model}{', from scratch' if args.scratch else ''}), "
          f"{cfg.train.steps} steps x {cfg.train.global_batch} examples, warm-up {cfg.train.warmup_steps}, "
          f"seeds {' '.join(map(str, args.seeds))}; dev majority class {_majority(Path(args.data)):.3f}")
    print("| train.lr | accuracy (per seed) | accuracy_rank (per seed) | train loss, last quarter (mean) "
          "| lr x d_model / 64 |\n|---|---|---|---|---|")
    for lr, rows in sorted(results.items(), key=lambda item: float(item[0]) if item[0] != "auto" else 1.0):
        per_seed = lambda k: " / ".join(f"{r[k]:.3f}" for r in rows)
        unit = "auto" if lr == "auto" else f"{float(lr) * d_model / 64:.2g}"
        print(f"| {lr} | {per_seed(0)} | {per_seed(1)} | {statistics.mean(r[2] for r in rows):.3f} | {unit} |")


if __name__ == "__main__":
    main()
