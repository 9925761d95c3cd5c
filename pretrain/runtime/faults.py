"""Faults: the exit codes of `pretrain.train` (one place; schedulers and docs/training.md rely on them),
preemption signals agreed on by all ranks (recorded by `pretrain.runtime.preemption`), the skipped-step budget,
and the one wrapper of every job's body (`run_with_exit_codes`) that turns failures into those codes and always
ends child processes.

Exit codes:
  EXIT_OK (0)          training reached train.steps, or train.exit_after steps were done (checkpoint saved)
  EXIT_FAILED (1)      an error: its traceback on the failing rank; every other rank fails within about twice
                       parallel.timeout_s, with one line saying another rank failed first (or, where a collective
                       timed out, that a rank never arrived: stalled or hung). Storage that refuses a write (a full
                       disk, a quota, a file size limit, a read-only filesystem: `StorageError`) is no bug: one line
                       per rank naming the errno and the file, no traceback; what was saved before stays
  EXIT_USAGE (2)       a user mistake (pretrain.core.config.UsageError: config, inputs, layout): one line on stderr;
                       found by one rank only (its shards, its data), it is passed to the others through the job's
                       store, and every rank ends with that line and this code (`_share_usage_error`)
  EXIT_DIVERGED (3)    more than train.max_skipped_steps steps were skipped (non-finite loss or gradients);
                       the last good checkpoint stays
  EXIT_PREEMPTED (75)  SIGTERM, SIGINT (Ctrl-C) or SIGUSR1 arrived: a checkpoint was saved (or, before the first
                       step of the run, there was nothing to save), run the same command again
                       (EX_TEMPFAIL from sysexits.h: "temporary failure, try again"; requeue the job)
"""
from __future__ import annotations

import atexit
import functools
import gc
import logging
import multiprocessing
import os
import re
import signal
import socket
import sys
import traceback
from typing import Callable

import torch
import torch.distributed as dist

from pretrain.core.config import UsageError, print_error
from pretrain.core.files import chain, describe_storage_failure, storage_failure
from pretrain.distributed.parallel import destroy_distributed

# the signals live in pretrain.core.signals and their record in pretrain.runtime.preemption (both light: installed
# before torch is imported);
# PREEMPTION_SIGNALS and PreemptionFlag are also importable from here
from pretrain.runtime.preemption import PREEMPTION_SIGNALS, PreemptionFlag, received_signal, stop_watching  # noqa: F401

log = logging.getLogger(__name__)

EXIT_OK = 0
EXIT_FAILED = 1
EXIT_USAGE = 2
EXIT_DIVERGED = 3
EXIT_PREEMPTED = 75


class Diverged(RuntimeError):
    """Too many non-finite losses; the message names the step."""


class StorageError(RuntimeError):
    """A write the storage refused (`STORAGE_ERRNOS`); the message is the one line a rank prints."""


class Preempted(Exception):
    """Every rank agreed that some rank received a preemption signal where there is no step to save (start-up,
    evaluation): the job exits EXIT_PREEMPTED; the message says where, and what the rerun does."""


def stop_if_preempted(device: torch.device, where: str = "during start-up: nothing to save") -> None:
    """Whether any rank has received a preemption signal, agreed by every rank of the job (one all-reduce of one
    number over the world: every rank calls it at the same point); if so, `Preempted` on every rank, its message
    naming the signal, then `where`. A job calls it during start-up after the rendezvous, after the engine is built
    and before the first step (a checkpoint before step 1 would hold nothing the rerun lacks), and between the
    batches of an evaluation."""
    signum = torch.tensor([float(received_signal() or 0)], device=device)
    dist.all_reduce(signum, op=dist.ReduceOp.MAX)  # the highest signal number, if two ranks differ
    if signum.item():
        raise Preempted(f"preempted by {signal.Signals(int(signum.item())).name} {where}")


def check_skip_budget(step: int, skipped: int, limit: int) -> None:
    """After a skipped step: a warning, or `Diverged` once more than `limit` steps were skipped in the run."""
    log.warning("step %d: non-finite loss or gradients on some rank; the update was skipped (%d of %d allowed)",
                step, skipped, limit)
    if skipped > limit:
        raise Diverged(f"step {step}: non-finite loss or gradients; {skipped} steps skipped, more than "
                       f"train.max_skipped_steps ({limit}); stopping, the last good checkpoint stays")


