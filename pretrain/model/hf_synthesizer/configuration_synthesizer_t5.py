"""Config of a T5 v1.1 model whose self-attention mixes dot-product and Synthesizer logits
(model_type "synthesizer_t5"): HF's T5Config plus which mixers each stack uses.

Part of a Synthesizer export made by `python -m pretrain.export`; self-contained (torch + transformers). Written
the way transformers 4 configs are (an `__init__` taking the keys), which transformers 5 also accepts for remote
code; its T5Config is a strict dataclass that a `@strict` subclass would have to be too, and transformers 4's is not.
"""
from transformers import T5Config

# the names of pretrain.model.mixers.MIXERS in its order: a copy, as exports ship this file without that package
# (tests/test_mixers.py fails when they differ)
MIXERS = ("vanilla", "dense", "random", "fixed_random", "factorized_dense", "factorized_random")

# The keys beyond T5Config, each with the value a config.json without it means: the behaviour of the exports made
# before the key existed. A new key is one line here (and its use in modeling_synthesizer_t5.py).
SYNTHESIZER_DEFAULTS = {
    "encoder_attention": "vanilla",  # a mixer or a mixture "a+b[+c]" of MIXERS ("vanilla" is dot-product)
    "decoder_attention": "vanilla",
    "synthesizer_length": 512,  # N: synthesized logits are N x N, sliced to the sequence (longer ones are refused)
    "factorized_k": 8,  # rank k of factorized_random (R1 R2^T with R1, R2 in R^{N x k})
    "mixture_per_head": False,  # one mixture weight vector per head instead of one per layer
    # T5's relative bias: "all" (added to the mixed logits), "vanilla" (to q k^T alone, before mixing; no bias in a
    # layer without "vanilla"), "none" (nowhere: the paper's formula)
    "position_bias": "all",
    "synthesizer_init": "t5",  # how a fresh model draws its synthesizers: "t5" or "mesh_tf" (near-uniform attention)
}
CHOICES = {"position_bias": ("all", "vanilla", "none"), "synthesizer_init": ("mesh_tf", "t5")}


class SynthesizerT5Config(T5Config):
    """T5Config plus the keys of SYNTHESIZER_DEFAULTS."""

    model_type = "synthesizer_t5"

    def __init__(self, **kwargs) -> None:
        for key, default in SYNTHESIZER_DEFAULTS.items():
            setattr(self, key, kwargs.pop(key, default))
        for key in ("encoder_attention", "decoder_attention"):
            names = getattr(self, key).split("+")
            if any(name not in MIXERS for name in names) or len(set(names)) != len(names):
                raise ValueError(f"{key} '{getattr(self, key)}': expected distinct names of {', '.join(MIXERS)} "
                                 f"joined by '+'")
        for key, allowed in CHOICES.items():
            if getattr(self, key) not in allowed:
                raise ValueError(f"{key} '{getattr(self, key)}': expected one of {', '.join(allowed)}")
        super().__init__(**kwargs)

    def to_dict(self) -> dict:
        # v1.1's lm_head is its own. transformers 5 sets tie_word_embeddings true on every T5Config (and writes it
        # out), but reads a false one as "do not scale the decoder output"; transformers 4 reads true as "tie lm_head
        # to the embedding and scale": so config.json says false, also when a user's save_pretrained writes it
        return {**super().to_dict(), "tie_word_embeddings": False}
