"""What each mixer file declares to the registry (`pretrain.model.mixers.MIXERS`): a `Mixer`, the one place its
name, model-card line, FLOPs, module and picture live. Parsing, the model, the planner's FLOPs, the model card
and the TensorBoard pictures read it; the remote code of exports is checked against it (tests/test_mixers.py)."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Mapping

import torch
from torch import nn

from pretrain.core.config import ModelConfig


@dataclass(frozen=True)
class Mixer:
    name: str  # as model.encoder_attention / model.decoder_attention spell it
    text: str  # its line in an export's model card
    # forward matmul FLOPs (2 m n k) of its logits for one sequence of n tokens, beyond what every mixer has: the V
    # and output projections and probs @ V (pretrain/model/flops.py)
    flops: Callable[[ModelConfig, int], int]
    # (cfg, mp_config, tp_rank, tp) -> a module whose forward(x [b, n, d], start, m) gives this rank's heads' logits
    # [b|1, heads/tp, n, m] for query positions [start, start + n) and the first m keys; None for vanilla, whose
    # Q K^T is SelfAttention's own (fused QKV, SDPA). A module whose logits are a product Q' K'^T of small factors
    # also has factors(x, start, m) -> (Q' [b|1, heads/tp, n, r], K' [1|b, heads/tp, m, r]): the layer then runs it
    # through the fused attention kernels (pretrain/model/attention.py) instead of materialising its logits
    build: Callable[[ModelConfig, object, int, int], nn.Module] | None = None
    # its input-independent logit matrix [heads, N, N] from its parameters by name ({"r": R}, our state dict or an
    # export's): the picture TensorBoard shows and the study's weight movement measures; None: nothing to picture
    matrix: Callable[[Mapping[str, torch.Tensor]], torch.Tensor] | None = None
