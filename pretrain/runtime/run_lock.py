"""One job per run folder, held by global rank 0 for the life of the job: two advisory `flock`s, which the kernel
drops when their holder dies however it dies.

- On the run folder itself (a file descriptor of the directory): a stray `rm run.dir/lock` cannot replace it (before,
  a second job then created a new `lock`, locked it and trained beside the first).
- On `run.dir/lock`, whose text names the holder (host, pid, SLURM job id) for the refusal message. It is the lock
  other nodes see on NFS: Linux's NFS client sends a regular file's flock to the server (as a whole-file byte-range
  lock, since 2.6.12), while it keeps a directory's on the node (its directory operations have no lock method).

Across nodes either lock is only as good as the filesystem's flock: shared by every node on NFS (unless mounted
`nolock` or `local_lock=flock|all`) and on Lustre mounted with `-o flock`; node-local on Lustre's `-o localflock`;
refused on Lustre's default `noflock`. A lock the filesystem refuses is skipped with a warning saying what is then
not held off, rather than stopping the run (docs/cluster.md, "The run lock"). So a lock file naming another host
whose lock is free is taken over saying so: the kernel here says no process on this host holds it; whether the job
on the other host is gone only that filesystem's flock can tell.
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


def _flock_holder_pid(fd: int) -> int | None:
    """The pid that holds a flock on the file of `fd`, as this host's kernel lists it (/proc/locks), or None."""
    st = os.fstat(fd)
    inode = f"{os.major(st.st_dev):02x}:{os.minor(st.st_dev):02x}:{st.st_ino}"
    try:
        for line in Path("/proc/locks").read_text().splitlines():
            fields = line.split()
            if "FLOCK" in fields and inode in fields:
                return int(fields[fields.index(inode) - 1])
    except (OSError, ValueError, IndexError):
        pass
    return None


class RunLock:
    """`acquire()` or a UsageError naming the job that holds `run_dir`; `release()` on the way out."""

    def __init__(self, run_dir: Path) -> None:
        self.path = run_dir / LOCK
        self._folder: int | None = None  # descriptors whose flock this job holds
        self._file: int | None = None

    def acquire(self) -> None:
        run_dir = self.path.parent
        try:  # the job's first write to run.dir: where a path that cannot be a run folder shows
            run_dir.mkdir(parents=True, exist_ok=True)
            folder = os.open(run_dir, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
            # the folder's lock first: a second job on this host stops here, also where `lock` was removed
            self._folder = self._take(folder)
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
        except OSError as e:
            self.release()
            files = [p for p in (run_dir, *run_dir.parents) if p.exists() and not p.is_dir()]
            why = f"{files[0]} is a file" if files else f"{e.strerror}: {e.filename}"
            raise UsageError(f"run.dir {run_dir} cannot be created or written ({why}); choose another run.dir") from None
        self._file = self._take(fd)
        if self._file is None or self._folder is None:  # a filesystem without flock (Lustre's default, noflock)
            neither = self._file is None and self._folder is None
            lost = ("nothing stops a second job from sharing this run.dir" if neither else
                    "a removed run.dir/lock admits a second job" if self._folder is None else
                    "jobs on other nodes are not held off")
            log.warning("cannot flock %s: %s (docs/cluster.md, \"The run lock\")",
                        run_dir if self._folder is None else self.path, lost)
        if self._file is None:
            return
        previous = self._describe()
        if previous:
            log.warning("taking over the stale lock of %s", previous)
        os.ftruncate(fd, 0)
        os.write(fd, json.dumps(_holder()).encode())
        os.fsync(fd)

    def _take(self, fd: int) -> int | None:
        """flock `fd`: `fd`, held until `release`; None (`fd` closed) where the filesystem has no flock for it; a
        UsageError naming the holder where another job holds it."""
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return fd
        except BlockingIOError:
            holder = self._describe(fd) or "not named: run.dir/lock was removed"
            os.close(fd)
            self.release()
            raise UsageError(f"{self.path.parent} is in use by another job ({holder}); give this run its own "
                             "run.dir, or stop that job first") from None
        except OSError:  # e.g. ENOSYS, ENOLCK
            os.close(fd)
            return None

    def _describe(self, locked_fd: int | None = None) -> str:
        """Who the lock file names, with what was checked of it; `locked_fd`: a descriptor another job holds a flock
        on, whose holder this host's kernel may name when the lock file is gone."""
        try:
            holder = json.loads(self.path.read_text())
        except (OSError, ValueError):
            pid = _flock_holder_pid(locked_fd) if locked_fd is not None else None
            return f"pid {pid} on this host, by /proc/locks; run.dir/lock was removed" if pid else ""
        job = f", SLURM job {holder['slurm_job']}" if holder.get("slurm_job") else ""
        named = f"pid {holder.get('pid')} on {holder.get('host')}{job}"
        if locked_fd is not None:
            return named
        if holder.get("host") == socket.gethostname():
            return f"{named}: no process holds it, that job is gone (the kernel drops a flock with its holder)"
        return (f"{named}: no process on this host holds it; that the job on {holder.get('host')} is gone is not "
                "checked: only a filesystem that shares flock between nodes tells (docs/cluster.md, \"The run lock\")")

    def release(self) -> None:
        """Let go of the locks. Never raises: on a filesystem gone read-only clearing the holder's name fails (the
        next job reports the lock as stale), and the error that stopped the job is the one to report."""
        if self._file is not None:
            try:
                os.ftruncate(self._file, 0)  # a clean exit leaves no holder to report
            except OSError:
                pass
        for fd in (self._file, self._folder):
            if fd is not None:
                os.close(fd)
        self._file = self._folder = None
