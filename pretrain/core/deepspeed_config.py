"""DeepSpeed's config dict, derived from ours: the one place that writes one (`build_deepspeed_config`), and the
batch arithmetic both jobs check before building anything (`num_accumulation_steps`). Plain dicts, no DeepSpeed:
the planner checks a job with it (pretrain.planning.planner.check_job) before the engine is built with it
(pretrain.runtime.engine.build_engine)."""
from __future__ import annotations

from typing import Any

from pretrain.core.config import TrainConfig, UsageError, ZeroConfig


def num_accumulation_steps(cfg: TrainConfig, dp: int) -> int:
    """global batch = micro batch x accumulation x DP; a global batch that does not split is a user error, one line
    in pretraining and fine-tuning alike (both call this before building anything)."""
    per_pass = cfg.micro_batch * dp
    if cfg.global_batch < per_pass or cfg.global_batch % per_pass:
        lower = max(cfg.global_batch // per_pass, 1) * per_pass
        raise UsageError(
            f"train.global_batch ({cfg.global_batch}) must equal train.micro_batch ({cfg.micro_batch}) x "
            f"gradient accumulation x data-parallel size ({dp}), i.e. a multiple of {cfg.micro_batch} x {dp} = "
            f"{per_pass}; use {lower} or {lower + per_pass}"
        )
    return cfg.global_batch // per_pass


def build_deepspeed_config(
    train: TrainConfig, zero: ZeroConfig, precision: str, dp: int, *, load_universal: bool = False
) -> dict[str, Any]:
    """DeepSpeed's config dict, derived from ours; nothing else writes one. Each key's own values (precision,
    zero.stage, train.optimizer, train.schedule) are the config's rules; the rules across keys are here."""
    if train.optimizer == "adafactor" and zero.stage > 0:
        # ZeRO (and bf16's optimizer with it) hands the optimizer one flat 1-D partition per group: Adafactor would
        # keep no factored second moment and take its RMS and update clipping over chunks of mixed parameters
        raise UsageError(f"train.optimizer adafactor needs zero.stage 0 (got {zero.stage}): ZeRO flattens parameters "
                         f"and Adafactor's per-matrix statistics with them; use train.optimizer=adamw or zero.stage=0")
    accumulation = num_accumulation_steps(train, dp)
    ds: dict[str, Any] = {
        "train_batch_size": train.global_batch,  # = micro x accumulation x DP; DeepSpeed re-checks it
        "train_micro_batch_size_per_gpu": train.micro_batch,
        "gradient_accumulation_steps": accumulation,
        # global norm over DP and TP (the mpu makes it TP-aware); in bf16 at ZeRO 1 and 2 the clipping is
        # pretrain.runtime.engine's (_clip_on_device), and at ZeRO 2 the step-skip check too (_skip_on_invalid_norm)
        "gradient_clipping": 0.0 if _clips_on_device(precision, zero.stage) else train.grad_clip,
        "zero_optimization": _zero_section(zero),
        "bf16": {"enabled": precision == "bf16"},
        "fp16": {"enabled": precision == "fp16", "initial_scale_power": 16, "loss_scale_window": 1000},
        "checkpoint": {"load_universal": load_universal},
        "steps_per_print": 2**31 - 1,  # progress lines are ours (pretrain.runtime.metrics)
        "wall_clock_breakdown": False,
        # DeepSpeed's throughput timer synchronises the device at every forward and backward to time steps we
        # time ourselves (pretrain.runtime.metrics)
        "timers": {"throughput": {"enabled": False, "synchronized": False}},
    }
    if precision != "fp32" and zero.stage > 0:
        # gradients accumulate over micro batches and are reduced over DP in fp32, not in bf16/fp16 (whose 8
        # or 10 mantissa bits drop small contributions); DeepSpeed 0.19 supports an fp32 accumulation for a
        # half-precision model only with ZeRO (stage 0 raises NotImplementedError)
        ds["data_types"] = {"grad_accum_dtype": "fp32"}
        ds["communication_data_type"] = "fp32"
    if _skips_on_norm(precision, zero.stage):
        ds["bf16"]["check_grad_overflow"] = False
    if train.optimizer == "adamw":
        ds["optimizer"] = {
            "type": "AdamW",
            "params": {
                "lr": train.lr,
                "betas": [train.beta1, train.beta2],
                "eps": 1e-8,
                "weight_decay": train.weight_decay,
                # torch's AdamW, not DeepSpeed's JIT-compiled Adam ops (~40 s on first use, a CUDA toolkit on GPU);
                # its fused kernel updates a group in one call and keeps the step count on the device: no .item()
                # per parameter, as the for-each path does to read the step
                "torch_adam": True,
                "fused": True,
            },
        }
    else:
        ds["zero_allow_untested_optimizer"] = True  # a client optimizer (torch's Adafactor) at ZeRO 0
    return ds


def _takes_bf16_optimizer(precision: str, stage: int) -> bool:
    """DeepSpeed 0.19 wraps the optimizer in its BF16_Optimizer for a bf16 model with fp32 gradient accumulation
    at ZeRO 1 (engine._do_optimizer_sanity_check), which build_deepspeed_config sets up for bf16 at ZeRO 1."""
    return precision == "bf16" and stage == 1


def _skips_on_norm(precision: str, stage: int) -> bool:
    """bf16 at ZeRO 2 (DeepSpeedZeroOptimizer): its own overflow check waits for the device three times a step
    (an all-reduced flag's .item(), then an invalid-norm test before the update and one per group before clipping,
    stage_1_and_2.py): the config turns it off (`check_grad_overflow`), and pretrain.runtime.engine decides the skip
    from the norm once (_skip_on_invalid_norm)."""
    return precision == "bf16" and stage == 2


def _clips_on_device(precision: str, stage: int) -> bool:
    """The clipping is pretrain.runtime.engine's (_clip_on_device): the config's `gradient_clipping` is 0."""
    return _takes_bf16_optimizer(precision, stage) or _skips_on_norm(precision, stage)


def _zero_section(zero: ZeroConfig) -> dict[str, Any]:
    section: dict[str, Any] = {"stage": zero.stage}
    if zero.stage > 0:
        section.update(overlap_comm=zero.overlap_comm, reduce_bucket_size=zero.reduce_bucket_size,
                       allgather_bucket_size=zero.allgather_bucket_size)
    return section
