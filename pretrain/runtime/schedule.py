"""Learning rates: linear warmup, then inverse square root (T5) or cosine decay; and fine-tuning's peak LR rule.

`lr_factor(cfg, step)` is the multiplier of `train.lr` for the optimizer step with 0-based index `step`
(torch's LambdaLR calls it with the number of steps already taken), so step 0 already trains with
lr / warmup_steps rather than 0. `with_finetune_lr` resolves fine-tuning's `train.lr: auto` from the export's width.
"""
from __future__ import annotations

import dataclasses
import math

import torch
from torch.optim.lr_scheduler import LambdaLR

from pretrain.core.config import TrainConfig

# Fine-tuning's peak AdamW LR at d_model 64, scaled by 64 / d_model as pretraining's 1e-2 is (configs/_t5_v1_1.yaml:
# Adam's LR for hidden matrices goes as 1 / width, Yang et al. 2021): 8.3e-5 at base's 768, where AdamW's usual
# T5 fine-tuning rate is 1e-4. Measured at d_model 64 (`python -m bench.finetune_recipe`, docs/transfer.md, "Learning
# rate"; polarity, 300 steps, 2 seeds): dev accuracy 0.609 at 1e-3, 0.586 at 3e-3, 0.585 at 1e-2, 0.568 at 3e-4 and
# 0.502 at 1e-4, the configs' old fixed rate (chance: the majority class is 0.518).
FINETUNE_LR_AT_WIDTH_64 = 1e-3


def lr_factor(cfg: TrainConfig, step: int) -> float:
    t = step + 1  # 1-based: the t-th update
    warmup = max(cfg.warmup_steps, 1)
    if t <= warmup:
        return t / warmup
    if cfg.schedule == "inverse_sqrt":
        # T5 (Raffel et al. 2020, sec. 3.1.2): 1/sqrt(max(t, warmup)), here normalised to 1 at the warmup end
        return math.sqrt(warmup / t)
    assert cfg.schedule == "cosine", cfg.schedule  # TrainConfig's rule: one of core.config.SCHEDULES
    progress = min((t - warmup) / max(cfg.steps - warmup, 1), 1.0)
    floor = cfg.min_lr / cfg.lr  # train.lr > 0: TrainConfig's rule
    return floor + (1.0 - floor) * 0.5 * (1.0 + math.cos(math.pi * progress))


def build_scheduler(cfg: TrainConfig, optimizer: torch.optim.Optimizer) -> LambdaLR:
    """A LambdaLR over `lr_factor`; its state (the step count) is saved in DeepSpeed's checkpoint."""
    return LambdaLR(optimizer, lambda step: lr_factor(cfg, step))


def with_finetune_lr(cfg: TrainConfig, d_model: int) -> TrainConfig:
    """`cfg` with `lr: auto` set to fine-tuning's width rule, FINETUNE_LR_AT_WIDTH_64 x 64 / d_model (a number is
    kept as given)."""
    return dataclasses.replace(cfg, lr=FINETUNE_LR_AT_WIDTH_64 * 64 / d_model) if cfg.lr == "auto" else cfg
