"""A job step for the launch tests: join the process group from the launcher's variables, all-gather
every rank's view of itself, and write it to OUT_DIR/rank<R>.json (OUT_DIR is argv[1])."""
from __future__ import annotations

import dataclasses
import json
import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist

from pretrain.distributed.env import distributed_env, export_torch_env


def main(out_dir: str) -> None:
    env = distributed_env()
    export_torch_env(env)
    dist.init_process_group("gloo", init_method="env://", rank=env.rank, world_size=env.world_size)
    ranks = torch.tensor([env.rank])
    gathered = [torch.zeros_like(ranks) for _ in range(env.world_size)]
    dist.all_gather(gathered, ranks)
    record = {**dataclasses.asdict(env), "gathered": [int(t) for t in gathered], "node": os.environ.get("SLURM_NODEID"),
              "cuda_connections": os.environ.get("CUDA_DEVICE_MAX_CONNECTIONS"),
              "nccl_error_handling": os.environ.get("TORCH_NCCL_ASYNC_ERROR_HANDLING")}
    Path(out_dir, f"rank{env.rank}.json").write_text(json.dumps(record))
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1])
