"""The planner: will this job start, and does it fit? Run before submitting, without a GPU:

    python -m pretrain.plan --config configs/xl.yaml --nodes 4 --gpus-per-node 8 [--gpu-memory-gb 80] \
        [section.key=value ...]

It runs the trainer's own start-up checks (`check_job`: the parallel layout, the batch split, every engine
option; the trainer calls the same function), estimates the memory per GPU (pretrain.planning.memory: model states
per ZeRO stage, activations traced on the meta device for the configured mixers, with and without
recompute, buffers), the model FLOPs per step and the step's communication (pretrain.planning.comm: collectives,
bytes, exposed or overlapped, at --link-gbps / --nvlink-gbps), the checkpoint's bytes per rank and save time at
--fs-gbps with the share of wall time `checkpoint.every` spends saving (pretrain.planning.checkpoint; a warning
line over 5%), and ends with a verdict: exit 0 and
`fits: X of M GiB`, or exit 2 and one line naming what does not fit and the first setting to change.

`train.micro_batch: auto` is resolved here as well: the largest micro batch that divides the per-rank batch
(global batch / DP) and fits in `AUTO_FILL` of the device's memory.
"""
from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from pathlib import Path

from pretrain.core.config import Config, UsageError
from pretrain.core.deepspeed_config import build_deepspeed_config
from pretrain.data.loader import dp_sizes, num_streams
from pretrain.data.span_corruption import input_and_target_lengths
from pretrain.distributed.parallel import check_parallel, padded_vocab_size
from pretrain.model import check_model
from pretrain.model.flops import flops_per_sequence
from pretrain.planning.checkpoint import (
    FS_GBPS,
    T5_TOKENIZER_BYTES,
    CheckpointEstimate,
    checkpoint_bytes,
    describe_checkpoint,
    estimate_save,
    warning,
)
from pretrain.planning.comm import GPU_TFLOPS, IB_GBPS, NVLINK_GBPS, describe, estimate_comm
from pretrain.planning.memory import GiB, MemoryEstimate, estimate_memory, length_bound_params
from pretrain.planning.units import binary_size, count

AUTO_FILL = 0.9  # auto micro batch: leave 10% of the device for what the estimate does not see
T5_IDS = 32100  # T5's SentencePiece ids (32000 pieces + 100 sentinels), assumed when no tokenizer is at hand


@dataclass(frozen=True)
class Layout:
    """How a job of `world` processes runs `cfg`, as the trainer will set it up."""

    world: int
    tp: int
    dp: int
    zero_stage: int
    micro_batch: int
    accumulation: int
    input_length: int
    target_length: int
    tokens_per_step: int  # input + target tokens of one global batch
    vocab_rows: int  # embedding rows at this TP (model.vocab_size padded to 128 x TP)


def check_job(cfg: Config, world: int, gpu_memory_bytes: int | None = None) -> Layout:
    """Every start-up rule across sections the trainer checks before allocating, for `world` processes (each
    section's own rules ran when `cfg` was built); a mistake is a UsageError whose message is one line.
    `train.micro_batch: auto` needs
    `gpu_memory_bytes` (without it: the whole per-rank batch in one pass, no accumulation)."""
    tp = cfg.parallel.tensor
    if cfg.train.lr == "auto":
        raise UsageError("train.lr auto is fine-tuning's rule (from the export's width); pretraining takes a number "
                         "(the size configs: 1e-2 x 64 / model.d_model, configs/_t5_v1_1.yaml)")
    try:
        check_parallel(cfg.model, tp, world)
        check_model(cfg.model, tp)
        dp = world // tp
        target_length = input_and_target_lengths(cfg.data.input_length, cfg.data.noise_density,
                                                 cfg.data.mean_noise_span_length)[1]
        micro = _micro_batch(cfg, tp, dp, target_length, gpu_memory_bytes)
        train = dataclasses.replace(cfg.train, micro_batch=micro)
        ds = build_deepspeed_config(train, cfg.zero, cfg.precision, dp)  # batch split, stage, precision, optimizer
    except UsageError:
        raise
    except ValueError as e:  # the checks' one-line messages are the user's mistakes
        raise UsageError(str(e)) from None
    return Layout(
        world=world, tp=tp, dp=dp, zero_stage=cfg.zero.stage, micro_batch=micro,
        accumulation=ds["gradient_accumulation_steps"], input_length=cfg.data.input_length,
        target_length=target_length, tokens_per_step=cfg.train.global_batch * (cfg.data.input_length + target_length),
        vocab_rows=padded_vocab_size(_ids(cfg), tp),
    )


