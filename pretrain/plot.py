"""`python -m pretrain.plot RUN_DIR [RUN_DIR ...] [--output FILE.png]`: the curves of runs' metrics.jsonl in
one PNG, one panel per metric (default: loss, and eval_loss / eval_accuracy where the runs have them), one
line per run, against the step (or `--x tokens_seen`).
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path

from pretrain.experiments.figures import plot_panels

DEFAULT_METRICS = ("loss", "eval_loss", "eval_accuracy")


def read_runs(run_dirs: list[str]) -> dict[str, list[dict]]:
    """{label: records} from each RUN_DIR/metrics.jsonl; the label is the folder name (its path if names repeat)."""
    names = [Path(d).name for d in run_dirs]
    runs = {}
    for d, name in zip(run_dirs, names):
        path = Path(d) / "metrics.jsonl"
        if not path.is_file():
            raise ValueError(f"{path} not found: is {d} a run folder (run.dir of a training or fine-tuning)?")
        runs[d if names.count(name) > 1 else name] = [json.loads(line) for line in path.read_text().splitlines()]
    return runs


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m pretrain.plot",
                                     description=" ".join(__doc__.split("\n\n")[0].split()))
    parser.add_argument("runs", nargs="+", metavar="RUN_DIR", help="run folders holding metrics.jsonl")
    parser.add_argument("--output", default="metrics.png", help="PNG file to write (default: metrics.png)")
    parser.add_argument("--metrics", default="", help="comma-separated keys of metrics.jsonl (default: "
                        f"those of {', '.join(DEFAULT_METRICS)} the runs have)")
    parser.add_argument("--x", default="step", choices=("step", "tokens_seen"), help="the horizontal axis")
    args = parser.parse_args(argv)
    try:
        runs = read_runs(args.runs)
    except ValueError as e:
        parser.exit(2, f"{parser.prog}: error: {e}\n")
    present = {k for records in runs.values() for r in records for k in r}
    metrics = args.metrics.split(",") if args.metrics else [m for m in DEFAULT_METRICS if m in present]
    missing = [m for m in metrics if m not in present]
    if missing or not metrics:
        parser.exit(2, f"{parser.prog}: error: no run has metric '{missing[0] if missing else DEFAULT_METRICS[0]}'; "
                       f"available: {', '.join(sorted(present - {'step'}))}\n")
    if args.x not in present:
        parser.exit(2, f"{parser.prog}: error: the runs' metrics.jsonl have no '{args.x}' (the trainer writes it "
                       "with tokens_seen)\n")
    print(plot_panels(runs, metrics, Path(args.output), args.x))


if __name__ == "__main__":
    main()
