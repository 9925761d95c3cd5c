"""The one training loop of every job. Pretraining (`pretrain.train`) and fine-tuning (`pretrain.finetune`) differ
in setup (data, model, evaluation); a step, a skipped step, a metrics line, a save, an evaluation and a signal
work the same in both, here.

Each step: `train_step` (forward/backward of every micro batch, one optimizer step); then, in this order, the
metrics record (`Meter`, kept in the checkpoint's progress), the checkpoint (`CheckpointManager.maybe_save`; with
`checkpoint.async_save` a periodic one is written in the background and completes at the first step whose
collective says no rank is still writing it, `CheckpointManager.poll`), the evaluation (`Evaluator`), so a failing evaluation never loses the step's checkpoint, and the metrics line; then the
preemption signal (agreed by every rank) ends the run with EXIT_PREEMPTED after that checkpoint. A signal during
an evaluation ends it between two batches (the step saved if it was not); one before the first step ends the run
with nothing to save. A resumed step whose metrics line is missing (a kill after its checkpoint committed: during
its evaluation, say) gets it back first: the record from the checkpoint, the evaluation done again.

A step counts only when DeepSpeed applied it (`engine.was_step_applied()`). A non-finite activation in any micro
batch makes that micro batch's loss and the accumulated gradients non-finite; the optimizer then skips the whole
step on every rank: DeepSpeed's ZeRO and bf16/fp16 optimizers check their (DP-reduced) gradients themselves,
the plain fp32 ZeRO-0 optimizer through `install_skip_guard`. A skipped step neither updates weights nor moments
nor the LR schedule; it is counted (`skipped_steps`), its batches are consumed, and the same step number is tried
again with the next ones. No micro batch waits on the host: losses stay on the device until a metrics line.
"""
from __future__ import annotations

import functools
import logging
import signal
import time
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any, Callable, Iterable, Iterator, Protocol

import deepspeed
import torch
import torch.distributed as dist
from megatron.core import parallel_state

from pretrain.core.config import TrainConfig
from pretrain.distributed.parallel import ParallelDims
from pretrain.model.sharding import is_tp_sharded
from pretrain.runtime.checkpoint import CheckpointManager, Progress
from pretrain.runtime.device_streams import CudaStreams, streams_for
from pretrain.runtime.faults import EXIT_OK, EXIT_PREEMPTED, Preempted, check_skip_budget, stop_if_preempted
from pretrain.runtime.metrics import MetricsLogger, peak_memory_bytes
from pretrain.runtime.pictures import synthesizer_images
from pretrain.runtime.preemption import PreemptionFlag, stop_watching, watch_preemption
from pretrain.runtime.profiling import Profiler, span
from pretrain.runtime.stragglers import RankSpread, StepClock

log = logging.getLogger(__name__)


def to_device(batches: Iterable[dict], device: torch.device,
              streams: CudaStreams | None = None) -> Iterator[dict[str, torch.Tensor]]:
    """Batches on `device`; from pinned host memory on CUDA, so the copy is asynchronous (a pageable source
    makes `non_blocking` copies synchronous). streams: the device's (`streams_for`) unless given (a test double)."""
    streams = streams or streams_for(device)
    for batch in batches:
        if streams is not None:
            batch = {k: streams.pin(v) for k, v in batch.items()}
        yield {k: v.to(device, non_blocking=True) for k, v in batch.items()}


# ----------------------------------------------------------------------------------------------------------------
# One step
# ----------------------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class StepResult:
    applied: bool  # DeepSpeed applied the update
    preempted: bool  # some rank had received a preemption signal by the step's collective (the same on every rank)
    loss: torch.Tensor  # [] mean loss over the step's micro batches and DP ranks, on the device
    grad_norm: torch.Tensor | float  # global norm before clipping (over DP and TP)
    lr: float  # the learning rate this step used (the engine's)
    tokens: int  # input + target tokens of the step over all DP ranks (padded; from the shapes, no sync)
    clock: StepClock  # this rank's data wait and time to the gradient reduction (pretrain.runtime.stragglers)
    writing: bool = False  # some rank's checkpoint writer was still writing at the step's collective


