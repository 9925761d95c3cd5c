"""HF's T5Model (the encoder-decoder without the LM head) with Synthesizer self-attention: what
`AutoModel.from_pretrained(EXPORT, trust_remote_code=True)` gives for a Synthesizer export, as T5Model for a T5.

Part of a Synthesizer export made by `python -m pretrain.export`, beside modeling_synthesizer_t5.py (whose
attention it uses: the relative imports resolve in the export folder, not in this package). The attention layers
are set as SynthesizerT5ForConditionalGeneration sets them; tests/test_export.py holds its outputs to our model's.
"""
from transformers import T5Model

from .configuration_synthesizer_t5 import SynthesizerT5Config
from .modeling_synthesizer_t5 import SynthesizerT5Attention, bias_placement


class SynthesizerT5Model(T5Model):
    """T5Model whose self-attention layers are `SynthesizerT5Attention`; the export's lm_head is not read."""

    config_class = SynthesizerT5Config
    config: SynthesizerT5Config
    _keys_to_ignore_on_load_unexpected = [*T5Model._keys_to_ignore_on_load_unexpected, r"^lm_head\."]
    # synthesized logits are computed here, not by an attention kernel: masks must be eager's additive floats
    _supports_sdpa = False
    _supports_flex_attn = False

    def __init__(self, config: SynthesizerT5Config) -> None:
        super().__init__(config)
        for stack, spec in ((self.encoder, config.encoder_attention), (self.decoder, config.decoder_attention)):
            mixers = tuple(spec.split("+"))
            placement = bias_placement(config.position_bias, mixers)
            for i, block in enumerate(stack.block):
                block.layer[0].SelfAttention = SynthesizerT5Attention(stack.config, mixers, i == 0 and bool(placement),
                                                                      i, placement == "vanilla")
        self.post_init()
