"""HuggingFace remote code for Synthesizer exports: `configuration_synthesizer_t5.py` and
`modeling_synthesizer_t5.py` are copied verbatim into every Synthesizer export by `pretrain.export`, so
they import only torch and transformers (and each other, relatively)."""
