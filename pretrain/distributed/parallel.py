"""Process groups: torch.distributed + megatron-core `parallel_state` (TP x DP), the TP-aware RNG, and the
`mpu` adapter DeepSpeed needs. The one module that touches megatron's global parallel state at setup; the model
takes its TP group from here (`tensor_parallel_group`) once, at construction.

Layout (megatron's): TP groups are consecutive ranks, DP groups are strided. World 4, TP 2: TP groups
[0, 1], [2, 3]; DP groups [0, 2], [1, 3].

RNG streams (as in megatron): the default torch generator is seeded with the same `seed` on every rank,
so every rank builds identical full weights on CPU and dropout in replicated regions (residual stream)
agrees across the TP ranks that hold the same activations. Dropout inside the TP region (attention
probabilities, the FFN hidden, both sharded by TP) runs under `tensor_parallel.get_cuda_rng_tracker().fork()`
whose stream is seeded with seed + 2718 + tp_rank, so every TP rank draws a different mask for its shard.
On a CPU-only torch megatron's tracker cannot work (it calls torch.cuda); `_CpuRNGStatesTracker` has the
same interface and forks the CPU generator instead.
"""
from __future__ import annotations

import contextlib
import logging
import os
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist
from megatron.core import parallel_state, tensor_parallel
from megatron.core.tensor_parallel import random as mp_random

from pretrain.core.config import ModelConfig, ParallelConfig, UsageError
from pretrain.distributed.env import (
    CUDA_CONNECTIONS,
    distributed_env,
    export_torch_env,
    free_port,
    init_launcher_death_signal,
)

log = logging.getLogger(__name__)

VOCAB_MULTIPLE = 128  # embedding rows are padded to a multiple of 128 x TP (GEMM-friendly shards)
_TP_SEED_OFFSET = 2718  # megatron's offset of the TP-region stream (model_parallel_cuda_manual_seed)


@dataclass(frozen=True)
class ParallelDims:
    world: int
    rank: int
    local_rank: int
    tp: int
    dp: int
    tp_rank: int
    dp_rank: int
    device: torch.device


