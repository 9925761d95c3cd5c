"""Memory per GPU of a training job, estimated before anything is allocated (the planner and the trainer's
start-up check): model states from the parameter count of one TP rank's shard and DeepSpeed's layout per
ZeRO stage, activations by tracing one real forward pass of the model on the `meta` device.

Why a meta trace and not a formula: the bytes autograd keeps for the backward depend on every mixer's code
path (batch-shared softmax of input-independent mixers, SDPA, fp32 softmax copies, the vocab-parallel loss);
running the model's own forward on shape-only tensors under `saved_tensors_hooks` counts exactly what that
code saves, at the job's micro batch, lengths, dtype and TP shard, in milliseconds and without memory.

One TP rank's shard without a process group: megatron's layers size themselves from the TP group's
`size()`/`rank()`, so `tp_shapes(tp)` installs a stand-in group of that size (rank 0: shards are equal) in
megatron's parallel state and makes collectives no-ops while tracing, then puts back what was there (the
trainer's real groups, if any: nothing else runs meanwhile).

What the trace cannot see is device-specific: on CUDA, `F.scaled_dot_product_attention` runs a fused kernel
that keeps Q, K, V, the output and the log-sum-exp instead of the probabilities (counted so for
`device="cuda"`; on CPU so for self-attention's fused form where the CPU's flash kernel runs it, no trained mask and
no dropout, and elsewhere the meta dispatch keeps what the CPU's math path keeps), and on CUDA the context, NCCL
and allocator reserve (`CUDA_RESERVE_BYTES`) is added. The backward adds one term of its own: on CUDA the
memory-efficient kernel's backward allocates the gradient of a trained mask at the expanded [b, heads, n, m] size
before summing it to the mask's shape (T5's bias [1, heads, n, m]: 192 MiB at configs/base.yaml's micro batch 32 in
bf16), one layer at a time (`ActivationTrace.attention_backward`). Otherwise, measured on CPU (tests/test_plan.py),
the peak of a forward + backward stays within a few percent of the bytes saved at the end of the forward, because
each layer's backward frees its saved tensors as it creates gradients.
"""
from __future__ import annotations

import contextlib
import dataclasses
import warnings
from dataclasses import dataclass
from typing import Iterator

import torch
import torch.distributed as dist
import torch.nn.functional as F
from megatron.core import parallel_state
from megatron.core.tensor_parallel import random as mp_random

from pretrain.core.config import Config
from pretrain.model.sdpa import meta_as

GiB = 2**30
CUDA_RESERVE_BYTES = 3 * GiB  # CUDA context (~0.5 GiB), NCCL buffers, caching-allocator fragmentation
_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


@dataclass(frozen=True)
class MemoryEstimate:
    """Bytes per GPU. `activations` is for the configured train.activation_checkpointing."""

    params: int
    grads: int
    optimizer: int
    activations: int
    activations_none: int  # no recompute
    activations_full: int  # whole layers recomputed
    activations_selective: int  # attention core recomputed
    buffers: int  # DeepSpeed buckets + the device reserve
    num_params: int  # parameters of this TP rank's shard

    @property
    def total(self) -> int:
        return self.params + self.grads + self.optimizer + self.activations + self.buffers


# ---------------------------------------------------------------------------------------------------------
# One TP rank's shapes without process groups
# ---------------------------------------------------------------------------------------------------------
class _StandInGroup:
    """What megatron's layers ask of a TP group: its size and this rank's place in it."""

    def __init__(self, size: int) -> None:
        self._size = size

    def size(self) -> int:
        return self._size

    def rank(self) -> int:
        return 0


def _no_collective(*args, **kwargs) -> None:
    return None


class _NoRngTracker:
    """megatron's RNG tracker while tracing: dropout on meta tensors draws nothing, so no stream is needed."""

    def fork(self, *args, **kwargs):
        return contextlib.nullcontext()


_STATE = ("_TENSOR_MODEL_PARALLEL_GROUP", "_PIPELINE_MODEL_PARALLEL_GROUP", "_DATA_PARALLEL_GROUP",
          "_MPU_TENSOR_MODEL_PARALLEL_WORLD_SIZE", "_MPU_TENSOR_MODEL_PARALLEL_RANK")
