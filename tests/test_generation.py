"""Greedy decoding: the incremental cache gives the same tokens as full recomputation for every decoder
mixer, and a vanilla model decodes exactly as HuggingFace's `generate` with the same weights."""
from __future__ import annotations

import dataclasses

import pytest
import torch
from transformers import T5ForConditionalGeneration

from pretrain.core.config import ModelConfig
from pretrain.model import build_local_model, full_state_dict, generate_greedy
from pretrain.model.hf_convert import hf_config, to_hf_state_dict
from tests.registry import SPECS
from tests.test_hf_parity import randomize_constant_parameters

CFG = ModelConfig(vocab_size=256, d_model=32, d_ff=48, d_kv=8, num_heads=4, num_layers=2, num_decoder_layers=2,
                  max_length=16, factorized_k=3, relative_attention_num_buckets=8, relative_attention_max_distance=16)


def _inputs():
    g = torch.Generator().manual_seed(3)
    ids = torch.randint(2, 256, (3, 12), generator=g)
    mask = torch.ones_like(ids)
    mask[1, 7:] = 0
    return ids.masked_fill(mask == 0, 0), mask


@pytest.mark.parametrize("spec", SPECS)
def test_cached_equals_recomputed(spec):
    torch.manual_seed(0)
    model = build_local_model(dataclasses.replace(CFG, decoder_attention=spec, mixture_per_head=True)).eval()
    with torch.no_grad():
        model.lm_head.weight[1] += 0.5  # make EOS (id 1) likely so rows finish at different steps
    ids, mask = _inputs()
    cached = generate_greedy(model, ids, mask, max_new_tokens=CFG.max_length - 1)
    assert torch.equal(cached, generate_greedy(model, ids, mask, max_new_tokens=CFG.max_length - 1, use_cache=False))
    # same as taking the argmax of the teacher-forced logits of the produced sequence
    dec = torch.cat([torch.zeros(3, 1, dtype=torch.long), cached[:, :-1]], dim=1)
    expected = model(ids, mask, dec).logits.argmax(-1)
    finished = torch.cumsum((cached == 1).long(), dim=1) - (cached == 1).long() > 0  # after a row's EOS
    assert torch.equal(cached[~finished], expected[~finished]) and (cached[finished] == 0).all()


def test_greedy_decoding_projects_the_encoder_output_once_per_layer(monkeypatch):
    from pretrain.model.attention import CrossAttention

    torch.manual_seed(0)
    model = build_local_model(CFG).eval()
    calls = []
    original = CrossAttention.project_memory
    monkeypatch.setattr(CrossAttention, "project_memory", lambda self, memory: calls.append(1) or original(self, memory))
    ids, mask = _inputs()
    out = generate_greedy(model, ids, mask, max_new_tokens=5)
    assert out.shape[1] == 5 and len(calls) == CFG.num_decoder_layers  # not 5 decode steps x layers


def test_vanilla_greedy_equals_huggingface_generate(tmp_path):
    torch.manual_seed(0)
    ours = build_local_model(CFG).eval()
    randomize_constant_parameters(ours)  # distinct norm weights: a swapped norm mapping must show
    hf = T5ForConditionalGeneration(hf_config(CFG))
    hf.lm_head.weight = torch.nn.Parameter(torch.empty_like(hf.lm_head.weight))  # untie before loading
    hf.load_state_dict(to_hf_state_dict(full_state_dict(ours), CFG))
    ids, mask = _inputs()
    ref = hf.eval().generate(input_ids=ids, attention_mask=mask, max_new_tokens=10, do_sample=False, num_beams=1)
    out = generate_greedy(ours, ids, mask, max_new_tokens=10)
    assert torch.equal(out, ref[:, 1:])