def with_layout(cfg: Config, layout: Layout) -> Config:
    """`cfg` with the resolved micro batch (an int), as the trainer then uses it."""
    return dataclasses.replace(cfg, train=dataclasses.replace(cfg.train, micro_batch=layout.micro_batch))


def check_memory(cfg: Config, layout: Layout, gpu_memory_bytes: int, device: str = "cuda") -> MemoryEstimate:
    """The estimate for `layout`; a UsageError (one line: what does not fit, the first thing to change) when
    it exceeds `gpu_memory_bytes`. The trainer calls it on CUDA with the device's memory before allocating."""
    est = estimate(cfg, layout, device)
    if est.total > gpu_memory_bytes:
        raise UsageError(_advice(cfg, layout, est, gpu_memory_bytes, device))
    return est


def estimate(cfg: Config, layout: Layout, device: str = "cuda") -> MemoryEstimate:
    """The memory per GPU of `cfg` at `layout` (pretrain.planning.memory.estimate_memory), whether it fits or not."""
    return _estimate(cfg, layout.tp, layout.dp, layout.micro_batch, layout.target_length, device)


def step_flops(cfg: Config, layout: Layout) -> float:
    """The model FLOPs of one global batch (all GPUs together)."""
    return cfg.train.global_batch * flops_per_sequence(with_vocab_size(cfg).model, layout.input_length,
                                                       layout.target_length)


def _ids(cfg: Config) -> int:
    """model.vocab_size, or the tokenizer's ids when it is 0 (T5's 32100 without a tokenizer file)."""
    if cfg.model.vocab_size:
        return cfg.model.vocab_size
    if cfg.data.tokenizer and Path(cfg.data.tokenizer).is_file():
        from tokenizer.spm import Tokenizer  # imported where used: sentencepiece only when a file is named

        return Tokenizer(cfg.data.tokenizer).num_ids
    return T5_IDS


def with_vocab_size(cfg: Config) -> Config:
    """`cfg` with model.vocab_size set: the tokenizer's ids when it is 0 (T5's 32100 without a tokenizer file)."""
    return dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, vocab_size=_ids(cfg)))


_ESTIMATES: dict[tuple, MemoryEstimate] = {}


def _estimate(cfg: Config, tp: int, dp: int, micro: int, target_length: int, device: str) -> MemoryEstimate:
    """estimate_memory, once per job: a plan asks twice (the auto micro batch, then the check), and each estimate
    builds and traces a meta model (1.7 s of CPU at T5-base's 24 layers)."""
    key = (repr(cfg), tp, dp, micro, target_length, device)
    if key not in _ESTIMATES:
        _ESTIMATES[key] = estimate_memory(with_vocab_size(cfg), tp, dp, micro, target_length, device)
    return _ESTIMATES[key]


def _micro_batch(cfg: Config, tp: int, dp: int, target_length: int, gpu_memory_bytes: int | None) -> int:
    value = cfg.train.micro_batch
    if isinstance(value, int) and not isinstance(value, bool):
        return value  # build_deepspeed_config checks the split
    if value != "auto":
        raise UsageError(f"train.micro_batch ({value}) must be an integer >= 1 or auto")  # as TrainConfig says
    per_rank = cfg.train.global_batch // dp
    if per_rank < 1 or cfg.train.global_batch % dp:
        raise UsageError(f"train.global_batch ({cfg.train.global_batch}) must be a multiple of the data-parallel "
                         f"size ({dp}) for train.micro_batch: auto")
    candidates = [b for b in range(per_rank, 0, -1) if per_rank % b == 0]
    if gpu_memory_bytes is None:
        return candidates[0]
    for micro in candidates:
        if _estimate(cfg, tp, dp, micro, target_length, "cuda").total <= AUTO_FILL * gpu_memory_bytes:
            return micro
    return 1  # does not fit even so: check_memory says what to change


