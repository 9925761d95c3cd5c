"""Pretraining's evaluation (an `Evaluator` of pretrain.runtime.loop): loss and token accuracy on fixed validation
slices, reduced over the DP group.
"""
from __future__ import annotations

import logging
from typing import Iterable

import torch
import torch.distributed as dist
from megatron.core import parallel_state

from pretrain.distributed.parallel import ParallelDims
from pretrain.model import IGNORE_INDEX, vocab_parallel_argmax
from pretrain.runtime.faults import stop_if_preempted
from pretrain.runtime.loop import to_device

log = logging.getLogger(__name__)


class ValidationLoss:
    """Loss and token accuracy on fixed validation slices (the same batches every time), every `every` steps:
    `eval_loss` on data.valid's, `eval_loss/NAME` on each source's `valid` ({"": data.valid's, NAME: ...}). Without
    data.valid, when every source of a mixture has a `valid`, `eval_loss` is their mean at the mixture's `weights`:
    the expected loss of an example of the mixture (every example has as many tokens)."""

    def __init__(self, engine, slices: dict[str, Iterable[dict]], every: int, dims: ParallelDims,
                 weights: dict[str, float]) -> None:
        self.engine, self.slices, self.every, self.dims, self.weights = engine, slices, every, dims, weights

    def due(self, step: int, final: bool) -> bool:
        return bool(self.every) and step % self.every == 0

    @torch.no_grad()
    def __call__(self, step: int, final: bool) -> dict[str, float]:
        self.engine.eval()
        result = {}
        for name, batches in self.slices.items():
            sums = torch.zeros(3, dtype=torch.float64, device=self.dims.device)  # loss x tokens, correct, tokens
            for batch in to_device(batches, self.dims.device):
                stop_if_preempted(self.dims.device, "during evaluation")  # every rank holds as many batches
                out = self.engine(**batch)
                valid = batch["labels"] != IGNORE_INDEX
                correct = ((vocab_parallel_argmax(out.logits) == batch["labels"]) & valid).sum()
                sums += torch.stack([out.loss.double() * out.num_tokens, correct.double(), out.num_tokens.double()])
            dist.all_reduce(sums, group=parallel_state.get_data_parallel_group())
            loss, accuracy = (sums[:2] / sums[2]).tolist()
            result[f"eval_loss/{name}" if name else "eval_loss"] = loss
            result[f"eval_accuracy/{name}" if name else "eval_accuracy"] = accuracy
        self.engine.train()
        if "" not in self.slices and self.weights and self.weights.keys() <= self.slices.keys():
            for key in ("eval_loss", "eval_accuracy"):
                result[key] = sum(w * result[f"{key}/{name}"] for name, w in self.weights.items())
        log.info("step %d  %s", step, "  ".join(f"{k} {v:.4f}" for k, v in result.items()))
        return result


def sum_over_dp(values: list[float], device: torch.device) -> list[float]:
    """`values` added up over the DP ranks (the loader's per-source epochs: each rank knows its own streams)."""
    total = torch.tensor(values, dtype=torch.float64, device=device)
    dist.all_reduce(total, group=parallel_state.get_data_parallel_group())
    return total.tolist()
