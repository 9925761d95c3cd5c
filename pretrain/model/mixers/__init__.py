"""The registry of attention mixers, `MIXERS` (name -> `Mixer`), and the parsing of mixer specs
("random+vanilla"). Each mixer is one file here declaring its `Mixer` (mixer.py): `vanilla` (dot-product, whose
logits are `pretrain.model.attention.SelfAttention`'s own) and the Synthesizer logit generators (Tay et al. 2021,
arXiv 2005.00743), per-head logits over key positions that do not come from query-key dot products.
docs/model.md, "Adding a mixer", says what a new one takes.

Every generator builds logits for the maximum length N (`model.max_length`) and slices them to the rows
of the current query positions and the first m key columns, as the Mesh TensorFlow reference does. All
parameters are per head with the head dimension first, drawn in full on every rank from the global RNG
(so TP=N and TP=1 start identical) and sliced to this rank's heads: column-like, concatenated over TP
along dim 0. `model.synthesizer_init` picks their initialisers: `t5` (T5's scale: initial logits of std 0.5-1,
like vanilla's) or `mesh_tf` (Mesh TensorFlow's `synthetic_attention`: near-uniform attention at the start);
docs/model.md, "Initial scale", has both and the initial logit std they give.
"""
from __future__ import annotations

from pretrain.core.config import UsageError
from pretrain.model.mixers.dense import DENSE
from pretrain.model.mixers.factorized_dense import FACTORIZED_DENSE
from pretrain.model.mixers.factorized_random import FACTORIZED_RANDOM
from pretrain.model.mixers.mixer import Mixer
from pretrain.model.mixers.random import FIXED_RANDOM, RANDOM
from pretrain.model.mixers.vanilla import VANILLA

# the order error messages, model cards and benchmarks list them in
MIXERS: dict[str, Mixer] = {m.name: m for m in (VANILLA, DENSE, RANDOM, FIXED_RANDOM, FACTORIZED_DENSE,
                                                FACTORIZED_RANDOM)}


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
