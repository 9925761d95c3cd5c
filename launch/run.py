"""torchrun with the jobs' exit codes and signals:

    python -m launch.run [torchrun options] -m pretrain.train --config FILE [section.key=value ...]

torchrun itself (`torch.distributed.run`) takes SIGTERM and SIGINT in its agent: it passes them on to the ranks,
SIGKILLs them 30 s later and exits 1 with a `SignalException` traceback, so a requeue wrapper never sees the
ranks' "preempted, checkpoint saved" code; and a rank's one-line error is followed by torchrun's 30-line
`ChildFailedError` report. This launcher runs torchrun itself (`torch.distributed.run.run`, its option parser and
agent), so every torchrun option works (`--standalone`, `--nnodes`, `--rdzv-backend c10d`, ...), with two changes:
- SIGTERM, SIGINT and SIGUSR1 are forwarded to the ranks, which decide what they mean (the jobs checkpoint and
  exit 75: pretrain.runtime.faults), and the agent keeps watching the ranks until they exit; one that arrives
  before the ranks exist (torch's import, the rendezvous) ends the launcher with 75 at once (nothing to save), as
  does one that kills ranks still starting (before their handlers), one after they ended changes nothing;
- the launcher exits with the ranks' code (`job_exit_code`) and prints nothing after their last line, except for
  a rank killed by a signal, which could not say so itself (one line); a rank that crashed (SIGABRT, SIGSEGV...)
  makes it 128 + N, never the ranks' "preempted" code, so a requeue wrapper does not requeue a crash.
"""
from __future__ import annotations

import atexit
import gc
import logging
import os
import signal
import sys
import threading
import time
import types
from typing import Sequence

from pretrain.distributed.env import NCCL_ERROR_HANDLING

FORWARDED_SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGUSR1)
# the signals torchrun's agent keeps: it ends the ranks on them (after its shutdown timeout, by SIGKILL)
AGENT_SIGNALS = "SIGHUP,SIGQUIT"
# how the agent ends the other ranks once one failed: a rank ended so did not crash
AGENT_KILLS = (signal.SIGTERM, signal.SIGKILL)
# the jobs' "preempted, checkpoint saved" code (pretrain.runtime.faults.EXIT_PREEMPTED; not imported: that loads megatron,
# seconds of CPU on the way out; tests/test_faults.py checks that they agree)
EXIT_PREEMPTED = 75