def install_skip_guard(engine) -> bool:
    """Give the plain fp32 optimizer (ZeRO 0, no loss scaling) the `overflow` flag that DeepSpeed's other
    optimizers set when their gradients are non-finite: `engine.step()` then skips the update and the LR schedule
    and reports `was_step_applied() == False`, as it does for them. True if the guard was installed."""
    optimizer = engine.optimizer
    if hasattr(optimizer, "overflow"):
        return False
    step = optimizer.step

    @functools.wraps(step)  # keeps the LR scheduler's mark on the step it wrapped (else torch warns at every start)
    def guarded_step(*args, **kwargs):
        return None if optimizer.overflow else step(*args, **kwargs)

    optimizer.overflow, optimizer.skip_guard = False, True
    optimizer.step = guarded_step
    return True


def grad_norm_over_tp(model: torch.nn.Module) -> torch.Tensor:
    """[] the L2 norm of the whole model's gradients, on the device (no sync), the same on every TP rank: a
    TP-sharded parameter counts on every TP rank, a replicated one (norms, a per-layer mixture vector) on TP rank
    0 only. Non-finite when any gradient is. DeepSpeed's `get_global_norm_of_tensors` does neither: it reports a
    non-finite norm as -1.0 and counts replicated parameters TP times."""
    first = parallel_state.get_tensor_model_parallel_rank() == 0
    grads = [p.grad for p in model.parameters() if p.grad is not None and (first or is_tp_sharded(p))]
    squares = torch.nn.utils.get_total_norm(grads).float().square()
    dist.all_reduce(squares, group=parallel_state.get_tensor_model_parallel_group())
    return squares.sqrt()


def _to_host(t: torch.Tensor, streams: CudaStreams | None = None) -> Callable[[], list[float]]:
    """Start copying `t` to the host without waiting for the device; the returned call waits for that copy only
    (a pinned buffer and a CUDA event), so read after a sync the step makes anyway it waits for nothing.
    streams: the device's unless given (a test double)."""
    streams = streams or streams_for(t.device)
    if streams is None:
        return t.tolist
    host = streams.pinned_empty(t.shape, t.dtype)
    host.copy_(t, non_blocking=True)
    done = streams.event()
    done.record()

    def read() -> list[float]:
        done.synchronize()
        return host.tolist()

    return read


def train_step(engine, batches: Iterator[dict], accumulation: int, dims: ParallelDims,
               preemption: PreemptionFlag | None = None, writing: bool = False,
               before_update: Callable[[], None] = lambda: None) -> StepResult:
    """One optimizer step over `accumulation` micro batches (the engine applies it, or skips it when some rank
    saw a non-finite loss or gradient). The result says whether any rank's `preemption` flag was raised, and
    whether any rank was still `writing` a checkpoint in the background, by the step's one collective (after the
    last backward). `before_update` runs just before the optimizer step (CheckpointManager.before_update)."""
    clock = StepClock(dims.device)
    lr = engine.get_lr()[0]
    loss_sum = torch.zeros((), dtype=torch.float32, device=dims.device)
    tokens, grad_norm = 0, None
    for micro in range(accumulation):
        waiting = time.perf_counter()
        with span("data_wait"):
            batch = next(batches)
        clock.waited(waiting)
        tokens += batch["input_ids"].numel() + batch["labels"].numel()
        with span("forward"):
            loss = engine(**batch).loss
            loss_sum += loss.detach().float()
        if micro == accumulation - 1:
            clock.mark_ready()  # the gradient reduction below waits for the slowest rank
        with span("backward"):
            engine.backward(loss)  # at the last micro batch this also reduces the gradients over DP
        if micro == accumulation - 1:
            # the step's one collective of ours, over the world: [loss summed over DP ranks (TP ranks share it,
            # TP rank 0's counts; x 0 keeps inf and nan non-finite), ranks that received a preemption signal,
            # ranks whose checkpoint writer is still writing]
            share = float(dims.tp_rank == 0)
            preempted = float(preemption is not None and preemption.raised)
            flags = torch.stack([loss_sum * share, loss_sum.new_full((), preempted), loss_sum.new_full((), writing)])
            with span("loss_all_reduce"):
                dist.all_reduce(flags)
            loss_sum, read_flags = flags[0], _to_host(flags)
            if getattr(engine.optimizer, "skip_guard", False):
                grad_norm = grad_norm_over_tp(engine.module)  # the gradients are DP-reduced already
                # the step's one device-to-host sync, only on the path whose optimizer does not check itself;
                # the norm is non-finite when a gradient is, also where the loss is finite (a backward overflow)
                engine.optimizer.overflow = not bool(torch.isfinite(loss_sum + grad_norm))
        with span("optimizer_step"):
            before_update()  # CUDA: a background checkpoint's copies read what this step changes
            engine.step()
    # after the step's sync (the skip check: DeepSpeed's, or ours above) the flags are on the host already
    host_flags = read_flags()
    applied = engine.was_step_applied()
    if grad_norm is None:
        grad_norm = engine.get_global_grad_norm() if applied else float("nan")
    return StepResult(applied, host_flags[1] > 0, loss_sum / (accumulation * dims.dp), grad_norm, lr,
                      tokens * dims.dp, clock, writing=host_flags[2] > 0)


