"""The Synthesizer study: attention variants x seeds, each pretrained on the same data and step budget,
exported, fine-tuned and evaluated on every listed task; one table and a folder of figures.

    python -m pretrain.study --config configs/study/cpu.yaml [section.key=value ...]

The command: arguments in, `pretrain.experiments.runner` does the work (its docstring says how)."""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

from pretrain.core.config import ConfigError, load_config
from pretrain.experiments.grid import StudyConfig, cells, check_study
from pretrain.experiments.runner import prepare_data, run_cell, run_study, write_baseline


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m pretrain.study",
                                     description=" ".join(__doc__.split("\n\n")[0].split()),
                                     usage="%(prog)s --config FILE [--cells | --stage STAGE [--cell I]] [section.key=value ...]")
    parser.add_argument("--config", help="study config (configs/study/*.yaml)")
    parser.add_argument("--cells", action="store_true", help="print the number of cells and the study folder")
    parser.add_argument("--stage", choices=("data", "pretrain", "downstream", "report"), help="run one part only")
    parser.add_argument("--cell", type=int, help="the cell (0-based, variant-major) of --stage pretrain|downstream")
    args, overrides = parser.parse_known_args(argv)
    try:
        cfg = load_config(StudyConfig, args.config, overrides)
        check_study(cfg)
    except ConfigError as e:
        parser.exit(2, f"{parser.prog}: error: {e}\n")
    grid = cells(cfg)
    if args.cells:
        print(len(grid), Path(cfg.study.dir).resolve())
        return 0
    if args.stage in ("pretrain", "downstream"):
        if args.cell is None or not 0 <= args.cell < len(grid):
            parser.exit(2, f"{parser.prog}: error: --stage {args.stage} needs --cell in 0..{len(grid) - 1}\n")
        return 0 if run_cell(cfg, grid[args.cell], (args.stage,)) else 1
    if args.stage == "data":
        prepare_data(cfg)
        write_baseline(cfg)
        return 0
    if args.stage == "report":
        from pretrain.experiments.report import write_report

        write_report(cfg)
        return 0
    return run_study(cfg)


if __name__ == "__main__":
    sys.exit(main())
