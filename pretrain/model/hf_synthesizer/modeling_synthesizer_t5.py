"""HF's T5ForConditionalGeneration (v1.1) with Synthesizer self-attention (Tay et al. 2021, arXiv 2005.00743).

Part of a Synthesizer export made by `python -m pretrain.export`; self-contained (torch + transformers), loaded
with `AutoModelForSeq2SeqLM.from_pretrained(EXPORT, trust_remote_code=True)`. Everything but the
self-attention is HF's T5. Each self-attention sums its mixers' per-head logits [b, heads, n, m], weighted
by softmax(mix) (one vector per layer, or one per head) when there are several: "vanilla" is T5's q k^T,
the synthesizers build logits for the maximum length N (`synthesizer_length`) and slice them to the query
rows [start, start + n) and the first m key columns. Then T5's relative position bias and the mask are
added, softmax in fp32, times the values. `position_bias` moves the bias (`bias_placement`): "vanilla" adds it to
q k^T alone, before mixing, "none" leaves it out; a stack without it has no `relative_attention_bias`.
`synthesizer_init` says how a model built from its config (not loaded) draws its synthesizers. Incremental
decoding caches keys and values in HF's cache, whose length is the position offset `start` of the synthesized rows. Runs on transformers 4.46 to 5.x, whose T5 calls
self-attention in several ways (`_CACHE`, `_FOLDS_MASK` below).
"""
import inspect
import math

import torch
import torch.nn.functional as F
import transformers
from torch import nn
from transformers import T5ForConditionalGeneration
from transformers.cache_utils import EncoderDecoderCache
from transformers.models.t5.modeling_t5 import T5Attention

from .configuration_synthesizer_t5 import SynthesizerT5Config

# How this transformers' T5 calls self-attention, told by its T5Attention.forward's parameters (measured on 4.46 to
# 5.24, docs/transfer.md):
#   with `output_attentions` (up to 5.10 at least): the first layer folds the mask into the bias it returns, which
#     the stack hands the later layers as position_bias; it takes (output, bias) back, plus the weights when asked,
#     and before 4.56 (a `past_key_value` argument) the cache between: (output, cache, bias[, weights]);
#   without (5.15 on): the stack adds the mask in every layer and takes (output, bias, weights) back.
# The cache comes as `cache` (5.24), `past_key_values` or `past_key_value`.
_PARAMETERS = inspect.signature(T5Attention.forward).parameters
_CACHE = next((name for name in ("cache", "past_key_values", "past_key_value") if name in _PARAMETERS), None)
_FOLDS_MASK = "output_attentions" in _PARAMETERS
_OLDEST = (4, 46)  # the oldest release measured to give this model's logits
if _CACHE is None or tuple(int(part) for part in transformers.__version__.split(".")[:2]) < _OLDEST:
    raise ImportError(f"this Synthesizer export runs on transformers 4.46 or later (measured up to 5.24); this is "
                      f"transformers {transformers.__version__}")


def bias_placement(position_bias: str, mixers: tuple) -> str:
    """Where a stack adds T5's relative bias: "mixed" (to the mixed logits), "vanilla" (to q k^T before mixing) or
    None; a layer of vanilla alone is the same function under "all" and "vanilla"."""
    if position_bias == "all" or (position_bias == "vanilla" and mixers == ("vanilla",)):
        return "mixed"
    return "vanilla" if position_bias == "vanilla" and "vanilla" in mixers else None


def mesh_tf_glorot(shape: tuple, mesh_tf_shape: tuple) -> torch.Tensor:
    """Drawn as Mesh TF draws a variable of `mesh_tf_shape` without an initializer: TF's glorot_uniform, the fans
    of that layout (the last two dimensions, each times the others' product)."""
    limit = math.sqrt(6 / ((mesh_tf_shape[-2] + mesh_tf_shape[-1]) * math.prod(mesh_tf_shape[:-2])))
    return torch.empty(shape).uniform_(-limit, limit)


