"""Our vanilla model is HF's T5ForConditionalGeneration (v1.1): weights copied both ways, same logits/loss.

Every parameter that starts constant (RMSNorm weights at 1; in Synthesizer models also mixture logits and biases
at 0) is randomised first, so a swapped mapping (attention norm <-> FFN norm, mixer order) changes the logits."""
from __future__ import annotations

import dataclasses

import torch
from safetensors.torch import save_file
from transformers import T5ForConditionalGeneration

from pretrain.core.config import ModelConfig
from pretrain.model import build_local_model, full_state_dict, load_full_state_dict
from pretrain.model.hf_convert import from_hf_state_dict, hf_config, to_hf_state_dict

CFG = ModelConfig(vocab_size=256, d_model=32, d_ff=48, d_kv=8, num_heads=4, num_layers=2, num_decoder_layers=3,
                  max_length=32, relative_attention_num_buckets=8, relative_attention_max_distance=16)


def _batch(seed: int):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(2, 256, (3, 20), generator=g)
    mask = torch.ones_like(ids)
    mask[1, 13:] = 0  # padded encoder rows
    mask[2, 5:] = 0
    ids = ids.masked_fill(mask == 0, 0)
    labels = torch.randint(2, 256, (3, 9), generator=g)
    labels[2, 6:] = -100
    dec = torch.cat([torch.zeros(3, 1, dtype=torch.long), labels[:, :-1].clamp(min=0)], dim=1)
    return ids, mask, dec, labels


@torch.no_grad()
def randomize_constant_parameters(model: torch.nn.Module, seed: int = 0) -> None:
    """Distinct random values (0.5-1.5) for every parameter whose entries are all equal, e.g. norm weights."""
    g = torch.Generator().manual_seed(seed)
    for param in model.parameters():
        if param.numel() > 0 and bool((param == param.flatten()[0]).all()):
            param.copy_(torch.rand(param.shape, generator=g) + 0.5)


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).norm() / b.norm()).item()


def test_hf_weights_into_ours_give_same_logits_and_loss():
    torch.manual_seed(0)
    hf = T5ForConditionalGeneration(hf_config(CFG)).eval()
    # a fresh HF model has lm_head tied to `shared`; give it its own values, as v1.1 checkpoints have
    hf.lm_head.weight = torch.nn.Parameter(torch.randn_like(hf.lm_head.weight))
    randomize_constant_parameters(hf)
    ours = build_local_model(CFG).eval()
    load_full_state_dict(ours, from_hf_state_dict(hf.state_dict(), CFG))
    ids, mask, dec, labels = _batch(1)
    ref = hf(input_ids=ids, attention_mask=mask, decoder_input_ids=dec, labels=labels)
    out = ours(ids, mask, dec, labels)
    assert _rel(out.logits, ref.logits) < 1e-5
    assert abs(out.loss.item() - ref.loss.item()) / ref.loss.item() < 1e-5
    assert out.num_tokens.item() == (labels != -100).sum().item()


def test_our_weights_into_hf_via_safetensors_round_trip(tmp_path):
    torch.manual_seed(1)
    ours = build_local_model(CFG).eval()
    randomize_constant_parameters(ours)
    save_file(to_hf_state_dict(full_state_dict(ours), CFG), tmp_path / "model.safetensors")
    hf_config(CFG).save_pretrained(tmp_path)
    hf = T5ForConditionalGeneration.from_pretrained(tmp_path).eval()
    ids, mask, dec, labels = _batch(2)
    ref = hf(input_ids=ids, attention_mask=mask, decoder_input_ids=dec, labels=labels)
    out = ours(ids, mask, dec, labels)
    assert _rel(out.logits, ref.logits) < 1e-5
    assert abs(out.loss.item() - ref.loss.item()) / ref.loss.item() < 1e-5
    back = from_hf_state_dict(hf.state_dict(), CFG)
    assert all(torch.equal(back[k], v) for k, v in full_state_dict(ours).items())


def test_only_vanilla_converts():
    cfg = dataclasses.replace(CFG, encoder_attention="random+vanilla")
    try:
        to_hf_state_dict({}, cfg)
    except ValueError as e:
        assert "encoder 'random+vanilla'" in str(e)
    else:
        raise AssertionError("a Synthesizer model must not convert to HF T5")
