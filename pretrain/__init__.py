"""Synthesizer/T5 pretraining and fine-tuning (see README.md).

megatron-core warns at import, once per module, that Transformer Engine and Apex are missing and it falls back to
its local implementations: four lines from every process of every job, not actionable (the fallbacks are what
this project uses). The filter is installed here, before any of our modules imports megatron.
"""
import warnings

warnings.filterwarnings("ignore", message="Transformer Engine and Apex are not installed", category=UserWarning)
