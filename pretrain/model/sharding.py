"""How each parameter is split over TP, in one place: gathering a full (TP=1) state dict from the shards,
loading a full one into a sharded model, and DeepSpeed's universal-checkpoint patterns.

The split of a parameter is read from megatron's attributes (`tensor_model_parallel`, `partition_dim`,
`partition_stride`): not marked -> replicated (norms, a per-layer mixture vector); dim 1 -> row-parallel
(attention and FFN output projections); dim 0, stride 1 -> heads or vocabulary rows concatenated in rank
order (Q/K/V, every per-head Synthesizer parameter, relative bias, embedding, LM head); dim 0, stride 2 ->
the fused [wi_0; wi_1] whose rank r holds [wi_0 piece r; wi_1 piece r].
"""
from __future__ import annotations

import re

import torch
import torch.distributed as dist
from torch import nn

from pretrain.core.config import UsageError
from pretrain.model.t5 import T5Model

VOCAB_PARAMETERS = ("embed.weight", "lm_head.weight")


def is_tp_sharded(param: torch.Tensor) -> bool:
    """Each TP rank holds its own piece of `param`; otherwise every TP rank holds the same full copy."""
    return getattr(param, "tensor_model_parallel", False)


def _split(param: torch.Tensor) -> tuple[int | None, int]:
    if not is_tp_sharded(param):
        return None, 1
    return param.partition_dim, param.partition_stride


def _gather(shard: torch.Tensor, dim: int, stride: int, group: dist.ProcessGroup) -> torch.Tensor:
    tp = group.size()
    parts = [torch.empty_like(shard) for _ in range(tp)]
    dist.all_gather(parts, shard.contiguous(), group=group)
    pieces = [p.chunk(stride, dim=dim) for p in parts]  # [rank][sub-parameter]
    return torch.cat([pieces[r][s] for s in range(stride) for r in range(tp)], dim=dim)


def _shard(full: torch.Tensor, dim: int, stride: int, tp_rank: int, tp: int) -> torch.Tensor:
    subs = full.chunk(stride, dim=dim)
    return torch.cat([s.chunk(tp, dim=dim)[tp_rank] for s in subs], dim=dim)


def full_state_dict(model: T5Model, grads: bool = False, clone: bool = True) -> dict[str, torch.Tensor]:
    """Every parameter (or its gradient) gathered to its TP=1 shape over the model's TP group, the vocabulary
    parameters cut to the token ids (`model.config.vocab_size` rows: the padding to 128 x TP is the layout's, not
    the model's), so the result is the same whatever TP holds the model; all TP ranks must call together.
    `clone=False`: at TP 1 the tensors are views of the parameters (for readers that copy anyway, such as an
    export)."""
    out = {}
    for name, param in model.named_parameters():
        t = param.grad if grads else param.detach()
        if t is None:
            t = torch.zeros_like(param)
        dim, stride = _split(param)
        whole = dim is None or model.tp == 1
        full = t if whole else _gather(t, dim, stride, model.tp_group)
        if name in VOCAB_PARAMETERS:
            full = full[: model.config.vocab_size]
        out[name] = full.clone() if clone else full
    return out


@torch.no_grad()
def copy_full_parameter(model: T5Model, name: str, full: torch.Tensor, into: torch.Tensor | None = None) -> None:
    """Copy the full (TP=1) value of the model's parameter `name` into this rank's shard of it (`into`: another
    tensor of the shard's shape, such as its fp32 master copy; default the parameter). A vocabulary parameter
    takes the first min(rows, vocab_size) token rows of `full`; rows from there up to vocab_size are left as
    they are (a resized vocabulary keeps its fresh rows) and this TP's padding rows are zero, as the model
    initialises them."""
    param = model.get_parameter(name)
    target = param if into is None else into
    if name in VOCAB_PARAMETERS:  # rows split in rank order (stride 1)
        vocab_size = model.config.vocab_size
        start = model.tp_rank * target.shape[0]
        end = min(start + target.shape[0], len(full), vocab_size)
        if end > start:
            target[: end - start].copy_(full[start:end])
        target[max(vocab_size - start, 0):].zero_()
        return
    dim, stride = _split(param)
    target.copy_(full if dim is None else _shard(full, dim, stride, model.tp_rank, model.tp))


@torch.no_grad()
def load_full_state_dict(model: T5Model, state: dict[str, torch.Tensor], assign: bool = False) -> None:
    """Copy a TP=1 state dict into this rank's shards (names must match exactly). Vocabulary parameters may
    come with any number of rows from the token ids up (an export, or a checkpoint gathered at another TP):
    their token rows are kept and the padding rows of this TP are zero, as the model initialises them.
    `assign=True` (TP 1, e.g. a model built on `meta`): the parameters become `state`'s tensors, not copies
    (the vocabulary ones padded)."""
    params = dict(model.named_parameters())
    if set(params) != set(state):
        missing, extra = sorted(set(params) - set(state)), sorted(set(state) - set(params))
        raise UsageError(f"the weights do not match the model config: missing {missing[:3]}, unexpected {extra[:3]}")
    if assign and model.tp != 1:
        raise ValueError(f"load_full_state_dict(assign=True) needs a TP 1 model, this one is TP {model.tp}")
    if not assign:
        for name in params:
            copy_full_parameter(model, name, state[name])
        return
    whole = {}
    for name, param in params.items():
        full = state[name]
        if name in VOCAB_PARAMETERS:
            ids = model.config.vocab_size
            full = torch.cat([full[:ids], full.new_zeros(param.shape[0] - ids, *full.shape[1:])])
        whole[name] = full
    model.load_state_dict(whole, assign=True)


def _pattern(name: str) -> str:
    """A regex for the name with layer indices generalised: encoder.layers.3.x -> encoder\\.layers\\.\\d+\\.x$."""
    return re.sub(r"\\\.\d+\\\.", r"\\.\\d+\\.", re.escape(name)) + "$"


def universal_checkpoint_info(model: nn.Module, original_vocab_size: int) -> dict:
    """`client_state["universal_checkpoint_info"]` for DeepSpeed's ds_to_universal (mutually exclusive patterns)."""
    replicated, row, sub2, vocab = set(), set(), set(), set()
    for name, param in model.named_parameters():
        dim, stride = _split(param)
        if dim is None:
            replicated.add(_pattern(name))
        elif dim == 1:
            row.add(_pattern(name))
        elif stride == 2:
            sub2.add(_pattern(name))
        if name in VOCAB_PARAMETERS:
            vocab.add(_pattern(name))
    return {
        "universal_checkpoint_version": 0.2,
        "original_vocab_size": original_vocab_size,
        "tp_replicated_parameter_patterns": sorted(replicated),
        "parameter_with_row_parallelism_patterns": sorted(row),
        "parameter_with_2_sub_params_cat_dim_0": sorted(sub2),
        "vocabulary_parameter_patterns": sorted(vocab),
    }
