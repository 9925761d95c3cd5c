"""The planner over a study: does every variant's pretraining fit, and what does the grid cost?

    python -m pretrain.study_plan --config configs/study/base_c4.yaml --nodes 1 --gpus-per-node 8 \
        [--gpu-memory-gb 80] [--gpu-tflops 989] [--mfu 0.4] [section.key=value ...]

For each variant it builds the pretraining job's config from the arguments the study passes it
(`pretrain.experiments.grid.pretrain_args` of the variant's first cell) and runs the planner's checks on it
(`pretrain.plan`: the layout, the batch split, the memory per GPU) at nodes x gpus-per-node processes. It prints
one line per variant (micro batch, memory, model FLOPs per step) and the grid's pretraining cost: model FLOPs x
steps x seeds, in GPU-hours at the assumed MFU (model FLOPs utilisation) of --gpu-tflops. Exit 0 when every
variant fits; exit 2 with the planner's one-line reason for the first that does not.
"""
from __future__ import annotations

import argparse
import sys
from typing import Sequence

from pretrain.core.config import Config, ConfigError, UsageError, load_config
from pretrain.experiments.grid import Cell, StudyConfig, cells, check_study, pretrain_args
from pretrain.planning.comm import GPU_TFLOPS
from pretrain.planning.memory import GiB
from pretrain.planning.planner import check_job, check_memory, step_flops


def pretrain_config(cfg: StudyConfig, cell: Cell) -> Config:
    """The config of `cell`'s pretraining job, from the very arguments pretrain.study gives it."""
    args = pretrain_args(cfg, cell)  # --config FILE section.key=value ...
    return load_config(Config, args[1], args[2:])


def plan_study(cfg: StudyConfig, world: int, memory: int, gpu_tflops: float, mfu: float) -> list[str]:
    """The report's lines; a UsageError names the first variant that does not fit and why."""
    lines, total = [], 0.0
    width = max(24, *(len(v.label) for v in cfg.study.variants))
    for cell in cells(cfg)[:: len(cfg.study.seeds)]:  # variant-major: each variant's first seed
        variant, job = cell.variant, pretrain_config(cfg, cell)
        try:
            layout = check_job(job, world, memory)
            est = check_memory(job, layout, memory)
        except UsageError as e:
            raise UsageError(f"variant {variant.label}: {e}") from None
        flops = step_flops(job, layout)
        hours = flops * job.train.steps / (gpu_tflops * 1e12 * mfu) / 3600
        total += hours * len(cfg.study.seeds)
        lines.append(f"{variant.label:{width}s} TP {layout.tp} x DP {layout.dp}, micro {layout.micro_batch} x accumulation "
                     f"{layout.accumulation}: {est.total / GiB:5.1f} of {memory / GiB:.0f} GiB; {flops:.3e} FLOPs/step "
                     f"x {job.train.steps:,} steps = {hours:,.1f} GPU-hours per seed")
    lines.append(f"pretraining, {len(cfg.study.variants) * len(cfg.study.seeds)} cells ({len(cfg.study.variants)} variants x {len(cfg.study.seeds)} seeds): "
                 f"{total:,.0f} GPU-hours at {100 * mfu:.0f}% MFU of {gpu_tflops:.0f} TFLOP/s "
                 f"({total / world:,.1f} h on {world} GPUs)")
    return lines


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m pretrain.study_plan", description=__doc__.splitlines()[0])
    parser.add_argument("--config", required=True, help="study config (configs/study/*.yaml)")
    parser.add_argument("--nodes", type=int, default=1)
    parser.add_argument("--gpus-per-node", type=int, default=8)
    parser.add_argument("--gpu-memory-gb", type=float, default=80.0, help="memory of one GPU in GiB")
    parser.add_argument("--gpu-tflops", type=float, default=GPU_TFLOPS,
                        help=f"peak dense bf16 TFLOP/s of one GPU (default {GPU_TFLOPS:.0f}: H100 SXM)")
    parser.add_argument("--mfu", type=float, default=0.4, help="assumed model FLOPs utilisation (default 0.4)")
    args, overrides = parser.parse_known_args(argv)
    try:
        if args.nodes < 1 or args.gpus_per_node < 1:
            raise UsageError("--nodes and --gpus-per-node must be >= 1")
        if not 0 < args.mfu <= 1 or args.gpu_tflops <= 0:
            raise UsageError(f"--mfu ({args.mfu}) must be in (0, 1] and --gpu-tflops ({args.gpu_tflops}) > 0")
        cfg = load_config(StudyConfig, args.config, overrides)
        check_study(cfg)
        lines = plan_study(cfg, args.nodes * args.gpus_per_node, int(args.gpu_memory_gb * GiB), args.gpu_tflops,
                           args.mfu)
    except (UsageError, ConfigError) as e:
        print(f"{parser.prog}: error: {e}", file=sys.stderr)
        return 2
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
