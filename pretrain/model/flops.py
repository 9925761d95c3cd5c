"""Model FLOPs for MFU: matmuls counted as 2 m n k, training = forward + backward = 3 x forward.

Softmax, norms and elementwise work are not counted (the usual MFU convention); neither is activation
recompute (model FLOPs, not hardware FLOPs). Synthesized logits are counted as the matmuls that
produce them for the needed [n, m] slice, as each mixer declares them (`Mixer.flops`).
"""
from __future__ import annotations

from pretrain.core.config import ModelConfig
from pretrain.model.mixers import MIXERS, parse_mixers


def _self_attention(cfg: ModelConfig, spec: str, n: int) -> float:
    inner = cfg.num_heads * cfg.d_kv
    flops = 2 * n * cfg.d_model * inner * 2  # V projection and output projection
    flops += 2 * n * n * inner  # probs @ V
    return flops + sum(MIXERS[name].flops(cfg, n) for name in parse_mixers(spec))  # each mixer's logits


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
