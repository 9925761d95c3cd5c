"""Attention for the T5 stacks: T5's relative position bias, the
self-attention layer that mixes dot-product and Synthesizer logits, and dot-product cross-attention.

Every mixer yields per-head logits [b, heads/tp, n, m]; a mixture sums them weighted by
softmax(learned weights) (one vector per layer, or per head); then the relative position bias and the
additive masks are added, softmax, dropout, times the per-head values, and the row-parallel output
projection (all-reduce over TP). `model.position_bias` moves the bias (`bias_placement`): onto the
dot-product logits alone, before mixing, or nowhere. Heads are split over TP: Q/K/V columns, synthesizer
parameters, bias rows and per-head mixture weights live only on their rank.

Two implementations of that core, equal within float rounding. Fused (`_fused`): the mixers whose logits are a
product Q' K'^T (vanilla's Q K^T; dense: Q' = [relu(X W1 + b1), 1], K' = [W2[:m], b2[:m]]; factorized_random: R1, R2)
are one dot product over their pieces concatenated along the head dimension, each mixture weight folded into its Q
piece, in one `F.scaled_dot_product_attention` call (scale 1, T5 has no 1/sqrt(d_kv)); everything else (T5's bias,
masks, the full-rank logits of random / fixed_random / factorized_dense in a mixture) is its float `attn_mask`, summed
in fp32, and a decoder's causal mask alone goes in as `is_causal`. The kernel is named explicitly
(pretrain/model/sdpa.py), from what the layer is, so a no-grad forward and its recompute run the same one.
Materialised (`_mixed`): the logits and an fp32 softmax are built explicitly, which also allows the batch-shared
softmax of input-independent mixers; always so for layers without a Q' K'^T mixer (random, fixed_random,
factorized_dense and their mixtures). `sdpa=None` (default) takes the fused form on CUDA (but for input-independent
layers, factorized_random alone, with a trained mask: their batch-shared softmax measured faster and smaller) and
wherever its mask needs no gradient (on the CPU: `position_bias: none`, or evaluation), and materialised logits for
CPU training with a trained mask, except for layers of Q' K'^T mixers alone other than vanilla and factorized_random alone (dense,
dense+vanilla, factorized_random+vanilla: `cpu_math_wins`), where SDPA's math path measured less memory and at least
the same speed; True / False force one (tests, benchmarks).
`recompute` (train.activation_checkpointing: selective) recomputes that core in the backward instead of
storing its activations (Megatron's selective recompute).
"""
from __future__ import annotations

import contextlib
import functools
import math

import torch
import torch.distributed as dist
import torch.nn.functional as F
from megatron.core import tensor_parallel
from torch import nn

from pretrain.core.config import ModelConfig, UsageError
from pretrain.model.init import init_scope
from pretrain.model.layers import ColumnLinear, RowLinear, head_parameter
from pretrain.model.mixers import MIXERS
from pretrain.model.sdpa import attend, device_kind, sdpa_backend


def bias_placement(position_bias: str, mixers: tuple[str, ...]) -> str | None:
    """Where a stack of `mixers` layers adds T5's relative bias under model.position_bias: "mixed" (to the mixed
    logits), "vanilla" (to Q K^T alone, before mixing: a mixture with vanilla) or None (no bias, no parameter).
    A layer of vanilla alone is the same function under all and vanilla, so it takes "mixed" under both."""
    if position_bias == "all" or (position_bias == "vanilla" and mixers == ("vanilla",)):
        return "mixed"
    return "vanilla" if position_bias == "vanilla" and "vanilla" in mixers else None


def add_optional(a: torch.Tensor | None, b: torch.Tensor | None) -> torch.Tensor | None:
    """a + b where None means nothing to add (no bias, no mask)."""
    return b if a is None else a if b is None else a + b


