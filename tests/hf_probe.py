"""What a HuggingFace user gets from export folders under whichever transformers runs this file: logits of a fixed
padded batch, cached greedy tokens, the token ids of a text from AutoTokenizer, T5TokenizerFast and T5Tokenizer, the
length limits, and whether resize_token_embeddings keeps the trained lm_head. Imports only torch and transformers:
tests/test_hf_users.py runs it with the project's interpreter (transformers 5) and with conftest's
transformers4_python (4.57).

    python tests/hf_probe.py OUT.pt UNTIE FOLDER...   # UNTIE: the card's line run before resizing a plain T5
"""
from __future__ import annotations

import sys

import torch
import transformers
from transformers import AutoModelForSeq2SeqLM, AutoTokenizer, T5Tokenizer, T5TokenizerFast

TEXT = "The quick brown fox <extra_id_0> over 12 lazy dogs.  Two  spaces, émigré naïve <extra_id_99>x"


def batch(vocab: int = 1100) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Encoder ids [3, 12] with one padded row, their mask, decoder ids [3, 7]."""
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(2, vocab, (3, 12), generator=g)
    mask = torch.ones_like(ids)
    mask[1, 9:] = 0
    return ids.masked_fill(mask == 0, 0), mask, torch.randint(2, vocab, (3, 7), generator=g)


@torch.no_grad()
def probe(folder: str, untie: str) -> dict:
    model = AutoModelForSeq2SeqLM.from_pretrained(folder, trust_remote_code=True).eval()
    ids, mask, dec = batch()
    found = {
        "logits": model(input_ids=ids, attention_mask=mask, decoder_input_ids=dec).logits,
        "greedy": model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=12, do_sample=False),
        "generation_max_length": model.generation_config.max_length,
    }
    # named here: in transformers 5, T5TokenizerFast is T5Tokenizer (tokenizers-backed); in 4.x, T5Tokenizer is
    # the sentencepiece one
    classes = {"AutoTokenizer": AutoTokenizer, "T5TokenizerFast": T5TokenizerFast, "T5Tokenizer": T5Tokenizer}
    for name, cls in classes.items():
        tokenizer = cls.from_pretrained(folder, trust_remote_code=True)
        found[name] = tokenizer(TEXT).input_ids
        found[f"{name}.model_max_length"] = tokenizer.model_max_length
        found[f"{name}.truncated"] = len(tokenizer(TEXT * 20, truncation=True).input_ids)
    trained = model.lm_head.weight.clone()
    if model.config.model_type == "t5":
        exec(untie)  # the workaround the card of a plain T5 export gives
    model.resize_token_embeddings(trained.shape[0] + 10)
    model.tie_weights()
    found["lm_head_kept"] = (torch.equal(model.lm_head.weight[: len(trained)], trained)
                             and model.lm_head.weight is not model.shared.weight)
    return found


if __name__ == "__main__":
    out, untie, *folders = sys.argv[1:]
    torch.save({"version": transformers.__version__, **{f: probe(f, untie) for f in folders}}, out)
