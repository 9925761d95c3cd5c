"""`factorized_dense`: the Factorized Dense Synthesizer, A_h(x) in R^a repeated and B_h(x) in R^b tiled to
a * b = N logits, multiplied element-wise."""
from __future__ import annotations

import math

import torch
from torch import nn

from pretrain.core.config import ModelConfig
from pretrain.model.layers import head_parameter
from pretrain.model.mixers.dense import HiddenProjection, dense_kernel
from pretrain.model.mixers.mixer import Mixer


def factor_pair(n: int) -> tuple[int, int]:
    """(a, b) with a * b = n and a the largest divisor <= sqrt(n): 512 -> (16, 32), 64 -> (8, 8)."""
    a = max(d for d in range(1, math.isqrt(n) + 1) if n % d == 0)
    return a, n // a


class FactorizedDense(nn.Module):
    """A_h(x) in R^a repeated b times, B_h(x) in R^b tiled a times, multiplied: a * b = N logits."""

    def __init__(self, cfg: ModelConfig, mp_config, tp_rank: int, tp: int) -> None:
        super().__init__()
        self.a, self.b = factor_pair(cfg.max_length)
        self.hidden = HiddenProjection(cfg, mp_config)
        h = cfg.num_heads
        self.wa = head_parameter(dense_kernel(cfg, (h, self.a, cfg.d_kv)), tp_rank, tp)  # [heads, a, d_kv]
        self.ba = head_parameter(torch.zeros(h, self.a), tp_rank, tp)
        self.wb = head_parameter(dense_kernel(cfg, (h, self.b, cfg.d_kv)), tp_rank, tp)  # [heads, b, d_kv]
        self.bb = head_parameter(torch.zeros(h, self.b), tp_rank, tp)

    def forward(self, x: torch.Tensor, start: int, m: int) -> torch.Tensor:
        hid = self.hidden(x)  # [b, n, heads/tp, d_kv]
        fa = torch.einsum("bnhd,had->bhna", hid, self.wa) + self.ba[None, :, None, :]  # [b, h/tp, n, a]
        fb = torch.einsum("bnhd,hcd->bhnc", hid, self.wb) + self.bb[None, :, None, :]  # [b, h/tp, n, b]
        # column j = i_a * b + i_b: A repeated (each element b times), B tiled (whole vector a times)
        logits = (fa[..., :, None] * fb[..., None, :]).flatten(-2)  # [b, h/tp, n, N]
        return logits[..., :m]


def _flops(cfg: ModelConfig, n: int) -> int:
    inner = cfg.num_heads * cfg.d_kv
    return 2 * n * cfg.d_model * inner + 2 * n * inner * sum(factor_pair(cfg.max_length))  # W1; W_A and W_B


FACTORIZED_DENSE = Mixer(
    "factorized_dense", "Factorized Dense Synthesizer: two small dense projections whose outer product gives N logits",
    _flops, FactorizedDense,
)
