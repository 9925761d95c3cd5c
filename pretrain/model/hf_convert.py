"""Our full (TP=1) state dict <-> HuggingFace `T5ForConditionalGeneration` (v1.1: gated-gelu, untied).

Only vanilla models map onto HF's T5 weights (pretrain.export adds the Synthesizer parameters); `hf_config`
gives Synthesizer models `SynthesizerT5Config` (model_type "synthesizer_t5", remote code in
`pretrain/model/hf_synthesizer/`). Layout differences: our fused Q/K/V rows are ordered [head, (q, k, v),
d_kv], HF keeps q, k, v apart; our fused FFN input is [wi_0; wi_1]; our relative bias is [heads, buckets],
HF's embedding is [buckets, heads]; HF's `encoder/decoder.embed_tokens` are `shared`. The HF dict saved as
model.safetensors next to `hf_config(cfg).save_pretrained(dir)` loads with `from_pretrained(dir)`.
"""
from __future__ import annotations

import dataclasses
from typing import Callable

import torch
from transformers import T5Config

from pretrain.config import ModelConfig
from pretrain.model.hf_synthesizer.configuration_synthesizer_t5 import SynthesizerT5Config

# the HF tensors one of our parameters is made of, and how they combine into it
Source = tuple[tuple[str, ...], Callable[[list[torch.Tensor]], torch.Tensor]]


def hf_config(cfg: ModelConfig) -> T5Config:
    """T5Config for vanilla models; SynthesizerT5Config (T5Config plus the mixers) for the others."""
    t5 = dict(
        vocab_size=cfg.vocab_size, d_model=cfg.d_model, d_kv=cfg.d_kv, d_ff=cfg.d_ff, num_layers=cfg.num_layers,
        num_decoder_layers=cfg.num_decoder_layers, num_heads=cfg.num_heads,
        relative_attention_num_buckets=cfg.relative_attention_num_buckets,
        relative_attention_max_distance=cfg.relative_attention_max_distance, dropout_rate=cfg.dropout,
        layer_norm_epsilon=cfg.layer_norm_eps, initializer_factor=cfg.initializer_factor,
        feed_forward_proj="gated-gelu", tie_word_embeddings=False, is_encoder_decoder=True,
        # transformers 5.x needs these explicitly for labels= to work
        decoder_start_token_id=0, pad_token_id=0, eos_token_id=1,
    )
    if (cfg.encoder_attention, cfg.decoder_attention) == ("vanilla", "vanilla"):
        config = T5Config(**t5)
    else:
        config = SynthesizerT5Config(
            **t5, encoder_attention=cfg.encoder_attention, decoder_attention=cfg.decoder_attention,
            synthesizer_length=cfg.max_length, factorized_k=cfg.factorized_k, mixture_per_head=cfg.mixture_per_head,
        )
    # transformers 5.x reads tie_word_embeddings=False as "v1.1: do not scale the decoder output" and then
    # ties anyway; a checkpoint whose lm_head differs from `shared` is loaded untied by from_pretrained
    assert not config.scale_decoder_outputs
    return config


def vanilla_layout(cfg: ModelConfig) -> ModelConfig:
    """`cfg` with dot-product self-attention everywhere: the T5 layout of a Synthesizer model's shared parts."""
    return dataclasses.replace(cfg, encoder_attention="vanilla", decoder_attention="vanilla")


def _check_vanilla(cfg: ModelConfig) -> None:
    if cfg.encoder_attention != "vanilla" or cfg.decoder_attention != "vanilla":
        raise ValueError(
            f"only vanilla models have a HuggingFace T5 layout; this one has encoder '{cfg.encoder_attention}', "
            f"decoder '{cfg.decoder_attention}'"
        )


def _layers(cfg: ModelConfig):
    """(stack, our layer prefix, HF layer prefix, index of the FFN sub-layer in HF's block) per layer."""
    for stack, num in (("encoder", cfg.num_layers), ("decoder", cfg.num_decoder_layers)):
        for i in range(num):
            yield stack, f"{stack}.layers.{i}", f"{stack}.block.{i}.layer", 2 if stack == "decoder" else 1


