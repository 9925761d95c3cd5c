"""The slowest rank: each rank's step time without its wait for the others, its wait for the data loader, and the
straggler warning.

In a data-parallel step every rank's wall-clock time is the same: the gradient reduction makes the fast ranks
wait for the slowest one. What differs is when each rank gets there. `StepClock` times, per step and without a
sync, the data wait and the time from the step's start to the last micro batch's backward, where the reduction
begins ("ready"; on CUDA measured by events on the compute stream, read after the step's one sync). At a log step
`RankSpread.gather` exchanges these in one all_gather of n + 2 floats per rank (n: the steps since the last line)
and takes, for each rank, its step time less its wait at each step (the latest rank's ready time less its own):
a rank that waits for nobody keeps the whole step, a rank that waits for a straggler is charged only its own work.
"""
from __future__ import annotations

import logging
import socket
import statistics
import time

import torch
import torch.distributed as dist

from pretrain.runtime.device_streams import CudaStreams, streams_for

log = logging.getLogger(__name__)

STRAGGLER_LINES = 3  # consecutive metrics lines a rank must lag by log.straggler_factor before it is named


class StepClock:
    """One step's timings on this rank: `data_wait` (seconds in the loader) and `ready()` (seconds from the start
    to the last backward, read after the step's sync)."""

    def __init__(self, device: torch.device, streams: CudaStreams | None = None) -> None:
        """streams: the device's (`streams_for`) unless given (a test double)."""
        self.data_wait = 0.0
        self._start = time.perf_counter()
        self._ready = self._start
        self._events = None
        streams = streams or streams_for(device)
        if streams is not None:  # the host runs ahead of the device: time the compute stream
            self._events = (streams.event(timing=True), streams.event(timing=True))
            self._events[0].record()

    def waited(self, since: float) -> None:
        """Add the loader's wait since `since` (time.perf_counter)."""
        self.data_wait += time.perf_counter() - since

    def mark_ready(self) -> None:
        self._ready = time.perf_counter()
        if self._events is not None:
            self._events[1].record()

    def ready(self) -> float:
        if self._events is None:
            return self._ready - self._start
        self._events[1].synchronize()  # done already: a log step reads it after the loss's .item()
        return self._events[0].elapsed_time(self._events[1]) / 1000


class RankSpread:
    """At each log step, the spread of the ranks' step times (`step_time_max_s`, `step_time_min_s`,
    `slowest_rank`) and the longest loader wait (`data_wait_s`, per step); warns once when the same rank is
    slower than the median by more than `factor` for STRAGGLER_LINES lines running."""

    def __init__(self, factor: float) -> None:
        self.factor = factor
        self._lagging: tuple[int, int] = (-1, 0)  # (rank, lines running)
        self._hosts: list[str] | None = None

    def gather(self, wall: float, clocks: list[StepClock], device: torch.device) -> dict[str, float]:
        """`wall`: this rank's seconds for the steps of `clocks` (the window since the last line)."""
        mine = torch.tensor([wall, sum(c.data_wait for c in clocks), *(c.ready() for c in clocks)],
                            dtype=torch.float64, device=device)
        parts = [torch.empty_like(mine) for _ in range(dist.get_world_size())]
        dist.all_gather(parts, mine)  # the list form: every backend, and torch 2.11 (the GPU machine's) to 2.13
        every = torch.stack(parts).cpu()  # [world, 2 + steps]
        ready = every[:, 2:]  # [world, steps]
        waits = (ready.max(dim=0).values - ready).sum(dim=1)  # [world] seconds spent waiting for the latest rank
        times = ((every[:, 0] - waits) / len(clocks)).tolist()  # [world] per step, without the waits
        slowest = max(range(len(times)), key=times.__getitem__)
        self._warn_if_straggling(times, slowest)
        return {"step_time_max_s": times[slowest], "step_time_min_s": min(times), "slowest_rank": slowest,
                "data_wait_s": float(every[:, 1].max()) / len(clocks)}

    def _warn_if_straggling(self, times: list[float], slowest: int) -> None:
        """Every rank holds the same `times`: they agree, and one of them (rank 0) says it."""
        median = statistics.median(times)
        if times[slowest] <= self.factor * median:
            self._lagging = (-1, 0)
            return
        rank, lines = self._lagging
        self._lagging = (slowest, lines + 1 if rank == slowest else 1)
        if self._lagging[1] != STRAGGLER_LINES:
            return
        if self._hosts is None:  # once, and only for a job that has a straggler
            self._hosts = [""] * len(times)
            dist.all_gather_object(self._hosts, socket.gethostname())
        if dist.get_rank() == 0:
            log.warning("straggler: rank %d on %s took %.3f s a step, %.2fx the median rank's %.3f s, for %d metrics "
                        "lines running (its data wait is in data_wait_s; profile.enabled=true profile.ranks=[%d] "
                        "traces it)", slowest, self._hosts[slowest], times[slowest], times[slowest] / median,
                        median, STRAGGLER_LINES, slowest)
