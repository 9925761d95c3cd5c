"""Faults: the exit codes of `pretrain.train` (one place; schedulers and docs/training.md rely on them),
preemption signals agreed on by all ranks, and the non-finite-loss budget.

Exit codes:
  EXIT_OK (0)          training reached train.steps, or train.exit_after steps were done (checkpoint saved)
  EXIT_FAILED (1)      an error (a traceback on the failing rank; the others fail within parallel.timeout_s)
  EXIT_USAGE (2)       a config or command-line mistake (one line on stderr)
  EXIT_DIVERGED (3)    more than train.max_skipped_steps steps had a NaN/inf loss; the last good checkpoint stays
  EXIT_PREEMPTED (75)  SIGTERM or SIGUSR1 arrived: a checkpoint was saved, run the same command again
                       (EX_TEMPFAIL from sysexits.h: "temporary failure, try again"; requeue the job)
"""
from __future__ import annotations

import logging
import signal
import sys
import types
from typing import Callable

import torch
import torch.distributed as dist

from pretrain.config import ConfigError
from pretrain.parallel import destroy_distributed

log = logging.getLogger(__name__)

EXIT_OK = 0
EXIT_FAILED = 1
EXIT_USAGE = 2
EXIT_DIVERGED = 3
EXIT_PREEMPTED = 75

PREEMPTION_SIGNALS = (signal.SIGTERM, signal.SIGUSR1)


class Diverged(RuntimeError):
    """Too many non-finite losses; the message names the step."""


class PreemptionFlag:
    """Records SIGTERM/SIGUSR1; `agreed()` is a collective, so every rank stops at the same step boundary."""

    def __init__(self) -> None:
        self.received: int | None = None
        for sig in PREEMPTION_SIGNALS:
            signal.signal(sig, self._handle)

    def _handle(self, signum: int, frame: types.FrameType | None) -> None:
        # only record: saving from inside a signal handler could interrupt a collective half-way
        self.received = signum

    def agreed(self, device: torch.device) -> bool:
        """True on every rank if any rank received a signal."""
        return any_rank_true(self.received is not None, device)


def any_rank_true(value: bool, device: torch.device) -> bool:
    """A boolean OR over all ranks (a MAX all-reduce over the world; every rank must call it)."""
    flag = torch.tensor([1.0 if value else 0.0], device=device)
    dist.all_reduce(flag, op=dist.ReduceOp.MAX)
    return bool(flag.item())


class SkipBudget:
    """Counts steps skipped for a non-finite loss and raises `Diverged` once more than `limit` were skipped."""

    def __init__(self, limit: int, skipped: int = 0) -> None:
        self.limit = limit
        self.skipped = skipped

    def skip(self, step: int) -> None:
        self.skipped += 1
        log.warning("step %d: NaN/inf loss on some rank; skipped (%d of %d allowed)", step, self.skipped, self.limit)
        if self.skipped > self.limit:
            raise Diverged(
                f"step {step}: NaN/inf loss; {self.skipped} steps skipped, more than "
                f"train.max_skipped_steps ({self.limit}); stopping, the last good checkpoint stays"
            )


def run_with_exit_codes(job: Callable[[], int], prog: str, usage_errors: tuple[type[Exception], ...] = ()) -> int:
    """Run a job's body and map its documented failures to exit codes; process groups are always torn down.

    ValueError/ConfigError (and `usage_errors`) -> one line on stderr, EXIT_USAGE; Diverged -> EXIT_DIVERGED;
    anything else propagates (a traceback; Python exits 1 = EXIT_FAILED).
    """
    try:
        return job()
    except (ValueError, ConfigError, *usage_errors) as e:
        print(f"{prog}: error: {e}", file=sys.stderr)
        return EXIT_USAGE
    except Diverged as e:
        log.error("%s", e)
        return EXIT_DIVERGED
    finally:
        destroy_distributed()
