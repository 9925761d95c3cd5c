"""Export a training checkpoint to one folder that HuggingFace and our downstream jobs load, and load it back.

    python -m pretrain.export --run RUN_DIR --output OUT [--step N] [--dtype fp32|bf16] [--max-shard-size 5GB]

The command: arguments in, `pretrain.transfer.exporting` does the work (its docstring says how)."""
from __future__ import annotations

import argparse
import logging
import sys

from pretrain.runtime.faults import run_with_exit_codes
from pretrain.transfer.exporting import MAX_SHARD_SIZE, export


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m pretrain.export", description=__doc__.splitlines()[0])
    parser.add_argument("--run", required=True, help="run folder (run.dir of the pretraining)")
    parser.add_argument("--output", required=True, help="export folder to create")
    parser.add_argument("--step", type=int, default=None, help="checkpoint step (default: the newest complete one)")
    parser.add_argument("--dtype", default="fp32", choices=("fp32", "bf16"), help="dtype of the saved weights")
    parser.add_argument("--max-shard-size", default=MAX_SHARD_SIZE,
                        help="largest weights file (e.g. 5GB, 500MB); bigger models are split into "
                             "model-0000k-of-0000n.safetensors plus model.safetensors.index.json")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")

    def job() -> int:
        print(export(args.run, args.output, args.step, args.dtype, args.max_shard_size))
        return 0

    return run_with_exit_codes(job, parser.prog)


if __name__ == "__main__":
    sys.exit(main())
