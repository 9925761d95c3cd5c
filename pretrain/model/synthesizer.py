"""Synthesizer logit generators (Tay et al. 2021, arXiv 2005.00743): per-head logits over key positions
that do not come from query-key dot products.

Every generator builds logits for the maximum length N (`model.max_length`) and slices them to the rows
of the current query positions and the first m key columns, as the Mesh TensorFlow reference does. All
parameters are per head with the head dimension first, drawn in full on every rank from the global RNG
(so TP=N and TP=1 start identical) and sliced to this rank's heads: column-like, concatenated over TP
along dim 0. `model.synthesizer_init` picks their initialisers: `t5` (T5's scale: initial logits of std 0.5-1,
like vanilla's) or `mesh_tf` (Mesh TensorFlow's `synthetic_attention`: near-uniform attention at the start);
docs/model.md, "Initial scale", has both and the initial logit std they give.
"""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from megatron.core.tensor_parallel import ColumnParallelLinear, set_tensor_model_parallel_attributes
from torch import nn

from pretrain.core.config import ModelConfig


def head_parameter(full: torch.Tensor, tp_rank: int, tp: int, requires_grad: bool = True) -> nn.Parameter:
    """This rank's heads of a full per-head tensor [heads, ...], marked tensor-parallel along dim 0."""
    param = nn.Parameter(full.chunk(tp, dim=0)[tp_rank].clone(), requires_grad=requires_grad)
    set_tensor_model_parallel_attributes(param, True, 0, 1)
    return param


def mesh_tf_glorot(shape: tuple[int, ...], mesh_tf_shape: tuple[int, ...]) -> torch.Tensor:
    """A tensor of `shape` drawn as Mesh TF draws a variable of `mesh_tf_shape` that `mtf.get_variable` gives no
    initializer (R, R1, R2): TF's glorot_uniform, U(-a, a) with a = sqrt(6 / (fan_in + fan_out)), the fans read
    from the variable's layout (TF's `_compute_fans`: the last two dimensions, each times the others' product)."""
    receptive = math.prod(mesh_tf_shape[:-2])
    limit = math.sqrt(6 / ((mesh_tf_shape[-2] + mesh_tf_shape[-1]) * receptive))
    return torch.empty(shape).uniform_(-limit, limit)


def mesh_tf_dense_kernel(shape: tuple[int, ...], fan_in: int) -> torch.Tensor:
    """`mtf.layers.dense`'s default kernel (VarianceScalingInitializer: scale 1, fan_in, normal): TF's truncated
    normal, std sqrt(1 / fan_in) before values beyond two standard deviations are redrawn."""
    std = fan_in**-0.5
    return nn.init.trunc_normal_(torch.empty(shape), 0.0, std, -2 * std, 2 * std)


def factor_pair(n: int) -> tuple[int, int]:
    """(a, b) with a * b = n and a the largest divisor <= sqrt(n): 512 -> (16, 32), 64 -> (8, 8)."""
    a = max(d for d in range(1, math.isqrt(n) + 1) if n % d == 0)
    return a, n // a


class _HiddenProjection(nn.Module):
    """First layer shared by the dense forms: relu(W1_h x + b1_h) per head, a column-parallel linear. Under mesh_tf
    W1 starts as Mesh TF's W1 does, which is the query projection (T5's init, 1/sqrt(d_kv) folded in)."""

    def __init__(self, cfg: ModelConfig, mp_config) -> None:
        super().__init__()
        fan = cfg.d_model * (cfg.d_kv if cfg.synthesizer_init == "mesh_tf" else 1)
        std = cfg.initializer_factor * fan**-0.5
        self.w1 = ColumnParallelLinear(
            cfg.d_model, cfg.num_heads * cfg.d_kv, config=mp_config, bias=True, gather_output=False,
            init_method=lambda w: nn.init.normal_(w, 0.0, std),
        )
        self.d_kv = cfg.d_kv

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, n, _ = x.shape
        return F.relu(self.w1(x)[0]).view(b, n, -1, self.d_kv)  # [b, n, heads/tp, d_kv]


class Dense(nn.Module):
    """F_h(x) = W2_h relu(W1_h x + b1_h) + b2_h: each token synthesizes its row of N logits."""

    def __init__(self, cfg: ModelConfig, mp_config, tp_rank: int, tp: int) -> None:
        super().__init__()
        self.hidden = _HiddenProjection(cfg, mp_config)
        n, h = cfg.max_length, cfg.num_heads
        self.w2 = head_parameter(_dense_kernel(cfg, (h, n, cfg.d_kv)), tp_rank, tp)  # [heads, N, d_kv]
        self.b2 = head_parameter(torch.zeros(h, n), tp_rank, tp)  # [heads, N]

    def forward(self, x: torch.Tensor, start: int, m: int) -> torch.Tensor:
        hid = self.hidden(x)  # [b, n, heads/tp, d_kv]
        # only the first m of the N outputs are ever used: slicing W2 first saves (N - m) / N of the GEMM
        logits = torch.einsum("bnhd,hmd->bhnm", hid, self.w2[:, :m])
        return logits + self.b2[None, :, None, :m]  # [b, heads/tp, n, m]