# ---------------------------------------------------------------------------------------------------------
# What to change when it does not fit
# ---------------------------------------------------------------------------------------------------------
def _advice(cfg: Config, layout: Layout, est: MemoryEstimate, memory: int, device: str) -> str:
    need = (f"needs {est.total / GiB:.1f} GiB per GPU of {memory / GiB:.0f} GiB (model states "
            f"{(est.params + est.grads + est.optimizer) / GiB:.1f}, activations {est.activations / GiB:.1f})")
    for key, value, changed in _alternatives(cfg, layout):
        try:
            alt_layout = check_job(changed, layout.world)
        except UsageError:
            continue
        alt = estimate(changed, alt_layout, device)
        if alt.total <= memory:
            return f"does not fit: {need}; set {key}={value} ({alt.total / GiB:.1f} GiB)"
    return f"does not fit: {need}; no single change fits: add GPUs or raise parallel.tensor and zero.stage together"


def _alternatives(cfg: Config, layout: Layout):
    """(key, value, config) in the order to try: recompute, micro batch, ZeRO stage, tensor parallelism."""
    from pretrain.model.t5 import checkpointing_mode

    mode = checkpointing_mode(cfg.train.activation_checkpointing)
    for option in ("selective", "full"):
        if mode == "none" or (mode == "selective" and option == "full"):
            yield "train.activation_checkpointing", option, _with(cfg, "train", activation_checkpointing=option)
    micro = layout.micro_batch
    while micro > 1:
        micro //= 2
        if (layout.micro_batch // micro) * micro == layout.micro_batch:
            yield "train.micro_batch", micro, _with(cfg, "train", micro_batch=micro)
    for stage in range(cfg.zero.stage + 1, 4):
        if layout.dp > 1:
            yield "zero.stage", stage, _with(cfg, "zero", stage=stage)
    tp = layout.tp * 2
    while tp <= min(layout.world, 8):  # TP within a node
        yield "parallel.tensor", tp, _with(cfg, "parallel", tensor=tp)
        tp *= 2


def _with(cfg: Config, section: str, **changes) -> Config:
    return dataclasses.replace(cfg, **{section: dataclasses.replace(getattr(cfg, section), **changes)})


def _length_line(cfg: Config, layout: Layout, est: MemoryEstimate) -> list[str]:
    """The parameters bound to model.max_length N, by mixer (none for vanilla-only models): they grow as N^2
    (random, fixed_random: [h, N, N]) or N (dense, the factorized mixers), so a longer context costs them."""
    bound = length_bound_params(with_vocab_size(cfg), layout.tp)
    if not bound:
        return []
    parts = ", ".join(f"{name} {count(n)}" for name, n in sorted(bound.items()))
    total = sum(bound.values())
    return [f"  of which bound to model.max_length {cfg.model.max_length}: {parts} ({count(total)}, "
            f"{100 * total / est.num_params:.1f}%; random and fixed_random grow as N^2, the others as N)"]


def _data_line(cfg: Config, layout: Layout) -> str:
    """What the run reads, as far as the config says (the shards themselves are the loader's to open and check), and
    the DP sizes its lanes let it use and move between on a requeue (pretrain/data/loader.py, `dp_sizes`)."""
    d = cfg.data
    what = (f"{len(d.sources)} sources in one order: " + ", ".join(f"{s.name} {s.weight:g}" for s in d.sources)
            if d.sources else f"data.train {d.train or '(not set)'}")
    lanes = num_streams(d)
    sizes = dp_sizes(lanes)
    fits = "" if layout.dp in sizes else (f"; DP {layout.dp} is not one of them: set data.streams to a multiple of it at the run's "
                                            f"start ({math.lcm(lanes, layout.dp)} keeps the sizes above)")
    return (f"data: {what}; {lanes} lanes (data.streams {d.streams or '0: the default'}): the run may use and move "
            f"between DP sizes {', '.join(map(str, sizes))}{fits}")


# ---------------------------------------------------------------------------------------------------------
# Command line
# ---------------------------------------------------------------------------------------------------------
def plan_checkpoint(cfg: Config, layout: Layout, est: MemoryEstimate) -> CheckpointEstimate:
    """The bytes a save of `cfg` at `layout` writes (per rank, in all)."""
    tokenizer = Path(cfg.data.tokenizer) if cfg.data.tokenizer else None
    factored = 0
    if cfg.train.optimizer == "adafactor":
        from pretrain.planning.memory import _factored_elements, meta_model

        factored = _factored_elements(meta_model(with_vocab_size(cfg), layout.tp))
    return checkpoint_bytes(est.num_params, cfg.precision, layout.zero_stage, layout.tp, layout.dp,
                            cfg.train.optimizer, factored,
                            tokenizer.stat().st_size if tokenizer and tokenizer.is_file() else T5_TOKENIZER_BYTES)


def report(cfg: Config, layout: Layout, est: MemoryEstimate, memory: int, gpus_per_node: int = 8,
           link_gbps: float = IB_GBPS, nvlink_gbps: float = NVLINK_GBPS, gpu_tflops: float = GPU_TFLOPS,
           fs_gbps: float = FS_GBPS) -> tuple[str, str | None]:
    """The planner's table: layout, memory per GPU, FLOPs, communication per step, the checkpoint; and a
    warning line when saving takes more than 5% of wall time (else None)."""
    flops = step_flops(cfg, layout)
    comm = estimate_comm(cfg, layout.tp, layout.dp, layout.micro_batch, layout.accumulation, layout.target_length,
                         est.num_params, flops / layout.world, gpus_per_node, link_gbps, nvlink_gbps, gpu_tflops,
                         embedding_params=layout.vocab_rows // layout.tp * cfg.model.d_model)
    g = lambda nbytes: f"{binary_size(nbytes):>10}"  # noqa: E731
    lines = [
        f"layout: {layout.world} GPUs = TP {layout.tp} x DP {layout.dp}, ZeRO {layout.zero_stage}, {cfg.precision}; "
        f"global batch {cfg.train.global_batch} = micro {layout.micro_batch} x accumulation {layout.accumulation} "
        f"x DP {layout.dp}; {layout.tokens_per_step:,} tokens/step ({layout.input_length} + {layout.target_length})",
        f"model: {count(est.num_params)} parameters per GPU (TP shard), vocabulary rows {layout.vocab_rows}",
        *_length_line(cfg, layout, est),
        _data_line(cfg, layout),
        "memory per GPU:",
        f"  parameters           {g(est.params)}",
        f"  gradients            {g(est.grads)}",
        f"  optimizer states     {g(est.optimizer)}",
        f"  activations          {g(est.activations)}   (recompute none {binary_size(est.activations_none)}, "
        f"selective {binary_size(est.activations_selective)}, full {binary_size(est.activations_full)})",
        f"  buffers              {g(est.buffers)}",
        f"  total                {g(est.total)}   of {binary_size(memory)}",
        f"model FLOPs per step: {flops:.3e} ({flops / layout.world:.3e} per GPU)",
        *describe(comm, link_gbps, nvlink_gbps, gpu_tflops),
    ]
    ckpt = plan_checkpoint(cfg, layout, est)
    save = estimate_save(ckpt, cfg.checkpoint.every, comm.step_s, cfg.checkpoint.async_save, fs_gbps)
    return "\n".join(lines + describe_checkpoint(ckpt, save, layout.dp, fs_gbps)), warning(save, cfg.train.steps)
