"""The files transformers reads beside an export's weights: config.json, generation_config.json, tokenizer.json
and tokenizer_config.json, written so that transformers 4.57 (the last 4.x) and 5.x read them alike
(tests/test_hf_versions.py loads exports in both), with the model's length limit where HF looks for one.

Where transformers 5 writes what 4.x reads otherwise:
- config.json `tie_word_embeddings`: 5.x sets it true on every T5Config and writes it out; 4.x then ties lm_head to
  the input embedding and scales the decoder output by d_model^-0.5 (the tiny vanilla export's logits off by 0.93
  relative, greedy [208]*8). v1.1's lm_head is its own: written false, which 5.x reads as "do not scale the
  decoder output" (it then ties nothing that the checkpoint holds with other values).
- tokenizer_config.json: 5.x lists the sentinels as `extra_special_tokens`, a name 4.x reads as a dict of named
  tokens ("AttributeError: 'list' object has no attribute 'keys'"); `additional_special_tokens` is read by both.
Length: `model_max_length` (HF's default 1e30: truncation=True cut nothing) and generation's `max_length` (HF's
default 20, so generate ran past N and crashed partway) are `model.max_length`, which a Synthesizer cannot exceed.
"""
from __future__ import annotations

import json
import shutil
from pathlib import Path

from transformers import GenerationConfig, T5Config

from pretrain.model.pretrained import CONFIG, SPIECE
from tokenizer.spm import EOS_ID, NUM_SENTINELS, PAD_ID

TOKENIZER_CONFIG = "tokenizer_config.json"


def write_config(config: T5Config, folder: Path) -> None:
    """config.json, with tie_word_embeddings false (see the module docstring)."""
    config.save_pretrained(str(folder))
    saved = json.loads((folder / CONFIG).read_text())
    (folder / CONFIG).write_text(json.dumps({**saved, "tie_word_embeddings": False}, indent=2, sort_keys=True) + "\n")


def write_generation_config(folder: Path, max_length: int) -> None:
    """generation_config.json: T5's special ids, and generation stops at the model's length."""
    GenerationConfig(decoder_start_token_id=PAD_ID, eos_token_id=EOS_ID, pad_token_id=PAD_ID,
                     max_length=max_length).save_pretrained(str(folder))


def write_tokenizer(spiece: Path, folder: Path, max_length: int) -> None:
    """spiece.model, tokenizer.json (HF's conversion of it, done once here rather than on every load) and a
    tokenizer_config.json that 4.x's T5Tokenizer/T5TokenizerFast and 5.x's read alike."""
    from transformers import T5Tokenizer

    shutil.copyfile(spiece, folder / SPIECE)
    T5Tokenizer.from_pretrained(str(folder), extra_ids=NUM_SENTINELS).save_pretrained(str(folder))
    config = {
        "tokenizer_class": "T5Tokenizer",
        "pad_token": "<pad>", "eos_token": "</s>", "unk_token": "<unk>",
        "extra_ids": NUM_SENTINELS,
        "additional_special_tokens": [f"<extra_id_{i}>" for i in range(NUM_SENTINELS)],
        "model_max_length": max_length,
        "legacy": True,  # 4.x's sentencepiece T5Tokenizer: the behaviour whose ids are tested (and no warning)
    }
    (folder / TOKENIZER_CONFIG).write_text(json.dumps(config, indent=2) + "\n")
