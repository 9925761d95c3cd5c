"""Our full (TP=1) state dict <-> HuggingFace `T5ForConditionalGeneration` (v1.1: gated-gelu, untied).

Only vanilla models with T5's relative bias (`is_hf_t5`) map onto HF's T5 weights (pretrain.export adds the
Synthesizer parameters); `hf_config` gives the others `SynthesizerT5Config` (model_type "synthesizer_t5", remote
code in `pretrain/model/hf_synthesizer/`), vanilla ones with `model.position_bias: none` included: HF's T5 has no
way to leave the bias out. Layout differences: our fused Q/K/V rows are ordered [head, (q, k, v),
d_kv], HF keeps q, k, v apart; our fused FFN input is [wi_0; wi_1]; our relative bias is [heads, buckets],
HF's embedding is [buckets, heads]; HF's `encoder/decoder.embed_tokens` are `shared`. The HF dict saved as
model.safetensors next to `hf_config(cfg).save_pretrained(dir)` loads with `from_pretrained(dir)`.
"""
from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Callable

import torch

from pretrain.core.config import ModelConfig
from pretrain.model.attention import bias_placement
from pretrain.model.mixers import parse_mixers

if TYPE_CHECKING:
    from transformers import T5Config

# the HF tensors one of our parameters is made of, and how they combine into it
Source = tuple[tuple[str, ...], Callable[[list[torch.Tensor]], torch.Tensor]]
# the HF tensors one of our parameters becomes, and how it splits into them
Target = tuple[tuple[str, ...], Callable[[torch.Tensor], list[torch.Tensor]]]


def is_hf_t5(cfg: ModelConfig) -> bool:
    """Whether the model is HF's T5ForConditionalGeneration: dot-product self-attention everywhere, and T5's relative
    bias in both stacks (position_bias all or vanilla, the same function for a vanilla model)."""
    vanilla = (cfg.encoder_attention, cfg.decoder_attention) == ("vanilla", "vanilla")
    return vanilla and bias_placement(cfg.position_bias, ("vanilla",)) is not None


def hf_config(cfg: ModelConfig) -> T5Config:
    """T5Config for HF T5 models (`is_hf_t5`); SynthesizerT5Config (T5Config plus the mixers) for the others."""
    # imported where used: every training and fine-tuning process imports this module (weights from HF folders),
    # and transformers is ~1.2 s of CPU at its start-up (`python -c "import transformers"`) that only exports need
    from transformers import T5Config

    from pretrain.model.hf_synthesizer.configuration_synthesizer_t5 import SynthesizerT5Config

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
    if is_hf_t5(cfg):
        config = T5Config(**t5)
    else:
        config = SynthesizerT5Config(
            **t5, encoder_attention=cfg.encoder_attention, decoder_attention=cfg.decoder_attention,
            synthesizer_length=cfg.max_length, factorized_k=cfg.factorized_k, mixture_per_head=cfg.mixture_per_head,
            position_bias=cfg.position_bias, synthesizer_init=cfg.synthesizer_init,
        )
    # transformers 5.x reads tie_word_embeddings=False as "v1.1: do not scale the decoder output" and then
    # ties anyway; a checkpoint whose lm_head differs from `shared` is loaded untied by from_pretrained
    assert not config.scale_decoder_outputs
    return config


def vanilla_layout(cfg: ModelConfig) -> ModelConfig:
    """`cfg` with dot-product self-attention everywhere: the T5 layout of a Synthesizer model's shared parts."""
    return dataclasses.replace(cfg, encoder_attention="vanilla", decoder_attention="vanilla")


def _check_vanilla(cfg: ModelConfig) -> None:
    if not is_hf_t5(cfg):
        raise ValueError(
            f"only vanilla models with T5's relative bias have a HuggingFace T5 layout; this one has encoder "
            f"'{cfg.encoder_attention}', decoder '{cfg.decoder_attention}', position_bias '{cfg.position_bias}'"
        )


def _with_bias(cfg: ModelConfig) -> tuple[str, ...]:
    """The stacks that have a relative bias parameter (model.position_bias)."""
    specs = {"encoder": cfg.encoder_attention, "decoder": cfg.decoder_attention}
    return tuple(s for s, spec in specs.items() if bias_placement(cfg.position_bias, parse_mixers(spec)) is not None)


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


def hf_targets(cfg: ModelConfig) -> dict[str, Target]:
    """Our parameter name -> (the HF tensors it becomes, how it splits into them; views where the layout allows),
    for a vanilla model: the inverse of `hf_sources`, applied to a whole state dict (`to_hf_state_dict`) or one
    parameter at a time (pretrain.export)."""
    h, dkv, d = cfg.num_heads, cfg.d_kv, cfg.d_model

    def heads(t: torch.Tensor) -> list[torch.Tensor]:  # [head, (q, k, v), d_kv] rows -> q, k, v [heads x d_kv, d]
        return [part.reshape(h * dkv, d) for part in t.view(h, -1, dkv, d).unbind(1)]

    out: dict[str, Target] = {ours: ((hf,), lambda t: [t]) for ours, hf in _pairs(cfg)}
    # HF's `encoder/decoder.embed_tokens` are `shared`
    out["embed.weight"] = (("shared.weight", "encoder.embed_tokens.weight", "decoder.embed_tokens.weight"),
                           lambda t: [t, t, t])
    for stack in _with_bias(cfg):
        out[f"{stack}.relative_bias.weight"] = (  # ours [heads, buckets] -> HF's [buckets, heads]
            (f"{stack}.block.0.layer.0.SelfAttention.relative_attention_bias.weight",), lambda t: [t.t()])
    for stack, ours, hf, ffn in _layers(cfg):
        out[f"{ours}.attn.qkv.weight"] = (tuple(f"{hf}.0.SelfAttention.{n}.weight" for n in "qkv"), heads)
        out[f"{ours}.ffn.wi.weight"] = ((f"{hf}.{ffn}.DenseReluDense.wi_0.weight",
                                         f"{hf}.{ffn}.DenseReluDense.wi_1.weight"), lambda t: list(t.chunk(2)))
        if stack == "decoder":
            out[f"{ours}.cross.kv.weight"] = (tuple(f"{hf}.1.EncDecAttention.{n}.weight" for n in "kv"), heads)
    return out


def to_hf_state_dict(state: dict[str, torch.Tensor], cfg: ModelConfig) -> dict[str, torch.Tensor]:
    _check_vanilla(cfg)
    # separate contiguous copies: safetensors refuses tensors that share storage
    return {hf: part.clone(memory_format=torch.contiguous_format)
            for ours, (names, split) in hf_targets(cfg).items() for hf, part in zip(names, split(state[ours]))}


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
    for stack in _with_bias(cfg):
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
