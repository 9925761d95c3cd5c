"""The unigram baseline of the pretraining evaluation: the cross-entropy of the best unigram model of the
validation targets (the entropy of their empirical token distribution, nats per target token) and its token
accuracy (the share of the most frequent token), over exactly the tokens the trainer's eval scores: the same
validation slice (`eval.batches x train.global_batch` examples of `data.valid`), the same span corruption
(seed 0), the padding left out. A model whose eval loss is not clearly below it has learned token
frequencies and nothing more.

    python -m pretrain.data.unigram --config FILE [section.key=value ...] [--output FILE.json]

prints (and writes) {"unigram_loss", "unigram_accuracy", "tokens", "source"}.
"""
from __future__ import annotations

import argparse
import json
import math
import sys
from collections import Counter
from pathlib import Path
from typing import Iterable

import torch

from pretrain.core.config import Config, UsageError, load_config
from pretrain.core.files import write_atomic
from pretrain.core.redact import redact
from pretrain.data.loader import build_eval_loader
from pretrain.model.loss import IGNORE_INDEX


def unigram_baseline(labels: Iterable[torch.Tensor]) -> dict:
    """{"unigram_loss", "unigram_accuracy", "tokens"} of the label tensors (IGNORE_INDEX entries left out)."""
    counts: Counter = Counter()
    for batch in labels:
        counts.update(batch[batch != IGNORE_INDEX].tolist())
    total = sum(counts.values())
    if not total:
        raise UsageError("the validation slice holds no target tokens")
    loss = -sum(c / total * math.log(c / total) for c in counts.values())
    return {"unigram_loss": loss, "unigram_accuracy": max(counts.values()) / total, "tokens": total}


def eval_baseline(cfg: Config) -> dict:
    """The baseline of the validation slice the trainer of `cfg` evaluates on (all DP ranks' parts together)."""
    if not cfg.data.valid:
        raise UsageError("data.valid is empty: there is no validation slice to take the baseline of")
    examples = cfg.eval.batches * cfg.train.global_batch
    loader = build_eval_loader(cfg.data, dp_rank=0, dp_size=1, micro_batch=cfg.train.global_batch,
                               num_examples=examples)
    out = unigram_baseline(batch["labels"] for batch in loader)
    out["source"] = (f"the span-corrupted targets of the first {examples} examples (eval.batches {cfg.eval.batches} x "
                     f"train.global_batch {cfg.train.global_batch}) of {redact(cfg.data.valid)}, input length "
                     f"{cfg.data.input_length}")
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m pretrain.data.unigram", description=__doc__.splitlines()[0],
                                     usage="%(prog)s --config FILE [section.key=value ...] [--output FILE.json]")
    parser.add_argument("--config", help="the pretraining config (its data and eval sections decide the slice)")
    parser.add_argument("--output", type=Path, help="also write the result to this JSON file")
    args, overrides = parser.parse_known_args(argv)
    try:
        result = eval_baseline(load_config(Config, args.config, overrides))
    except (UsageError, OSError) as e:
        parser.exit(2, f"{parser.prog}: error: {e}\n")
    text = json.dumps(result, indent=1) + "\n"
    if args.output:
        args.output.parent.mkdir(parents=True, exist_ok=True)
        write_atomic(args.output, text)
    print(text, end="")
    return 0


if __name__ == "__main__":
    sys.exit(main())
