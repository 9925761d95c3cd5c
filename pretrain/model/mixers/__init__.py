"""The attention mixers: `vanilla` (dot-product, in `pretrain.model.attention`) and the Synthesizer logit
generators (Tay et al. 2021, arXiv 2005.00743), per-head logits over key positions that do not come from
query-key dot products; the mixer names and their parsing ("random+vanilla").

Every generator builds logits for the maximum length N (`model.max_length`) and slices them to the rows
of the current query positions and the first m key columns, as the Mesh TensorFlow reference does. All
parameters are per head with the head dimension first, drawn in full on every rank from the global RNG
(so TP=N and TP=1 start identical) and sliced to this rank's heads: column-like, concatenated over TP
along dim 0. `model.synthesizer_init` picks their initialisers: `t5` (T5's scale: initial logits of std 0.5-1,
like vanilla's) or `mesh_tf` (Mesh TensorFlow's `synthetic_attention`: near-uniform attention at the start);
docs/model.md, "Initial scale", has both and the initial logit std they give.
"""
from __future__ import annotations

from torch import nn

from pretrain.core.config import ModelConfig, UsageError
from pretrain.model.mixers.dense import Dense
from pretrain.model.mixers.factorized_dense import FactorizedDense
from pretrain.model.mixers.factorized_random import FactorizedRandom
from pretrain.model.mixers.random import Random

MIXERS = ("vanilla", "dense", "random", "fixed_random", "factorized_dense", "factorized_random")


def parse_mixers(spec: str, key: str = "attention") -> tuple[str, ...]:
    """'random+vanilla' -> ('random', 'vanilla'); a bad name is a one-line ValueError listing valid names."""
    names = tuple(spec.split("+"))
    for name in names:
        if name not in MIXERS:
            raise UsageError(
                f"{key} '{spec}': unknown mixer '{name}'; valid: {', '.join(MIXERS)}, or a mixture 'a+b[+c]'"
            )
    if len(set(names)) != len(names):
        raise UsageError(f"{key} '{spec}' names a mixer twice; a mixture lists distinct mixers")
    return names


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
