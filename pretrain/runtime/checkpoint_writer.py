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

On CUDA the copies go into pinned host buffers kept from one save to the next (`HostBuffers`), made on a side
stream behind the work the loop queued before the save (`HostCopies`): the loop goes on at once and waits for
the copies' event only before its next optimizer step changes what they read (`train_step(before_update=)`); the
writer waits for it before its first write. On the CPU a storage is cloned, as it always was.
"""
from __future__ import annotations

import contextlib
import copy
import threading
import time
from pathlib import Path
from typing import Any, Callable, Iterator

import torch

from pretrain.runtime.device_streams import CudaStreams, streams_for


class HostBuffers:
    """Host storages lent to the copies of one save, given back once its writer is done, and lent again to the
    next save's copies of the same size: pinned memory is slow to allocate (cudaHostAlloc maps and locks every
    page), and the state's storages keep their sizes from save to save (flat ZeRO partitions, the same weights).
    Buffers the last save did not ask for again are dropped (`trim`): the pool never outgrows one save."""

    def __init__(self, pin: bool) -> None:
        self.pin = pin
        self._free: dict[int, list[torch.UntypedStorage]] = {}  # by bytes
        self._lent: list[torch.UntypedStorage] = []

    def take(self, nbytes: int) -> torch.UntypedStorage:
        free = self._free.get(nbytes)
        buffer = free.pop() if free else torch.empty(nbytes, dtype=torch.uint8, pin_memory=self.pin).untyped_storage()
        self._lent.append(buffer)
        return buffer

    def trim(self) -> None:
        """A save's copies are all made: what it did not take again goes."""
        self._free = {}

    def give_back(self) -> None:
        """The writer that read the lent buffers is done: they are free for the next save."""
        for buffer in self._lent:
            self._free.setdefault(buffer.nbytes(), []).append(buffer)
        self._lent = []


class HostCopies:
    """Where `snapshot` copies a storage to: a CPU one is cloned; a CUDA one goes into a pinned buffer of
    `buffers`, copied on a side stream after everything queued before it on the current stream (the state's last
    update, DeepSpeed's own copies), the loop not waiting. `copied()` ends a save's copies: the event the loop's
    next optimizer step and the writer wait for, or None when there was nothing to wait for (CPU)."""

    def __init__(self, streams: CudaStreams | None = None) -> None:
        """streams: each storage's device's (`streams_for`) unless given (a test double)."""
        self.buffers = HostBuffers(pin=True)  # allocates only for a CUDA storage
        self.streams = streams
        self._stream: torch.cuda.Stream | None = None
        self._device: torch.device | None = None  # the CUDA device of the copies
        self._queued = False  # a copy is on the side stream since the last `copied()`

    def copy(self, storage: torch.UntypedStorage) -> torch.UntypedStorage:
        streams = self.streams or streams_for(storage.device)
        if streams is None:
            return storage.clone()  # the next step changes it in place
        if self._stream is None:
            self._stream, self._device = streams.side_stream(storage.device), storage.device
        self._stream.wait_stream(streams.current_stream(storage.device))
        host = self.buffers.take(storage.nbytes())
        source = torch.empty(0, dtype=torch.uint8, device=storage.device).set_(storage)
        with streams.use(self._stream):
            torch.empty(0, dtype=torch.uint8).set_(host).copy_(source, non_blocking=True)
        streams.keep_until_used(source, self._stream)  # a temporary's memory is not reused before the copy read it
        self._queued = True
        return host

    def copied(self) -> torch.cuda.Event | None:
        self.buffers.trim()
        if not self._queued:
            return None
        self._queued = False
        return self._stream.record_event()

    def wait_before_update(self, copied: torch.cuda.Event) -> None:
        """The loop's next optimizer step, queued on the compute stream, waits on the device for `copied` (the
        event `copied()` returned): the step changes in place what the copies read; the host goes on."""
        streams = self.streams or streams_for(self._device)
        streams.current_stream(self._device).wait_event(copied)


def snapshot(obj: Any, copies: HostCopies, memo: dict | None = None) -> Any:
    """`obj` with every tensor copied to host memory (dicts, lists and tuples rebuilt, other objects shared: the
    state dicts hold numbers, strings and configs besides tensors, none of which a step changes). What was shared
    stays shared, as in `copy.deepcopy`: each storage is copied once and its tensors stay views of the copy
    (DeepSpeed's weights are views of one flat buffer, which torch.save writes once), and an object met twice is
    copied once (pickle writes it once): the files are the bytes a synchronous save writes (tested)."""
    memo = {} if memo is None else memo
    if id(obj) in memo:
        return memo[id(obj)]
    if isinstance(obj, torch.Tensor):
        storage = obj.untyped_storage()
        key = ("storage", storage._cdata)  # torch.save's own key: storages may share a data pointer (empty ones)
        if key not in memo:
            memo[key] = copies.copy(storage)
        out = torch.empty(0, dtype=obj.dtype).set_(memo[key], obj.storage_offset(), obj.size(), obj.stride())
        out.requires_grad_(obj.requires_grad)  # pickled too (ZeRO's fp32 partitions are the optimizer's leaves)
    elif isinstance(obj, dict):
        out = copy.copy(obj)  # keeps the kind (OrderedDict, defaultdict)
        for k, v in obj.items():
            out[k] = snapshot(v, copies, memo)
    elif type(obj) in (list, tuple):
        out = type(obj)(snapshot(v, copies, memo) for v in obj)
    else:
        return obj
    memo[id(obj)] = out
    memo[("keep", id(obj))] = obj  # the id stays this object's while the memo lives
    return out


@contextlib.contextmanager
def staging_saves(engine, staged: list[tuple[Path, Any]], copies: HostCopies | None) -> Iterator[None]:
    """Inside, DeepSpeed's saves put (path, state dict) into `staged` instead of writing; `copies`: a snapshot in
    host memory (the background writer's), else (None) the live state dict (written before the next step)."""
    checkpoint_engine = engine.checkpoint_engine

    def stage(state_dict, path) -> None:
        staged.append((Path(path), state_dict if copies is None else snapshot(state_dict, copies)))

    checkpoint_engine.save = stage
    try:
        yield
    finally:
        del checkpoint_engine.save  # the class's method again


class BackgroundWriter:
    """Runs `write()` (which returns {name: {"bytes", "crc32"}} of the files it wrote) in one thread; `done` once it
    returned or raised. Not a daemon: an interpreter that is exiting waits for the files it is writing."""

    def __init__(self, write: Callable[[], dict[str, dict]], step: int, rank: int) -> None:
        self.step, self.rank, self.launched = step, rank, time.perf_counter()
        self.listed: dict[str, dict] | None = None
        self.error: BaseException | None = None
        self._done = threading.Event()

        def run() -> None:
            try:
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
