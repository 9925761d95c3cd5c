"""Per-rank memory of parameters, gradients and optimizer states under ZeRO 0-3 at DP = 2 and 4, counted
in tensor bytes on every rank, against the planner's model-state bytes (pretrain.planning.memory, the ZeRO paper's
formulas, Rajbhandari et al. 2020, fig. 1, in DeepSpeed's layout); and
the step time of the DeepSpeed engine against a plain PyTorch loop (DDP + torch AdamW) on the same model.

    OMP_NUM_THREADS=1 .venv/bin/python -m bench.zero_memory [--dp 2 4] [--steps 5]

fp32 on CPU, so the paper's 2-byte parameters and gradients are 4 bytes here and its K = 12 bytes of Adam
state (fp32 master copy + m + v) per parameter is 8 (m + v) without ZeRO, where there is no master copy.
"""
from __future__ import annotations

import argparse
import dataclasses
import os
import socket
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from pretrain.core.config import Config, ParallelConfig, load_config
from pretrain.distributed.parallel import destroy_distributed, init_distributed
from pretrain.model import build_model
from pretrain.planning.memory import model_state_bytes
from pretrain.runtime.engine import build_engine

MODEL_OVERRIDES = ["model.d_model=128", "model.d_ff=256", "model.num_heads=4", "model.d_kv=32"]


def _bytes(tensors) -> int:
    """Bytes of the distinct storages behind `tensors` (views of one flat buffer count once)."""
    seen = {}
    for t in tensors:
        if t is not None and t.numel():
            seen[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
    return sum(seen.values())


def _measure(engine, batch: dict) -> dict[str, int]:
    """Bytes this rank holds after a backward (gradients alive) and after the step (optimizer states)."""
    loss = engine(**batch).loss
    engine.backward(loss)
    opt = engine.optimizer
    params = [getattr(p, "ds_tensor", p) for p in engine.module.parameters()]  # ZeRO-3 keeps a partition
    grads = [p.grad for p in engine.module.parameters()]
    grads += [getattr(opt, "grads_in_partition", None), getattr(opt, "grad_partitions_flat_buffer", None)]
    grads += getattr(opt, "fp32_groups_gradients_flat", [])  # bf16 at ZeRO 1: the fp32 accumulation
    # ZeRO 1/2 move reduced gradients out of .grad into per-group partitions
    grads += [g for group in getattr(opt, "averaged_gradients", {}).values() for g in (group or [])]
    grad_bytes = _bytes(grads)
    engine.step()
    basic = getattr(opt, "optimizer", opt)  # ZeRO wraps torch's AdamW
    states = [v for s in basic.state.values() for v in s.values() if torch.is_tensor(v) and v.dim() > 0]
    states += getattr(opt, "single_partition_of_fp32_groups", []) + getattr(opt, "fp32_partitioned_groups_flat", [])
    # the fp32 masters of a bf16 model: BF16_Optimizer (ZeRO 1) keeps flat partitions, FP16_UnfusedOptimizer (ZeRO 0)
    # one tensor per parameter
    states += getattr(opt, "fp32_groups_flat_partition", []) + [t for g in getattr(opt, "fp32_groups", []) for t in g]
    return {"params": _bytes(params), "grads": grad_bytes, "optimizer": _bytes(states)}


def _formula(stage: int, num_params: int, dp: int) -> dict[str, float]:
    """The planner's bytes (pretrain.planning.memory) of fp32 AdamW; ZeRO 1's gradient is the whole one it counts, which
    lives until the end of the backward, not the partition measured after it."""
    params, grads, optimizer = model_state_bytes(num_params, "fp32", stage, dp, "adamw")
    return {"params": params, "grads": grads, "optimizer": optimizer}


def _time_steps(step, batch: dict, steps: int) -> float:
    step(batch)  # warm-up
    start = time.perf_counter()
    for _ in range(steps):
        step(batch)
    return (time.perf_counter() - start) / steps


def _worker(rank: int, world: int, port: int, steps: int, out) -> None:
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank), MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=str(port))
    torch.set_num_threads(1)
    cfg = load_config(Config, "configs/tiny.yaml", MODEL_OVERRIDES)
    init_distributed(ParallelConfig(tensor=1), cfg.run.seed)
    g = torch.Generator().manual_seed(rank)
    batch = {
        "input_ids": torch.randint(2, 1100, (cfg.train.micro_batch, 64), generator=g),
        "attention_mask": torch.ones(cfg.train.micro_batch, 64, dtype=torch.long),
        "decoder_input_ids": torch.randint(2, 1100, (cfg.train.micro_batch, 14), generator=g),
        "labels": torch.randint(2, 1100, (cfg.train.micro_batch, 14), generator=g),
    }
    train = dataclasses.replace(cfg.train, global_batch=cfg.train.micro_batch * world)
    rows = []
    for stage in range(4):
        model = build_model(cfg.model)
        num_params = sum(p.numel() for p in model.parameters())
        engine = build_engine(model, train, dataclasses.replace(cfg.zero, stage=stage), "fp32", world)
        measured = _measure(engine, batch)

        def ds_step(b, engine=engine):
            engine.backward(engine(**b).loss)
            engine.step()

        rows.append((stage, num_params, measured, _time_steps(ds_step, batch, steps)))
    model = torch.nn.parallel.DistributedDataParallel(build_model(cfg.model))
    adamw = torch.optim.AdamW(model.parameters(), lr=1e-4)

    def plain_step(b):
        model(**b).loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        adamw.step()
        adamw.zero_grad()

    plain = _time_steps(plain_step, batch, steps)
    if rank == 0:
        out.put((rows, plain))
    dist.barrier()
    destroy_distributed()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dp", type=int, nargs="+", default=[2, 4])
    parser.add_argument("--steps", type=int, default=5)
    args = parser.parse_args()
    ctx = mp.get_context("spawn")
    for dp in args.dp:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        out = ctx.SimpleQueue()
        mp.start_processes(_worker, args=(dp, port, args.steps, out), nprocs=dp, start_method="spawn")
        rows, plain = out.get()
        print(f"\nDP = {dp}: bytes per rank, measured / ZeRO formula (fp32, Adam); step time vs plain DDP loop")
        print(f"{'stage':>5} {'params':>22} {'grads':>22} {'optimizer':>22} {'step ms':>8} {'x plain':>8}")
        for stage, num_params, measured, step_s in rows:
            expect = _formula(stage, num_params, dp)
            cells = [f"{measured[k] / 2**20:7.2f}/{expect[k] / 2**20:7.2f} MiB" for k in ("params", "grads", "optimizer")]
            print(f"{stage:>5} {cells[0]:>22} {cells[1]:>22} {cells[2]:>22} {step_s * 1e3:8.1f} {step_s / plain:8.2f}")
        print(f"plain PyTorch (DDP + AdamW): {plain * 1e3:.1f} ms/step; {rows[0][1]:,} parameters")


if __name__ == "__main__":
    main()
