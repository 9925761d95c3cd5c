"""Per-op CPU time of train steps, side by side: where one model's step spends more than another's.

Each aten op a step dispatches (forward, backward and optimizer alike) is timed with the calling thread's CPU
clock (`time.thread_time_ns`) by a TorchDispatchMode, and summed per (phase, op). Thread CPU time, not wall
time: on a shared machine a step is descheduled at random points, which wall-clock profiles (torch.profiler)
charge to whatever op was running; CPU time is what the op itself cost. The steps are interleaved and each
(phase, op) sum is the minimum over the repetitions: the least disturbed. It counts one thread only, so run it
with `torch.set_num_threads(1)` (bench.model does). The dispatch mode adds a few microseconds per op (the
same for every model); GEMMs are `mm` / `bmm`, the rest is elementwise work, copies and reductions.
"""
from __future__ import annotations

import time
from collections import Counter
from typing import Callable

import torch
from torch.utils._python_dispatch import TorchDispatchMode


class _OpTimer(TorchDispatchMode):
    def __init__(self, phase: list[str], shapes: bool = False) -> None:
        super().__init__()
        self.phase, self.ns, self.shapes = phase, Counter(), shapes

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        start = time.thread_time_ns()
        out = func(*args, **(kwargs or {}))
        op = func.overloadpacket.__name__
        if self.shapes and _is_gemm(op):  # one row per operand shapes and strides: layouts cost differently
            op += " " + " x ".join(f"{list(a.shape)}/{a.stride()}" for a in args if isinstance(a, torch.Tensor))
        self.ns[(self.phase[0], op)] += time.thread_time_ns() - start
        return out


def op_times(steps: dict[str, Callable[[Callable[[str], None]], None]], reps: int,
             shapes: bool = False) -> dict[str, dict[tuple, float]]:
    """{model: {(phase, op): ms}}; `steps[model](mark)` runs one step, calling mark("fwd"), mark("bwd"),
    mark("opt") as it enters each phase. `shapes`: GEMMs per operand shapes and strides ("bmm [6, 512, 512]/
    (262144, 1, 512) x ..."), each a row of its own."""
    phase = ["fwd"]
    runs: dict[str, list[Counter]] = {name: [] for name in steps}
    for step in steps.values():  # warm-up: the optimizer's first step allocates its state
        step(lambda p: None)
    for _ in range(reps):
        for name, step in steps.items():
            timer = _OpTimer(phase, shapes)
            with timer:
                step(lambda p: phase.__setitem__(0, p))
            runs[name].append(timer.ns)
    keys = set().union(*(c.keys() for counters in runs.values() for c in counters))
    return {name: {k: min(c[k] for c in counters) / 1e6 for k in keys} for name, counters in runs.items()}


def print_op_table(times: dict[str, dict[tuple, float]], min_ms: float = 3.0) -> None:
    """Per phase: the ops above `min_ms` in any model, largest first, with each model's ms; then the totals."""
    names = list(times)
    keys = next(iter(times.values())).keys()
    width = max([44] + [len(k[1]) + 1 for k in keys])
    print(f"{'phase':<6}{'op':<{width}}" + "".join(f"{n:>10}" for n in names))
    for phase in ("fwd", "bwd", "opt"):
        rows = sorted((k for k in keys if k[0] == phase), key=lambda k: -max(times[n][k] for n in names))
        for key in rows:
            if max(times[n][key] for n in names) >= min_ms:
                print(f"{phase:<6}{key[1]:<{width}}" + "".join(f"{times[n][key]:>10.1f}" for n in names))
    for label, pick in (("GEMMs (mm, bmm, SDPA)", _is_gemm), ("other ops", lambda op: not _is_gemm(op))):
        print(f"{'all':<6}{label:<{width}}" + "".join(
            f"{sum(v for k, v in times[n].items() if pick(k[1].split()[0])):>10.1f}" for n in names))
    print(f"{'all':<6}{'sum':<{width}}" + "".join(f"{sum(times[n].values()):>10.1f}" for n in names))


def _is_gemm(op: str) -> bool:
    return op in ("mm", "bmm", "addmm", "baddbmm") or op.startswith("_scaled_dot_product")
