"""Evaluation of a text-to-text model on a task: greedy generation (cached) and rank classification over the
label words, the official metrics, `results.json`, a Markdown table, TensorBoard and submission files.

    python -m pretrain.evaluate --export OUT --task sst2 --data DIR --output RUN [--batch 32] [--device cuda]

The command: arguments in, `pretrain.transfer.evaluation` does the work (its docstring says how)."""
from __future__ import annotations

import argparse
import logging
from pathlib import Path

import torch

from pretrain.core.finetune_config import METHODS
from pretrain.tasks import get_task
from pretrain.transfer.evaluation import (
    check_evaluation_files,
    evaluate_task,
    markdown_table,
    task_baselines,
    write_results,
)
from tokenizer.spm import Tokenizer


def main(argv: list[str] | None = None) -> None:
    from pretrain.runtime.metrics import MetricsLogger
    from pretrain.transfer.exporting import load_pretrained

    parser = argparse.ArgumentParser(prog="python -m pretrain.evaluate",
                                     description=" ".join(__doc__.split("\n\n")[0].split()))  # the first paragraph
    parser.add_argument("--export", required=True, help="export folder (python -m pretrain.export)")
    parser.add_argument("--task", required=True, help="task name: sst2, mnli, boolq, ...")
    parser.add_argument("--data", required=True, help="the task's folder in the official layout")
    parser.add_argument("--output", required=True, help="folder for results.json, results.md, submission/")
    parser.add_argument("--method", default="both", choices=METHODS,
                        help="greedy generation, rank classification over the label words, or both (default: both)")
    parser.add_argument("--batch", type=int, default=32, help="examples per forward pass (default: 32)")
    parser.add_argument("--max-input-length", type=int, default=512,
                        help="tokens per input including EOS (capped at model.max_length of a synthesized encoder)")
    parser.add_argument("--limit", type=int, default=0, help="evaluate only the first N examples of each file")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu",
                        help="where the model runs: cpu, cuda, cuda:1 (default: cuda when available, else cpu)")
    args = parser.parse_args(argv)
    if args.batch < 1:
        parser.error(f"--batch must be at least 1, got {args.batch}")
    if args.max_input_length < 2:
        parser.error(f"--max-input-length must be at least 2 (a token and EOS), got {args.max_input_length}")
    if args.limit < 0:
        parser.error(f"--limit must be 0 (all) or positive, got {args.limit}")
    try:
        device = torch.device(args.device)
    except RuntimeError:
        parser.error(f"--device '{args.device}' is not a device (cpu, cuda, cuda:1)")
    if device.type == "cuda" and not torch.cuda.is_available():
        parser.error(f"--device {args.device}: no CUDA device is available here; use --device cpu")
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    try:
        task, out = get_task(args.task), Path(args.output)
        check_evaluation_files(task, args.data, submission=True)
        model, tokenizer = load_pretrained(args.export).to(device), Tokenizer(args.export)
        results = evaluate_task(model, tokenizer, task, args.data, args.method, args.batch, args.max_input_length,
                                args.limit, out / "submission")
    except ValueError as e:
        parser.exit(2, f"{parser.prog}: error: {e}\n")
    baselines = task_baselines(task, args.data, args.limit)
    write_results(out, results, baselines)
    metrics = MetricsLogger(out, enabled=True)
    metrics.write(0, {f"eval/{t}/{k}": v for t, s in results.items() for k, v in s.items()})
    metrics.close()
    print(markdown_table(results, baselines), end="")


if __name__ == "__main__":
    main()