_COLLECTIVES = ("all_reduce", "all_gather", "all_gather_into_tensor", "reduce_scatter_tensor", "broadcast",
                "is_initialized", "get_rank")


@contextlib.contextmanager
def tp_shapes(tp: int) -> Iterator[None]:
    """Build and run meta models as TP rank 0 of `tp`; megatron's state and torch.distributed are restored."""
    saved = {name: getattr(parallel_state, name) for name in _STATE}
    collectives = {name: getattr(dist, name) for name in _COLLECTIVES}
    tracker = (mp_random._CUDA_RNG_STATE_TRACKER, mp_random._CUDA_RNG_STATE_TRACKER_INITIALIZED)
    with warnings.catch_warnings():
        # megatron's advice to set CUDA_DEVICE_MAX_CONNECTIONS is for the job, which sets it; not for a trace
        warnings.filterwarnings("ignore", message="When using async grad allreduce", category=UserWarning)
        try:
            parallel_state._TENSOR_MODEL_PARALLEL_GROUP = _StandInGroup(tp)
            parallel_state._PIPELINE_MODEL_PARALLEL_GROUP = _StandInGroup(1)
            parallel_state._DATA_PARALLEL_GROUP = _StandInGroup(1)
            parallel_state._MPU_TENSOR_MODEL_PARALLEL_WORLD_SIZE = tp
            parallel_state._MPU_TENSOR_MODEL_PARALLEL_RANK = 0
            for name in _COLLECTIVES:  # shape-only tensors: a reduction changes no shape
                setattr(dist, name, _no_collective)
            dist.is_initialized = lambda: True  # megatron reads the group from its state only in a "launched" process
            dist.get_rank = lambda group=None: 0
            mp_random._CUDA_RNG_STATE_TRACKER, mp_random._CUDA_RNG_STATE_TRACKER_INITIALIZED = _NoRngTracker(), True
            yield
        finally:
            mp_random._CUDA_RNG_STATE_TRACKER, mp_random._CUDA_RNG_STATE_TRACKER_INITIALIZED = tracker
            for name, value in saved.items():
                setattr(parallel_state, name, value)
            for name, fn in collectives.items():
                setattr(dist, name, fn)


def meta_model(cfg: Config, tp: int, device: str = "cuda") -> torch.nn.Module:
    """This TP rank's shard of the model on the meta device, in the training dtype, taking the attention code
    path it takes on `device`; allocates nothing and draws nothing from torch's generators."""
    from pretrain.model import build_model  # imported where used: pretrain.model imports this module's users

    with tp_shapes(tp):  # its forward picks `device`'s attention path under sdpa.meta_as (trace_activations)
        model = build_model(cfg.model, device="meta")
    return model.to(_DTYPES[cfg.precision])


# ---------------------------------------------------------------------------------------------------------
# Model states
# ---------------------------------------------------------------------------------------------------------
def length_bound_params(cfg: Config, tp: int) -> dict[str, int]:
    """Parameters of this TP rank's shard that grow with `model.max_length` N, by mixer (Random's [h, N, N],
    Dense's W2 [d_kv, N] and b2 per head, the factorized mixers' factors): the ones whose size changes with N,
    found by building the model at N and N + 1 on the meta device."""
    sizes = []
    for n in (cfg.model.max_length, cfg.model.max_length + 1):
        longer = dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, max_length=n))
        sizes.append({name: p.numel() for name, p in meta_model(longer, tp).named_parameters()})
    bound: dict[str, int] = {}
    for name, numel in sizes[0].items():
        if sizes[1].get(name) != numel:
            mixer = name.split(".synth.", 1)[1].split(".", 1)[0] if ".synth." in name else name.rsplit(".", 1)[0]
            bound[mixer] = bound.get(mixer, 0) + numel
    return bound


