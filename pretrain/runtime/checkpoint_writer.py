"""The background writer of asynchronous checkpoints (`checkpoint.async_save`): the state staged in host memory,
written, fsync'd and checksummed by one thread per rank while training goes on.

Why a thread of ours, not DeepSpeed 0.19's engines or torch's `dcp.async_save`: DeepSpeed's checkpoint engine is
the one place its state dicts pass through (`engine.checkpoint_engine.save(state_dict, path)`), so the manager
lets `engine.save_checkpoint` run as always (its collectives, its layout, its recovery scripts) with `save`
replaced by a copy into host memory (`staging_saves`), and this thread writes the copies to the very files
DeepSpeed would have written: universal conversion, export and evaluation read them like any other checkpoint.
DeepSpeed's `DecoupledCheckpointEngine` writes through `FastCheckpointEngine`, which needs the `async_io` op
(libaio, a JIT build) and sends each state dict through a multiprocessing queue (pickled: a second copy, on
the loop's side); `dcp.async_save` writes its own layout, which DeepSpeed's loader, the universal converter and
`pretrain.export` do not read. A thread shares the copies, and what it runs (file writes, fsync, zlib's crc32)
releases the GIL; the measured cost is in docs/training.md ("Asynchronous saves").

`PRETRAIN_TEST_HOLD_WRITER=DIR` (tests only) holds the writer of step N before its first write: it creates
`DIR/held_step_N_rank_R` and waits until `DIR/release_step_N` exists, so a test can act while a save is in flight
without sleeping and hoping.
"""
from __future__ import annotations

import contextlib
import copy
import os
import threading
import time
from pathlib import Path
from typing import Any, Callable, Iterator

import torch

HOLD = "PRETRAIN_TEST_HOLD_WRITER"


def snapshot(obj: Any) -> Any:
    """`obj` with every tensor copied to host memory (dicts, lists and tuples rebuilt, other objects shared: the
    state dicts hold numbers, strings and configs besides tensors, none of which a step changes)."""
    if isinstance(obj, torch.Tensor):
        # a CUDA tensor goes to host memory here, a CPU one is copied: the step after this one changes it in place
        return obj.detach().to("cpu", copy=True)
    if isinstance(obj, dict):
        out = copy.copy(obj)  # keeps the kind (OrderedDict, defaultdict)
        for k, v in obj.items():
            out[k] = snapshot(v)
        return out
    if isinstance(obj, (list, tuple)) and type(obj) in (list, tuple):
        return type(obj)(snapshot(v) for v in obj)
    return obj


@contextlib.contextmanager
def staging_saves(engine, staged: list[tuple[Path, Any]], copy: bool) -> Iterator[None]:
    """Inside, DeepSpeed's saves put (path, state dict) into `staged` instead of writing; `copy`: a snapshot in
    host memory (the background writer's), else the live state dict (written before the next step changes it)."""
    checkpoint_engine = engine.checkpoint_engine

    def stage(state_dict, path) -> None:
        staged.append((Path(path), snapshot(state_dict) if copy else state_dict))

    checkpoint_engine.save = stage
    try:
        yield
    finally:
        del checkpoint_engine.save  # the class's method again


def _hold(step: int, rank: int) -> None:
    folder = os.environ.get(HOLD)
    if not folder:
        return
    Path(folder, f"held_step_{step}_rank_{rank}").touch()
    while not Path(folder, f"release_step_{step}").exists():
        time.sleep(0.05)  # a test's hold: it releases the writer after what it does meanwhile


class BackgroundWriter:
    """Runs `write()` (which returns {name: {"bytes", "crc32"}} of the files it wrote) in one thread; `done` once it
    returned or raised. Not a daemon: an interpreter that is exiting waits for the files it is writing."""

    def __init__(self, write: Callable[[], dict[str, dict]], step: int, rank: int) -> None:
        self.step, self.launched = step, time.perf_counter()
        self.listed: dict[str, dict] | None = None
        self.error: BaseException | None = None
        self._done = threading.Event()

        def run() -> None:
            try:
                _hold(step, rank)
                self.listed = write()
            except BaseException as e:  # handed to the loop's thread, which reports it (faults.run_with_exit_codes)
                self.error = e
            finally:
                self._done.set()

        self._thread = threading.Thread(target=run, name=f"checkpoint-writer-step-{step}")
        self._thread.start()

    @property
    def done(self) -> bool:
        return self._done.is_set()

    def join(self) -> None:
        self._thread.join()
