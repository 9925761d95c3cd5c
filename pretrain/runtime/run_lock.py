"""One job per run folder: `run.dir/lock`, held by global rank 0 for the life of the job.

The lock is an advisory `flock` on the file, which the kernel drops when its holder dies however it dies, so
a file left by a killed or requeued job is a stale lock and is taken over (and the log says whose it was).
The file's text names the holder (host, pid, SLURM job id) for the refusal message. Where the filesystem does
not support `flock` the lock is skipped with a warning rather than stopping the run.
"""
from __future__ import annotations

import fcntl
import json
import logging
import os
import socket
from pathlib import Path

from pretrain.core.config import UsageError

log = logging.getLogger(__name__)

LOCK = "lock"


def _holder() -> dict:
    return {"host": socket.gethostname(), "pid": os.getpid(), "slurm_job": os.environ.get("SLURM_JOB_ID", "")}


class RunLock:
    """`acquire()` or a UsageError naming the job that holds `run_dir`; `release()` on the way out."""

    def __init__(self, run_dir: Path) -> None:
        self.path = run_dir / LOCK
        self._fd: int | None = None

    def acquire(self) -> None:
        try:  # the job's first write to run.dir: where a path that cannot be a run folder shows
            self.path.parent.mkdir(parents=True, exist_ok=True)
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
        except OSError as e:
            run_dir = self.path.parent
            files = [p for p in (run_dir, *run_dir.parents) if p.exists() and not p.is_dir()]
            why = f"{files[0]} is a file" if files else f"{e.strerror}: {e.filename}"
            raise UsageError(f"run.dir {run_dir} cannot be created or written ({why}); choose another run.dir") from None
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            raise UsageError(f"{self.path.parent} is in use by another job ({self._describe()}); give this run "
                             "its own run.dir, or stop that job first") from None
        except OSError as e:  # e.g. a filesystem without flock
            os.close(fd)
            log.warning("cannot lock %s (%s): nothing stops a second job from sharing this run.dir", self.path, e)
            return
        previous = self._describe()
        if previous:
            log.warning("taking over the stale lock of %s (that job is gone)", previous)
        os.ftruncate(fd, 0)
        os.write(fd, json.dumps(_holder()).encode())
        os.fsync(fd)
        self._fd = fd

    def _describe(self) -> str:
        try:
            holder = json.loads(self.path.read_text())
        except (OSError, ValueError):
            return ""
        job = f", SLURM job {holder['slurm_job']}" if holder.get("slurm_job") else ""
        return f"pid {holder.get('pid')} on {holder.get('host')}{job}"

    def release(self) -> None:
        if self._fd is not None:
            os.ftruncate(self._fd, 0)  # a clean exit leaves no holder to report
            os.close(self._fd)
            self._fd = None