def padded_vocab_size(num_ids: int, tp: int) -> int:
    """Embedding rows for `num_ids` token ids at TP `tp`: the smallest multiple of 128 x tp (Megatron's rule;
    32100 -> 32128 at TP 1, 32256 at TP 2). The one place the padding rule lives; model.vocab_size is ids."""
    multiple = VOCAB_MULTIPLE * tp
    return -(-num_ids // multiple) * multiple


def check_world(tp: int, world_size: int) -> None:
    """TP groups tile the world (parallel.tensor >= 1 is ParallelConfig's own rule)."""
    if world_size % tp:
        raise UsageError(f"parallel.tensor ({tp}) must divide the world size ({world_size}); launch a multiple of "
                         f"{tp} processes or change parallel.tensor")


def check_parallel(model_cfg: ModelConfig, tp: int, world_size: int) -> None:
    """Cross-field rules of the parallel layout, checked before anything is allocated (a user error, one line: also
    in fine-tuning, whose model comes from an export)."""
    check_world(tp, world_size)
    if model_cfg.num_heads % tp:
        raise UsageError(f"model.num_heads ({model_cfg.num_heads}) must be a multiple of parallel.tensor ({tp})")
    if model_cfg.d_ff % tp:
        raise UsageError(f"model.d_ff ({model_cfg.d_ff}) must be a multiple of parallel.tensor ({tp})")


def _pick_backend(requested: str) -> str:
    if requested == "auto":
        return "nccl" if torch.cuda.is_available() else "gloo"
    if requested == "nccl" and not torch.cuda.is_available():
        raise UsageError("parallel.backend 'nccl' needs CUDA, which this torch/machine lacks; use gloo or auto")
    return requested


def init_distributed(cfg: ParallelConfig, seed: int) -> ParallelDims:
    """Join the job's process group (torchrun or SLURM variables), build TP x DP groups and seed the RNGs."""
    env = distributed_env()
    init_launcher_death_signal()  # a rank whose launcher is killed stops (checkpoint, exit) instead of training on
    check_world(cfg.tensor, env.world_size)  # before joining: each rank refuses on its own, none waits
    export_torch_env(env)  # SLURM's variables -> the env:// rendezvous variables
    backend = _pick_backend(cfg.backend)
    if backend == "nccl":
        if cfg.tensor > 1:
            # read when the CUDA context is created: the launchers set it in the job's environment; this covers
            # other launches, unless something in this process already created the context
            if torch.cuda.is_initialized() and os.environ.get(CUDA_CONNECTIONS[0]) != CUDA_CONNECTIONS[1]:
                log.warning("%s=%s comes too late: the CUDA context exists; set it in the job's environment",
                            *CUDA_CONNECTIONS)
            os.environ.setdefault(*CUDA_CONNECTIONS)
        # a task may see all the node's GPUs (torchrun) or only its own (srun --gpus-per-task)
        device = torch.device("cuda", env.local_rank % torch.cuda.device_count())
        torch.cuda.set_device(device)
        # fp32 matmuls and convolutions on tensor cores (TF32); bf16 runs are unaffected
        torch.backends.cuda.matmul.allow_tf32 = True
        torch.backends.cudnn.allow_tf32 = True
    else:
        device = torch.device("cpu")
    if not dist.is_initialized():
        dist.init_process_group(
            backend=backend,
            init_method="env://",
            rank=env.rank,
            world_size=env.world_size,
            timeout=timedelta(seconds=cfg.timeout_s),
        )
    if not parallel_state.model_parallel_is_initialized():
        # every group gets the configured timeout (megatron's default is 30 minutes); megatron's extra gloo
        # groups serve its own distributed optimizer and checkpointing, which this project does not use
        parallel_state.initialize_model_parallel(tensor_model_parallel_size=cfg.tensor,
                                                 distributed_timeout_minutes=cfg.timeout_s / 60,
                                                 create_gloo_process_groups=False)
    init_rng(seed, cuda=device.type == "cuda")
    dims = ParallelDims(
        world=env.world_size,
        rank=env.rank,
        local_rank=env.local_rank,
        tp=cfg.tensor,
        dp=env.world_size // cfg.tensor,
        tp_rank=parallel_state.get_tensor_model_parallel_rank(),
        dp_rank=parallel_state.get_data_parallel_rank(),
        device=device,
    )
    log.info("process groups ready: %s, backend %s, source %s", dims, backend, env.source)
    return dims


def tensor_parallel_group() -> dist.ProcessGroup:
    """This rank's TP group, handed to the model at construction (`pretrain.model.build_model`): the model's forwards
    and helpers use the group and the rank and size it took then, and read no global state (Megatron's own rule for
    its library code: process groups come from the caller, not from `parallel_state`)."""
    if not parallel_state.model_parallel_is_initialized():
        raise RuntimeError("no process groups yet: call init_distributed() first (or init_single_process())")
    return parallel_state.get_tensor_model_parallel_group()


def init_single_process(seed: int = 0) -> None:
    """A 1-process gloo group + parallel_state (TP 1) for launcher-free use; no-op if already set up."""
    if not dist.is_initialized():
        # a private address, not MASTER_ADDR/MASTER_PORT: jobs this process starts must not inherit them
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1)
    if not parallel_state.model_parallel_is_initialized():
        parallel_state.initialize_model_parallel(tensor_model_parallel_size=1, create_gloo_process_groups=False)
        state = torch.get_rng_state()  # leave the caller's global stream (and its manual_seed) untouched
        init_rng(seed, cuda=False)
        torch.set_rng_state(state)



def destroy_distributed() -> None:
    if parallel_state.model_parallel_is_initialized():
        parallel_state.destroy_model_parallel()
    if dist.is_initialized():
        dist.destroy_process_group()


