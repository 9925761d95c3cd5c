"""The planner: will this job start, and does it fit? Run before submitting, without a GPU:

    python -m pretrain.plan --config configs/xl.yaml --nodes 4 --gpus-per-node 8 [--gpu-memory-gb 80] \\
        [section.key=value ...]

The command: arguments in, `pretrain.planning.planner` does the work (its docstring says how)."""
from __future__ import annotations

import argparse
import sys
from typing import Sequence

from pretrain.core.config import Config, UsageError, load_config
from pretrain.planning.checkpoint import FS_GBPS, FS_GBPS_WHY
from pretrain.planning.comm import GPU_TFLOPS, IB_GBPS, NVLINK_GBPS
from pretrain.planning.memory import GiB
from pretrain.planning.planner import check_job, check_memory, estimate, report


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="pretrain.plan", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", required=True, help="the run's YAML config")
    parser.add_argument("--nodes", type=int, default=1)
    parser.add_argument("--gpus-per-node", type=int, default=8)
    parser.add_argument("--gpu-memory-gb", type=float, default=80.0, help="memory of one GPU in GiB")
    parser.add_argument("--link-gbps", type=float, default=IB_GBPS,
                        help=f"inter-node bandwidth per GPU in Gb/s (default {IB_GBPS:.0f}: one NDR InfiniBand NIC)")
    parser.add_argument("--nvlink-gbps", type=float, default=NVLINK_GBPS,
                        help=f"intra-node bandwidth per GPU in Gb/s (default {NVLINK_GBPS:.0f}: H100 NVLink 4)")
    parser.add_argument("--gpu-tflops", type=float, default=GPU_TFLOPS,
                        help=f"peak dense bf16 TFLOP/s of one GPU (default {GPU_TFLOPS:.0f}: H100 SXM)")
    parser.add_argument("--fs-gbps", type=float, default=FS_GBPS,
                        help=f"filesystem write bandwidth per rank in GB/s (bytes; every rank writes its part of a "
                             f"checkpoint at once: aggregate = this x GPUs) (default {FS_GBPS:g}: {FS_GBPS_WHY})")
    parser.add_argument("overrides", nargs="*", help="section.key=value")
    args = parser.parse_args(argv)
    memory = int(args.gpu_memory_gb * GiB)
    try:
        if args.nodes < 1 or args.gpus_per_node < 1:
            raise UsageError("--nodes and --gpus-per-node must be >= 1")
        for flag in ("gpu_memory_gb", "link_gbps", "nvlink_gbps", "gpu_tflops", "fs_gbps"):
            if not getattr(args, flag) > 0:  # also NaN; --gpu-memory-gb 0 planned a layout, then said "add GPUs"
                raise UsageError(f"--{flag.replace('_', '-')} ({getattr(args, flag)}) must be > 0")
        cfg = load_config(Config, args.config, args.overrides)
        layout = check_job(cfg, args.nodes * args.gpus_per_node, memory)
        est = estimate(cfg, layout)
        table, slow_saves = report(cfg, layout, est, memory, args.gpus_per_node, args.link_gbps, args.nvlink_gbps,
                                   args.gpu_tflops, args.fs_gbps)
        print(table)
        if slow_saves:
            print(f"pretrain.plan: {slow_saves}", file=sys.stderr)
        check_memory(cfg, layout, memory)  # what to change when it does not fit
    except UsageError as e:
        print(f"pretrain.plan: {e}", file=sys.stderr)
        return 2
    print(f"fits: {est.total / GiB:.1f} of {memory / GiB:.0f} GiB")
    return 0


if __name__ == "__main__":
    sys.exit(main())
