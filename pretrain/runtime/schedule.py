"""Learning-rate schedules: linear warmup, then inverse square root (T5) or cosine decay.

`lr_factor(cfg, step)` is the multiplier of `train.lr` for the optimizer step with 0-based index `step`
(torch's LambdaLR calls it with the number of steps already taken), so step 0 already trains with
lr / warmup_steps rather than 0.
"""
from __future__ import annotations

import math

import torch
from torch.optim.lr_scheduler import LambdaLR

from pretrain.core.config import TrainConfig

SCHEDULES = ("inverse_sqrt", "cosine")


def lr_factor(cfg: TrainConfig, step: int) -> float:
    t = step + 1  # 1-based: the t-th update
    warmup = max(cfg.warmup_steps, 1)
    if t <= warmup:
        return t / warmup
    if cfg.schedule == "inverse_sqrt":
        # T5 (Raffel et al. 2020, sec. 3.1.2): 1/sqrt(max(t, warmup)), here normalised to 1 at the warmup end
        return math.sqrt(warmup / t)
    if cfg.schedule == "cosine":
        progress = min((t - warmup) / max(cfg.steps - warmup, 1), 1.0)
        floor = cfg.min_lr / cfg.lr  # train.lr > 0: TrainConfig's rule
        return floor + (1.0 - floor) * 0.5 * (1.0 + math.cos(math.pi * progress))
    raise ValueError(f"train.schedule '{cfg.schedule}' is not one of {', '.join(SCHEDULES)}")


def build_scheduler(cfg: TrainConfig, optimizer: torch.optim.Optimizer) -> LambdaLR:
    """A LambdaLR over `lr_factor`; its state (the step count) is saved in DeepSpeed's checkpoint."""
    if cfg.schedule not in SCHEDULES:
        raise ValueError(f"train.schedule '{cfg.schedule}' is not one of {', '.join(SCHEDULES)}")
    return LambdaLR(optimizer, lambda step: lr_factor(cfg, step))
