"""`factorized_random`: the Factorized Random Synthesizer, R_h = R1_h R2_h^T with R1, R2 in R^{N x k}."""
from __future__ import annotations

import torch
from torch import nn

from pretrain.core.config import ModelConfig
from pretrain.model.layers import head_parameter
from pretrain.model.mixers.mesh_tf import mesh_tf_glorot
from pretrain.model.mixers.mixer import Mixer


class FactorizedRandom(nn.Module):
    """R_h = R1_h R2_h^T with R1, R2 in R^{N x k}: 2 N k parameters per head instead of N^2."""

    def __init__(self, cfg: ModelConfig, mp_config, tp_rank: int, tp: int) -> None:
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

    def factors(self, x: torch.Tensor, start: int, m: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(Q' = R1[rows] [1, heads/tp, n, k], K' = R2[:m] [1, heads/tp, m, k]): Q' K'^T = forward's logits."""
        return self.r1[None, :, start : start + x.shape[1]], self.r2[None, :, :m]


FACTORIZED_RANDOM = Mixer(
    "factorized_random", "Factorized Random Synthesizer: R1 R2^T per head, R1, R2 in R^{N x k}",
    lambda cfg, n: 2 * cfg.num_heads * n * n * cfg.factorized_k,  # R1 R2^T
    FactorizedRandom, lambda p: p["r1"] @ p["r2"].transpose(1, 2),  # [heads, N, k] @ [heads, k, N]
)
