"""A test's hold on a job's background checkpoint writers (`pretrain.runtime.checkpoint_writer.BackgroundWriter`),
installed in the job's processes before they train; the trainer knows nothing of it.

With `DIR` held, the writer of step N creates `DIR/held_step_N_rank_R` (holding its pid: the process to kill) and
waits, before its first write, until `DIR/release_step_N` exists; the loop, when it waits for a held writer, creates
`DIR/waiting_step_N_rank_R`. So a test acts while a save is in flight, and knows where the loop is, without sleeping
and hoping.

In a process the test runs itself (`run_distributed`): `with held_writers(DIR): train(cfg)`. In a job launched as
srun would (`launch_like_srun`), its code: `train_holding_writers(DIR)`.
"""
from __future__ import annotations

import contextlib
import os
import threading
import time
from pathlib import Path
from typing import Callable, Iterator

from pretrain.runtime import checkpoint
from pretrain.runtime.checkpoint_writer import BackgroundWriter


def _held_writer(folder: str) -> type[BackgroundWriter]:
    class HeldWriter(BackgroundWriter):
        def __init__(self, write: Callable[[], dict[str, dict]], step: int, rank: int) -> None:
            def held_write() -> dict[str, dict]:
                Path(folder, f"held_step_{step}_rank_{rank}").write_text(str(os.getpid()))  # the process to kill
                # released by the test, or once the job's main thread has ended (a loop that never waited for it)
                while not Path(folder, f"release_step_{step}").exists() and threading.main_thread().is_alive():
                    time.sleep(0.05)
                return write()

            super().__init__(held_write, step, rank)

        def join(self) -> None:
            if not self.done:  # the test's sign that the loop waits for this writer (the next save, the end, a SIGTERM)
                Path(folder, f"waiting_step_{self.step}_rank_{self.rank}").touch()
            super().join()

    return HeldWriter


@contextlib.contextmanager
def held_writers(folder: str | os.PathLike) -> Iterator[None]:
    """Inside, the checkpoint manager's background writers are held at `folder`."""
    original = checkpoint.BackgroundWriter
    checkpoint.BackgroundWriter = _held_writer(str(folder))
    try:
        yield
    finally:
        checkpoint.BackgroundWriter = original


def train_holding_writers(folder: str | os.PathLike) -> str:
    """The code of a `launch_like_srun` job that runs `python -m pretrain.train` with its writers held at `folder`."""
    return (f"import sys; from tests.writer_hold import held_writers; from pretrain.train import main\n"
            f"with held_writers({str(folder)!r}):\n    sys.exit(main())")