def dense_kernel(config: SynthesizerT5Config, shape: tuple) -> torch.Tensor:
    """W2 / W_A / W_B [heads, out, d_kv]: T5's normal of std 1/sqrt(d_kv), or Mesh TF's dense kernel (a truncated
    normal of std 1/sqrt(d_kv) before values beyond two standard deviations are redrawn)."""
    std = config.d_kv**-0.5
    if config.synthesizer_init == "mesh_tf":
        # not trunc_normal_'s return value: transformers 4's from_pretrained swaps nn.init for functions returning None
        w = torch.empty(shape)
        nn.init.trunc_normal_(w, 0.0, std, -2 * std, 2 * std)
        return w
    return torch.randn(shape) * config.initializer_factor * std


def factor_pair(n: int) -> tuple[int, int]:
    """(a, b) with a * b = n and a the largest divisor <= sqrt(n): 512 -> (16, 32)."""
    a = max(d for d in range(1, math.isqrt(n) + 1) if n % d == 0)
    return a, n // a


class HiddenProjection(nn.Module):
    """relu(W1_h x + b1_h) per head: the first layer of the dense synthesizers."""

    def __init__(self, config: SynthesizerT5Config) -> None:
        super().__init__()
        self.w1 = nn.Linear(config.d_model, config.num_heads * config.d_kv, bias=True)
        fan = config.d_model * (config.d_kv if config.synthesizer_init == "mesh_tf" else 1)  # mesh_tf: as a query
        nn.init.normal_(self.w1.weight, 0.0, config.initializer_factor * fan**-0.5)
        nn.init.zeros_(self.w1.bias)
        self.d_kv = config.d_kv

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, n, _ = x.shape
        return F.relu(self.w1(x)).view(b, n, -1, self.d_kv)  # [b, n, heads, d_kv]


class Dense(nn.Module):
    """F_h(x) = W2_h relu(W1_h x + b1_h) + b2_h: each token synthesizes its row of N logits."""

    def __init__(self, config: SynthesizerT5Config) -> None:
        super().__init__()
        h, n = config.num_heads, config.synthesizer_length
        self.hidden = HiddenProjection(config)
        self.w2 = nn.Parameter(dense_kernel(config, (h, n, config.d_kv)))
        self.b2 = nn.Parameter(torch.zeros(h, n))

    def forward(self, x: torch.Tensor, start: int, m: int) -> torch.Tensor:
        logits = torch.einsum("bnhd,hmd->bhnm", self.hidden(x), self.w2[:, :m])
        return logits + self.b2[None, :, None, :m]  # [b, heads, n, m]


class FactorizedDense(nn.Module):
    """A_h(x) in R^a repeated b times times B_h(x) in R^b tiled a times: a * b = N logits."""

    def __init__(self, config: SynthesizerT5Config) -> None:
        super().__init__()
        h, dkv = config.num_heads, config.d_kv
        self.a, self.b = factor_pair(config.synthesizer_length)
        self.hidden = HiddenProjection(config)
        self.wa, self.ba = nn.Parameter(dense_kernel(config, (h, self.a, dkv))), nn.Parameter(torch.zeros(h, self.a))
        self.wb, self.bb = nn.Parameter(dense_kernel(config, (h, self.b, dkv))), nn.Parameter(torch.zeros(h, self.b))

    def forward(self, x: torch.Tensor, start: int, m: int) -> torch.Tensor:
        hid = self.hidden(x)  # [b, n, heads, d_kv]
        fa = torch.einsum("bnhd,had->bhna", hid, self.wa) + self.ba[None, :, None, :]  # [b, heads, n, a]
        fb = torch.einsum("bnhd,hcd->bhnc", hid, self.wb) + self.bb[None, :, None, :]  # [b, heads, n, b]
        return (fa[..., :, None] * fb[..., None, :]).flatten(-2)[..., :m]  # column i_a * b + i_b: [b, heads, n, m]


class Random(nn.Module):
    """A learned (random) or frozen (fixed_random) N x N logit matrix per head, independent of the input."""

    def __init__(self, config: SynthesizerT5Config, trainable: bool) -> None:
        super().__init__()
        n, h = config.synthesizer_length, config.num_heads
        if config.synthesizer_init == "mesh_tf":  # Mesh TF's R [length, heads, memory_length]
            r = mesh_tf_glorot((h, n, n), (n, h, n))
        else:
            r = torch.randn(h, n, n) * config.initializer_factor
        self.r = nn.Parameter(r, requires_grad=trainable)

    def forward(self, x: torch.Tensor, start: int, m: int) -> torch.Tensor:
        return self.r[None, :, start : start + x.shape[1], :m]  # [1, heads, n, m]


