"""The metrics logger: one JSON object per logged step in `run.dir/metrics.jsonl` and the same scalars in
TensorBoard event files under `run.dir/tensorboard/`. Only global rank 0 writes; elsewhere it is a no-op.

Also the figures a progress line needs that are not losses: the device's peak FLOP/s for model FLOPs
utilisation (configured, a table on GPUs, or a measured matmul rate on CPU) and peak memory.
"""
from __future__ import annotations

import json
import logging
import resource
import time
from pathlib import Path

import torch

log = logging.getLogger(__name__)

# dense bf16 peak FLOP/s per device (vendor data sheets, without sparsity)
_GPU_PEAK_FLOPS = {"H200": 989e12, "H100": 989e12, "A100": 312e12, "L40S": 362e12, "A10G": 70e12, "V100": 125e12}


class MetricsLogger:
    """`write(step, scalars)` appends to metrics.jsonl and TensorBoard; resuming drops records after `start_step`."""

    def __init__(self, run_dir: str | Path, enabled: bool, start_step: int = 0) -> None:
        self.enabled = enabled
        if not enabled:
            return
        from torch.utils.tensorboard import SummaryWriter  # imported where used: rank 0 only

        run_dir = Path(run_dir)
        run_dir.mkdir(parents=True, exist_ok=True)
        self.path = run_dir / "metrics.jsonl"
        if self.path.exists():
            # steps after the resumed checkpoint were computed by a run that died; they are redone now
            kept = [line for line in self.path.read_text().splitlines() if json.loads(line)["step"] <= start_step]
            self.path.write_text("".join(line + "\n" for line in kept))
        self._file = self.path.open("a")
        # purge_step hides the same stale steps from TensorBoard
        self._tb = SummaryWriter(str(run_dir / "tensorboard"), purge_step=start_step + 1 if start_step else None)

    def write(self, step: int, scalars: dict[str, float]) -> None:
        if not self.enabled:
            return
        self._file.write(json.dumps({"step": step, **scalars}) + "\n")
        self._file.flush()
        for key, value in scalars.items():
            self._tb.add_scalar(key, value, step)
        self._tb.flush()

    def close(self) -> None:
        if self.enabled:
            self._file.close()
            self._tb.close()


def peak_flops(configured: float, device: torch.device) -> float:
    """Peak FLOP/s of one device: `log.peak_flops` if set, a data-sheet table on GPUs, else a measured matmul."""
    if configured > 0:
        return configured
    if device.type == "cuda":
        name = torch.cuda.get_device_name(device)
        for key, flops in _GPU_PEAK_FLOPS.items():
            if key in name:
                return flops
        log.warning("no peak FLOP/s known for %s; set log.peak_flops for model FLOPs utilisation", name)
        return 0.0
    return measured_matmul_flops()


def measured_matmul_flops(n: int = 512, repeats: int = 8) -> float:
    """fp32 n x n x n matmul rate of this CPU process (its threads), the CPU stand-in for a peak figure."""
    # a private generator: the global stream drives dropout, and a resumed run restores it before this call
    gen = torch.Generator().manual_seed(0)
    a, b = torch.randn(n, n, generator=gen), torch.randn(n, n, generator=gen)
    a @ b  # warm-up: first call allocates and picks the kernel
    start = time.perf_counter()
    for _ in range(repeats):
        a @ b
    return 2 * n**3 * repeats / (time.perf_counter() - start)


def peak_memory_bytes(device: torch.device) -> int:
    """Peak allocated device memory on GPU; peak resident set of this process on CPU."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device)
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux reports KiB
