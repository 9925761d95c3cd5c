"""Re-layout as its own step: convert a run's latest checkpoint to DeepSpeed's universal format, so the next
start on another TP x DP layout loads it instead of converting inside the job (where the other ranks would
wait at a barrier limited by parallel.timeout_s):

    python -m pretrain.reshard --run RUN [--workers K]     # or: sbatch slurm/reshard.sbatch --run RUN

RUN is the run folder (run.dir); the checkpoint is the one the trainer would resume from (the newest complete
one whose checksums match), written next to it as `step_N_universal/`, which the trainer finds and loads. K worker
processes extract and merge the ZeRO fragments (default: the CPUs this process may use). Exit 0 when the
universal checkpoint exists (also when it already did), 2 on a usage error (no run, no checkpoint).
"""
from __future__ import annotations

import argparse
import logging
import os
import sys
import time
from pathlib import Path
from typing import Sequence

from pretrain.core.config import CheckpointConfig, UsageError
from pretrain.core.progress import progress
from pretrain.runtime.checkpoint import universal_path
from pretrain.runtime.resume import convert_to_universal, find_resume, usable_universal

log = logging.getLogger("pretrain.reshard")


def reshard(run: Path, workers: int) -> Path:
    """The universal checkpoint of `run`'s latest checkpoint (converted unless it is already there)."""
    root = run / "checkpoints"
    if not root.is_dir():
        raise UsageError(f"{run} is not a run folder: no checkpoints/ in it")
    path = find_resume(CheckpointConfig(resume="auto"), root)
    if path is None:
        raise UsageError(f"no complete checkpoint in {root}")
    output = universal_path(path)
    if usable_universal(output):
        log.info("%s exists already", output)
        return output
    start = time.perf_counter()
    for source in progress([path], total=1, desc=f"reshard {path.name} ({workers} workers)"):
        convert_to_universal(source, output, workers=workers)
    log.info("universal checkpoint %s written in %.1f s", output, time.perf_counter() - start)
    return output


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="pretrain.reshard", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--run", required=True, type=Path, help="the run folder (run.dir)")
    parser.add_argument("--workers", type=int, default=len(os.sched_getaffinity(0)),
                        help="processes extracting and merging ZeRO fragments (default: usable CPUs)")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        if args.workers < 1:
            raise UsageError(f"--workers ({args.workers}) must be >= 1")
        print(reshard(args.run, args.workers))
    except UsageError as e:
        print(f"pretrain.reshard: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