def sum_wide(terms: list[torch.Tensor | None], dtype: torch.dtype) -> torch.Tensor | None:
    """The sum of additive logit terms (bias, masks, weighted synthesized logits; None: nothing) in at least fp32,
    cast to `dtype` once: in bf16 each partial sum would round again (256 + 0.75 + 0.75 is 256 in bf16, 258 once
    rounded from fp32's 257.5)."""
    terms = [t for t in terms if t is not None]
    if not terms:
        return None
    wide = torch.promote_types(dtype, torch.float32)
    total = terms[0].to(wide)
    for t in terms[1:]:
        total = total + t.to(wide)
    return total.to(dtype)


def _normal(std: float):
    return lambda w: nn.init.normal_(w, 0.0, std)


def _fork_tp_rng(active: bool):
    """Dropout on head-sharded activations: a different stream per TP rank (megatron's tracker)."""
    return tensor_parallel.get_cuda_rng_tracker().fork() if active else contextlib.nullcontext()


class RelativePositionBias(nn.Module):
    """T5's bucketed relative position bias, one scalar per (bucket, head); heads sharded over TP."""

    def __init__(self, cfg: ModelConfig, bidirectional: bool, tp_rank: int, tp: int) -> None:
        super().__init__()
        self.bidirectional = bidirectional
        self.num_buckets = cfg.relative_attention_num_buckets
        self.max_distance = cfg.relative_attention_max_distance
        full = torch.randn(cfg.num_heads, self.num_buckets) * cfg.initializer_factor * cfg.d_model**-0.5
        self.weight = head_parameter(full, tp_rank, tp)  # [heads, buckets] (HF stores the transpose)

    def _bucket(self, rel: torch.Tensor) -> torch.Tensor:
        # Mesh TF / HF `_relative_position_bucket`: half exact buckets, half log-spaced up to max_distance
        num_buckets, buckets = self.num_buckets, 0
        if self.bidirectional:
            num_buckets //= 2
            buckets = (rel > 0).long() * num_buckets
            rel = rel.abs()
        else:
            rel = -torch.clamp(rel, max=0)
        max_exact = num_buckets // 2
        large = max_exact + (
            torch.log(rel.float() / max_exact) / math.log(self.max_distance / max_exact) * (num_buckets - max_exact)
        ).long()
        large = torch.clamp(large, max=num_buckets - 1)
        return buckets + torch.where(rel < max_exact, rel, large)

    def forward(self, n: int, m: int, start: int = 0) -> torch.Tensor:
        q = torch.arange(start, start + n, device=self.weight.device)[:, None]
        k = torch.arange(m, device=self.weight.device)[None, :]
        return self.weight[:, self._bucket(k - q)][None]  # [1, heads/tp, n, m]


def _split_heads(fused: torch.Tensor, heads: int, parts: int, d_kv: int) -> tuple[torch.Tensor, ...]:
    """A fused projection [b, n, heads/tp * parts * d_kv] (rows ordered [head, part, d_kv]) -> `parts` tensors
    [b, heads/tp, n, d_kv] (q, k, v or k, v).

    unbind, not indexing: unbind's gradient is one stack straight into the projection's [b, n, heads, parts,
    d_kv] layout, where `qkv[i]` made one zero-filled full-size gradient per part, summed them and copied the
    sum again (select_backward + add + clone: ~130 ms of a 7.3 s one-thread T5-small CPU step; the stack ~45 ms).
    On the CPU the parts are copied to contiguous tensors, as the matmuls would copy them anyway; CUDA kernels
    take the strided views."""
    b, n, _ = fused.shape
    parts_ = fused.view(b, n, heads, parts, d_kv).unbind(3)  # [b, n, heads/tp, d_kv] each
    return tuple(t.transpose(1, 2).contiguous() if t.device.type == "cpu" else t.transpose(1, 2) for t in parts_)


