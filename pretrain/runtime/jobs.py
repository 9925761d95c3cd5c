"""What every job (pretraining, fine-tuning) does at start besides its own setup: logging with a rank prefix, the
precision/device rule, and the run-folder lock agreed by all ranks. Entry points import these, not each other.
"""
from __future__ import annotations

import logging
from pathlib import Path

import torch
import torch.distributed as dist

from pretrain.core.config import UsageError
from pretrain.distributed.parallel import ParallelDims
from pretrain.runtime.run_lock import RunLock


def init_logging(rank: int) -> None:
    """A rank prefix on every line; info from rank 0, warnings and errors from every rank."""
    logging.basicConfig(
        level=logging.INFO if rank == 0 else logging.WARNING,
        format=f"%(asctime)s [rank {rank}] %(levelname)s %(name)s: %(message)s",
        force=True,
    )
    logging.getLogger("DeepSpeed").setLevel(logging.WARNING)  # its per-step chatter; our progress lines suffice


def resolve_precision(precision: str, device: torch.device) -> str:
    """`auto`: bf16 on CUDA, fp32 elsewhere; any other value as given."""
    if precision == "auto":
        return "bf16" if device.type == "cuda" else "fp32"
    return precision


def check_precision(precision: str, backend: str, device: torch.device) -> None:
    """bf16/fp16 on a CPU is almost always a job that meant to run on GPUs and did not get them: refused unless
    the config asks for the CPU explicitly (parallel.backend=gloo)."""
    if precision in ("bf16", "fp16") and device.type != "cuda" and backend != "gloo":
        raise UsageError(f"precision {precision} without CUDA: this job found no GPU (did the job request GPUs?); "
                         "use precision=fp32, or set parallel.backend=gloo to train in "
                         f"{precision} on the CPU on purpose")


def acquire_run_lock(run_dir: Path, dims: ParallelDims) -> RunLock:
    """Rank 0 takes `run.dir/lock`; every rank learns the outcome, so all of them stop on a refusal."""
    lock = RunLock(run_dir)
    refusal = ""
    if dims.rank == 0:
        try:
            lock.acquire()
        except UsageError as e:
            refusal = str(e)
    outcome = [refusal]
    dist.broadcast_object_list(outcome, src=0)
    if outcome[0]:
        raise UsageError(outcome[0])
    return lock
