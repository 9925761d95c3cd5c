"""The model package: T5 v1.1 + Synthesizer mixers on megatron-core tensor parallelism.

`build_model(cfg)` inside a launched job (after `init_distributed`), `build_local_model(cfg)` anywhere else
(tests, notebooks, export): TP 1 on CPU, setting up a 1-process group if none exists.
"""
from __future__ import annotations

import dataclasses

import torch
from megatron.core import ModelParallelConfig

from pretrain.core.config import ModelConfig, UsageError
from pretrain.distributed.parallel import check_parallel, init_single_process, tensor_parallel_group
from pretrain.model.generation import generate_greedy
from pretrain.model.loss import IGNORE_INDEX
from pretrain.model.mixers import MIXERS, parse_mixers
from pretrain.model.sharding import full_state_dict, load_full_state_dict, universal_checkpoint_info
from pretrain.model.t5 import T5Model, T5Output, checkpointing_mode, vocab_parallel_argmax

__all__ = [
    "MIXERS", "IGNORE_INDEX", "T5Model", "T5Output", "build_model", "build_local_model", "check_model",
    "full_state_dict", "generate_greedy", "load_full_state_dict", "universal_checkpoint_info",
    "vocab_parallel_argmax", "with_vocab",
]


VOCAB_ROWS_PER_ID = 2  # model.vocab_size may exceed the tokenizer's ids (T5: 32128 rows for 32100), at most this many times


def with_vocab(cfg: ModelConfig, num_ids: int) -> ModelConfig:
    """`cfg` with model.vocab_size = the tokenizer's `num_ids` when it is 0; a set value below the ids, or above
    VOCAB_ROWS_PER_ID times them (rows no token id reaches, never trained: 1e8 for a 2,100-id tokenizer was a
    25.6 GB allocation), is refused in one line before anything is allocated (it runs before the job's other
    checks)."""
    if cfg.vocab_size == 0:
        return dataclasses.replace(cfg, vocab_size=num_ids)
    if cfg.vocab_size < num_ids:
        raise UsageError(f"model.vocab_size ({cfg.vocab_size}) is smaller than the tokenizer's {num_ids} ids; "
                         f"set it to 0 (the tokenizer's) or at least {num_ids}")
    if cfg.vocab_size > VOCAB_ROWS_PER_ID * num_ids:
        raise UsageError(f"model.vocab_size ({cfg.vocab_size}) is more than {VOCAB_ROWS_PER_ID} x the tokenizer's "
                         f"{num_ids} ids: the rows beyond them are never trained; set it to 0 (the tokenizer's, "
                         f"padded by the model itself) or at most {VOCAB_ROWS_PER_ID * num_ids}")
    return cfg


def check_model(cfg: ModelConfig, tp: int = 1) -> None:
    """The model-config rules that need the model package, checked before allocation: mixer names (the registry)
    and divisibility by TP. Sizes and rates are ModelConfig's own rules, checked when it is built."""
    parse_mixers(cfg.encoder_attention, "model.encoder_attention")
    parse_mixers(cfg.decoder_attention, "model.decoder_attention")
    check_parallel(cfg, tp, tp)


def build_model(cfg: ModelConfig, activation_checkpointing: str | bool = "none", compile: bool = False,
                sdpa: bool | None = None, device: torch.device | str = "cpu") -> T5Model:
    """The model for this rank (its TP shard), in fp32 on `device`, on the job's TP group (which it keeps).

    Every rank draws the full weights from `device`'s generator one parameter at a time and keeps its slice,
    so TP=N and TP=1 start as the same function given the same `torch.manual_seed` (on one device type: CUDA
    and CPU generators draw different numbers), and built on the GPU (the trainer passes its device) the host
    never holds the model: only this shard plus one parameter's full tensor exist, on the device. activation_checkpointing: none, full or
    selective (true/false: full/none); compile: torch.compile each encoder and decoder layer; sdpa: None picks
    SDPA or materialised logits for vanilla attention by device, True / False force one (see attention.py).
    """
    tp_group = tensor_parallel_group()  # the one read of the job's groups: the model keeps it (and its rank, size)
    tp = tp_group.size()
    check_model(cfg, tp)
    if cfg.vocab_size == 0:
        raise ValueError("model.vocab_size is 0 (the tokenizer's ids): resolve it with with_vocab before building")
    mp_config = ModelParallelConfig(
        tensor_model_parallel_size=tp, use_cpu_initialization=True, params_dtype=torch.float32
    )
    with torch.device(device):
        model = T5Model(cfg, mp_config, tp_group, checkpointing_mode(activation_checkpointing), sdpa)
    if compile:
        model.compile_layers()
    return model


def build_local_model(cfg: ModelConfig, device: torch.device | str = "cpu") -> T5Model:
    """A launcher-free model: sets up a 1-process gloo group + TP 1 if no parallel state exists yet."""
    init_single_process()
    return build_model(cfg, device=device)
