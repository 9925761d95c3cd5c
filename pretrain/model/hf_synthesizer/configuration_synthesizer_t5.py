"""Config of a T5 v1.1 model whose self-attention mixes dot-product and Synthesizer logits
(model_type "synthesizer_t5"): HF's T5Config plus which mixers each stack uses.

Part of a Synthesizer export made by `python -m pretrain.export`; self-contained (torch + transformers).
"""
from huggingface_hub.dataclasses import strict
from transformers import T5Config

MIXERS = ("vanilla", "dense", "random", "fixed_random", "factorized_dense", "factorized_random")


@strict
class SynthesizerT5Config(T5Config):
    """Args beyond T5Config:
    encoder_attention / decoder_attention: a mixer or a mixture "a+b[+c]" of MIXERS ("vanilla" is dot-product).
    synthesizer_length: N; synthesized logits are N x N, sliced to the sequence (longer ones are refused).
    factorized_k: rank k of factorized_random (R1 R2^T with R1, R2 in R^{N x k}).
    mixture_per_head: one mixture weight vector per head instead of one per layer.
    """

    model_type = "synthesizer_t5"

    encoder_attention: str = "vanilla"
    decoder_attention: str = "vanilla"
    synthesizer_length: int = 512
    factorized_k: int = 8
    mixture_per_head: bool = False

    def __post_init__(self, **kwargs):
        for key in ("encoder_attention", "decoder_attention"):
            names = getattr(self, key).split("+")
            if any(name not in MIXERS for name in names) or len(set(names)) != len(names):
                raise ValueError(f"{key} '{getattr(self, key)}': expected distinct names of {', '.join(MIXERS)} "
                                 f"joined by '+'")
        super().__post_init__(**kwargs)
