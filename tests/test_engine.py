"""DeepSpeed config from ours, batch arithmetic, LR schedules against their formulas, no decay on norms."""
from __future__ import annotations

import dataclasses
import math
import warnings

import pytest
import torch

from pretrain.core.config import Config, ConfigError, TrainConfig, UsageError, ZeroConfig
from pretrain.core.deepspeed_config import build_deepspeed_config, num_accumulation_steps
from pretrain.runtime.engine import param_groups
from pretrain.runtime.schedule import build_scheduler, lr_factor


def test_batch_arithmetic_and_message():
    cfg = TrainConfig(micro_batch=4, global_batch=32)
    assert num_accumulation_steps(cfg, dp=2) == 4  # 4 micro x 4 accumulation x 2 DP = 32
    with pytest.raises(UsageError) as e:
        num_accumulation_steps(TrainConfig(micro_batch=4, global_batch=20), dp=2)
    msg = str(e.value)
    assert "train.global_batch (20)" in msg and "train.micro_batch (4)" in msg and "4 x 2 = 8" in msg
    assert "use 16 or 24" in msg


def test_deepspeed_config_follows_ours():
    train = TrainConfig(micro_batch=2, global_batch=16, lr=3e-4, beta2=0.98, weight_decay=0.1, grad_clip=0.5)
    ds = build_deepspeed_config(train, ZeroConfig(stage=2), "bf16", dp=4, load_universal=True)
    assert (ds["train_batch_size"], ds["train_micro_batch_size_per_gpu"], ds["gradient_accumulation_steps"]) == (16, 2, 2)
    assert ds["zero_optimization"] == {"stage": 2, "overlap_comm": True, "reduce_bucket_size": 200_000_000,
                                       "allgather_bucket_size": 200_000_000}
    # bf16 with ZeRO: gradients accumulate and reduce in fp32
    assert ds["data_types"] == {"grad_accum_dtype": "fp32"} and ds["communication_data_type"] == "fp32"
    assert ds["bf16"]["enabled"] and not ds["fp16"]["enabled"]
    # bf16 at ZeRO 2: clipping and the step-skip check are pretrain.runtime.engine's, on the device (one host sync a step)
    assert ds["gradient_clipping"] == 0.0 and ds["bf16"]["check_grad_overflow"] is False
    assert ds["checkpoint"]["load_universal"] is True
    fp32 = build_deepspeed_config(train, ZeroConfig(stage=2), "fp32", dp=4)
    assert fp32["gradient_clipping"] == 0.5 and "check_grad_overflow" not in fp32["bf16"]
    params = ds["optimizer"]["params"]
    assert ds["optimizer"]["type"] == "AdamW" and params["betas"] == [0.9, 0.98] and params["weight_decay"] == 0.1
    assert params["torch_adam"] and params["fused"]  # torch's fused AdamW: no .item() per parameter per step
    assert ds["timers"]["throughput"]["enabled"] is False  # no device synchronize at every forward
    ada = build_deepspeed_config(dataclasses.replace(train, optimizer="adafactor"), ZeroConfig(0), "fp32", dp=4)
    assert "optimizer" not in ada and ada["zero_allow_untested_optimizer"]
    assert "data_types" not in ada  # fp32 accumulates in fp32 anyway
    no_zero = build_deepspeed_config(train, ZeroConfig(stage=0, overlap_comm=False), "bf16", dp=4)
    assert no_zero["zero_optimization"] == {"stage": 0} and "data_types" not in no_zero  # DeepSpeed refuses it
    custom = build_deepspeed_config(train, ZeroConfig(stage=1, overlap_comm=False, reduce_bucket_size=5,
                                                      allgather_bucket_size=7), "fp16", dp=4)
    assert custom["zero_optimization"] == {"stage": 1, "overlap_comm": False, "reduce_bucket_size": 5,
                                           "allgather_bucket_size": 7}


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_adafactor_under_zero_is_refused_in_one_line(stage):
    # ZeRO hands the optimizer flat 1-D partitions: no factored second moment, RMS over mixed parameters
    with pytest.raises(UsageError) as e:
        build_deepspeed_config(TrainConfig(optimizer="adafactor"), ZeroConfig(stage=stage), "bf16", dp=2)
    assert str(e.value).startswith(f"train.optimizer adafactor needs zero.stage 0 (got {stage})")
    assert "\n" not in str(e.value)