# what a collective reports when the other end is gone or never answered (gloo, NCCL, the store)
_PEER_SIGNS = ("Connection closed by peer", "Connection reset by peer", "Broken pipe", "imed out",
               "NCCL communicator was aborted", "Socket Timeout")


def _is_peer_failure(e: BaseException) -> bool:
    """A collective that failed because another rank died or failed first. Errors before the process group
    exists (the rendezvous: a busy port, a wrong address) are this rank's own and keep their traceback."""
    return dist.is_initialized() and isinstance(e, (dist.DistError, RuntimeError)) and \
        any(sign in str(e) for sign in _PEER_SIGNS)


def _timeout_s(e: BaseException) -> float | None:
    """The wait of a collective that timed out, read from its message (gloo: "Timed out waiting 30000ms for recv",
    NCCL's watchdog: "Timeout(ms)=30000"); None for any other failure."""
    match = re.search(r"Timed out waiting (\d+)ms|Timeout\(ms\)=(\d+)", str(e))
    return int(match.group(1) or match.group(2)) / 1000 if match else None


def _peer_failure_line(e: BaseException) -> str:
    """What a rank whose collective failed knows: a peer ended first (its error is the one to read), or, on a
    timeout, that some rank never arrived, which, when no rank printed an error, is a stalled or hung one."""
    timeout = _timeout_s(e)
    if timeout is not None:
        return (f"a collective timed out after {timeout:g} s (parallel.timeout_s): another rank never arrived; if no "
                "rank printed an error, a rank stalled or hung (stopped, swapping, a lost node)")
    first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
    return f"a collective failed ({first}); another rank failed first, its error is the one to read"


def _storage_line(e: BaseException, rank: int) -> str | None:
    """The line of the first storage failure among `e` and the errors it came from (cleanup that failed on the same
    storage afterwards, closing files or releasing the lock, raised its errors over it), else None."""
    ours = [str(x) for x in chain(e) if isinstance(x, StorageError)]
    if ours:
        return ours[-1]
    failure = storage_failure(e)
    return f"rank {rank}: {describe_storage_failure(failure)}" if failure is not None else None


def _user_message(e: UsageError) -> str:
    """The one line of a usage error; one raised in a DataLoader worker arrives wrapped with its traceback."""
    lines = [line for line in str(e).splitlines() if line.strip()]
    if "Original Traceback" in str(e):
        return lines[-1].split(": ", 1)[-1]
    return " ".join(lines)


# keys in the job's rendezvous store (torch.distributed's default store: torchrun's agent or rank 0 serves it)
_USAGE_LINE = "pretrain/usage_error"  # the first one-line usage error of any rank
_USAGE_SEEN = "pretrain/usage_error_seen/"  # + rank: that rank ends with it


def _close_peer_connections() -> None:
    """Shut down this process's TCP connections except the rendezvous store's (MASTER_PORT at either end): the gloo
    connections of every process group. Destroying the groups does not close them while DeepSpeed and megatron
    hold references (measured: a peer's pending collective waited for this process's exit, or for the
    process-group timeout, 600 s by default); a shut-down connection fails the peer's collective at once."""
    store_port = int(os.environ.get("MASTER_PORT", "0"))
    for fd in os.listdir("/proc/self/fd"):
        try:
            conn = socket.socket(fileno=int(fd))
        except (OSError, ValueError):  # not a socket (or closed meanwhile)
            continue
        try:
            if conn.family in (socket.AF_INET, socket.AF_INET6) and conn.type == socket.SOCK_STREAM and \
                    store_port not in (conn.getsockname()[1], conn.getpeername()[1]):
                conn.shutdown(socket.SHUT_RDWR)
        except OSError:  # a listening or unconnected socket
            pass
        finally:
            conn.detach()  # the descriptor stays its owner's


