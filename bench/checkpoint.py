"""Synchronous vs asynchronous checkpoints (`checkpoint.async_save`) in the same run: how long the loop is blocked
per save, the ratio, the step time with and without a save in flight, and the host memory the staged copy adds.
A real `CheckpointManager` of a real DeepSpeed engine on `--ranks` gloo processes (CPU, one thread each), the
config as shipped (default configs/small.yaml, T5-small: bf16, ZeRO 2, AdamW) with one sequence per rank at the
config's lengths (data.input_length, its span-corruption targets) and T5's 32100 ids.

    OMP_NUM_THREADS=1 .venv/bin/python -m bench.checkpoint [--config configs/small.yaml] [--ranks 2] [--saves 3]
        [--dir DIR] [section.key=value ...]

Saves of the two kinds alternate (both meet the same load), each after 3 steps; after an asynchronous save the
ranks step while a writer is still writing on some rank as a step starts (the loop's rule), and then the save
completes. Beside wall seconds, CPU seconds (this thread's, and the writer's), which a loaded machine skews less.
Blocking: the slowest rank's, per save (the next step's collectives wait for it). Host memory added: the ranks'
resident-memory growth across an asynchronous save's staging, summed, against the checkpoint's bytes. DIR
(default: a temporary folder) should be on the filesystem the checkpoints go to.
"""
from __future__ import annotations

import argparse
import dataclasses
import os
import socket
import statistics
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from pretrain.core.config import Config, load_config
from pretrain.data.span_corruption import input_and_target_lengths
from pretrain.distributed.parallel import destroy_distributed, init_distributed
from pretrain.model import build_model, universal_checkpoint_info, with_vocab
from pretrain.runtime.checkpoint import CheckpointManager, Progress, RunInputs
from pretrain.runtime.engine import build_engine

T5_IDS = 32100  # T5's 32000 SentencePiece pieces + 100 sentinels (model.vocab_size 0: the tokenizer's ids)
IDLE_STEPS = 3  # steps before each save