@pytest.mark.parametrize("field,value", [("precision", "fp8"), ("stage", 4), ("optimizer", "sgd")])
def test_deepspeed_config_rejects_unknown_values(field, value):
    # the config's rules (a section refuses them when built), so no DeepSpeed config is ever made of them
    with pytest.raises(ConfigError, match=str(value)):
        train, zero, precision = TrainConfig(), ZeroConfig(), Config().precision
        if field == "precision":
            precision = Config(precision=value).precision
        elif field == "stage":
            zero = ZeroConfig(stage=value)
        else:
            train = TrainConfig(optimizer=value)
        build_deepspeed_config(train, zero, precision, dp=1)


def test_inverse_sqrt_schedule_matches_t5_formula():
    # T5 (Raffel et al. 2020, sec. 3.1.2): lr(t) = 1 / sqrt(max(t, k)) with k = 10^4 warm-up steps, written out
    # here; ours reaches it with lr 0.01 = 1 / sqrt(10^4) and the same k, after a linear ramp instead of the
    # constant 0.01 (the ramp is ours, for optimizers without Adafactor's own relative-step warm-up)
    cfg = TrainConfig(lr=1e-2, warmup_steps=10_000, schedule="inverse_sqrt")
    for t in (10_000, 10_001, 40_000, 65_536):
        assert cfg.lr * lr_factor(cfg, t - 1) == pytest.approx(1 / math.sqrt(max(t, 10_000)), rel=1e-12)
    for t in (1, 5_000):
        assert cfg.lr * lr_factor(cfg, t - 1) == pytest.approx(1e-2 * t / 10_000)


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


def test_weight_decay_reaches_matrices_only():
    from pretrain.core.config import ModelConfig
    from pretrain.model import build_local_model

    cfg = ModelConfig(vocab_size=256, d_model=32, d_ff=48, d_kv=8, num_heads=4, num_layers=1, num_decoder_layers=1,
                      max_length=16, encoder_attention="dense+factorized_dense+vanilla",
                      decoder_attention="random+factorized_random", mixture_per_head=True)
    model = build_local_model(cfg)
    names = {id(p): n for n, p in model.named_parameters()}
    decay, no_decay = param_groups(model, 0.1)
    decayed = {names[id(p)].replace("encoder.layers.0.", "e.").replace("decoder.layers.0.", "d.") for p in decay["params"]}
    assert decayed == {
        "embed.weight", "lm_head.weight", "e.attn.qkv.weight", "e.attn.o.weight", "d.attn.v.weight", "d.attn.o.weight",
        "e.ffn.wi.weight", "e.ffn.wo.weight", "d.ffn.wi.weight", "d.ffn.wo.weight",
        "d.cross.q.weight", "d.cross.kv.weight", "d.cross.o.weight",
        "e.attn.synth.dense.hidden.w1.weight", "e.attn.synth.factorized_dense.hidden.w1.weight",
        "e.attn.synth.dense.w2", "e.attn.synth.factorized_dense.wa", "e.attn.synth.factorized_dense.wb",  # [heads, x, d]
        "d.attn.synth.random.r", "d.attn.synth.factorized_random.r1", "d.attn.synth.factorized_random.r2",
    }
    # never: norms, biases, per-head bias vectors [heads, x], per-head mixture weights, relative position bias
    kept = {names[id(p)] for p in no_decay["params"]}
    for name in ("encoder.relative_bias.weight", "encoder.layers.0.attn.mix", "encoder.layers.0.attn.synth.dense.b2",
                 "encoder.layers.0.attn.synth.factorized_dense.ba", "encoder.layers.0.attn_norm.weight",
                 "encoder.layers.0.attn.synth.dense.hidden.w1.bias"):
        assert name in kept
    assert decay["weight_decay"] == 0.1 and no_decay["weight_decay"] == 0.0
    assert len(decay["params"]) + len(no_decay["params"]) == sum(1 for p in model.parameters() if p.requires_grad)