def _children() -> list[int]:
    """This process's children: the ranks (torchrun starts each as a subprocess of its agent, this process)."""
    me, pids = str(os.getpid()), []
    for entry in os.listdir("/proc"):
        try:
            with open(f"/proc/{entry}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()  # the name in parentheses may hold spaces
        except (OSError, IndexError):  # not a process, or one that ended meanwhile
            continue
        if fields[1] == me:
            pids.append(int(entry))
    return pids


class _PreemptedBeforeRanks(BaseException):
    """A preemption signal before the ranks started: nothing to save. A BaseException, so that it passes torchrun's
    `except Exception` clauses (their `finally` still closes the rendezvous)."""


_ranks_started = threading.Event()


def _watch_for_ranks() -> None:
    """Mark when the ranks exist (every 0.1 s until then: seconds), so that a signal which finds none can tell
    "not yet" from "ended"."""
    while not _children():
        time.sleep(0.1)
    _ranks_started.set()


_forwarded: list[int] = []  # the first preemption signal passed on to the ranks


def _forward(signum: int, frame: types.FrameType | None) -> None:
    ranks = _children()
    if not ranks:
        if _ranks_started.is_set():  # they ended: the launcher is on its way out with their code
            return
        raise _PreemptedBeforeRanks(signum)  # torch's import or the rendezvous: nothing to save
    _ranks_started.set()
    if not _forwarded:
        _forwarded.append(signum)
    for pid in ranks:
        try:
            os.kill(pid, signum)
        except ProcessLookupError:  # ended meanwhile
            pass


def job_exit_code(codes: dict[int, int], forwarded: int | None = None) -> tuple[int, str]:
    """The launcher's exit code from the ranks that ended non-zero ({global rank: exit code}, negative: killed by
    that signal), and the line to print ("" for none).

    Once a rank ends non-zero, torchrun's agent SIGTERMs the others (SIGKILL after its shutdown timeout) and
    records how they ended too. So the ranks' own codes come first: the lowest such rank's (every rank of a usage
    error exits with the same one), a "preempted" 75 (requeue) last, and only if no rank crashed, that is died of
    a signal other than the agent's TERM and KILL (SIGABRT: NCCL's watchdog, a C++ error; SIGSEGV ...): a crash is
    128 + N as a shell reports it, as is a failure where every failing rank was killed. A rank killed by anything
    but the agent's SIGTERM could not say so itself: the line names it.

    `forwarded`: the preemption signal the launcher passed on to the ranks, if any. A rank that died of it had not
    installed its handler yet (the jobs do so first thing: the interpreter's start-up), so it had nothing to save:
    the job was preempted, 75, even if every rank died of it."""
    own = sorted(rank for rank, code in codes.items() if code > 0)
    killed = sorted(rank for rank, code in codes.items() if code < 0)
    crashed = [rank for rank in killed if -codes[rank] not in (*AGENT_KILLS, forwarded)]
    failed = [rank for rank in own if codes[rank] != EXIT_PREEMPTED]
    if failed:  # an error, a usage mistake, a divergence: in the ranks' own words
        code = codes[failed[0]]
    elif (own or forwarded) and not crashed:  # every rank that ended by itself saved its checkpoint and exited 75
        code = EXIT_PREEMPTED
    else:
        code = 128 + -codes[(crashed or killed)[0]]
    named = [f"rank {rank} was killed by {signal.Signals(-codes[rank]).name}" for rank in killed
             if -codes[rank] not in (signal.SIGTERM, forwarded)]
    if code == EXIT_PREEMPTED and not own and not named:
        named.append(f"preempted by {signal.Signals(forwarded).name} while the ranks started: nothing to save, "
                     f"exiting {EXIT_PREEMPTED}")
    return code, "; ".join(named)


def main(argv: Sequence[str] | None = None) -> int:
    for sig in FORWARDED_SIGNALS:  # first: torch's import below takes seconds
        signal.signal(sig, _forward)
    try:  # a signal from here on is a preemption, also while the thread below starts
        threading.Thread(target=_watch_for_ranks, daemon=True).start()
        return _launch(argv)
    except _PreemptedBeforeRanks as e:
        print(f"launch.run: preempted by {signal.Signals(e.args[0]).name} before the ranks started: nothing to save, "
              f"exiting {EXIT_PREEMPTED}", file=sys.stderr)
        return EXIT_PREEMPTED
    finally:
        # the ranks have ended: a repeated signal changes nothing (Python's finalization would restore the default
        # action, and the launcher would die of it: 130, 138, 143)
        for sig in FORWARDED_SIGNALS:
            signal.signal(sig, signal.SIG_IGN)
        # spare the interpreter's final collection of torch's objects (pretrain.runtime.faults.freeze_at_exit: why)
        atexit.register(gc.freeze)


def _launch(argv: Sequence[str] | None) -> int:
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError  # deferred: --help stays fast
    from torch.distributed.run import determine_local_world_size, parse_args, run

    args = parse_args(list(sys.argv[1:] if argv is None else argv))
    nproc = args.nproc_per_node  # torchrun: 0 and -1 a bare AssertionError, 2x a ValueError
    if nproc not in ("gpu", "cpu", "auto") and not (nproc.isdigit() and int(nproc) >= 1):
        print(f"launch.run: error: --nproc-per-node {nproc} must be a number of ranks on this node, at least 1, or "
              "gpu, cpu or auto", file=sys.stderr)
        return 2  # a usage mistake (pretrain.runtime.faults.EXIT_USAGE)
    os.environ.setdefault(*NCCL_ERROR_HANDLING)  # the agent passes it on, else sets 1 (pretrain/distributed/env.py)
    if "OMP_NUM_THREADS" not in os.environ and determine_local_world_size(args.nproc_per_node) > 1:
        os.environ["OMP_NUM_THREADS"] = "1"  # what torchrun sets then, without its six-line banner
    args.signals_to_handle = AGENT_SIGNALS  # torchrun's --signals-to-handle (torch >= 2.8, the device's 2.11 too)
    # the agent's own report of a failed rank (its exit code, pid, closing the others): the ranks said it already
    logging.getLogger("torch.distributed.elastic").setLevel(logging.CRITICAL)
    try:
        run(args)
    except ChildFailedError as e:
        codes = {rank: failure.exitcode for rank, failure in e.failures.items()}
        code, line = job_exit_code(codes, _forwarded[0] if _forwarded else None)
        if line:
            print(f"launch.run: {line}", file=sys.stderr)
        return code
    return 0


if __name__ == "__main__":
    sys.exit(main())
