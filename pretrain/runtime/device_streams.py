"""The CUDA calls of the loop's asynchronous pieces behind one object: pinned host memory, side streams, events.

The pieces (the loop's pinned batch transfer and host reads, `loop.to_device` / `loop._to_host`; the step timer's
events, `stragglers.StepClock`; the asynchronous checkpoint's staged copies, `checkpoint_writer.HostCopies`) take a
`CudaStreams` where their tensors are on CUDA and None elsewhere (`streams_for`), so what they do with streams and
events is plain Python that a test double of this API runs on the CPU (tests/test_device_streams.py). What only a
GPU shows (that the copies overlap the compute, the pinned pages, the timings) is the one-GPU check's
(docs/cluster.md, "What stays GPU-only").
"""
from __future__ import annotations

import torch


class CudaStreams:
    """torch.cuda's streams, events and pinned memory, as the loop's pieces use them."""

    def pin(self, t: torch.Tensor) -> torch.Tensor:
        """`t` in pinned host memory (itself if it is already there)."""
        return t if t.is_pinned() else t.pin_memory()

    def pinned_empty(self, shape: torch.Size, dtype: torch.dtype) -> torch.Tensor:
        return torch.empty(shape, dtype=dtype, pin_memory=True)

    def event(self, timing: bool = False) -> torch.cuda.Event:
        return torch.cuda.Event(enable_timing=timing)

    def side_stream(self, device: torch.device) -> torch.cuda.Stream:
        return torch.cuda.Stream(device)

    def current_stream(self, device: torch.device) -> torch.cuda.Stream:
        return torch.cuda.current_stream(device)

    def use(self, stream: torch.cuda.Stream):
        """A context in which kernels and copies go to `stream`."""
        return torch.cuda.stream(stream)

    def keep_until_used(self, t: torch.Tensor, stream: torch.cuda.Stream) -> None:
        """The allocator does not reuse `t`'s memory before the work queued on `stream` has run."""
        t.record_stream(stream)


CUDA_STREAMS = CudaStreams()


def streams_for(device: torch.device) -> CudaStreams | None:
    """CUDA's streams for a CUDA device; None elsewhere (the CPU: copies and reads are synchronous)."""
    return CUDA_STREAMS if device.type == "cuda" else None