def _pairs(cfg: ModelConfig) -> list[tuple[str, str]]:
    """(our name, HF name) for parameters that map one to one."""
    pairs = [("embed.weight", "shared.weight"), ("lm_head.weight", "lm_head.weight")]
    pairs += [(f"{stack}.final_norm.weight", f"{stack}.final_layer_norm.weight") for stack in ("encoder", "decoder")]
    for stack, ours, hf, ffn in _layers(cfg):
        pairs += [
            (f"{ours}.attn_norm.weight", f"{hf}.0.layer_norm.weight"),
            (f"{ours}.attn.o.weight", f"{hf}.0.SelfAttention.o.weight"),
            (f"{ours}.ffn_norm.weight", f"{hf}.{ffn}.layer_norm.weight"),
            (f"{ours}.ffn.wo.weight", f"{hf}.{ffn}.DenseReluDense.wo.weight"),
        ]
        if stack == "decoder":
            pairs += [
                (f"{ours}.cross_norm.weight", f"{hf}.1.layer_norm.weight"),
                (f"{ours}.cross.q.weight", f"{hf}.1.EncDecAttention.q.weight"),
                (f"{ours}.cross.o.weight", f"{hf}.1.EncDecAttention.o.weight"),
            ]
    return pairs


def to_hf_state_dict(state: dict[str, torch.Tensor], cfg: ModelConfig) -> dict[str, torch.Tensor]:
    _check_vanilla(cfg)
    h, dkv, d = cfg.num_heads, cfg.d_kv, cfg.d_model
    out = {hf: state[ours].clone() for ours, hf in _pairs(cfg)}
    # separate copies: safetensors refuses tensors that share storage
    out["encoder.embed_tokens.weight"] = out["shared.weight"].clone()
    out["decoder.embed_tokens.weight"] = out["shared.weight"].clone()
    for stack in ("encoder", "decoder"):
        bias = state[f"{stack}.relative_bias.weight"]  # [heads, buckets]
        out[f"{stack}.block.0.layer.0.SelfAttention.relative_attention_bias.weight"] = bias.t().contiguous()
    for stack, ours, hf, ffn in _layers(cfg):
        q, k, v = state[f"{ours}.attn.qkv.weight"].view(h, 3, dkv, d).unbind(1)
        for name, t in zip("qkv", (q, k, v)):
            out[f"{hf}.0.SelfAttention.{name}.weight"] = t.reshape(h * dkv, d).clone()
        wi_0, wi_1 = state[f"{ours}.ffn.wi.weight"].chunk(2, dim=0)
        out[f"{hf}.{ffn}.DenseReluDense.wi_0.weight"] = wi_0.clone()
        out[f"{hf}.{ffn}.DenseReluDense.wi_1.weight"] = wi_1.clone()
        if stack == "decoder":
            k, v = state[f"{ours}.cross.kv.weight"].view(h, 2, dkv, d).unbind(1)
            out[f"{hf}.1.EncDecAttention.k.weight"] = k.reshape(h * dkv, d).clone()
            out[f"{hf}.1.EncDecAttention.v.weight"] = v.reshape(h * dkv, d).clone()
    return out


def hf_sources(cfg: ModelConfig) -> dict[str, Source]:
    """Our parameter name -> (the HF tensors it is made of, how they combine), for a vanilla model: the one
    statement of the HF -> ours layout, applied to a whole state dict (`from_hf_state_dict`) or one tensor at a
    time (pretrain.model.pretrained)."""
    h, dkv, d = cfg.num_heads, cfg.d_kv, cfg.d_model

    def heads(ts: list[torch.Tensor]) -> torch.Tensor:  # q, k, v (or k, v) [heads x d_kv, d] -> [head, (q, k, v), d_kv] rows
        return torch.stack([t.view(h, dkv, d) for t in ts], dim=1).reshape(len(ts) * h * dkv, d)

    def one(ts: list[torch.Tensor]) -> torch.Tensor:
        return ts[0]

    out: dict[str, Source] = {ours: ((hf,), one) for ours, hf in _pairs(cfg)}
    for stack in ("encoder", "decoder"):
        out[f"{stack}.relative_bias.weight"] = (  # HF's [buckets, heads] -> ours [heads, buckets]
            (f"{stack}.block.0.layer.0.SelfAttention.relative_attention_bias.weight",), lambda ts: ts[0].t().contiguous())
    for stack, ours, hf, ffn in _layers(cfg):
        out[f"{ours}.attn.qkv.weight"] = (tuple(f"{hf}.0.SelfAttention.{n}.weight" for n in "qkv"), heads)
        out[f"{ours}.ffn.wi.weight"] = ((f"{hf}.{ffn}.DenseReluDense.wi_0.weight",
                                         f"{hf}.{ffn}.DenseReluDense.wi_1.weight"), torch.cat)
        if stack == "decoder":
            out[f"{ours}.cross.kv.weight"] = (tuple(f"{hf}.1.EncDecAttention.{n}.weight" for n in "kv"), heads)
    return out


def from_hf_state_dict(hf_state: dict[str, torch.Tensor], cfg: ModelConfig) -> dict[str, torch.Tensor]:
    _check_vanilla(cfg)
    return {ours: combine([hf_state[n] for n in names]) for ours, (names, combine) in hf_sources(cfg).items()}
