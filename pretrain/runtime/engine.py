"""The DeepSpeed engine: the one place that turns our config into DeepSpeed's config dict, and builds the
engine (optimizer, ZeRO over the data-parallel group, precision, clipping, LR schedule) around the model.
"""
from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import deepspeed
import torch
from deepspeed.utils import safe_set_full_fp32_param
from megatron.core.tensor_parallel import ColumnParallelLinear, RowParallelLinear, VocabParallelEmbedding

from pretrain.core.config import TrainConfig, UsageError, ZeroConfig
from pretrain.distributed.parallel import deepspeed_mpu
from pretrain.model.pretrained import open_weights
from pretrain.model.sharding import copy_full_parameter
from pretrain.runtime.schedule import build_scheduler

log = logging.getLogger(__name__)


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
        # global norm over DP and TP (the mpu makes it TP-aware); in bf16 at ZeRO 1 and 2 the clipping is ours
        # (_clip_on_device), and at ZeRO 2 the step-skip check too (_skip_on_invalid_norm)
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
    stage_1_and_2.py); pretrain.runtime.engine turns it off and decides the skip from the norm once (_skip_on_invalid_norm)."""
    return precision == "bf16" and stage == 2


def _clips_on_device(precision: str, stage: int) -> bool:
    return _takes_bf16_optimizer(precision, stage) or _skips_on_norm(precision, stage)


def _skip_on_invalid_norm(zero_optimizer) -> None:
    """ZeRO 2 in bf16 with `check_grad_overflow` off: the step's one host sync tests DeepSpeed's global gradient
    norm (over DP and TP, already reduced on every rank, so all ranks agree; -1.0 or non-finite when a gradient
    is not finite). On such a step the check is switched back on for that step only: DeepSpeed's own test of
    the same norm then takes its skip path (no update, no moment or LR change, `was_step_applied()` False)."""
    norm_of, step = zero_optimizer.scaled_global_norm, zero_optimizer.step

    def checked_norm(*args, **kwargs):
        norm = norm_of(*args, **kwargs)
        zero_optimizer.check_grad_overflow = not bool(torch.isfinite(norm) & (norm >= 0))
        return norm

    def guarded_step(*args, **kwargs):
        zero_optimizer.check_grad_overflow = False  # no overflow all-reduce and .item() before the norm
        return step(*args, **kwargs)

    zero_optimizer.scaled_global_norm, zero_optimizer.step = checked_norm, guarded_step


def _clip_on_device(wrapper, max_norm: float) -> None:
    """Clip the gradients of DeepSpeed's `wrapper` (BF16_Optimizer, or the ZeRO 2 optimizer) by their global norm
    as DeepSpeed would, without its host-side branch on the norm (BF16_Optimizer: `if clip_coef < 1` in
    runtime/utils.py clip_tensors_by_global_norm; ZeRO 2: a validity test per group), which waits for the device
    at every step: the factor min(1, max_norm / (norm + 1e-6)) stays on the device and scales the fp32 gradient
    partitions the wrapped optimizer is about to read, after the skip check has passed on the same norm."""
    inner = wrapper.optimizer
    step = inner.step

    def clipped_step(*args, **kwargs):
        norm = torch.as_tensor(wrapper._global_grad_norm)
        grads = [p.grad for group in inner.param_groups for p in group["params"] if p.grad is not None]
        torch._foreach_mul_(grads, (max_norm / (norm + 1e-6)).clamp(max=1.0).to(grads[0].device))
        return step(*args, **kwargs)

    inner.step = clipped_step


def _zero_section(zero: ZeroConfig) -> dict[str, Any]:
    section: dict[str, Any] = {"stage": zero.stage}
    if zero.stage > 0:
        section.update(overlap_comm=zero.overlap_comm, reduce_bucket_size=zero.reduce_bucket_size,
                       allgather_bucket_size=zero.allgather_bucket_size)
    return section


_MATRIX_LAYERS = (torch.nn.Linear, torch.nn.Embedding, ColumnParallelLinear, RowParallelLinear, VocabParallelEmbedding)


def decays(module: torch.nn.Module, param: torch.nn.Parameter) -> bool:
    """Weight decay reaches matrices only: the weights of linear maps and embeddings, and per-head matrices
    ([heads, N, d] and up). Never vectors (norms, biases), per-head vectors ([heads, x]: Synthesizer biases,
    per-head mixture weights) or the relative position bias ([heads, buckets]), though those are 2-D."""
    return param.ndim >= 3 or (param.ndim == 2 and isinstance(module, _MATRIX_LAYERS))


def param_groups(model: torch.nn.Module, weight_decay: float) -> list[dict[str, Any]]:
    """Two groups, decayed and not decayed: ZeRO flattens each group into one tensor, and DeepSpeed's bf16
    optimizer pays per group at start (a gc.collect() per group) and per step (one all-gather per group)."""
    decay, no_decay = [], []
    for module in model.modules():
        for p in module.parameters(recurse=False):
            if p.requires_grad:
                (decay if decays(module, p) else no_decay).append(p)
    return [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}]


def _empty_extra_state(module: torch.nn.Module, state: dict, prefix: str, local_metadata: dict) -> None:
    # megatron's parallel layers put `_extra_state: None` into state dicts (TE compatibility; ignored on load);
    # DeepSpeed's universal-checkpoint converter calls .float() on every entry, so store an empty tensor
    for key in [k for k, v in state.items() if v is None and k.endswith("_extra_state")]:
        state[key] = torch.empty(0)


def _build_adafactor(train: TrainConfig, groups: list[dict[str, Any]]) -> torch.optim.Optimizer:
    # T5's Adafactor (Shazeer & Stern 2018): no momentum, beta2_t = 1 - t^-0.8, update clipping d = 1;
    # the learning rate comes from our schedule instead of Adafactor's relative step size. Only at ZeRO 0
    # (build_deepspeed_config), where DeepSpeed keeps each parameter's shape (fp32, or its unfused fp32 master
    # copies under bf16/fp16), so the second moment is factored per matrix.
    return torch.optim.Adafactor(groups, lr=train.lr, beta2_decay=-0.8, d=1.0, weight_decay=train.weight_decay)


def build_engine(
    model: torch.nn.Module,
    train: TrainConfig,
    zero: ZeroConfig,
    precision: str,
    dp: int,
    *,
    load_universal: bool = False,
) -> deepspeed.DeepSpeedEngine:
    """Wrap `model` in a DeepSpeed engine that shards optimizer state (ZeRO) over the DP group only."""
    ds_config = build_deepspeed_config(train, zero, precision, dp, load_universal=load_universal)
    # DeepSpeed's CPU comm backend JIT-compiles a shared-memory op (~30-60 s the first time on a machine)
    # that only serves inference all-reduce; training collectives go through torch.distributed.
    deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False
    model.register_state_dict_post_hook(_empty_extra_state)
    groups = param_groups(model, train.weight_decay)
    if precision == "fp16":
        log.warning("precision fp16: T5 v1.1 is known to overflow and diverge in fp16 (its activations exceed "
                    "65504); prefer bf16")
    optimizer = _build_adafactor(train, groups) if train.optimizer == "adafactor" else None
    engine, _, _, _ = deepspeed.initialize(
        model=model,
        model_parameters=groups,
        optimizer=optimizer,
        lr_scheduler=lambda opt: build_scheduler(train, opt),
        mpu=deepspeed_mpu(),
        config=ds_config,
    )
    if _skips_on_norm(precision, zero.stage):
        assert type(engine.optimizer).__name__ == "DeepSpeedZeroOptimizer", type(engine.optimizer)
        _skip_on_invalid_norm(engine.optimizer)
    if _clips_on_device(precision, zero.stage) and train.grad_clip > 0:
        assert type(engine.optimizer).__name__ in ("BF16_Optimizer", "DeepSpeedZeroOptimizer"), type(engine.optimizer)
        _clip_on_device(engine.optimizer, train.grad_clip)
    log.info(
        "engine: ZeRO %d, %s, %s, global batch %d = micro %d x accumulation %d x DP %d",
        zero.stage, precision, train.optimizer, train.global_batch, train.micro_batch,
        ds_config["gradient_accumulation_steps"], dp,
    )
    return engine


@torch.no_grad()
def load_master_weights(engine: deepspeed.DeepSpeedEngine, folder: str | Path, resize_vocab: bool = False) -> None:
    """Start the optimizer's fp32 master weights from `folder`'s fp32 values. In bf16 or fp16 DeepSpeed casts the
    module and builds the master copy from the cast (BF16_Optimizer, ZeRO's fp32 partitions), so weights loaded
    before `build_engine` would train on from their rounded values; in fp32 they are the module's own. Reads the
    folder again, one parameter at a time; each DP rank sets its own fragments (no collective)."""
    if not (engine.bfloat16_enabled() or engine.fp16_enabled()):
        return
    model = engine.module
    with open_weights(model, folder, resize_vocab=resize_vocab) as (_, tensors):
        for name, param, full in tensors:
            if not param.requires_grad:  # a frozen parameter has no master copy: the module's value is used
                continue
            value = torch.zeros(getattr(param, "ds_shape", param.shape), dtype=torch.float32, device=param.device)
            if value.shape == param.shape:  # not a ZeRO 3 partition: rows a resized vocabulary leaves keep theirs
                value.copy_(param)
            copy_full_parameter(model, name, full, into=value)
            safe_set_full_fp32_param(param, value)
