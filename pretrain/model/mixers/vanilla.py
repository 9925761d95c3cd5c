"""`vanilla`: T5's dot-product attention, Q K^T with the 1/sqrt(d_kv) folded into the query's init. Its projections
and logits are `pretrain.model.attention.SelfAttention`'s own (fused Q, K, V; the SDPA path); this is its entry."""
from __future__ import annotations

from pretrain.core.config import ModelConfig
from pretrain.model.mixers.mixer import Mixer


def _flops(cfg: ModelConfig, n: int) -> int:
    inner = cfg.num_heads * cfg.d_kv
    return 2 * n * cfg.d_model * 2 * inner + 2 * n * n * inner  # Q, K projections; Q K^T


VANILLA = Mixer("vanilla", "dot-product attention (T5's q k^T)", _flops)