def _clipped_weights(rank: int, world: int, ours: bool, stage: int, inf_at: int | None = None) -> list:
    """A tiny bf16 engine at ZeRO `stage` (1: BF16_Optimizer, 2: DeepSpeedZeroOptimizer), DP `world`, after three
    steps clipped hard (grad_clip 1e-2; at 1e-3 the clipped gradients sink to Adam's eps, where a 1e-12 difference
    in a gradient grows to 1e-4 in the weights within three steps, and the comparison reads chaos): with pretrain.runtime.engine's clipping and skip check on the device (`ours`), or
    with DeepSpeed's own (gradient_clipping and bf16.check_grad_overflow in its config). With `inf_at`, rank 0's
    gradients are infinite at that step: it must be skipped everywhere. The fp32 master partitions, and the steps
    applied."""
    import pretrain.core.deepspeed_config as rules
    import pretrain.runtime.engine
    from pretrain.core.config import Config, ParallelConfig, load_config
    from pretrain.distributed.parallel import init_distributed
    from pretrain.model import build_model

    if not ours:  # DeepSpeed's config keeps its own clipping and overflow check, which the engine then leaves alone
        rules._clips_on_device = rules._skips_on_norm = lambda precision, stage: False
    cfg = load_config(Config, "configs/tiny.yaml", [f"zero.stage={stage}", "zero.reduce_bucket_size=20000"])
    init_distributed(ParallelConfig(), seed=3)
    train = dataclasses.replace(cfg.train, micro_batch=2, global_batch=2 * world, grad_clip=1e-2, warmup_steps=0)
    engine = pretrain.runtime.engine.build_engine(build_model(cfg.model), train, cfg.zero, "bf16", world)
    ids = torch.randint(2, 1000, (2, 12), generator=torch.Generator().manual_seed(rank))
    applied = []
    for step in range(3):
        loss = engine(input_ids=ids, attention_mask=torch.ones_like(ids), decoder_input_ids=ids[:, :6],
                      labels=ids[:, 1:7]).loss
        if step == inf_at and rank == 0:
            loss = loss * float("inf")  # every gradient of this rank infinite, before DP reduction
        engine.backward(loss)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            engine.step()
        # the LR scheduler's check that optimizer.step is the one it wrapped (an H200 run warned at every start)
        assert not [w for w in caught if "overridden after learning rate scheduler" in str(w.message)]
        applied.append(engine.was_step_applied())
        if applied[-1]:
            assert engine.get_global_grad_norm() > 1e-2  # clipped (unclipped, the weights move by 3e-3 more)
    partitions = engine.optimizer.fp32_groups_flat_partition if stage == 1 else \
        engine.optimizer.single_partition_of_fp32_groups
    return [p.detach().float().clone() for p in partitions], applied


@pytest.mark.parametrize("stage", [1, 2])
def test_clipping_and_skip_on_the_device_equal_deepspeeds(stage):
    """DeepSpeed's bf16 optimizers branch on the norm on the host to clip (a sync per step, and at ZeRO 2 two
    more for its overflow checks); ours scale on the device and, at ZeRO 2, test the norm once: the same fp32
    master weights after three clipped steps at DP 2, also when the second step's gradients are infinite on one
    rank (skipped on both, as DeepSpeed does)."""
    from tests.distributed import run_distributed

    for inf_at in (None, 1):
        ours, theirs = (run_distributed(_clipped_weights, 2, flag, stage, inf_at) for flag in (True, False))
        for (a_weights, a_applied), (b_weights, b_applied) in zip(ours, theirs):
            assert a_applied == b_applied == [True, inf_at != 1, True]
            for a, b in zip(a_weights, b_weights):
                torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7)
