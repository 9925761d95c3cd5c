"""The loop's CUDA-only pieces run on the CPU under a test double of pretrain/runtime/device_streams.py's API (issue 47):
the pinned batch transfer (`loop.to_device`), the host read of the step's flags (`loop._to_host`), the step timer's
events (`stragglers.StepClock`) and the asynchronous checkpoint's staged copies (`checkpoint_writer.HostCopies`). The
double keeps one log of every stream and event call, in order, so each test asserts the order the GPU needs (a copy
issued after the side stream waited for the compute stream, an event recorded after the copy it stands for, a wait
only when the value is read). What only a GPU shows is docs/cluster.md's "What stays GPU-only"."""
from __future__ import annotations

import contextlib

import torch

from pretrain.runtime.checkpoint_writer import HostBuffers, HostCopies, snapshot
from pretrain.runtime.loop import _to_host, to_device
from pretrain.runtime.stragglers import StepClock

CPU = torch.device("cpu")


class Event:
    def __init__(self, log: list, name: str, timing: bool, elapsed_ms: float) -> None:
        self.log, self.name, self.timing, self.elapsed_ms = log, name, timing, elapsed_ms

    def record(self, stream=None) -> None:
        self.log.append(("record", self.name))

    def synchronize(self) -> None:
        self.log.append(("synchronize", self.name))

    def elapsed_time(self, end: Event) -> float:
        assert self.timing and end.timing, "elapsed_time needs events made with timing"
        self.log.append(("elapsed", self.name, end.name))
        return self.elapsed_ms


class Stream:
    def __init__(self, log: list, name: str) -> None:
        self.log, self.name = log, name

    def wait_stream(self, other: Stream) -> None:
        self.log.append(("wait_stream", self.name, other.name))

    def wait_event(self, event: Event) -> None:
        self.log.append(("wait_event", self.name, event.name))

    def record_event(self) -> Event:
        event = Event(self.log, f"{self.name}.event", False, 0.0)
        self.log.append(("record", event.name))
        return event


class RecordingStreams:
    """CudaStreams' API on the CPU: pinning copies (and remembers) the tensor, streams and events log their calls;
    `copies` logs each tensor copy_ made inside `use(stream)` with that stream's name."""

    def __init__(self, elapsed_ms: float = 0.0) -> None:
        self.log: list[tuple] = []
        self.pinned: set[int] = set()
        self.elapsed_ms = elapsed_ms
        self._events = 0
        self.current = Stream(self.log, "compute")

    def pin(self, t: torch.Tensor) -> torch.Tensor:
        if id(t) in self.pinned:
            return t
        self.log.append(("pin",))
        pinned = t.clone()
        self.pinned.add(id(pinned))
        return pinned

    def pinned_empty(self, shape, dtype) -> torch.Tensor:
        self.log.append(("pinned_empty", tuple(shape)))
        t = torch.empty(shape, dtype=dtype)
        self.pinned.add(id(t))
        return t

    def event(self, timing: bool = False) -> Event:
        self._events += 1
        return Event(self.log, f"event{self._events}", timing, self.elapsed_ms)

    def side_stream(self, device) -> Stream:
        self.log.append(("side_stream",))
        return Stream(self.log, "side")

    def current_stream(self, device) -> Stream:
        return self.current

    @contextlib.contextmanager
    def use(self, stream: Stream):
        self.log.append(("enter", stream.name))
        yield
        self.log.append(("exit", stream.name))

    def keep_until_used(self, t: torch.Tensor, stream: Stream) -> None:
        self.log.append(("keep", stream.name, t.untyped_storage().data_ptr()))


def test_to_device_pins_each_tensor_of_a_batch_once_before_its_copy():
    streams = RecordingStreams()
    batches = [{"input_ids": torch.arange(6).view(2, 3), "labels": torch.ones(2, 2)}, {"input_ids": torch.zeros(1, 3)}]
    out = list(to_device(batches, CPU, streams))
    assert streams.log == [("pin",)] * 3
    assert [list(b) for b in out] == [["input_ids", "labels"], ["input_ids"]]
    for got, sent in zip(out, batches):
        assert all(torch.equal(got[k], sent[k]) and got[k].device == CPU for k in sent)
    assert list(to_device(batches, CPU)) and streams.log == [("pin",)] * 3  # no streams on the CPU: no pinning


def test_a_host_read_waits_for_its_copy_only_when_read():
    streams = RecordingStreams()
    flags = torch.tensor([2.5, 1.0, 0.0])
    read = _to_host(flags, streams)
    assert streams.log == [("pinned_empty", (3,)), ("record", "event1")]  # the copy issued, then its event; no wait
    assert read() == [2.5, 1.0, 0.0]
    assert streams.log[-1] == ("synchronize", "event1")  # the read waits for that event, nothing else


def test_the_step_clock_times_the_compute_stream_with_events_read_after_the_step():
    streams = RecordingStreams(elapsed_ms=1250.0)
    clock = StepClock(CPU, streams)
    assert streams.log == [("record", "event1")]  # the start, on the compute stream, at once
    clock.mark_ready()
    assert streams.log[-1] == ("record", "event2")
    assert clock.ready() == 1.25  # seconds from the events, not the host's clock
    assert streams.log[-2:] == [("synchronize", "event2"), ("elapsed", "event1", "event2")]
    assert StepClock(CPU).ready() >= 0  # the CPU's form: the host's clock


def test_staged_copies_go_on_a_side_stream_behind_the_compute_stream_and_end_with_its_event():
    streams = RecordingStreams()
    copies = HostCopies(streams)
    copies.buffers = HostBuffers(pin=False)  # the pool's bookkeeping, in pageable memory (tests/test_async_checkpoint.py)
    flat = torch.randn(300)
    state = {"flat": flat, "view": flat[100:200], "moment": torch.randn(50)}
    staged = snapshot(state, copies)
    storages = [flat.untyped_storage().data_ptr(), state["moment"].untyped_storage().data_ptr()]
    copy_calls = [("wait_stream", "side", "compute"), ("enter", "side"), ("exit", "side")]
    assert streams.log == [("side_stream",), *copy_calls, ("keep", "side", storages[0]),
                           *copy_calls, ("keep", "side", storages[1])]  # one side stream, one copy per storage
    for k in state:
        assert torch.equal(staged[k], state[k]) and staged[k].untyped_storage().data_ptr() not in storages
    assert staged["view"].untyped_storage().data_ptr() == staged["flat"].untyped_storage().data_ptr()  # still a view
    done = copies.copied()
    assert streams.log[-1] == ("record", "side.event") and done.name == "side.event"  # after every copy
    copies.wait_before_update(done)  # the loop's next optimizer step: the compute stream waits, not the host
    assert streams.log[-1] == ("wait_event", "compute", "side.event")
    assert copies.copied() is None  # nothing queued since: nothing to wait for
    assert HostCopies().copy(flat.untyped_storage()).data_ptr() != storages[0]  # the CPU's form: a clone
