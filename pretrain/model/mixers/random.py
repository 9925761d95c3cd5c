"""`random` and `fixed_random`: the Random Synthesizer, a learned (or frozen) N x N logit matrix per head,
independent of the input."""
from __future__ import annotations

import functools

import torch
from torch import nn

from pretrain.core.config import ModelConfig
from pretrain.model.layers import head_parameter
from pretrain.model.mixers.mesh_tf import mesh_tf_glorot
from pretrain.model.mixers.mixer import Mixer


class Random(nn.Module):
    """A learned (or fixed) N x N logit matrix per head, independent of the input."""

    def __init__(self, cfg: ModelConfig, mp_config, tp_rank: int, tp: int, trainable: bool = True) -> None:
        super().__init__()
        n, h = cfg.max_length, cfg.num_heads
        if cfg.synthesizer_init == "mesh_tf":  # Mesh TF's R [length, heads, memory_length]; fixed_random: the same
            full = mesh_tf_glorot((h, n, n), (n, h, n))
        else:
            full = torch.randn(h, n, n) * cfg.initializer_factor
        self.r = head_parameter(full, tp_rank, tp, trainable)

    def forward(self, x: torch.Tensor, start: int, m: int) -> torch.Tensor:
        n = x.shape[1]
        return self.r[None, :, start : start + n, :m]  # [1, heads/tp, n, m]


# no FLOPs of their own: R is sliced, not computed
RANDOM = Mixer("random", "Random Synthesizer: a learned N x N logit matrix per head, independent of the input",
               lambda cfg, n: 0, Random, lambda p: p["r"])
FIXED_RANDOM = Mixer("fixed_random", "Fixed Random Synthesizer: a frozen random N x N logit matrix per head",
                     lambda cfg, n: 0, functools.partial(Random, trainable=False), lambda p: p["r"])
