"""Start-up time of the DeepSpeed engine (`pretrain.runtime.engine.build_engine`: optimizer, ZeRO, precision) for a config
as shipped, on one CPU process over gloo, with a real model of the config's shape (T5's 32100 ids).

    OMP_NUM_THREADS=2 .venv/bin/python -m bench.engine_start --config configs/base.yaml

Prints the optimizer's parameter groups, the final optimizer DeepSpeed chose and the seconds `build_engine` took
(model construction is not timed), wall-clock and this process's CPU time (which a loaded machine stretches
less). On a GPU the same groups are built, so the per-group costs carry over.
"""
from __future__ import annotations

import argparse
import dataclasses
import os
import socket
import time

from pretrain.core.config import Config, load_config
from pretrain.distributed.parallel import init_distributed
from pretrain.model import build_model
from pretrain.runtime.engine import build_engine


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="bench.engine_start", description=__doc__.splitlines()[0])
    parser.add_argument("--config", default="configs/base.yaml")
    parser.add_argument("overrides", nargs="*", help="key=value over the config")
    args = parser.parse_args(argv)
    cfg = load_config(Config, args.config, ["parallel.backend=gloo", "parallel.tensor=1", *args.overrides])
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dims = init_distributed(cfg.parallel, cfg.run.seed)
    model = build_model(dataclasses.replace(cfg.model, vocab_size=cfg.model.vocab_size or 32100))
    train = dataclasses.replace(cfg.train, micro_batch=1, global_batch=dims.dp)
    start, start_cpu = time.perf_counter(), time.process_time()
    engine = build_engine(model, train, cfg.zero, cfg.precision, dims.dp)
    seconds, cpu_seconds = time.perf_counter() - start, time.process_time() - start_cpu
    params = sum(p.numel() for p in model.parameters())
    print(f"{args.config}: {params / 1e6:.0f}M parameters, {cfg.train.optimizer}, ZeRO {cfg.zero.stage}, "
          f"{cfg.precision}: {len(engine.optimizer.param_groups)} parameter groups, "
          f"{type(engine.optimizer).__name__}, deepspeed.initialize {seconds:.1f} s ({cpu_seconds:.1f} s of CPU time)")


if __name__ == "__main__":
    main()
