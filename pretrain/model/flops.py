"""Model FLOPs for MFU: matmuls counted as 2 m n k, training = forward + backward = 3 x forward.

Softmax, norms and elementwise work are not counted (the usual MFU convention); neither is activation
recompute (model FLOPs, not hardware FLOPs). Synthesized logits are counted as the matmuls that
produce them for the needed [n, m] slice.
"""
from __future__ import annotations

from pretrain.core.config import ModelConfig
from pretrain.model.mixers import parse_mixers
from pretrain.model.mixers.factorized_dense import factor_pair


def _self_attention(cfg: ModelConfig, spec: str, n: int) -> float:
    d, h, k = cfg.d_model, cfg.num_heads, cfg.factorized_k
    inner = h * cfg.d_kv
    mixers = parse_mixers(spec)
    flops = 2 * n * d * inner * 2  # V projection and output projection
    flops += 2 * n * n * inner  # probs @ V
    for name in mixers:
        if name == "vanilla":
            flops += 2 * n * d * 2 * inner + 2 * n * n * inner  # Q, K projections; Q K^T
        elif name == "dense":
            flops += 2 * n * d * inner + 2 * n * inner * n  # W1; W2 sliced to n keys
        elif name == "factorized_dense":
            a, b = factor_pair(cfg.max_length)
            flops += 2 * n * d * inner + 2 * n * inner * (a + b)
        elif name == "factorized_random":
            flops += 2 * h * n * n * k  # R1 R2^T
    return flops


def flops_per_sequence(cfg: ModelConfig, input_length: int, target_length: int) -> float:
    """Training FLOPs of one (input_length, target_length) example: 3 x the forward matmuls."""
    d, n, m = cfg.d_model, input_length, target_length
    inner = cfg.num_heads * cfg.d_kv
    ffn = lambda t: 2 * t * d * 2 * cfg.d_ff + 2 * t * cfg.d_ff * d  # noqa: E731  gated: wi_0, wi_1, wo
    encoder = cfg.num_layers * (_self_attention(cfg, cfg.encoder_attention, n) + ffn(n))
    cross = 2 * m * d * inner + 2 * n * d * 2 * inner + 2 * 2 * m * n * inner + 2 * m * inner * d
    decoder = cfg.num_decoder_layers * (_self_attention(cfg, cfg.decoder_attention, m) + cross + ffn(m))
    lm_head = 2 * m * d * cfg.vocab_size
    return 3.0 * (encoder + decoder + lm_head)
