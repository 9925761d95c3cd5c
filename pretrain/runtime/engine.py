"""The DeepSpeed engine: builds it (optimizer, ZeRO over the data-parallel group, precision, clipping, LR schedule)
around the model, from the config dict pretrain.core.deepspeed_config derives from ours.
"""
from __future__ import annotations

import functools
import logging
from typing import Any

import deepspeed
import torch
from deepspeed.utils import safe_set_full_fp32_param
from megatron.core.tensor_parallel import ColumnParallelLinear, RowParallelLinear, VocabParallelEmbedding

from pretrain.core.config import TrainConfig, ZeroConfig
from pretrain.core.deepspeed_config import build_deepspeed_config
from pretrain.distributed.parallel import deepspeed_mpu
from pretrain.model.pretrained import LoadReport
from pretrain.model.t5 import T5Model
from pretrain.runtime.schedule import build_scheduler

log = logging.getLogger(__name__)


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

    @functools.wraps(step)  # keeps the LR scheduler's mark on the step it wrapped (else torch warns at every start)
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

    @functools.wraps(step)  # the LR scheduler wrapped `step` and checks for its mark (else it warns at every start)
    def clipped_step(*args, **kwargs):
        norm = torch.as_tensor(wrapper._global_grad_norm)
        grads = [p.grad for group in inner.param_groups for p in group["params"] if p.grad is not None]
        torch._foreach_mul_(grads, (max_norm / (norm + 1e-6)).clamp(max=1.0).to(grads[0].device))
        return step(*args, **kwargs)

    inner.step = clipped_step


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
    # where the config leaves the overflow check and the clipping off (bf16 at ZeRO 1 and 2), they are ours
    if ds_config["bf16"].get("check_grad_overflow") is False:
        assert type(engine.optimizer).__name__ == "DeepSpeedZeroOptimizer", type(engine.optimizer)
        _skip_on_invalid_norm(engine.optimizer)
    if ds_config["gradient_clipping"] == 0.0 and train.grad_clip > 0:
        assert type(engine.optimizer).__name__ in ("BF16_Optimizer", "DeepSpeedZeroOptimizer"), type(engine.optimizer)
        _clip_on_device(engine.optimizer, train.grad_clip)
    log.info(
        "engine: ZeRO %d, %s, %s, global batch %d = micro %d x accumulation %d x DP %d",
        zero.stage, precision, train.optimizer, train.global_batch, train.micro_batch,
        ds_config["gradient_accumulation_steps"], dp,
    )
    return engine


CAST = {"bf16": torch.bfloat16, "fp16": torch.float16}  # the precisions whose engine casts the module


@torch.no_grad()
def master_values(model: T5Model, report: LoadReport, precision: str) -> dict[str, torch.Tensor]:
    """The fp32 values the optimizer's master copy must start from after `load_weights(model, ...)` (`report`).
    In bf16 or fp16 DeepSpeed casts the module and builds the master copy from the cast (BF16_Optimizer, ZeRO's
    fp32 partitions), so the loaded weights would train on from their rounded values: these are the loaded
    parameters' own fp32 tensors, kept past the cast (no copy, no second read of the folder) until
    `set_master_weights`. A resized vocabulary's fresh rows (init_resize_vocab) take their cast value, as in a random
    start; a frozen parameter has no master copy. fp32: none (the module is its own master copy)."""
    if precision not in CAST:
        return {}
    vocab_size, values = model.config.vocab_size, {}
    for name in report.loaded:
        param = model.get_parameter(name)
        if not param.requires_grad:
            continue
        value = param.data
        if report.vocab_rows.get(name, vocab_size) < vocab_size:  # rows past the folder's are this run's draws
            start = model.tp_rank * len(value)
            fresh = value[max(report.vocab_rows[name] - start, 0): max(vocab_size - start, 0)]
            fresh.copy_(fresh.to(CAST[precision]))  # rounding a rounded value changes nothing: the cast is unchanged
        values[name] = value
    return values


def set_master_weights(engine: deepspeed.DeepSpeedEngine, values: dict[str, torch.Tensor]) -> None:
    """Set the fp32 master copy of each parameter named in `values` (`master_values`) to its value; each DP rank sets
    its own fragments (no collective)."""
    params = dict(engine.module.named_parameters())
    for name, value in values.items():
        safe_set_full_fp32_param(params[name], value)