def _softmax(logits: torch.Tensor, additive: torch.Tensor | None, dtype: torch.dtype, fresh: bool = False) -> torch.Tensor:
    """softmax(logits + additive) in at least fp32 (bf16 logits lose the small differences that decide the
    weights), returned in `dtype`; one elementwise chain that torch.compile fuses into a single kernel.

    `fresh`: `logits` is a full-shape [b, heads/tp, n, m] temporary that nothing else reads (Q K^T or a sum of
    weighted logits), so the additive terms go in in place, as HF's `scores += position_bias`: one [b, heads,
    n, m] buffer less per layer to allocate and fill (25 MB per T5-small encoder layer at batch 4)."""
    wide = torch.promote_types(dtype, torch.float32)
    if additive is None:
        summed = logits.to(wide)
    elif fresh:
        summed = logits.to(wide).add_(additive.to(wide))  # .to: a no-op in fp32, else a new wide tensor
    else:
        summed = logits.to(wide) + additive.to(wide)
    return torch.softmax(summed, dim=-1).to(dtype)  # summed in fp32, not bf16


class SelfAttention(nn.Module):
    """Self-attention whose logits are a softmax-weighted mixture of the configured mixers."""

    def __init__(self, cfg: ModelConfig, mixers: tuple[str, ...], mp_config, tp_rank: int, tp: int,
                 sdpa: bool | None = None, recompute: bool = False,
                 tp_group: dist.ProcessGroup | None = None) -> None:
        """tp_group: the group of TP rank `tp_rank` of `tp` (None only at TP 1: a layer built alone, in a test)."""
        super().__init__()
        assert tp_group is not None or tp == 1, "a TP-sharded SelfAttention needs its tp_group"
        self.tp, self.tp_group = tp, tp_group
        self.mixers = mixers
        self.recompute = recompute  # selective activation recompute of the core (logits, softmax, @ V)
        self.d_kv = cfg.d_kv
        self.heads = cfg.num_heads // tp
        self.dropout = cfg.dropout
        self.max_length = cfg.max_length
        inner, d, f = cfg.num_heads * cfg.d_kv, cfg.d_model, cfg.initializer_factor
        if "vanilla" in mixers:
            # fused Q, K, V, rows ordered [head, (q, k, v), d_kv] so a contiguous TP shard holds whole heads;
            # T5 folds 1/sqrt(d_kv) into the query init instead of scaling the logits
            def init_qkv(w: torch.Tensor) -> None:
                w = w.view(cfg.num_heads, 3, cfg.d_kv, d)
                nn.init.normal_(w[:, 0], 0.0, f * (d * cfg.d_kv) ** -0.5)
                nn.init.normal_(w[:, 1:], 0.0, f * d**-0.5)

            with init_scope("qkv"):
                self.qkv = ColumnLinear(d, 3 * inner, config=mp_config, init_method=init_qkv, bias=False)
        else:
            with init_scope("v"):
                self.v = ColumnLinear(d, inner, config=mp_config, init_method=_normal(f * d**-0.5), bias=False)
        self.synth = nn.ModuleDict()
        for name in mixers:
            if name != "vanilla":
                with init_scope(f"synth.{name}"):
                    self.synth[name] = MIXERS[name].build(cfg, mp_config, tp_rank, tp)
        # the mixers whose logits are a product Q' K'^T (vanilla's Q K^T, `factors` of the synthesizers): with any
        # of them the layer has a fused form; the others' logits go into its attn_mask
        self.dot = tuple(name for name in mixers if name == "vanilla" or hasattr(self.synth[name], "factors"))
        self.sdpa = sdpa if self.dot else False  # None: by device and mask, see the module docstring
        # measured (docs/model.md, "Fused attention"): with a trained mask on the CPU, SDPA's math path trains in
        # less memory than the materialised form and at least as fast for layers of Q' K'^T mixers alone (dense,
        # dense+vanilla, factorized_random+vanilla); not for vanilla alone (its hand-written core), input-independent
        # layers (factorized_random alone: the batch-shared softmax has no batch factor) or mixtures with a full-rank
        # mixer (random+vanilla: its whole model measured no faster, 1.03-1.18x)
        independent = all(MIXERS[name].matrix is not None for name in mixers)
        self.cpu_math_wins = self.dot == mixers and mixers != ("vanilla",) and not independent
        # measured on an H200 (bf16, batch 8, 12 heads): with a trained mask, factorized_random alone is 2.1-2.9x the
        # time and 1.4-1.6x the memory of its batch-shared softmax at N 2048-4096 through the memory-efficient kernel
        # (which takes the mask's gradient at [b, heads, n, m]); without one, fused is 0.14x the memory at 4096
        self.cuda_materialises_with_trained_mask = independent
        if len(mixers) > 1:
            if cfg.mixture_per_head:
                self.mix = head_parameter(torch.zeros(cfg.num_heads, len(mixers)), tp_rank, tp)  # [heads, k]
            else:
                self.mix = nn.Parameter(torch.zeros(len(mixers)))  # [k], replicated over TP
        with init_scope("o"):
            self.o = RowLinear(
                inner, d, config=mp_config, init_method=_normal(f * inner**-0.5), bias=False, input_is_parallel=True,
                skip_bias_add=True,
            )

    def mixture_weights(self) -> torch.Tensor:
        """softmax of the mixture weights: [k] or [heads/tp, k]."""
        return torch.softmax(self.mix, dim=-1)

    def forward(
        self, x: torch.Tensor, bias: torch.Tensor | None, mask: torch.Tensor | None, cache: dict | None = None,
        vanilla_bias: torch.Tensor | None = None, causal: bool = False,
    ) -> torch.Tensor:
        """x [b, n, d]; bias [1, heads/tp, n, m] (added after mixing) or None; mask additive [b, 1, n|1, m] or None;
        cache: decoding; vanilla_bias [1, heads/tp, n, m]: added to Q K^T before mixing (position_bias: vanilla);
        causal: bias + mask is exactly the causal mask of n = m positions (a decoder stack without padding, cache or
        relative bias after mixing), which the fused form passes to the kernel as is_causal instead."""
        b, n, _ = x.shape
        start = cache.get("len", 0) if cache is not None else 0
        if self.synth and start + n > self.max_length:
            raise UsageError(
                f"sequence length {start + n} exceeds model.max_length ({self.max_length}) of the synthesized "
                f"attention; raise model.max_length or shorten the inputs"
            )
        additive = add_optional(bias, mask)  # [b|1, heads/tp, n, m] or None
        p = self.dropout if self.training else 0.0
        mask_grad = self._mask_grad(additive, vanilla_bias)
        if self.sdpa is not None:
            sdpa = self.sdpa
        elif device_kind(x.device) == "cuda":
            sdpa = not (mask_grad and self.cuda_materialises_with_trained_mask)
        else:
            sdpa = not mask_grad or self.cpu_math_wins
        if "vanilla" in self.mixers:
            q, k, v = _split_heads(self.qkv(x), self.heads, 3, self.d_kv)  # [b, heads/tp, n, d_kv] each
        else:
            q = k = None
            v = self.v(x).view(b, n, self.heads, self.d_kv).transpose(1, 2)  # [b, heads/tp, n, d_kv]
        if cache is not None:
            # incremental decoding: keys/values of the earlier positions are kept, the new ones appended
            if k is not None:
                k = cache["k"] = torch.cat([cache["k"], k], dim=2) if "k" in cache else k
            v = cache["v"] = torch.cat([cache["v"], v], dim=2) if "v" in cache else v
            cache["len"] = start + n
        m = v.shape[2]
        core = functools.partial(self._fused, mask_grad=mask_grad, causal=causal) if sdpa else self._mixed

        def run(x, q, k, v, additive, vanilla_bias):
            with _fork_tp_rng(p > 0):
                return core(x, q, k, v, additive, vanilla_bias, start, m, p)  # [b, heads/tp, n, d_kv]

        if self.recompute and self.training:
            # megatron's recompute restores the default and the TP-region RNG streams: same dropout masks
            out = tensor_parallel.checkpoint(run, False, x, q, k, v, additive, vanilla_bias)
        else:
            out = run(x, q, k, v, additive, vanilla_bias)
        out = out.transpose(1, 2).reshape(b, n, -1)  # [b, n, heads/tp * d_kv]
        return self.o(out)  # fwd: all-reduce over TP

    def _mask_grad(self, additive: torch.Tensor | None, vanilla_bias: torch.Tensor | None) -> bool:
        """Whether the fused form's attn_mask is trained, read from what the layer is and not from grad mode, so that
        megatron's no-grad forward and its recompute take the same kernel (pretrain/model/sdpa.py)."""
        if not (self.training or torch.is_grad_enabled()):
            return False  # inference
        if any(t is not None and t.requires_grad for t in (additive, vanilla_bias)):
            return True  # the relative bias (made outside the layer: its flag is the same in both passes)
        masked = [name for name in self.mixers if name not in self.dot]  # with self.dot: a mixture, weighted by mix
        return bool(masked and self.dot) and (self.mix.requires_grad or any(
            p.requires_grad for name in masked for p in self.synth[name].parameters()))

    def _fused(self, x, q, k, v, additive, vanilla_bias, start: int, m: int, p: float, mask_grad: bool = False,
               causal: bool = False) -> torch.Tensor:
        # softmax(sum_i a_i Q_i K_i^T + a_v B_v + sum_j a_j S_j + additive) V = SDPA(Q', K', V, mask, scale 1) with
        # Q' = [a_i Q_i ...] and K' = [K_i ...] concatenated along the head dimension over the mixers with a
        # Q' K'^T form (weights folded into the Q side), and the mask the rest: full-rank synthesized logits S_j,
        # T5's bias, padding and causal masks, summed in fp32 (sum_wide)
        alpha = self._alpha() if len(self.mixers) > 1 else None
        qs, ks, terms = [], [], [additive]
        for i, name in enumerate(self.mixers):
            weight = None if alpha is None else alpha[i] if alpha.dim() == 1 else alpha[:, i, None, None]
            if name in self.dot:
                qi, ki = (q, k) if name == "vanilla" else self.synth[name].factors(x, start, m)
                qs.append(qi if weight is None else qi * weight.to(qi.dtype))
                ks.append(ki)
                if name == "vanilla" and vanilla_bias is not None:
                    terms.append(vanilla_bias if weight is None else weight * vanilla_bias)
            else:  # a layer with a Q' K'^T mixer and another is a mixture: weight is set
                terms.append(weight * self.synth[name](x, start, m))  # [b|1, heads/tp, n, m]
        b = v.shape[0]
        q, k = (pieces[0].expand(b, *pieces[0].shape[1:]) if len(pieces) == 1 else
                torch.cat([t.expand(b, *t.shape[1:]) for t in pieces], dim=-1) for pieces in (qs, ks))
        is_causal = causal and len(terms) == 1  # nothing but the causal mask: the kernel applies it
        mask = None if is_causal else sum_wide(terms, v.dtype)
        backend = sdpa_backend(v.device, v.dtype, mask is not None, mask_grad, p, max(q.shape[-1], v.shape[-1]))
        return attend(q, k, v, mask, is_causal, p, backend)

    def _mixed(self, x, q, k, v, additive, vanilla_bias, start: int, m: int, p: float) -> torch.Tensor:
        alpha = self._alpha() if len(self.mixers) > 1 else None
        logits = None
        for i, name in enumerate(self.mixers):
            s = q @ k.transpose(-1, -2) if name == "vanilla" else self.synth[name](x, start, m)  # [b|1, h/tp, n, m]
            if name == "vanilla" and vanilla_bias is not None:
                s = s + vanilla_bias  # T5's bias on the dot-product logits, weighted with them
            s = s if alpha is None else s * (alpha[i] if alpha.dim() == 1 else alpha[:, i, None, None])
            logits = s if logits is None else logits + s
        # with vanilla in the layer the logits are a new [b, heads/tp, n, m] tensor: add the bias in place
        probs = _softmax(logits, additive, v.dtype, fresh="vanilla" in self.mixers)  # [b|1, heads/tp, n, m]
        b, h, _, d_kv = v.shape
        if probs.shape[0] == 1 and b > 1 and p == 0:
            # input-independent logits and no padding: one softmax (and its backward) for the whole batch,
            # and the batch folded into the GEMM's columns instead of b copies of probs
            out = probs[0] @ v.permute(1, 2, 0, 3).reshape(h, m, b * d_kv)  # [heads/tp, n, b * d_kv]
            return out.view(h, -1, b, d_kv).permute(2, 0, 1, 3)  # [b, heads/tp, n, d_kv]
        probs = F.dropout(probs.expand(b, -1, -1, -1), p, training=p > 0)  # dropout: per example
        return probs @ v  # [b, heads/tp, n, d_kv]

    def _alpha(self) -> torch.Tensor:
        if self.mix.dim() == 1 and self.tp > 1:
            # one weight vector shared by all heads: each TP rank sees only its heads' gradient, so the
            # gradient is summed over TP (fwd: identity, bwd: all-reduce) to keep the replicas identical; the
            # group is passed, as megatron warns at every call without one (a torch.compile graph break)
            mix = tensor_parallel.copy_to_tensor_model_parallel_region(self.mix, self.tp_group)
            return torch.softmax(mix, dim=-1)
        return torch.softmax(self.mix, dim=-1)


