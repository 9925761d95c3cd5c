"""The T5 v1.1 encoder-decoder (HF `T5ForConditionalGeneration` with gated-gelu, untied) on megatron-core
tensor-parallel layers, with Synthesizer mixers in the self-attention of either stack.

Parallel plan per block: RMSNorm (replicated) -> self-attention (heads split over TP, row-parallel output,
one all-reduce) -> [decoder: cross-attention, same plan] -> gated-GELU FFN (wi column-parallel with the
gate and linear halves interleaved per rank via stride 2, wo row-parallel, one all-reduce). Embedding and
LM head are vocab-parallel; the loss is vocab-parallel cross-entropy, so logits are never gathered.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn.functional as F
from megatron.core import tensor_parallel
from megatron.core.tensor_parallel import VocabParallelEmbedding
from torch import nn

from pretrain.core.config import ModelConfig, UsageError
from pretrain.distributed.parallel import padded_vocab_size, tensor_parallel_group
from pretrain.model.attention import CrossAttention, RelativePositionBias, SelfAttention, add_optional, bias_placement
from pretrain.model.init import init_scope, model_init
from pretrain.model.layers import ColumnLinear, RowLinear
from pretrain.model.loss import IGNORE_INDEX, vocab_parallel_cross_entropy
from pretrain.model.mixers import parse_mixers


@dataclass
class T5Output:
    loss: torch.Tensor | None  # mean cross-entropy over the labels != IGNORE_INDEX (same value on every TP rank)
    logits: torch.Tensor  # [b, m, vocab/tp]: this rank's vocabulary shard
    num_tokens: torch.Tensor | None  # number of labels that count in the loss


class RMSNorm(nn.Module):
    """T5LayerNorm: scale only, no mean subtraction, no bias."""

    def __init__(self, d: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(d))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.rms_norm(x, (x.shape[-1],), self.weight, self.eps)


class GatedFFN(nn.Module):
    """wo(gelu_tanh(wi_0 x) * wi_1 x); wi_0 and wi_1 fused in one column-parallel GEMM."""

    def __init__(self, cfg: ModelConfig, mp_config) -> None:
        super().__init__()
        f, d = cfg.initializer_factor, cfg.d_model
        # stride 2: master rows [wi_0; wi_1] are cut in 2 x TP pieces, rank r keeps [wi_0 piece r; wi_1 piece r]
        self.wi = ColumnLinear(
            d, 2 * cfg.d_ff, config=mp_config, bias=False, stride=2,
            init_method=lambda w: nn.init.normal_(w, 0.0, f * d**-0.5),
        )
        self.wo = RowLinear(
            cfg.d_ff, d, config=mp_config, bias=False, input_is_parallel=True, skip_bias_add=True,
            init_method=lambda w: nn.init.normal_(w, 0.0, f * cfg.d_ff**-0.5),
        )
        self.dropout = cfg.dropout

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.wi(x)  # [b, n, 2 d_ff/tp]: [gate | linear]
        gate, linear = h.chunk(2, dim=-1)  # [b, n, d_ff/tp] each
        h = F.gelu(gate, approximate="tanh") * linear
        if self.training and self.dropout > 0:
            with tensor_parallel.get_cuda_rng_tracker().fork():  # sharded activation: per-TP-rank mask
                h = F.dropout(h, self.dropout)
        return self.wo(h)


class Block(nn.Module):
    def __init__(self, cfg: ModelConfig, mixers: tuple[str, ...], is_decoder: bool, mp_config,
                 tp_group: dist.ProcessGroup, sdpa: bool | None, recompute_attention: bool):
        super().__init__()
        tp = tp_group.size()
        self.attn_norm = RMSNorm(cfg.d_model, cfg.layer_norm_eps)
        with init_scope("attn"):
            self.attn = SelfAttention(cfg, mixers, mp_config, tp_group.rank(), tp, sdpa, recompute_attention, tp_group)
        if is_decoder:
            self.cross_norm = RMSNorm(cfg.d_model, cfg.layer_norm_eps)
            with init_scope("cross"):
                self.cross = CrossAttention(cfg, mp_config, tp)
        self.ffn_norm = RMSNorm(cfg.d_model, cfg.layer_norm_eps)
        with init_scope("ffn"):
            self.ffn = GatedFFN(cfg, mp_config)
        self.dropout = cfg.dropout

    def forward(self, h, bias, mask, memory=None, memory_mask=None, cache: dict | None = None,
                vanilla_bias=None, causal: bool = False) -> torch.Tensor:
        # residual-stream dropout is replicated over TP: the default stream, identical on every TP rank
        p = self.dropout if self.training else 0.0
        h = h + F.dropout(self.attn(self.attn_norm(h), bias, mask, cache, vanilla_bias, causal), p)
        if memory is not None:
            if cache is None:
                memory_kv = self.cross.project_memory(memory)
            else:  # the encoder output is fixed while decoding: project it at the first step only
                if "memory_kv" not in cache:
                    cache["memory_kv"] = self.cross.project_memory(memory)
                memory_kv = cache["memory_kv"]
            h = h + F.dropout(self.cross(self.cross_norm(h), memory_kv, memory_mask), p)
        return h + F.dropout(self.ffn(self.ffn_norm(h)), p)


class Stack(nn.Module):
    """Encoder or decoder: relative bias computed once and shared by all layers, final RMSNorm."""

    def __init__(self, cfg: ModelConfig, num_layers: int, mixers: tuple[str, ...], is_decoder: bool,
                 mp_config, tp_group: dist.ProcessGroup, activation_checkpointing: str, sdpa: bool | None) -> None:
        super().__init__()
        # where T5's relative bias goes (model.position_bias): after mixing, on Q K^T before mixing, or nowhere
        self.bias_placement = bias_placement(cfg.position_bias, mixers)
        self.relative_bias = None
        if self.bias_placement:
            with init_scope("relative_bias"):
                self.relative_bias = RelativePositionBias(cfg, not is_decoder, tp_group.rank(), tp_group.size())
        selective = activation_checkpointing == "selective"
        self.layers = nn.ModuleList()
        for i in range(num_layers):
            with init_scope(f"layers.{i}"):
                self.layers.append(Block(cfg, mixers, is_decoder, mp_config, tp_group, sdpa, selective))
        self.final_norm = RMSNorm(cfg.d_model, cfg.layer_norm_eps)
        self.dropout = cfg.dropout
        self.activation_checkpointing = activation_checkpointing == "full"  # whole layers

    def forward(self, h, mask, memory=None, memory_mask=None, caches: list[dict] | None = None,
                causal: bool = False) -> torch.Tensor:
        """causal: `mask` is the causal mask alone (no padding, no cache)."""
        start = caches[0].get("len", 0) if caches else 0
        n = h.shape[1]
        bias = None if self.relative_bias is None else self.relative_bias(n, start + n, start)  # [1, h/tp, n, start+n]
        vanilla_bias = bias if self.bias_placement == "vanilla" else None  # added to Q K^T alone, before mixing
        # bias + mask once per stack, shared by the layers (as HF's position_bias): one pass over
        # [b, heads/tp, n, m] and one gradient sum into the bias instead of one per layer; without a mask
        # (unpadded encoder batches) it stays [1, heads/tp, n, m] and input-independent mixers use that
        additive = add_optional(None if vanilla_bias is not None else bias, mask)  # [b|1, heads/tp, n, start + n]
        causal = causal and (bias is None or vanilla_bias is not None)  # additive is that causal mask alone
        p = self.dropout if self.training else 0.0
        h = F.dropout(h, p)
        for i, layer in enumerate(self.layers):
            if self.activation_checkpointing and self.training:
                # megatron's recompute restores the default and the TP-region RNG streams: same dropout masks
                h = tensor_parallel.checkpoint(functools.partial(layer, causal=causal), False, h, additive, None, memory,
                                               memory_mask, None, vanilla_bias)
            else:
                h = layer(h, additive, None, memory, memory_mask, caches[i] if caches else None, vanilla_bias, causal)
        return F.dropout(self.final_norm(h), p)


CHECKPOINTING = ("none", "full", "selective")


def checkpointing_mode(value: str | bool) -> str:
    """train.activation_checkpointing -> none | full | selective; true / false (older configs) mean full / none."""
    mode = {"true": "full", "false": "none"}.get(str(value).lower(), str(value).lower())
    if mode not in CHECKPOINTING:
        raise UsageError(f"train.activation_checkpointing '{value}' must be one of {', '.join(CHECKPOINTING)}")
    return mode


def padding_mask(mask: torch.Tensor | None, dtype: torch.dtype) -> torch.Tensor | None:
    """[b, m] of 1 (keep) / 0 (pad) -> additive [b, 1, 1, m]. None means nothing is padded: the collator leaves
    the mask out of unpadded batches (pretraining after span corruption), which keeps attention logits shared
    across the batch where the mixer allows, without reading the mask on the host (a device sync)."""
    if mask is None:
        return None
    additive = torch.zeros(mask.shape[0], 1, 1, mask.shape[1], dtype=dtype, device=mask.device)
    return additive.masked_fill(mask[:, None, None, :] == 0, torch.finfo(dtype).min)


def causal_mask(n: int, start: int, pad: torch.Tensor | None, dtype: torch.dtype, device) -> torch.Tensor:
    """Additive [b|1, 1, n, start + n]: query start + i sees keys <= start + i that are not padding."""
    keys = torch.arange(start + n, device=device)
    allowed = keys[None, :] <= (start + torch.arange(n, device=device))[:, None]  # [n, start + n]
    allowed = allowed[None, None]
    if pad is not None:
        allowed = allowed & (pad[:, None, None, :] != 0)
    return torch.zeros(allowed.shape, dtype=dtype, device=device).masked_fill(~allowed, torch.finfo(dtype).min)


class T5Model(nn.Module):
    def __init__(self, cfg: ModelConfig, mp_config, tp_group: dist.ProcessGroup,
                 activation_checkpointing: str = "none", sdpa: bool | None = None) -> None:
        """tp_group: this rank's TP group (a ProcessGroup, or anything with its `size()` and `rank()`: the planner's
        stand-in), kept with its rank and size for the forwards and helpers, which read no global parallel state;
        activation_checkpointing: none, full (whole layers) or selective (core attention); sdpa: see attention.py."""
        super().__init__()
        self.config = cfg
        self.tp_group, self.tp_rank, self.tp = tp_group, tp_group.rank(), tp_group.size()
        self.mixers = {
            "encoder": parse_mixers(cfg.encoder_attention, "model.encoder_attention"),
            "decoder": parse_mixers(cfg.decoder_attention, "model.decoder_attention"),
        }
        f = cfg.initializer_factor
        # vocabulary rows padded to a multiple of 128 x TP; the padding rows are zero and their logits masked,
        # and only the real rows draw from the RNG, so every TP starts from the same function
        rows = padded_vocab_size(cfg.vocab_size, self.tp)

        def init_vocab(std: float):
            def init(w: torch.Tensor) -> None:  # w: the full [rows, d] master weight
                nn.init.normal_(w[: cfg.vocab_size], 0.0, std)
                w[cfg.vocab_size :].zero_()
            return init

        # each part draws from its own generator seeded by its name (pretrain/model/init.py): a parameter's
        # initial value does not depend on which other modules (mixers) the model has
        with model_init():
            with init_scope("embed"):
                self.embed = VocabParallelEmbedding(rows, cfg.d_model, config=mp_config, init_method=init_vocab(f))
            with init_scope("encoder"):
                self.encoder = Stack(cfg, cfg.num_layers, self.mixers["encoder"], False, mp_config, tp_group,
                                     activation_checkpointing, sdpa)
            with init_scope("decoder"):
                self.decoder = Stack(cfg, cfg.num_decoder_layers, self.mixers["decoder"], True, mp_config, tp_group,
                                     activation_checkpointing, sdpa)
            # the untied lm_head as Mesh TF and T5X draw it, std d_model^-0.5: logits of variance about 1 on the
            # final norm's unit-RMS output, a first loss near ln(vocab). HF's T5 draws std 1.0 (logit variance
            # d_model: a first loss of 20-110 nats; HF PR #26441); loaded weights (init=, exports) are unaffected
            with init_scope("lm_head"):
                self.lm_head = ColumnLinear(
                    cfg.d_model, rows, config=mp_config, bias=False, gather_output=False,
                    init_method=init_vocab(f * cfg.d_model**-0.5),
                )

    def encode(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None) -> torch.Tensor:
        return self._encode(self.embed(input_ids), attention_mask)  # embed: [b, n, d]

    def decode(self, decoder_input_ids: torch.Tensor, memory: torch.Tensor, attention_mask: torch.Tensor | None,
               decoder_attention_mask: torch.Tensor | None = None, caches: list[dict] | None = None) -> torch.Tensor:
        """Logits [b, m, vocab/tp]; with `caches` (one dict per layer) the ids are the next positions only."""
        return self._decode(self.embed(decoder_input_ids), memory, attention_mask, decoder_attention_mask, caches)

    def _embed_pair(self, input_ids: torch.Tensor, decoder_input_ids: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """Embeddings of encoder [b, n] and decoder [b, m] ids from one embedding call: the backward then makes
        one zero-filled [vocab/tp, d] gradient instead of two plus their sum (T5-small: 65 MB each; 140 -> 40 ms
        of a 7.3 s one-thread CPU step), and at TP > 1 the forward makes one all-reduce instead of two."""
        ids = torch.cat([input_ids.reshape(-1), decoder_input_ids.reshape(-1)])  # [b n + b m]
        h_enc, h_dec = self.embed(ids).split([input_ids.numel(), decoder_input_ids.numel()])  # [b n | b m, d]
        return h_enc.view(*input_ids.shape, -1), h_dec.view(*decoder_input_ids.shape, -1)

    def _encode(self, h: torch.Tensor, attention_mask: torch.Tensor | None) -> torch.Tensor:
        return self.encoder(h, padding_mask(attention_mask, h.dtype))

    def _decode(self, h: torch.Tensor, memory: torch.Tensor, attention_mask: torch.Tensor | None,
                decoder_attention_mask: torch.Tensor | None, caches: list[dict] | None = None) -> torch.Tensor:
        start = caches[0].get("len", 0) if caches else 0
        mask = causal_mask(h.shape[1], start, decoder_attention_mask, h.dtype, h.device)
        causal = decoder_attention_mask is None and not caches  # the fused kernels apply it themselves
        h = self.decoder(h, mask, memory, padding_mask(attention_mask, h.dtype), caches, causal)
        return mask_vocab_padding(self.lm_head(h), self.config.vocab_size, self.tp_rank)

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None,
                decoder_input_ids: torch.Tensor | None = None, labels: torch.Tensor | None = None,
                decoder_attention_mask: torch.Tensor | None = None) -> T5Output:
        """Masks [b, n] / [b, m] of 1 (keep) / 0 (pad); None: nothing padded (batches of the pretraining collator)."""
        if decoder_input_ids is None:
            raise ValueError("T5Model needs decoder_input_ids (the targets shifted right)")
        h_enc, h_dec = self._embed_pair(input_ids, decoder_input_ids)  # [b, n, d], [b, m, d]
        memory = self._encode(h_enc, attention_mask)
        logits = self._decode(h_dec, memory, attention_mask, decoder_attention_mask)
        if labels is None:
            return T5Output(None, logits, None)
        valid = labels != IGNORE_INDEX
        losses = vocab_parallel_cross_entropy(logits, labels.masked_fill(~valid, 0), self.tp_group)  # [b, m]
        num_tokens = valid.sum()
        loss = (losses * valid).sum() / num_tokens.clamp(min=1)
        return T5Output(loss, logits, num_tokens)

    def compile_layers(self) -> None:
        """torch.compile each encoder and decoder layer in place (parameter names unchanged): the elementwise
        chains (bias + mask + softmax, gated GELU, RMSNorm, residual adds) fuse; embedding, loss and the
        per-stack bias stay eager."""
        for layer in [*self.encoder.layers, *self.decoder.layers]:
            layer.compile()

    def mixture_weights(self) -> dict[str, torch.Tensor]:
        """{"encoder.layers.3": softmax weights [k] or [heads, k]} in the order of `self.mixers[stack]`.

        Per-head weights are gathered over TP, so every TP rank must call this together.
        """
        out = {}
        for stack_name in ("encoder", "decoder"):
            for i, layer in enumerate(getattr(self, stack_name).layers):
                if hasattr(layer.attn, "mix"):
                    w = layer.attn.mixture_weights().detach()
                    out[f"{stack_name}.layers.{i}"] = self._gather_heads(w) if w.dim() == 2 else w
        return out

    def _gather_heads(self, t: torch.Tensor) -> torch.Tensor:
        """[heads/tp, ...] of every TP rank -> [heads, ...]."""
        if self.tp == 1:
            return t
        parts = [torch.empty_like(t) for _ in range(self.tp)]
        dist.all_gather(parts, t.contiguous(), group=self.tp_group)
        return torch.cat(parts, dim=0)


def mask_vocab_padding(logits: torch.Tensor, num_ids: int, tp_rank: int) -> torch.Tensor:
    """TP rank `tp_rank`'s logits [b, m, rows/tp] with the padding rows (ids >= num_ids) at the dtype's minimum:
    they take no probability, no gradient and no argmax, so re-padding for another TP changes nothing."""
    per_rank = logits.shape[-1]
    start = tp_rank * per_rank
    if start + per_rank <= num_ids:
        return logits
    ids = torch.arange(start, start + per_rank, device=logits.device)
    return logits.masked_fill(ids >= num_ids, torch.finfo(logits.dtype).min)


def vocab_parallel_argmax(logits: torch.Tensor, tp_group: dist.ProcessGroup | None = None) -> torch.Tensor:
    """Global token ids [b, m] of the maximum over the vocabulary sharded over `tp_group` (ties: the lowest id).
    Pass the model's `tp_group`; None takes the job's from pretrain.distributed (the fallback of a caller that does
    not pass one yet: pretrain/train.py's evaluation)."""
    group = tensor_parallel_group() if tp_group is None else tp_group
    local_idx = logits.argmax(dim=-1)  # [b, m]
    tp = group.size()
    if tp == 1:
        return local_idx
    local_max = logits.gather(-1, local_idx[..., None]).squeeze(-1)
    global_idx = local_idx + group.rank() * logits.shape[-1]
    maxes, idxs = [torch.empty_like(local_max) for _ in range(tp)], [torch.empty_like(global_idx) for _ in range(tp)]
    dist.all_gather(maxes, local_max.contiguous(), group=group)
    dist.all_gather(idxs, global_idx.contiguous(), group=group)
    best = torch.stack(maxes).argmax(dim=0, keepdim=True)  # [1, b, m]: first (lowest-id) shard on ties
    return torch.stack(idxs).gather(0, best).squeeze(0)