def mixture_metrics(model, zero_stage: int) -> dict[str, float]:
    """`mixture/<layer>/<mixer>`: how much each layer trusts each attention mixer (softmax weights)."""
    params = [p for name, p in model.named_parameters() if ".mix" in name]
    with deepspeed.zero.GatheredParameters(params, enabled=zero_stage == 3):  # ZeRO-3 holds only shards
        weights = model.mixture_weights()
    out = {}
    for layer, w in weights.items():
        mixers = model.mixers[layer.split(".")[0]]
        per_mixer = w if w.dim() == 1 else w.mean(dim=0)  # per-head weights: the mean over heads
        out.update({f"mixture/{layer}/{name}": float(v) for name, v in zip(mixers, per_mixer)})
    return out


def synthesizer_pictures(model, zero_stage: int) -> dict:
    """TensorBoard images of the learned Random / Factorized Random matrices and per-head mixture weights
    (`pretrain.runtime.pictures.synthesizer_images`); every rank calls (TP gathers; ZeRO-3 holds only shards)."""
    params = [p for name, p in model.named_parameters() if ".synth." in name or ".mix" in name]
    with deepspeed.zero.GatheredParameters(params, enabled=zero_stage == 3):
        return synthesizer_images(model)


# ----------------------------------------------------------------------------------------------------------------
# Metrics cadence and the step line
# ----------------------------------------------------------------------------------------------------------------
@dataclass
class Meter:
    """Collects applied steps and turns them into a metrics record every `every` steps (and at the last), with the
    spread of the ranks' step times (`pretrain.runtime.stragglers`: every rank takes part)."""

    every: int
    steps: int  # the run's train.steps (for the ETA)
    samples_per_step: int  # the global batch
    flops_per_step: float = 0.0  # model FLOPs of one step (0: MFU not reported)
    job_peak_flops: float = 0.0
    extra: Callable[[], dict[str, float]] = dict  # e.g. the mixture weights
    straggler_factor: float = 1.2  # log.straggler_factor
    window: list[StepResult] = field(default_factory=list)
    start: float = field(default_factory=time.perf_counter)

    def __post_init__(self) -> None:
        self.spread = RankSpread(self.straggler_factor)

    def add(self, result: StepResult) -> None:
        self.window.append(result)

    def due(self, step: int, last: bool) -> bool:
        return bool(self.window) and (last or step % self.every == 0)

    def record(self, progress: Progress, device: torch.device) -> dict[str, float]:
        elapsed = time.perf_counter() - self.start
        n = len(self.window)
        step_time = elapsed / n
        record = {
            "loss": torch.stack([r.loss for r in self.window]).mean().item(),  # the one sync of a log step
            "lr": self.window[-1].lr,
            "grad_norm": float(self.window[-1].grad_norm),
            "tokens_per_s": sum(r.tokens for r in self.window) / elapsed,
            "samples_per_s": self.samples_per_step / step_time,
            "step_time_s": step_time,
            "memory_gb": peak_memory_bytes(device) / 2**30,
            "tokens_seen": progress.tokens_seen,
            "skipped_steps": progress.skipped_steps,
            **self.spread.gather(elapsed, [r.clock for r in self.window], device),
        }
        if self.flops_per_step and self.job_peak_flops:
            record["mfu"] = self.flops_per_step / step_time / self.job_peak_flops
        record.update(self.extra())
        eta = timedelta(seconds=round(step_time * (self.steps - progress.step)))
        mfu = f"  MFU {100 * record['mfu']:.1f}%" if "mfu" in record else ""
        log.info("step %d/%d  loss %.4f  lr %.3g  grad_norm %.3f  %.3f s/step  ETA %s  %.0f tokens/s%s  "
                 "mem %.2f GiB  tokens %.3g", progress.step, self.steps, record["loss"], record["lr"],
                 record["grad_norm"], step_time, eta, record["tokens_per_s"], mfu, record["memory_gb"],
                 progress.tokens_seen)
        self.window, self.start = [], time.perf_counter()
        return record