def _rss() -> int:
    """This process's resident bytes (VmRSS)."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    return 0


@dataclass
class Clock:
    """Wall seconds, this thread's CPU seconds and the other threads' (the writer's) of one call."""

    wall: float
    cpu: float
    others_cpu: float

    @classmethod
    def of(cls, call) -> Clock:
        wall, cpu, process = time.perf_counter(), time.thread_time(), time.process_time()
        call()
        cpu, process = time.thread_time() - cpu, time.process_time() - process
        return cls(time.perf_counter() - wall, cpu, process - cpu)


def _any(flag: bool) -> bool:
    """Whether `flag` holds on any rank (the loop carries it in its step's all-reduce)."""
    t = torch.tensor([float(flag)])
    dist.all_reduce(t)
    return t.item() > 0


def _engine(cfg: Config, rank: int):
    """(dims, model, engine, step): the config's model in its precision, ZeRO stage and optimizer, after one step
    (Adam's moments exist: the optimizer files have their full size); `step()` one more, on 1 x (inputs + targets)."""
    dims = init_distributed(cfg.parallel, cfg.run.seed)
    model = build_model(with_vocab(cfg.model, T5_IDS))
    engine = build_engine(model, cfg.train, cfg.zero, cfg.precision, dims.dp)
    _, targets = input_and_target_lengths(cfg.data.input_length, cfg.data.noise_density,
                                          cfg.data.mean_noise_span_length)
    g = torch.Generator().manual_seed(rank)
    inputs = torch.randint(2, T5_IDS, (1, cfg.data.input_length), generator=g)
    labels = torch.randint(2, T5_IDS, (1, targets), generator=g)
    batch = {"input_ids": inputs, "attention_mask": torch.ones_like(inputs), "decoder_input_ids": labels,
             "labels": labels}

    def step() -> None:
        engine.backward(engine(**batch).loss)
        engine.step()

    step()
    return dims, model, engine, step


def _measure(manager: CheckpointManager, step, saves: int) -> dict:
    """This rank's clocks: saves of each kind (an async one from its launch to its completion), steps idle and
    with a save in flight, resident memory added by staging, and the checkpoint's bytes."""
    out = {"sync": [], "async": [], "async_whole": [], "durable": [], "idle": [], "in_flight": [], "added": [],
           "bytes": 0.0}
    number = 0
    for _ in range(saves):
        for background in (False, True):  # alternated: both kinds meet the same load
            out["idle"] += [Clock.of(step) for _ in range(IDLE_STEPS)]
            number += 1
            rss = _rss()
            if not background:
                out["sync"].append(Clock.of(lambda: manager.save(number)))
            else:
                def save_in_background() -> None:
                    out["async"].append(Clock.of(lambda: manager.save(number, background=True)))
                    out["added"].append(_rss() - rss)
                    while _any(manager.writing):  # a writer is still writing as the step starts, on some rank
                        out["in_flight"].append(Clock.of(step))
                    manager.poll(False)

                out["async_whole"].append(Clock.of(save_in_background))
            metrics = manager.take_metrics()
            out["bytes"] = metrics["checkpoint_bytes"]
            if background:
                out["durable"].append(metrics["checkpoint_s"])  # launch to durable on every rank
    return out


def _median(clocks: list[Clock], key: str = "wall") -> float:
    return statistics.median(getattr(c, key) for c in clocks) if clocks else float("nan")


def _report(every: list[dict], header: str) -> str:
    """The lines rank 0 prints from every rank's measures."""
    saves = len(every[0]["sync"])
    # the loop waits for the slowest rank (the next step's collectives)
    slowest = {kind: [max(r[kind][i].wall for r in every) for i in range(saves)] for kind in ("sync", "async")}
    sync_s, async_s = statistics.median(slowest["sync"]), statistics.median(slowest["async"])
    first = every[0]
    sync_cpu, stage_cpu = _median(first["sync"], "cpu"), _median(first["async"], "cpu")
    writer_cpu = _median(first["async_whole"], "others_cpu")  # from the launch to the completion
    idle_s, busy_s = _median(first["idle"]), _median(first["in_flight"])
    idle_cpu, busy_cpu = _median(first["idle"], "cpu"), _median(first["in_flight"], "cpu")
    added = statistics.median(sum(r["added"][i] for r in every) for i in range(saves))
    lost = sum(c.wall - idle_s for c in first["in_flight"]) / saves  # what the writer cost the steps, per save
    return (f"{header}; checkpoint {first['bytes'] / 1e6:.0f} MB\n"
            f"  blocking per save (slowest rank, median of {saves}): sync {sync_s:.3f} s, async {async_s:.3f} s "
            f"(ratio {async_s / sync_s:.2f}); async launch to durable {statistics.median(first['durable']):.2f} s\n"
            f"  rank 0 CPU per save: sync {sync_cpu:.2f} s; async {stage_cpu:.2f} s staging (ratio "
            f"{stage_cpu / sync_cpu:.2f}) + {writer_cpu:.2f} s in the writer\n"
            f"  step {idle_s:.3f} s idle, {busy_s:.3f} s with a save in flight ({len(first['in_flight'])} steps, "
            f"{busy_s / idle_s:.2f}x); rank 0 CPU per step {idle_cpu:.3f} s idle, {busy_cpu:.3f} s in flight\n"
            f"  host memory added by the staged copy: {added / 1e6:.0f} MB over {len(every)} rank(s), "
            f"{added / first['bytes']:.2f}x the checkpoint's bytes\n"
            f"  net per save: async blocks {sync_s - async_s:.2f} s less, its steps in flight take {lost:.2f} s more "
            f"({'faster' if sync_s - async_s > lost else 'slower'} by {abs(sync_s - async_s - lost):.2f} s)")


def _worker(rank: int, world: int, port: int, args: argparse.Namespace, tmp: Path) -> None:
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank), MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=str(port))
    torch.set_num_threads(1)
    cfg = load_config(Config, args.config, [*args.overrides, "train.micro_batch=1", f"train.global_batch={world}"])
    dims, model, engine, step = _engine(cfg, rank)
    manager = CheckpointManager(dataclasses.replace(cfg.checkpoint, keep=1), tmp / "checkpoints", dims,
                                engine=engine, progress=Progress(), data=None,
                                inputs=RunInputs.of(tmp / "spiece.model"), config_yaml="",
                                universal_info=universal_checkpoint_info(model, T5_IDS))
    load = os.getloadavg()[0]
    mine = _measure(manager, step, args.saves)
    load = max(load, os.getloadavg()[0])
    every: list[dict | None] = [None] * world
    dist.all_gather_object(every, mine)
    if rank == 0:
        params = sum(p.numel() for p in model.parameters())
        header = (f"{args.config} {' '.join(args.overrides)}: {params / 1e6:.1f} M parameters, {cfg.precision}, "
                  f"ZeRO {cfg.zero.stage}, {cfg.train.optimizer}, {world} rank(s), 1 x {cfg.data.input_length} "
                  f"input tokens a rank; 1-min load average {load:.1f} (the higher of start and end)")
        print(_report(every, header), flush=True)
    dist.barrier()
    destroy_distributed()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", default="configs/small.yaml")
    parser.add_argument("--ranks", type=int, default=2, help="gloo processes (DP), one thread each")
    parser.add_argument("--saves", type=int, default=3, help="saves of each kind")
    parser.add_argument("--dir", type=Path, default=None)
    parser.add_argument("overrides", nargs="*", help="section.key=value, applied to --config")
    args = parser.parse_args()
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with tempfile.TemporaryDirectory(dir=args.dir) as tmp:
        (Path(tmp) / "spiece.model").write_bytes(os.urandom(800_000))  # the size of T5's 32k-piece spiece.model
        mp.start_processes(_worker, args=(args.ranks, port, args, Path(tmp)), nprocs=args.ranks, start_method="spawn")


if __name__ == "__main__":
    main()
