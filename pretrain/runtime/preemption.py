"""Preemption signals: the process's one record of SIGTERM, SIGINT (Ctrl-C) and SIGUSR1, from the first line of a job
to its exit. Light on purpose (no torch): the jobs install it before their heavy imports, so a signal during
start-up is recorded, never fatal.

A job's life: `watch_preemption()` first thing (the handler only records the first signal: saving from inside a
signal handler could interrupt a collective half-way); the job acts on the record at agreed points
(`pretrain.runtime.faults.stop_if_preempted` during start-up and evaluation, every step's collective in the loop);
`stop_watching()` once it exits, whatever the reason. From then on the signals are ignored: a repeat changes
nothing, where Python's own finalization would otherwise restore their default action (death by the signal, which
the launchers report as 143, or as a crash: 130, 138).
"""
from __future__ import annotations

import signal
import types

from pretrain.core.signals import PREEMPTION_SIGNALS


class PreemptionFlag:
    """The first preemption signal received since the job started watching; `raised` rides in the agreed checks
    (`faults.stop_if_preempted`, every step's collective in `pretrain.runtime.loop.train_step`)."""

    def __init__(self) -> None:
        self.received: int | None = None

    def _handle(self, signum: int, frame: types.FrameType | None) -> None:
        if self.received is None:  # a repeat is the same request
            self.received = signum

    @property
    def raised(self) -> bool:
        return self.received is not None


_FLAG = PreemptionFlag()  # signal handlers belong to the process: one flag per process


def watch_preemption() -> PreemptionFlag:
    """Record PREEMPTION_SIGNALS from now on (idempotent: a job's entry point and its body both call it);
    returns the process's flag, with what it recorded since the first call."""
    for sig in PREEMPTION_SIGNALS:
        signal.signal(sig, _FLAG._handle)
    return _FLAG


def received_signal() -> int | None:
    """The signal recorded since the job started watching, if any."""
    return _FLAG.received


def stop_watching() -> None:
    """The job is exiting: ignore PREEMPTION_SIGNALS from now on where it watched them, and forget the one recorded
    (a later job in this process, as in the tests, starts watching afresh)."""
    for sig in PREEMPTION_SIGNALS:
        if signal.getsignal(sig) == _FLAG._handle:
            signal.signal(sig, signal.SIG_IGN)
    _FLAG.received = None