def model_state_bytes(num_params: int, precision: str, stage: int, dp: int, optimizer: str,
                      factored_elements: int = 0) -> tuple[int, int, int]:
    """(parameters, gradients, optimizer states) in bytes per GPU for `num_params` parameters of one TP shard.

    DeepSpeed's layout (deepspeed 0.19): fp32 has no master copy without ZeRO (AdamW keeps m and v, 8 bytes)
    and a partitioned fp32 copy with it (12 bytes over DP); bf16/fp16 keep 2-byte weights, gradients
    accumulated and reduced in fp32 (`data_types.grad_accum_dtype`): ZeRO 1 keeps the whole fp32 gradient
    (DeepSpeed's BF16 optimizer) plus the 2-byte `.grad` of every parameter, ZeRO 0 the 2-byte gradient and its
    fp32 copy in the step, stages 2 and 3 a partition over DP. Adafactor (ZeRO 0 only, see pretrain.core.deepspeed_config)
    keeps the row and column factors (`factored_elements`).
    """
    p, shard = num_params, lambda nbytes: -(-nbytes // dp)
    wide = precision == "fp32"
    params = 4 * p if wide else 2 * p
    if stage == 3:
        params = shard(params)
    grads = 4 * p if stage < 2 else shard(4 * p)
    if not wide and stage < 2:
        # and the half-precision .grad of every parameter beside it, all step: BF16_Optimizer (ZeRO 1) keeps it for
        # the next accumulation; without ZeRO it is the gradient, and the step makes the fp32 copy from it
        grads += 2 * p
    if stage == 0:
        opt = (8 * p if optimizer == "adamw" else 4 * factored_elements) + (0 if wide else 4 * p)
    else:
        opt = shard(12 * p)  # AdamW's m + v + the fp32 master partition
    return params, grads, opt


def _factored_elements(model: torch.nn.Module) -> int:
    """Adafactor's state without ZeRO: rows + columns of each matrix, every element of vectors."""
    return sum(p.shape[-2] + p.shape[-1] if p.dim() >= 2 else p.numel() for p in model.parameters())


# ---------------------------------------------------------------------------------------------------------
# Activations: a meta trace of the forward
# ---------------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class ActivationTrace:
    blocks: tuple[int, ...]  # bytes saved inside each encoder/decoder layer
    core: int  # of those, bytes saved inside attention cores (what selective recompute drops)
    largest_core: int  # the largest single core (what selective recompute holds while it recomputes)
    rest: int  # saved outside the layers: embeddings, relative bias, final norms, LM head, loss
    logits: int  # the returned logits [b, m, vocab/tp], alive until the backward
    layer_inputs: int  # what full recompute keeps per layer: its input hidden states, summed over layers
    attention_backward: int = 0  # the largest transient of one attention backward: CUDA's mask gradient, expanded


def _fused_attention_like_cuda(q, k, v, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, **kwargs):
    """SDPA as the fused kernels save it: Q, K, V, output and log-sum-exp (fp32), the mask if it needs a grad; and
    the backward's gradient of such a mask, at the expanded [b, heads, n, m] size (CUDA's memory-efficient kernel)."""
    out = torch.empty(*q.shape[:-1], v.shape[-1], dtype=q.dtype, device=q.device)
    lse = torch.empty(q.shape[:-1], dtype=torch.float32, device=q.device)
    trained = attn_mask is not None and attn_mask.requires_grad
    _SAVED_BY_KERNEL.extend([q, k, v, out, lse] + ([attn_mask] if trained else []))
    if trained:
        _BACKWARD_TRANSIENT.append(q.shape[0] * q.shape[1] * q.shape[2] * k.shape[2] * attn_mask.element_size())
    return out


def _counting_rms_norm(record):
    """F.rms_norm counted as CUDA's fused kernel saves it: its input and the fp32 reciprocal RMS per row. On meta (and
    the CPU) torch decomposes it, saving three fp32 copies of x: measured on an H200 at configs/base.yaml (bf16, micro
    batch 32), the trace of the layers then came to 8.7 GiB where CUDA saved 6.0 GiB."""
    def rms_norm(x, normalized_shape, weight=None, eps=None):
        record(x)
        record(torch.empty(*x.shape[:-1], 1, dtype=torch.float32, device=x.device))
        needs_grad = x.requires_grad or (weight is not None and weight.requires_grad)
        return torch.empty_like(x).requires_grad_(needs_grad)
    return rms_norm


_SAVED_BY_KERNEL: list[torch.Tensor] = []
_BACKWARD_TRANSIENT: list[int] = []


def trace_activations(cfg: Config, tp: int, micro_batch: int, target_length: int, device: str = "cuda",
                      model: torch.nn.Module | None = None) -> ActivationTrace:
    """Bytes autograd saves in one training forward of `micro_batch` sequences, per region of the model
    (`model`: meta_model(cfg, tp, device) when already built)."""
    model = meta_model(cfg, tp, device) if model is None else model
    model.train()
    params = {id(p) for p in model.parameters()}
    seen: dict[int, tuple[int, str]] = {}
    keep_alive: list[torch.Tensor] = []
    region = ["rest"]

    def record(t: torch.Tensor) -> None:
        base = t if t._base is None else t._base
        if id(base) in params or id(base) in seen:
            return
        keep_alive.append(base)  # ids stay unique while the trace runs
        seen[id(base)] = (base.untyped_storage().nbytes(), region[-1])

    def pack(t: torch.Tensor) -> torch.Tensor:
        record(t)
        return t

    blocks = [m for stack in (model.encoder, model.decoder) for m in stack.layers]
    for i, block in enumerate(blocks):
        block.register_forward_pre_hook(lambda mod, args, i=i: region.append(f"block{i}"))
        block.register_forward_hook(lambda mod, args, out: [region.pop(), None][1])
        attn = block.attn
        for name in ("_fused", "_mixed"):  # the attention core: what selective recompute drops
            if hasattr(attn, name):
                setattr(attn, name, _tag_core(getattr(attn, name), region, i))
    b, n, m = micro_batch, cfg.data.input_length, target_length
    ids = dict(
        input_ids=torch.zeros(b, n, dtype=torch.long, device="meta"),
        decoder_input_ids=torch.zeros(b, m, dtype=torch.long, device="meta"),
        labels=torch.zeros(b, m, dtype=torch.long, device="meta"),
    )
    sdpa = F.scaled_dot_product_attention
    _SAVED_BY_KERNEL.clear()
    _BACKWARD_TRANSIENT.clear()
    rms_norm = F.rms_norm
    try:
        F.scaled_dot_product_attention = _counting_sdpa(region, record, device, sdpa)
        if device == "cuda":
            F.rms_norm = _counting_rms_norm(record)
        with tp_shapes(tp), torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t), meta_as(device):
            out = model(**ids)
    finally:
        F.scaled_dot_product_attention, F.rms_norm = sdpa, rms_norm
    by_region: dict[str, int] = {}
    for nbytes, where in seen.values():
        by_region[where] = by_region.get(where, 0) + nbytes
    block_bytes = tuple(sum(v for k, v in by_region.items() if k in (f"block{i}", f"core{i}"))
                        for i in range(len(blocks)))
    cores = [by_region.get(f"core{i}", 0) for i in range(len(blocks))]
    logits = out.logits if out.logits._base is None else out.logits._base
    dtype_bytes = torch.finfo(_DTYPES[cfg.precision]).bits // 8
    d = cfg.model.d_model
    return ActivationTrace(
        blocks=block_bytes,
        core=sum(cores),
        largest_core=max(cores, default=0),
        rest=by_region.get("rest", 0),
        logits=0 if id(logits) in seen else logits.untyped_storage().nbytes(),
        layer_inputs=b * d * dtype_bytes * (cfg.model.num_layers * n + cfg.model.num_decoder_layers * m),
        attention_backward=max(_BACKWARD_TRANSIENT, default=0),
    )


