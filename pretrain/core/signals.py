"""The signals a process's life turns on, for every layer that needs them: which ones mean preemption
(`PREEMPTION_SIGNALS`: the jobs record them, the data loader's workers ignore them) and a signal to a process when
its parent dies (`die_with_parent`: the loader's workers, ranks under torchrun's agent). Light on purpose (no torch):
the jobs install their handlers before their heavy imports. Imports: no pretrain package."""
from __future__ import annotations

import ctypes
import os
import signal
import sys

# Ctrl-C too: an interactive user stopping a run loses no more than a scheduler's SIGTERM does
PREEMPTION_SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGUSR1)

_PR_SET_PDEATHSIG = 1  # linux/prctl.h


def die_with_parent(sig: int, parent: int | None = None) -> None:
    """Ask the kernel for `sig` to this process when its parent dies, however it dies (SIGKILL, SIGABRT, the OOM
    killer): no code of the parent needs to run. A parent gone before the request sends nothing, so then the
    signal is sent here: `parent` is the parent's pid, if known (else an orphan shows as the child of pid 1).
    Linux only (prctl); elsewhere nothing is done."""
    if not sys.platform.startswith("linux"):
        return
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(_PR_SET_PDEATHSIG, sig, 0, 0, 0) != 0:
        raise OSError(ctypes.get_errno(), "prctl(PR_SET_PDEATHSIG) failed")
    if os.getppid() == 1 or parent is not None and os.getppid() != parent:
        os.kill(os.getpid(), sig)