class FactorizedRandom(nn.Module):
    """R_h = R1_h R2_h^T with R1, R2 in R^{N x k}."""

    def __init__(self, config: SynthesizerT5Config) -> None:
        super().__init__()
        h, n, k = config.num_heads, config.synthesizer_length, config.factorized_k
        std = config.initializer_factor * k**-0.25  # t5: entries of R1 R2^T have unit variance

        def draw() -> torch.Tensor:  # mesh_tf: as Mesh TF's "factorized" R1, R2 [k, heads, memory_length]
            if config.synthesizer_init == "mesh_tf":
                return mesh_tf_glorot((h, n, k), (k, h, n))
            return torch.randn(h, n, k) * std

        self.r1, self.r2 = nn.Parameter(draw()), nn.Parameter(draw())

    def forward(self, x: torch.Tensor, start: int, m: int) -> torch.Tensor:
        return (self.r1[:, start : start + x.shape[1]] @ self.r2[:, :m].transpose(1, 2))[None]  # [1, heads, n, m]


# pretrain.model.mixers.MIXERS's synthesizers, each with our parameters (names, shapes) and logits, without TP: a copy,
# as exports ship this file without that package (tests/test_mixers.py fails when they differ)
SYNTHESIZERS = {
    "dense": Dense,
    "factorized_dense": FactorizedDense,
    "random": lambda config: Random(config, trainable=True),
    "fixed_random": lambda config: Random(config, trainable=False),
    "factorized_random": FactorizedRandom,
}


