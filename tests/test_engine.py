"""DeepSpeed config from ours, batch arithmetic, LR schedules against their formulas, no decay on norms."""
from __future__ import annotations

import dataclasses
import math

import pytest
import torch

from pretrain.config import TrainConfig, ZeroConfig
from pretrain.engine import build_deepspeed_config, num_accumulation_steps, param_groups
from pretrain.schedule import build_scheduler, lr_factor


def test_batch_arithmetic_and_message():
    cfg = TrainConfig(micro_batch=4, global_batch=32)
    assert num_accumulation_steps(cfg, dp=2) == 4  # 4 micro x 4 accumulation x 2 DP = 32
    with pytest.raises(ValueError) as e:
        num_accumulation_steps(TrainConfig(micro_batch=4, global_batch=20), dp=2)
    msg = str(e.value)
    assert "train.global_batch (20)" in msg and "train.micro_batch (4)" in msg and "4 x 2 = 8" in msg
    assert "use 16 or 24" in msg


def test_deepspeed_config_follows_ours():
    train = TrainConfig(micro_batch=2, global_batch=16, lr=3e-4, beta2=0.98, weight_decay=0.1, grad_clip=0.5)
    ds = build_deepspeed_config(train, ZeroConfig(stage=2), "bf16", dp=4, load_universal=True)
    assert (ds["train_batch_size"], ds["train_micro_batch_size_per_gpu"], ds["gradient_accumulation_steps"]) == (16, 2, 2)
    assert ds["zero_optimization"] == {"stage": 2}
    assert ds["bf16"]["enabled"] and not ds["fp16"]["enabled"]
    assert ds["gradient_clipping"] == 0.5 and ds["checkpoint"]["load_universal"] is True
    params = ds["optimizer"]["params"]
    assert ds["optimizer"]["type"] == "AdamW" and params["betas"] == [0.9, 0.98] and params["weight_decay"] == 0.1
    ada = build_deepspeed_config(dataclasses.replace(train, optimizer="adafactor"), ZeroConfig(1), "fp32", dp=4)
    assert "optimizer" not in ada and ada["zero_allow_untested_optimizer"]


@pytest.mark.parametrize("field,value", [("precision", "fp8"), ("stage", 4), ("optimizer", "sgd")])
def test_deepspeed_config_rejects_unknown_values(field, value):
    train, zero, precision = TrainConfig(), ZeroConfig(), "fp32"
    if field == "precision":
        precision = value
    elif field == "stage":
        zero = ZeroConfig(stage=value)
    else:
        train = TrainConfig(optimizer=value)
    with pytest.raises(ValueError, match=str(value)):
        build_deepspeed_config(train, zero, precision, dp=1)


def test_inverse_sqrt_schedule_matches_t5_formula():
    cfg = TrainConfig(lr=1e-2, warmup_steps=100, schedule="inverse_sqrt")
    for t in (1, 50, 100):  # linear warmup: the t-th update uses lr * t / warmup
        assert lr_factor(cfg, t - 1) == pytest.approx(t / 100)
    for t in (101, 400, 10_000):  # then 1/sqrt(t), continuous at the warmup end
        assert lr_factor(cfg, t - 1) == pytest.approx(1 / math.sqrt(t) / (1 / math.sqrt(100)))


def test_cosine_schedule_matches_formula():
    cfg = TrainConfig(lr=1e-3, min_lr=1e-4, warmup_steps=10, steps=110, schedule="cosine")
    assert lr_factor(cfg, 9) == pytest.approx(1.0)
    mid = 1e-4 + (1e-3 - 1e-4) * 0.5 * (1 + math.cos(math.pi * 0.5))
    assert cfg.lr * lr_factor(cfg, 59) == pytest.approx(mid)
    assert cfg.lr * lr_factor(cfg, 109) == pytest.approx(1e-4)


def test_scheduler_drives_optimizer_lr_and_rejects_unknown():
    cfg = TrainConfig(lr=0.1, warmup_steps=4)
    opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=cfg.lr)
    sched = build_scheduler(cfg, opt)
    seen = []
    for _ in range(6):
        seen.append(opt.param_groups[0]["lr"])
        opt.step()
        sched.step()
    assert seen == pytest.approx([0.025, 0.05, 0.075, 0.1, 0.1 * math.sqrt(4 / 5), 0.1 * math.sqrt(4 / 6)])
    with pytest.raises(ValueError, match="train.schedule 'linear'"):
        build_scheduler(TrainConfig(schedule="linear"), opt)


def test_no_weight_decay_on_norms():
    model = torch.nn.Sequential(torch.nn.Linear(4, 4, bias=False), torch.nn.LayerNorm(4, bias=False))
    decay, no_decay = param_groups(model, 0.1)
    assert decay["weight_decay"] == 0.1 and [p.shape for p in decay["params"]] == [(4, 4)]
    assert no_decay["weight_decay"] == 0.0 and no_decay["params"][0] is model[1].weight