# --------------------------------------------------------------------------------------------------------
# RNG
# --------------------------------------------------------------------------------------------------------
class _CpuRNGStatesTracker(mp_random.CudaRNGStatesTracker):
    """megatron's tracker interface (add / fork / get_states / set_states) over the CPU generator."""

    def add(self, name: str, seed: int) -> None:
        if seed in self.seeds_ or name in self.states_:
            raise ValueError(f"rng stream {name} (seed {seed}) already exists")
        self._is_initialized = True
        self.seeds_.add(seed)
        self.states_[name] = torch.Generator().manual_seed(seed).get_state()

    @contextlib.contextmanager
    def fork(self, name: str = mp_random._MODEL_PARALLEL_RNG_TRACKER_NAME):
        if name not in self.states_:
            raise ValueError(f"rng stream {name} was never added")
        outer = torch.get_rng_state()
        torch.set_rng_state(self.states_[name])
        try:
            yield
        finally:
            self.states_[name] = torch.get_rng_state()
            torch.set_rng_state(outer)


# megatron's own reads of "the CUDA state" (its recompute saves and restores it), which the CPU tracker replaces
_CUDA_RNG_STATE = (mp_random._get_cuda_rng_state, mp_random._set_cuda_rng_state)


def init_rng(seed: int, cuda: bool) -> None:
    """Seed the default stream (same on all ranks) and the TP-region streams (different per TP rank): megatron's CUDA
    tracker, or one over the CPU generator. Either replaces the other (a process that set up the CPU one first, as
    init_single_process does, gets CUDA's whole: the tracker and the state its recompute restores)."""
    torch.manual_seed(seed)
    if cuda:
        mp_random._get_cuda_rng_state, mp_random._set_cuda_rng_state = _CUDA_RNG_STATE
        tensor_parallel.model_parallel_cuda_manual_seed(seed, force_reset_rng=True)
        return
    tracker = _CpuRNGStatesTracker()
    tracker.add(mp_random._DATA_PARALLEL_RNG_TRACKER_NAME, seed)
    tracker.add(
        mp_random._MODEL_PARALLEL_RNG_TRACKER_NAME,
        seed + _TP_SEED_OFFSET + parallel_state.get_tensor_model_parallel_rank(),
    )
    mp_random._CUDA_RNG_STATE_TRACKER = tracker
    mp_random._CUDA_RNG_STATE_TRACKER_INITIALIZED = True
    # megatron's activation recompute saves/restores "the CUDA state": on CPU that is the CPU generator
    mp_random._get_cuda_rng_state = lambda *args, **kwargs: torch.get_rng_state()
    mp_random._set_cuda_rng_state = lambda state, *args, **kwargs: torch.set_rng_state(state)


# --------------------------------------------------------------------------------------------------------
# DeepSpeed
# --------------------------------------------------------------------------------------------------------
class _DeepSpeedMpu:
    """parallel_state plus the legacy names DeepSpeed calls (model parallel = tensor parallel here)."""

    def __getattr__(self, name: str):
        return getattr(parallel_state, name)

    def get_model_parallel_rank(self) -> int:
        return parallel_state.get_tensor_model_parallel_rank()

    def get_model_parallel_world_size(self) -> int:
        return parallel_state.get_tensor_model_parallel_world_size()

    def get_model_parallel_group(self):
        return parallel_state.get_tensor_model_parallel_group()

    def get_data_parallel_group_ranks(self) -> list[int]:
        return dist.get_process_group_ranks(parallel_state.get_data_parallel_group())


def deepspeed_mpu() -> _DeepSpeedMpu:
    """The `mpu` argument of `deepspeed.initialize`: ZeRO shards over DP only, clipping is TP-aware."""
    if not parallel_state.model_parallel_is_initialized():
        raise RuntimeError("deepspeed_mpu() needs init_distributed() first")
    return _DeepSpeedMpu()
