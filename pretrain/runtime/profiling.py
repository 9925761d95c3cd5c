"""Profiler traces on demand (`profile.*`): one `torch.profiler` trace per rank of steps [start, start + steps) in
`run.dir/profile/rank<R>.pt.trace.json` (Chrome trace JSON: Perfetto opens it, and TensorBoard's profiler plugin
lists it under `--logdir run.dir/profile`), and with `profile.memory` a CUDA memory snapshot per rank beside it
(`rank<R>.memory.pickle`, for pytorch.org/memory_viz).

`span(name)` marks a range of the step (forward, backward, optimizer_step, loss_all_reduce, data_wait,
checkpoint): a `record_function` range in the trace and, on CUDA, an NVTX range for Nsight Systems, whose
`--capture-range=cudaProfilerApi` then records exactly the profiled steps (cudaProfilerStart/Stop bracket them).
Outside the profiled steps, or with profiling off (no `Profiler` at all), `span` is a `nullcontext`: nothing is
recorded and nothing is paid but a flag test.
"""
from __future__ import annotations

import contextlib
import logging
from pathlib import Path
from typing import ContextManager, Iterator

import torch

from pretrain.core.config import ProfileConfig, UsageError
from pretrain.distributed.parallel import ParallelDims

log = logging.getLogger(__name__)

_tracing = False  # a trace is being recorded in this process: `span` records ranges
_nvtx = False  # and the device is CUDA: the ranges also go to NVTX


def span(name: str) -> ContextManager:
    """A named range of the step while a trace is recorded; a no-op context otherwise."""
    if not _tracing:
        return contextlib.nullcontext()
    return _nvtx_and_record(name) if _nvtx else torch.profiler.record_function(name)


@contextlib.contextmanager
def _nvtx_and_record(name: str) -> Iterator[None]:
    with torch.cuda.nvtx.range(name), torch.profiler.record_function(name):
        yield


class Profiler:
    """Starts the trace before step `cfg.start` and writes it after step `cfg.start + cfg.steps - 1` (or at the
    run's last step, if that comes first); the loop calls `before_step(step)` and `after_step(step, last)` with
    the step about to run and the step just done."""

    def __init__(self, cfg: ProfileConfig, run_dir: Path, dims: ParallelDims) -> None:
        self.cfg, self.folder, self.dims = cfg, run_dir / "profile", dims
        self.end = cfg.start + cfg.steps - 1  # the last profiled step
        self.cuda = dims.device.type == "cuda"
        self._profile: torch.profiler.profile | None = None
        self._first = cfg.start  # the first traced step (later when a resumed run starts past `start`)

    def before_step(self, step: int) -> None:
        global _tracing, _nvtx
        if self._profile is not None or not self.cfg.start <= step <= self.end:
            return  # a resumed run past `start` traces the steps that are left, if any
        activities = [torch.profiler.ProfilerActivity.CPU] + ([torch.profiler.ProfilerActivity.CUDA] if self.cuda
                                                               else [])
        self._profile = torch.profiler.profile(activities=activities, record_shapes=self.cfg.shapes,
                                               with_stack=self.cfg.stacks)
        if self.cfg.memory and self.cuda:
            torch.cuda.memory._record_memory_history(max_entries=100_000)
        self._profile.start()
        if self.cuda:
            torch.cuda.profiler.start()  # cudaProfilerStart: nsys --capture-range=cudaProfilerApi begins here
        _tracing, _nvtx, self._first = True, self.cuda, step
        log.info("profile: tracing steps %d-%d", step, self.end)

    def after_step(self, step: int, last: bool) -> None:
        global _tracing, _nvtx
        if self._profile is None or not (step >= self.end or last):
            return
        _tracing = _nvtx = False
        if self.cuda:
            torch.cuda.profiler.stop()
        self._profile.stop()
        self.folder.mkdir(parents=True, exist_ok=True)
        self._profile.export_chrome_trace(str(self.folder / f"rank{self.dims.rank}.pt.trace.json"))
        if self.cfg.memory and self.cuda:
            torch.cuda.memory._dump_snapshot(str(self.folder / f"rank{self.dims.rank}.memory.pickle"))
            torch.cuda.memory._record_memory_history(enabled=None)
        self._profile = None
        memory = " and CUDA memory snapshots (rank<R>.memory.pickle, pytorch.org/memory_viz)" if (
            self.cfg.memory and self.cuda) else ""
        log.info("profile: steps %d-%d traced in %s: rank<R>.pt.trace.json per traced rank%s; open one in "
                 "ui.perfetto.dev, or run `tensorboard --logdir %s` (profiler plugin)", self._first, step,
                 self.folder, memory, self.folder)


def build_profiler(cfg: ProfileConfig, run_dir: Path, dims: ParallelDims) -> Profiler | None:
    """This rank's profiler; None when profiling is off or this rank is not among `profile.ranks`."""
    if not cfg.enabled:
        return None
    outside = [r for r in cfg.ranks if r >= dims.world]
    if outside:
        raise UsageError(f"profile.ranks {list(cfg.ranks)}: rank {outside[0]} is not a rank of this job of "
                         f"{dims.world}; name ranks 0-{dims.world - 1}, or [] for all")
    log.info("profile: steps %d-%d of %s will be traced to %s", cfg.start, cfg.start + cfg.steps - 1,
             f"ranks {list(cfg.ranks)}" if cfg.ranks else "every rank", run_dir / "profile")
    if cfg.memory and dims.device.type != "cuda":
        log.info("profile.memory: the memory snapshot is CUDA's; ignored on %s", dims.device.type)
    if cfg.ranks and dims.rank not in cfg.ranks:
        return None
    return Profiler(cfg, run_dir, dims)