def _share_usage_error(line: str) -> None:
    """Tell the other ranks this rank's usage error, so that they end with its line and EXIT_USAGE instead of "a
    collective failed" and EXIT_FAILED: the line goes into the store, this rank's collective connections are shut
    down (`_close_peer_connections`: the others' pending gloo collective fails at once and reads it,
    `_peer_usage_error`), and this rank waits (at most the process-group timeout) until every rank has read it,
    since its process may be the one serving the store. NCCL ranks never learn of it (their wait is inside CUDA;
    the watchdog or the launcher ends them), so none waits."""
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return
    store, rank, world = dist.distributed_c10d._get_default_store(), dist.get_rank(), dist.get_world_size()
    gloo = dist.get_backend() == "gloo"
    try:
        store.compare_set(_USAGE_LINE, "", line)  # the first rank's line wins
        store.set(f"{_USAGE_SEEN}{rank}", "")
        if gloo:
            _close_peer_connections()
        destroy_distributed()
        if gloo:
            store.wait([f"{_USAGE_SEEN}{r}" for r in range(world)], store.timeout)
    except (dist.DistError, RuntimeError):  # the store's server ended (its rank exited) or the wait timed out
        pass


def _peer_usage_error() -> str | None:
    """The line of another rank's usage error, when one was shared (`_share_usage_error`)."""
    try:
        store, rank = dist.distributed_c10d._get_default_store(), dist.get_rank()
        if not store.check([_USAGE_LINE]):
            return None
        line = store.get(_USAGE_LINE).decode()
        store.set(f"{_USAGE_SEEN}{rank}", "")
        return line
    except (dist.DistError, RuntimeError):
        return None


def stop_child_processes() -> None:
    """Loader workers left by a failure: collect unreferenced DataLoader iterators (their shutdown ends the
    workers cleanly), then kill what is left. Workers ignore SIGTERM (pretrain.data.loader), so without this
    the interpreter's exit would wait for them forever."""
    gc.collect()
    for child in multiprocessing.active_children():
        child.kill()
        child.join(timeout=5)


@functools.cache
def freeze_at_exit() -> None:
    """At the interpreter's exit, before its final garbage collection, move every object to the permanent
    generation: that collection walks the ~500k objects of torch, DeepSpeed and megatron for nothing (the process
    ends) and cost 1.8 s of CPU per process, 0.2 s frozen (`import pretrain.train`, then exit; 2-core machine, 5 s
    of CPU less per 2-rank `launch.run` job). Our files are closed by then; a process that goes on is unaffected."""
    atexit.register(gc.freeze)


def run_with_exit_codes(job: Callable[[], int], prog: str) -> int:
    """Run a job's body and map its failures to exit codes; child processes and process groups always end.

    UsageError -> one line on stderr, EXIT_USAGE, on every rank (`_share_usage_error`); Diverged -> EXIT_DIVERGED;
    Preempted -> one line, EXIT_PREEMPTED; storage that refused a write (`StorageError`, or an OSError of
    `STORAGE_ERRNOS` raised anywhere) -> one line naming the errno and the file, the first such failure of the chain,
    EXIT_FAILED; a collective that failed because another rank failed first or never arrived -> one line saying which
    (`_peer_failure_line`), EXIT_FAILED (the first error is that rank's); anything else -> its traceback, once,
    EXIT_FAILED. Preemption signals, if the job watches them (`watch_preemption`), are ignored once it has ended.
    """
    try:
        return job()
    except UsageError as e:
        line = _user_message(e)
        print_error(prog, line)
        stop_child_processes()  # before the wait for the others: nothing of this rank runs on meanwhile
        _share_usage_error(line)
        return EXIT_USAGE
    except Diverged as e:
        log.error("%s", e)
        return EXIT_DIVERGED
    except Preempted as e:
        log.warning("%s, exiting %d", e, EXIT_PREEMPTED)
        return EXIT_PREEMPTED
    except Exception as e:
        rank = dist.get_rank() if dist.is_initialized() else 0
        storage = _storage_line(e, rank)
        if storage is not None:
            print_error(prog, storage)
        elif _is_peer_failure(e) and (line := _peer_usage_error()) is not None:
            print_error(prog, line)  # the rank that found it printed it too: the same line, and the same code
            return EXIT_USAGE
        elif _is_peer_failure(e):
            print(f"{prog}: rank {rank}: {_peer_failure_line(e)}", file=sys.stderr)
        else:
            print(f"{prog}: rank {rank} failed:\n{traceback.format_exc()}", file=sys.stderr, end="")
        return EXIT_FAILED
    finally:
        stop_watching()
        stop_child_processes()
        destroy_distributed()
        freeze_at_exit()