class SynthesizerT5Attention(T5Attention):
    """T5's self-attention with logits from a softmax-weighted mixture of mixers; no q, k without "vanilla"."""

    def __init__(self, config: SynthesizerT5Config, mixers: tuple[str, ...], has_relative_attention_bias: bool,
                 layer_idx: int, bias_on_vanilla: bool = False) -> None:
        super().__init__(config, has_relative_attention_bias, layer_idx)
        self.is_causal = config.is_decoder  # later transformers take it as an argument, earlier ones do not know it
        self.mixers = mixers
        self.bias_on_vanilla = bias_on_vanilla  # position_bias "vanilla" in a mixture: the bias weighs with q k^T
        self.max_length = config.synthesizer_length
        if "vanilla" not in mixers:
            del self.q, self.k
        self.synth = nn.ModuleDict({name: SYNTHESIZERS[name](config) for name in mixers if name != "vanilla"})
        if len(mixers) > 1:
            self.mix = nn.Parameter(torch.zeros((config.num_heads,) * config.mixture_per_head + (len(mixers),)))
        f, d = config.initializer_factor, config.d_model
        stds = {"q": f * (d * self.key_value_proj_dim) ** -0.5, "k": f * d**-0.5, "v": f * d**-0.5,
                "o": f * self.inner_dim**-0.5, "relative_attention_bias": f * d**-0.5}  # T5's init
        for name, std in stds.items():
            if hasattr(self, name):
                nn.init.normal_(getattr(self, name).weight, 0.0, std)
        # initialised here, synthesizers included: T5's _init_weights, which the stacks run, assumes q and k
        for module in self.modules():
            module._is_hf_initialized = True

    def forward(self, hidden_states, mask=None, key_value_states=None, position_bias=None, layer_head_mask=None,
                output_attentions=False, cache_position=None, **kwargs):
        """hidden_states [b, n, d]; mask additive [b, 1, n|1, >=m] or None; kwargs[_CACHE]: when decoding, the
        cache of the keys/values so far."""
        cache = kwargs.pop(_CACHE, None)
        b, n, _ = hidden_states.shape
        start = int(cache.get_seq_length(self.layer_idx)) if cache is not None else 0
        if self.synth and start + n > self.max_length:
            raise ValueError(f"sequence length {start + n} exceeds synthesizer_length ({self.max_length}) of the "
                             f"synthesized attention; shorten the inputs")
        shape = (b, n, -1, self.key_value_proj_dim)
        v = self.v(hidden_states).view(shape).transpose(1, 2)  # [b, heads, n, d_kv]
        q = k = None
        if "vanilla" in self.mixers:
            q = self.q(hidden_states).view(shape).transpose(1, 2)
            k = self.k(hidden_states).view(shape).transpose(1, 2)
        if cache is not None:
            self_cache = cache.self_attention_cache if isinstance(cache, EncoderDecoderCache) else cache
            cache_kwargs = {"cache_position": cache_position} if _FOLDS_MASK else kwargs
            # without dot-product keys the values fill the key slot too: HF's caches count positions by their keys
            k, v = self_cache.update(v if k is None else k, v, self.layer_idx, cache_kwargs)
        m = v.shape[2]
        if position_bias is None:  # the first layer computes it, the stack shares it with the others
            if self.has_relative_attention_bias:  # rows of the positions [start, start + n)
                position_bias = self.compute_bias(start + n, m, device=v.device)[:, :, -n:]
            else:
                position_bias = torch.zeros(1, self.n_heads, n, m, device=v.device, dtype=v.dtype)
            if _FOLDS_MASK and mask is not None and not self.bias_on_vanilla:
                position_bias = position_bias + mask[..., :m]
        if self.bias_on_vanilla:  # every layer of the stack keeps the bias apart and adds the mask itself
            vanilla_bias, additive = position_bias, None if mask is None else mask[..., :m]
        else:
            vanilla_bias, additive = None, position_bias if _FOLDS_MASK or mask is None else position_bias + mask
        alpha = torch.softmax(self.mix, dim=-1) if len(self.mixers) > 1 else None  # [k] or [heads, k]
        logits = 0
        for i, name in enumerate(self.mixers):
            s = q @ k.transpose(-1, -2) if name == "vanilla" else self.synth[name](hidden_states, start, m)
            if name == "vanilla" and vanilla_bias is not None:
                s = s + vanilla_bias
            if alpha is not None:
                s = s * (alpha[i] if alpha.dim() == 1 else alpha[:, i, None, None])
            logits = logits + s  # [b|1, heads, n, m]
        wide = torch.promote_types(v.dtype, torch.float32)  # bf16 logits lose the differences that decide
        probs = torch.softmax((logits if additive is None else logits + additive).to(wide), dim=-1).to(v.dtype)
        probs = F.dropout(probs, self.dropout, training=self.training)
        if layer_head_mask is not None:  # head_mask of the transformers 4 releases
            probs = probs * layer_head_mask
        out = self.o((probs @ v).transpose(1, 2).reshape(b, n, -1))  # [b, n, d] from [b, n, heads * d_kv]
        if not _FOLDS_MASK:
            return out, position_bias, probs
        weights = (probs,) if output_attentions else ()
        return (out, cache, position_bias, *weights) if _CACHE == "past_key_value" else (out, position_bias, *weights)


def _without_lm_head(tied: dict | list) -> dict | list:
    """T5's tied weights less lm_head (a dict in transformers 5, a list in 4): v1.1's output embedding is its own.
    transformers 5 sets tie_word_embeddings on every T5Config, so with lm_head listed, `tie_weights()` and
    `resize_token_embeddings` replace the trained lm_head with the input embedding."""
    if isinstance(tied, dict):
        return {k: v for k, v in tied.items() if k != "lm_head.weight"}
    return [k for k in tied if k != "lm_head.weight"]


class SynthesizerT5ForConditionalGeneration(T5ForConditionalGeneration):
    """T5ForConditionalGeneration whose self-attention layers are `SynthesizerT5Attention`."""

    config_class = SynthesizerT5Config
    config: SynthesizerT5Config
    _tied_weights_keys = _without_lm_head(T5ForConditionalGeneration._tied_weights_keys)
    # synthesized logits are computed here, not by an attention kernel: masks must be eager's additive floats
    _supports_sdpa = False
    _supports_flex_attn = False

    def __init__(self, config: SynthesizerT5Config) -> None:
        super().__init__(config)
        for stack, spec in ((self.encoder, config.encoder_attention), (self.decoder, config.decoder_attention)):
            mixers = tuple(spec.split("+"))
            placement = bias_placement(config.position_bias, mixers)
            for i, block in enumerate(stack.block):
                block.layer[0].SelfAttention = SynthesizerT5Attention(stack.config, mixers, i == 0 and bool(placement),
                                                                      i, placement == "vanilla")
        self.post_init()
