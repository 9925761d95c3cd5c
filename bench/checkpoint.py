"""Synchronous vs asynchronous checkpoints (`checkpoint.async_save`) in the same process: how long the loop is
blocked per save, the ratio, the step time with and without a save in flight, and the host memory the staged copy
adds. A real `CheckpointManager` of a DeepSpeed engine (one process, gloo, fp32 Adam, ZeRO 1) on configs/tiny.yaml
widened to a few hundred MB of checkpoint (bench.checkpoint_checksum's engine).

    OMP_NUM_THREADS=1 .venv/bin/python -m bench.checkpoint [--d-model 256] [--saves 3] [--dir DIR]

DIR (default: a temporary folder) should be on the filesystem the checkpoints go to.
"""
from __future__ import annotations

import argparse
import dataclasses
import os
import statistics
import tempfile
import time
from pathlib import Path

from bench.checkpoint_checksum import wide_engine
from pretrain.distributed.parallel import destroy_distributed
from pretrain.model import universal_checkpoint_info
from pretrain.runtime.checkpoint import CheckpointManager, Progress, RunInputs


def _rss() -> int:
    """This process's resident bytes (VmRSS)."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    return 0


def _timed(call) -> float:
    start = time.perf_counter()
    call()
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--d-model", type=int, default=256, help="model width (d_ff = 4x, 4 layers, 32128 ids)")
    parser.add_argument("--saves", type=int, default=3, help="saves of each kind")
    parser.add_argument("--dir", type=Path, default=None)
    args = parser.parse_args()
    cfg, dims, model, engine, step = wide_engine(args.d_model)
    blocking: dict[bool, list[float]] = {False: [], True: []}
    idle, in_flight, added, writes = [], [], [], []
    with tempfile.TemporaryDirectory(dir=args.dir) as tmp:
        tokenizer = Path(tmp) / "spiece.model"
        tokenizer.write_bytes(os.urandom(800_000))  # the size of T5's 32k-piece spiece.model
        manager = CheckpointManager(dataclasses.replace(cfg.checkpoint, keep=1), Path(tmp) / "checkpoints", dims,
                                    engine=engine, progress=Progress(), data=None, inputs=RunInputs.of(tokenizer),
                                    config_yaml="", universal_info=universal_checkpoint_info(model, 32128))
        number = 0
        for _ in range(args.saves):
            for background in (False, True):  # alternated: both kinds meet the same load
                idle += [_timed(step) for _ in range(3)]
                number += 1
                rss = _rss()
                blocking[background].append(_timed(lambda: manager.save(number, background=background)))
                if background:
                    added.append(_rss() - rss)
                    while manager.writing:  # steps while the writer works
                        in_flight.append(_timed(step))
                    manager.finish()
                    writes.append(manager.take_metrics()["checkpoint_s"])
        size = sum(f.stat().st_size for f in (Path(tmp) / "checkpoints" / f"step_{number}").rglob("*")
                   if f.is_file())
    sync_s, async_s = statistics.median(blocking[False]), statistics.median(blocking[True])
    step_s = statistics.median(idle)
    busy = f"{statistics.median(in_flight):.3f} s ({len(in_flight)} steps)" if in_flight else "none measured"
    print(f"checkpoint {size / 1e6:.0f} MB ({sum(p.numel() for p in model.parameters()) / 1e6:.1f} M parameters, "
          f"fp32 Adam ZeRO 1, one process), median of {args.saves} saves each: blocking sync {sync_s:.3f} s, "
          f"async {async_s:.3f} s (ratio {async_s / sync_s:.2f}); async save to durable {statistics.median(writes):.2f}"
          f" s; step {step_s:.3f} s idle, {busy} with a save in flight; host memory added by the staged copy "
          f"{statistics.median(added) / 1e6:.0f} MB")
    destroy_distributed()


if __name__ == "__main__":
    main()