class Evaluator(Protocol):
    """A job's evaluation: when it is due (`final`: the last step of training), and the scalars it adds to that
    step's metrics record."""

    def due(self, step: int, final: bool) -> bool: ...

    def __call__(self, step: int, final: bool) -> dict[str, float]: ...


# ----------------------------------------------------------------------------------------------------------------
# The loop
# ----------------------------------------------------------------------------------------------------------------
def _line_lost(step: int, metrics: MetricsLogger) -> bool:
    """Whether metrics.jsonl lacks the line of `step`: rank 0, its writer, reads it; every rank learns the answer."""
    lost = [metrics.lacks(step)]
    dist.broadcast_object_list(lost, src=0)
    return lost[0]


def _exit_preempted(message: str) -> int:
    log.warning("%s, exiting %d", message, EXIT_PREEMPTED)
    stop_watching()  # the job is ending: a repeated signal changes nothing
    return EXIT_PREEMPTED


@dataclass
class Components:
    """What the loop drives, built once by the job skeleton (pretrain.runtime.jobs.run_job)."""

    engine: Any  # the DeepSpeed engine
    batches: Iterator[dict]  # this DP rank's micro batches, on its device
    accumulation: int  # micro batches per optimizer step
    dims: ParallelDims
    train: TrainConfig  # steps, exit_after, max_skipped_steps
    progress: Progress
    meter: Meter
    checkpoints: CheckpointManager
    metrics: MetricsLogger
    evaluator: Evaluator | None = None
    pictures: Callable[[], dict] | None = None  # TensorBoard images, drawn at evaluation steps and the last step
    profiler: Profiler | None = None  # pretrain.runtime.profiling; None when off


def run_loop(c: Components) -> int:
    """Train from `progress.step` to `train.steps` (or `train.exit_after` steps of this run); EXIT_OK, or
    EXIT_PREEMPTED when one of `faults.PREEMPTION_SIGNALS` arrived on any rank: after a checkpoint, or with nothing
    to save before the first step. The profiler traces the steps it asks for, each with its checkpoint, evaluation
    and metrics line."""
    install_skip_guard(c.engine)
    preemption = watch_preemption()
    try:
        return _run_loop(c, preemption)
    finally:
        c.checkpoints.close()  # a run ending on an error: its writer is done before the run lock is released


def _finish(c: Components, step: int, final: bool, last: bool, record: dict[str, float]) -> None:
    """After the step's checkpoint: its evaluation when due, pictures, its metrics line (none if `Preempted`)."""
    evaluate = c.evaluator is not None and c.evaluator.due(step, final)
    if evaluate:
        record.update(c.evaluator(step, final))
    if c.pictures is not None and (evaluate or last):
        c.metrics.write_images(step, c.pictures())
    if record:
        c.metrics.write(step, record, tokens_seen=c.progress.tokens_seen)