def _tag_core(fn, region: list[str], i: int):
    def tagged(*args, **kwargs):
        region.append(f"core{i}")
        try:
            return fn(*args, **kwargs)
        finally:
            region.pop()
    return tagged


def _counting_sdpa(region: list[str], record, device: str, real):
    """SDPA counted as the fused kernel saves it: every call on CUDA; on the CPU self-attention's fused form where the
    flash kernel runs it (pretrain/model/sdpa.py: no trained mask, no dropout); `real` (the meta math path) else."""
    def sdpa(q, k, v, attn_mask=None, dropout_p=0.0, is_causal=False, **kwargs):
        cpu_flash = (region[-1].startswith("core") and torch.backends.cuda.flash_sdp_enabled() and dropout_p == 0
                     and not (attn_mask is not None and attn_mask.requires_grad))
        if device != "cuda" and not cpu_flash:
            return real(q, k, v, attn_mask=attn_mask, dropout_p=dropout_p, is_causal=is_causal, **kwargs)
        args = (q, k, v, attn_mask, dropout_p, is_causal)
        out = _fused_attention_like_cuda(*args, **kwargs)
        for t in _SAVED_BY_KERNEL:
            record(t)
        _SAVED_BY_KERNEL.clear()
        needs_grad = any(isinstance(a, torch.Tensor) and a.requires_grad for a in args)
        return out.requires_grad_(needs_grad)
    return sdpa