class CrossAttention(nn.Module):
    """Dot-product attention from decoder positions to the encoder output (no position bias)."""

    def __init__(self, cfg: ModelConfig, mp_config, tp: int) -> None:
        super().__init__()
        inner, d, f = cfg.num_heads * cfg.d_kv, cfg.d_model, cfg.initializer_factor
        self.d_kv, self.heads, self.dropout = cfg.d_kv, cfg.num_heads // tp, cfg.dropout
        self.q = ColumnLinear(
            d, inner, config=mp_config, init_method=_normal(f * (d * cfg.d_kv) ** -0.5), bias=False
        )
        self.kv = ColumnLinear(d, 2 * inner, config=mp_config, init_method=_normal(f * d**-0.5), bias=False)
        self.o = RowLinear(
            inner, d, config=mp_config, init_method=_normal(f * inner**-0.5), bias=False, input_is_parallel=True,
            skip_bias_add=True,
        )

    def project_memory(self, memory: torch.Tensor) -> torch.Tensor:
        """Encoder output [b, m, d] -> its fused K|V projection [b, m, heads/tp * 2 * d_kv] (rows [head, (k, v), d_kv])."""
        return self.kv(memory)

    def forward(self, x: torch.Tensor, memory_kv: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
        """x [b, n, d]; memory_kv: `project_memory`'s; mask additive [b, 1, 1, m] or None."""
        b, n, _ = x.shape
        p = self.dropout if self.training else 0.0
        q = self.q(x).view(b, n, self.heads, self.d_kv).transpose(1, 2)  # [b, heads/tp, n, d_kv]
        k, v = _split_heads(memory_kv, self.heads, 2, self.d_kv)
        backend = sdpa_backend(q.device, q.dtype, mask is not None, False, p, self.d_kv)  # the mask: no gradient
        with _fork_tp_rng(p > 0):
            out = attend(q, k, v, mask, False, p, backend)
        return self.o(out.transpose(1, 2).reshape(b, n, -1))
