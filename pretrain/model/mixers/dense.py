"""`dense`: the Dense Synthesizer, F_h(x) = W2_h relu(W1_h x + b1_h) + b2_h gives each token its row of N logits;
and the hidden projection and kernel init it shares with `factorized_dense`."""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from pretrain.core.config import ModelConfig
from pretrain.model.layers import ColumnLinear, head_parameter
from pretrain.model.mixers.mesh_tf import mesh_tf_dense_kernel
from pretrain.model.mixers.mixer import Mixer


class HiddenProjection(nn.Module):
    """First layer shared by the dense forms: relu(W1_h x + b1_h) per head, a column-parallel linear. Under mesh_tf
    W1 starts as Mesh TF's W1 does, which is the query projection (T5's init, 1/sqrt(d_kv) folded in)."""

    def __init__(self, cfg: ModelConfig, mp_config) -> None:
        super().__init__()
        fan = cfg.d_model * (cfg.d_kv if cfg.synthesizer_init == "mesh_tf" else 1)
        std = cfg.initializer_factor * fan**-0.5
        self.w1 = ColumnLinear(
            cfg.d_model, cfg.num_heads * cfg.d_kv, config=mp_config, bias=True, gather_output=False,
            init_method=lambda w: nn.init.normal_(w, 0.0, std),
        )
        self.d_kv = cfg.d_kv

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, n, _ = x.shape
        return F.relu(self.w1(x)).view(b, n, -1, self.d_kv)  # [b, n, heads/tp, d_kv]


def dense_kernel(cfg: ModelConfig, shape: tuple[int, ...]) -> torch.Tensor:
    """W2 of dense, W_A and W_B of factorized_dense ([heads, out, d_kv]): T5's normal of std 1/sqrt(d_kv), or under
    mesh_tf Mesh TF's dense kernel (factorized_dense, which Mesh TF lacks, takes dense's)."""
    if cfg.synthesizer_init == "mesh_tf":
        return mesh_tf_dense_kernel(shape, fan_in=cfg.d_kv)
    return torch.randn(shape) * cfg.initializer_factor * cfg.d_kv**-0.5


class Dense(nn.Module):
    """F_h(x) = W2_h relu(W1_h x + b1_h) + b2_h: each token synthesizes its row of N logits."""

    def __init__(self, cfg: ModelConfig, mp_config, tp_rank: int, tp: int) -> None:
        super().__init__()
        self.hidden = HiddenProjection(cfg, mp_config)
        n, h = cfg.max_length, cfg.num_heads
        self.w2 = head_parameter(dense_kernel(cfg, (h, n, cfg.d_kv)), tp_rank, tp)  # [heads, N, d_kv]
        self.b2 = head_parameter(torch.zeros(h, n), tp_rank, tp)  # [heads, N]

    def forward(self, x: torch.Tensor, start: int, m: int) -> torch.Tensor:
        hid = self.hidden(x)  # [b, n, heads/tp, d_kv]
        # only the first m of the N outputs are ever used: slicing W2 first saves (N - m) / N of the GEMM
        logits = torch.einsum("bnhd,hmd->bhnm", hid, self.w2[:, :m])
        return logits + self.b2[None, :, None, :m]  # [b, heads/tp, n, m]

    def factors(self, x: torch.Tensor, start: int, m: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(Q' [b, heads/tp, n, d_kv + 1], K' [1, heads/tp, m, d_kv + 1]) with Q' K'^T = forward's logits:
        Q' = [relu(W1 x + b1), 1], K' = [W2[:m], b2[:m]], K' shared by the batch (the fused kernels' form)."""
        hid = self.hidden(x).transpose(1, 2)  # [b, heads/tp, n, d_kv]
        q = torch.cat([hid, hid.new_ones(*hid.shape[:-1], 1)], dim=-1)
        k = torch.cat([self.w2[:, :m], self.b2[:, :m, None]], dim=-1)[None]
        return q, k


def _flops(cfg: ModelConfig, n: int) -> int:
    inner = cfg.num_heads * cfg.d_kv
    return 2 * n * cfg.d_model * inner + 2 * n * inner * n  # W1; W2 sliced to n keys


DENSE = Mixer("dense", "Dense Synthesizer: each token synthesizes its row of N logits, W2 relu(W1 x + b1) + b2",
              _flops, Dense)