def core_bytes(forward, device: str, exclude=()) -> tuple[int, int]:
    """(bytes saved for the backward, the backward's largest transient) of one attention core: `forward()` run on
    meta tensors, counted as trace_activations counts a layer's core on `device` (bench.attention prints it beside
    the measured peak); tensors in `exclude` (the core's inputs and parameters) are not counted."""
    skip = {id(t) for t in exclude}
    seen: dict[int, int] = {}
    keep_alive: list[torch.Tensor] = []

    def record(t: torch.Tensor) -> None:
        base = t if t._base is None else t._base
        if id(base) not in skip and id(base) not in seen:
            keep_alive.append(base)
            seen[id(base)] = base.untyped_storage().nbytes()

    sdpa = F.scaled_dot_product_attention
    _SAVED_BY_KERNEL.clear()
    _BACKWARD_TRANSIENT.clear()
    try:
        F.scaled_dot_product_attention = _counting_sdpa(["core"], record, device, sdpa)
        with torch.autograd.graph.saved_tensors_hooks(lambda t: [record(t), t][1], lambda t: t):
            forward()
    finally:
        F.scaled_dot_product_attention = sdpa
    return sum(seen.values()), max(_BACKWARD_TRANSIENT, default=0)


def activation_bytes(trace: ActivationTrace, mode: str) -> int:
    """Peak activation bytes for train.activation_checkpointing `mode` (none, full or selective)."""
    largest = max(trace.blocks, default=0)
    if mode == "full":  # layer inputs kept; one layer's activations rebuilt at a time during the backward
        return trace.rest + trace.logits + trace.layer_inputs + largest + trace.attention_backward
    saved = sum(trace.blocks) + trace.rest + trace.logits + trace.attention_backward
    if mode == "selective":  # cores dropped; one rebuilt at a time
        return saved - trace.core + trace.largest_core
    return saved


# ---------------------------------------------------------------------------------------------------------
# The whole estimate
# ---------------------------------------------------------------------------------------------------------
def estimate_memory(cfg: Config, tp: int, dp: int, micro_batch: int, target_length: int,
                    device: str = "cuda") -> MemoryEstimate:
    """Bytes per GPU of the job `cfg` at TP `tp`, DP `dp` and `micro_batch` sequences per forward."""
    from pretrain.model.t5 import checkpointing_mode  # the trainer's reading of the setting

    model = meta_model(cfg, tp, device)  # the device sets code paths only: the same parameters either way
    num_params = sum(p.numel() for p in model.parameters())
    params, grads, opt = model_state_bytes(num_params, cfg.precision, cfg.zero.stage, dp, cfg.train.optimizer,
                                           _factored_elements(model))
    trace = trace_activations(cfg, tp, micro_batch, target_length, device, model)
    modes = {mode: activation_bytes(trace, mode) for mode in ("none", "full", "selective")}
    configured = modes[checkpointing_mode(cfg.train.activation_checkpointing)]
    buffers = _bucket_bytes(cfg) + (CUDA_RESERVE_BYTES if device == "cuda" else 0)
    return MemoryEstimate(params, grads, opt, configured, modes["none"], modes["full"], modes["selective"],
                          buffers, num_params)


def _bucket_bytes(cfg: Config) -> int:
    """DeepSpeed's communication buckets (elements x the gradient's fp32 bytes): reduce and all-gather."""
    if cfg.zero.stage == 0:
        return 0
    return 4 * (cfg.zero.reduce_bucket_size + cfg.zero.allgather_bucket_size)