class FactorizedDense(nn.Module):
    """A_h(x) in R^a repeated b times, B_h(x) in R^b tiled a times, multiplied: a * b = N logits."""

    def __init__(self, cfg: ModelConfig, mp_config, tp_rank: int, tp: int) -> None:
        super().__init__()
        self.a, self.b = factor_pair(cfg.max_length)
        self.hidden = _HiddenProjection(cfg, mp_config)
        h = cfg.num_heads
        self.wa = head_parameter(_dense_kernel(cfg, (h, self.a, cfg.d_kv)), tp_rank, tp)  # [heads, a, d_kv]
        self.ba = head_parameter(torch.zeros(h, self.a), tp_rank, tp)
        self.wb = head_parameter(_dense_kernel(cfg, (h, self.b, cfg.d_kv)), tp_rank, tp)  # [heads, b, d_kv]
        self.bb = head_parameter(torch.zeros(h, self.b), tp_rank, tp)

    def forward(self, x: torch.Tensor, start: int, m: int) -> torch.Tensor:
        hid = self.hidden(x)  # [b, n, heads/tp, d_kv]
        fa = torch.einsum("bnhd,had->bhna", hid, self.wa) + self.ba[None, :, None, :]  # [b, h/tp, n, a]
        fb = torch.einsum("bnhd,hcd->bhnc", hid, self.wb) + self.bb[None, :, None, :]  # [b, h/tp, n, b]
        # column j = i_a * b + i_b: A repeated (each element b times), B tiled (whole vector a times)
        logits = (fa[..., :, None] * fb[..., None, :]).flatten(-2)  # [b, h/tp, n, N]
        return logits[..., :m]


class Random(nn.Module):
    """A learned (or fixed) N x N logit matrix per head, independent of the input."""

    def __init__(self, cfg: ModelConfig, tp_rank: int, tp: int, trainable: bool) -> None:
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


class FactorizedRandom(nn.Module):
    """R_h = R1_h R2_h^T with R1, R2 in R^{N x k}: 2 N k parameters per head instead of N^2."""

    def __init__(self, cfg: ModelConfig, tp_rank: int, tp: int) -> None:
        super().__init__()
        n, k, h = cfg.max_length, cfg.factorized_k, cfg.num_heads
        std = cfg.initializer_factor * k**-0.25  # t5: entries of R1 R2^T then have unit variance, like `random`

        def draw() -> torch.Tensor:  # mesh_tf: as Mesh TF's "factorized" R1, R2 [k, heads, memory_length]
            if cfg.synthesizer_init == "mesh_tf":
                return mesh_tf_glorot((h, n, k), (k, h, n))
            return torch.randn(h, n, k) * std

        self.r1 = head_parameter(draw(), tp_rank, tp)  # [heads, N, k]
        self.r2 = head_parameter(draw(), tp_rank, tp)

    def forward(self, x: torch.Tensor, start: int, m: int) -> torch.Tensor:
        n = x.shape[1]
        return (self.r1[:, start : start + n] @ self.r2[:, :m].transpose(1, 2))[None]  # [1, heads/tp, n, m]


def _dense_kernel(cfg: ModelConfig, shape: tuple[int, ...]) -> torch.Tensor:
    """W2 of dense, W_A and W_B of factorized_dense ([heads, out, d_kv]): T5's normal of std 1/sqrt(d_kv), or under
    mesh_tf Mesh TF's dense kernel (factorized_dense, which Mesh TF lacks, takes dense's)."""
    if cfg.synthesizer_init == "mesh_tf":
        return mesh_tf_dense_kernel(shape, fan_in=cfg.d_kv)
    return torch.randn(shape) * cfg.initializer_factor * cfg.d_kv**-0.5


def build_synthesizer(name: str, cfg: ModelConfig, mp_config, tp_rank: int, tp: int) -> nn.Module:
    if name == "dense":
        return Dense(cfg, mp_config, tp_rank, tp)
    if name == "factorized_dense":
        return FactorizedDense(cfg, mp_config, tp_rank, tp)
    if name in ("random", "fixed_random"):
        return Random(cfg, tp_rank, tp, trainable=name == "random")
    if name == "factorized_random":
        return FactorizedRandom(cfg, tp_rank, tp)
    raise AssertionError(f"not a synthesizer: {name}")