def _run_loop(c: Components, preemption: PreemptionFlag) -> int:
    progress, train, checkpoints, profiler = c.progress, c.train, c.checkpoints, c.profiler
    try:
        stop_if_preempted(c.dims.device, "before the first step of this run: nothing to save")
    except Preempted as e:
        return _exit_preempted(str(e))
    final = progress.step == train.steps
    redo_eval = c.evaluator is not None and c.evaluator.due(progress.step, final)
    if (progress.record is not None or redo_eval) and checkpoints.holds(progress.step) \
            and _line_lost(progress.step, c.metrics):
        log.warning("step %d: its metrics line is missing (the run ended after its checkpoint was saved): written "
                    "again from the checkpoint%s", progress.step, ", evaluated again" if redo_eval else "")
        try:
            _finish(c, progress.step, final, final, dict(progress.record or {}))
        except Preempted as e:
            return _exit_preempted(f"{e} of the resumed step {progress.step}: evaluated again on resume")
    c.meter.start = time.perf_counter()  # the first line's step time leaves out the setup (and an evaluation redone)
    steps_this_run = 0
    while progress.step < train.steps:
        if profiler is not None:
            profiler.before_step(progress.step + 1)
        result = train_step(c.engine, c.batches, c.accumulation, c.dims, preemption, writing=checkpoints.writing,
                            before_update=checkpoints.before_update)
        checkpoints.poll(result.writing)  # the save in flight completes once no rank is writing it
        progress.tokens_seen += result.tokens
        if not result.applied:  # the same step number is tried again with the next batches
            progress.skipped_steps += 1
            check_skip_budget(progress.step + 1, progress.skipped_steps, train.max_skipped_steps)
            if result.preempted:  # a skipped step re-saves nothing unless the job must stop
                return _exit_preempted(_stop_skipped(c, preemption))
            continue
        progress.step += 1
        steps_this_run += 1
        c.meter.add(result)
        final = progress.step == train.steps  # the end of training, not just of this run (train.exit_after)
        last = final or steps_this_run == train.exit_after
        record = c.meter.record(progress, c.dims.device) if c.meter.due(progress.step, last) else {}
        progress.record = dict(record) if record else None  # saved with the step: a resume rewrites a lost line
        with span("checkpoint"):
            saved = checkpoints.maybe_save(progress.step, last=last, preempted=result.preempted)
        if record:
            record.update(checkpoints.take_metrics())  # checkpoint_blocking_s, and checkpoint_s once one completed
        try:
            _finish(c, progress.step, final, last, record)
        except Preempted as e:  # during the evaluation: keep the step, evaluate it again on resume
            if not saved:
                checkpoints.save(progress.step)
            checkpoints.finish()  # a save of this step in flight
            return _exit_preempted(f"{e} at step {progress.step}: checkpoint saved, evaluated again on resume")
        if profiler is not None:
            profiler.after_step(progress.step, last or result.preempted)  # a preempted run keeps its traces
        if result.preempted:
            return _exit_preempted(f"preempted by {_signal_of(preemption)} at step {progress.step}: checkpoint saved")
        if last:
            break
    log.info("stopped at step %d of %d", progress.step, train.steps)
    return EXIT_OK


def _stop_skipped(c: Components, preemption: PreemptionFlag) -> str:
    """A preemption at a skipped step: the state of the last applied step (its number, the batches consumed
    since) is saved; the message to exit with."""
    c.progress.record = None
    with span("checkpoint"):
        c.checkpoints.maybe_save(c.progress.step, last=False, preempted=True)
    if c.profiler is not None:
        c.profiler.after_step(c.progress.step, True)
    return f"preempted by {_signal_of(preemption)} at step {c.progress.step}: checkpoint saved"


def _signal_of(preemption: PreemptionFlag) -> str:
    return signal.Signals(preemption.received).name if preemption.raised else "a signal to another rank"
