"""Launch a job on one machine without SLURM: `launch.run` (torchrun with the jobs' exit codes) in standalone
mode, one process per GPU (or N).

    python -m launch.local [--nproc-per-node N] [--module pretrain.train] --config FILE [section.key=value ...]

Every argument this launcher does not know goes to the module. The default process count is the number of
visible GPUs, else 1 (CPU-only machines; pass --nproc-per-node to run several gloo processes). The process
becomes `launch.run` (exec), so signals and the exit code are its: the ranks'.
"""
from __future__ import annotations

import argparse
import os
import sys
from typing import Sequence

from pretrain.distributed.env import CUDA_CONNECTIONS


def num_local_gpus() -> int:
    import torch  # deferred: --help should not pay for the torch import

    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def launcher_argv(nproc_per_node: int, module: str, args: Sequence[str]) -> list[str]:
    """The `launch.run` command line: a single-node rendezvous on a free port (--standalone)."""
    if nproc_per_node < 1:
        raise ValueError(f"--nproc-per-node {nproc_per_node} must be at least 1")
    return [sys.executable, "-m", "launch.run", "--standalone",
            f"--nproc-per-node={nproc_per_node}", "-m", module, *args]


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m launch.local", allow_abbrev=False,
                                     description="launch.run (torchrun) on this machine; other arguments go to the module")
    parser.add_argument("--nproc-per-node", type=int, default=None, help="processes (default: GPUs, else 1)")
    parser.add_argument("--module", default="pretrain.train", help="the module to run (default: pretrain.train)")
    opts, rest = parser.parse_known_args(argv)
    nproc = opts.nproc_per_node if opts.nproc_per_node is not None else max(num_local_gpus(), 1)
    try:
        cmd = launcher_argv(nproc, opts.module, rest)
    except ValueError as err:
        parser.exit(2, f"{parser.prog}: error: {err}\n")
    os.environ.setdefault(*CUDA_CONNECTIONS)  # before any process of the job creates its CUDA context
    os.execv(cmd[0], cmd)


if __name__ == "__main__":
    main()
