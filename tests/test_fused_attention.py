"""The fused forms of self-attention (pretrain/model/attention.py `_fused`, pretrain/model/sdpa.py): every layer with
a mixer whose logits are a product Q' K'^T (vanilla, dense, factorized_random and their mixtures) runs one
`F.scaled_dot_product_attention` call. Checked in float64 against the paper's per-head formulas (outputs and every
parameter's gradient), on the CPU's flash kernel where the CPU allows it (no trained mask); that such a layer
saves nothing of size [b, heads, n, m] for the backward; that megatron's no-grad forward and its recompute run the
same kernel; that a T5 decoder passes its causal mask as is_causal (and decodes through the cache); an evaluation
with a bias made with gradients; the CPU form of a trained mask; the bf16 sum of the mask's terms; and that the
reference comparison fails on hand-made bugs (a weight not folded into Q', no 1 column for b2)."""
from __future__ import annotations

import dataclasses

import pytest
import torch
import torch.nn.functional as F
from megatron.core import ModelParallelConfig, tensor_parallel
from torch.utils._python_dispatch import TorchDispatchMode

from pretrain.distributed.parallel import init_single_process
from pretrain.model import build_model
from pretrain.model.attention import SelfAttention, sum_wide
from pretrain.model.mixers import parse_mixers
from pretrain.model.t5 import causal_mask, padding_mask
from tests.registry import SPECS, has_fused_form
from tests.test_attention import CFG, _reference

FLASH = "_scaled_dot_product_flash_attention_for_cpu"
# every mixer and shipped mixture of Q' K'^T mixers alone (from the registry), and mixtures of two and three of them
FUSED = [*(spec for spec in SPECS if has_fused_form(spec)), "factorized_random+vanilla", "factorized_random+vanilla+dense"]


class Ops(TorchDispatchMode):
    """The ATen ops that run under it, by name."""

    def __init__(self) -> None:
        super().__init__()
        self.seen: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.seen.append(func.overloadpacket.__name__)
        return func(*args, **(kwargs or {}))


def _layer(spec: str, per_head: bool = False, dropout: float = 0.0, **kw) -> SelfAttention:
    init_single_process()
    torch.manual_seed(0)
    cfg = dataclasses.replace(CFG, mixture_per_head=per_head, dropout=dropout)
    attn = SelfAttention(cfg, parse_mixers(spec), ModelParallelConfig(use_cpu_initialization=True), 0, 1, **kw)
    with torch.no_grad():  # non-trivial mixture weights and biases (b2 is zero at init: its 1 column must count)
        for name, p in attn.named_parameters():
            if name.endswith(("mix", "b2", "bias")):
                p.normal_()
    return attn.double()


def _masks(b: int, n: int):
    """(name, additive mask, causal flag) as the T5 stacks pass them: none, padding, causal, causal + padding."""
    keep = torch.ones(b, n, dtype=torch.long)
    keep[1, 8:] = 0
    f64 = torch.float64
    return [("none", None, False), ("padding", padding_mask(keep, f64), False),
            ("causal", causal_mask(n, 0, None, f64, "cpu"), True), ("causal+padding", causal_mask(n, 0, keep, f64, "cpu"), False)]


def _grads(module: torch.nn.Module) -> dict[str, torch.Tensor]:
    grads = {name: p.grad.clone() for name, p in module.named_parameters() if p.grad is not None}
    module.zero_grad(set_to_none=True)
    return grads


@pytest.mark.parametrize("spec, per_head", [(s, False) for s in FUSED] + [(s, True) for s in FUSED if "+" in s]
                         + [("random+dense", True)])
def test_fused_form_equals_float64_reference(spec, per_head):
    attn = _layer(spec, per_head, sdpa=True if spec.startswith("random+") else None).train()  # None: CPU's own choice
    b, n = 3, 11  # n < N = 16: synthesized matrices sliced
    x = torch.randn(b, n, CFG.d_model, dtype=torch.float64)
    g = torch.randn(b, n, CFG.d_model, dtype=torch.float64)
    zero = torch.zeros(1, CFG.num_heads, n, n, dtype=torch.float64)
    for name, mask, causal in _masks(b, n):
        with Ops() as ops:
            out = attn(x, None, mask, causal=causal)
        (out * g).sum().backward()
        fused = _grads(attn)
        ref = _reference(attn, parse_mixers(spec), x, zero, mask)
        (ref * g).sum().backward()
        expected = _grads(attn)
        torch.testing.assert_close(out, ref, rtol=1e-10, atol=1e-12, msg=f"{name}: output")
        assert fused.keys() == expected.keys()
        for p in fused:
            torch.testing.assert_close(fused[p], expected[p], rtol=1e-10, atol=1e-12, msg=f"{name}: {p}")
        # the CPU's fused kernel ran where the mask is not trained (random+dense: R is, so the math path)
        assert ops.seen.count(FLASH) == (0 if spec.startswith("random+") else 1), name


@pytest.mark.parametrize("bug", ["a mixture weight not folded into Q'", "no 1 column for b2 in dense's Q'"])
def test_the_reference_comparison_fails_on_a_hand_made_bug(bug, monkeypatch):
    # the comparison of test_fused_form_equals_float64_reference, on a layer with the bug put in by hand: it must fail
    attn = _layer("dense+vanilla", per_head=True).train()
    b, n = 3, 11
    x = torch.randn(b, n, CFG.d_model, dtype=torch.float64)
    zero = torch.zeros(1, CFG.num_heads, n, n, dtype=torch.float64)
    ref = _reference(attn, parse_mixers("dense+vanilla"), x, zero, None)
    torch.testing.assert_close(attn(x, None, None), ref, rtol=1e-10, atol=1e-12)  # without the bug
    if bug.startswith("a mixture weight"):
        monkeypatch.setattr(attn, "_alpha", lambda: torch.ones_like(attn.mix))  # Q K^T and Q' K'^T unweighted
    else:
        dense = attn.synth["dense"]
        factors = dense.factors

        def without_one(x, start, m):
            q, k = factors(x, start, m)
            return torch.cat([q[..., :-1], torch.zeros_like(q[..., -1:])], dim=-1), k  # [relu(.), 0]: b2 is lost

        monkeypatch.setattr(dense, "factors", without_one)
    with pytest.raises(AssertionError):
        torch.testing.assert_close(attn(x, None, None), ref, rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("spec, sdpa_calls", [("vanilla", 0), ("dense", 1), ("factorized_random", 0),
                                              ("dense+vanilla", 1), ("factorized_random+vanilla", 1),
                                              ("random+vanilla", 0), ("random+factorized_random", 0)])
def test_cpu_training_with_a_trained_bias_takes_the_form_measured_faster(spec, sdpa_calls, monkeypatch):
    # T5's bias as a trained mask: CPU training takes SDPA's math path for layers of Q' K'^T mixers alone, where it
    # measured better (docs/model.md, "Fused attention"), but for vanilla and factorized_random alone, and the
    # materialised form for the rest; either equals the paper's formulas, the bias's gradient included (float64)
    calls = []
    sdpa = F.scaled_dot_product_attention
    monkeypatch.setattr(F, "scaled_dot_product_attention", lambda *a, **k: calls.append(k) or sdpa(*a, **k))
    attn = _layer(spec, per_head=True).train()
    b, n = 3, 11
    x = torch.randn(b, n, CFG.d_model, dtype=torch.float64)
    bias = torch.randn(1, CFG.num_heads, n, n, dtype=torch.float64, requires_grad=True)
    mask = _masks(b, n)[1][1]  # padding
    results = []
    for form in (lambda: attn(x, bias, mask), lambda: _reference(attn, parse_mixers(spec), x, bias, mask)):
        form().sum().backward()
        results.append((_grads(attn), bias.grad))
        bias.grad = None
        if not results[1:]:
            assert len(calls) == sdpa_calls
    torch.testing.assert_close(results[0], results[1], rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("spec", FUSED)
def test_evaluation_with_a_bias_made_with_gradients_runs_the_flash_kernel(spec):
    # an evaluation (eval mode, no grad) of a layer whose bias was made with gradients (the study's attention maps
    # recompute the layer so): the CPU flash kernel, which refuses a mask that requires grad, runs it, equal to the
    # paper's formulas (was: "No available kernel")
    attn = _layer(spec).eval()
    b, n = 2, 11
    x = torch.randn(b, n, CFG.d_model, dtype=torch.float64)
    bias = torch.randn(1, CFG.num_heads, n, n, dtype=torch.float64, requires_grad=True)
    with torch.no_grad():
        with Ops() as ops:
            out = attn(x, bias, None)
        ref = _reference(attn, parse_mixers(spec), x, bias, None)
    assert ops.seen.count(FLASH) == 1
    torch.testing.assert_close(out, ref, rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("spec", FUSED)
def test_fused_layer_saves_no_logit_sized_tensor(spec):
    # a layer with a fused form trains (CPU, no trained mask) without storing [b|1, heads, n, m] logits or
    # probabilities; the materialised form of the same layer does (what the check would see on a fallback)
    b, n = 2, 12
    x = torch.randn(b, n, CFG.d_model, dtype=torch.float64, requires_grad=True)
    for sdpa in (None, False):
        attn = _layer(spec, sdpa=sdpa).train()
        for name, mask, causal in _masks(b, n):
            saved: list[tuple[int, ...]] = []
            with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(tuple(t.shape)) or t, lambda t: t):
                attn(x, None, mask, causal=causal)
            # [b|1, heads, n, m]: the masks given ([b|1, 1, n|1, m]) are inputs, not the layer's
            logit_sized = [s for s in saved if s[-3:] == (CFG.num_heads, n, n)]
            assert bool(logit_sized) == (sdpa is False), (name, saved)


@pytest.mark.parametrize("spec, sdpa", [("random+vanilla", True), ("dense+vanilla", None), ("random+dense", True)])
def test_forward_and_recompute_take_the_same_kernel(spec, sdpa):
    # selective recompute: megatron runs the core without gradients, then again with them in the backward. The
    # kernel is chosen from the layer, not from requires_grad (random+vanilla's mask R: no gradient in the first
    # pass, one in the recompute), so both passes run the same one
    attn = _layer(spec, sdpa=sdpa, recompute=True).train()
    x = torch.randn(2, 11, CFG.d_model, dtype=torch.float64, requires_grad=True)
    tensor_parallel.get_cuda_rng_tracker()  # the RNG tracker the recompute restores exists
    with Ops() as forward:
        out = attn(x, None, None)
    with Ops() as backward:
        out.sum().backward()
    assert forward.seen.count(FLASH) == backward.seen.count(FLASH) == (1 if sdpa is None else 0)
    assert forward.seen.count("_softmax") == backward.seen.count("_softmax")  # the math path in both, or neither


@pytest.mark.parametrize("spec", ["dense+vanilla", "factorized_random"])
def test_t5_decoder_passes_its_causal_mask_to_the_kernel(spec, monkeypatch):
    # position_bias none: every self-attention layer runs the flash kernel; an unpadded decoder passes is_causal
    # and no mask, a padded one its mask; the model equals its materialised form (float64, loss and gradients).
    # Cross-attention (its query length 7, its keys the encoder's 12) goes through SDPA too, never causal
    calls, cross = [], []
    sdpa = F.scaled_dot_product_attention
    monkeypatch.setattr(F, "scaled_dot_product_attention", lambda q, k, v, **kw: (
        cross if q.shape[-2] != k.shape[-2] else calls).append(kw) or sdpa(q, k, v, **kw))
    cfg = dataclasses.replace(CFG, encoder_attention=spec, decoder_attention=spec, position_bias="none",
                              num_layers=2, num_decoder_layers=2)
    g = torch.Generator().manual_seed(1)
    ids, labels = torch.randint(2, 256, (3, 12), generator=g), torch.randint(2, 256, (3, 7), generator=g)
    dec = torch.cat([torch.zeros(3, 1, dtype=torch.long), labels[:, :-1]], dim=1)
    for dec_mask in (None, torch.ones(3, 7, dtype=torch.long).index_fill_(1, torch.tensor([5, 6]), 0)):
        results = []
        for form in (None, False):
            init_single_process()
            torch.manual_seed(0)
            model = build_model(cfg, sdpa=form).double()
            out = model(ids, None, dec, labels, dec_mask)
            out.loss.backward()
            results.append((out.loss.detach(), {n: p.grad for n, p in model.named_parameters()}))
            if form is None:
                causal = [k["is_causal"] for k in calls]
                assert causal == [False, False] + [dec_mask is None] * 2  # encoder layers, then decoder layers
                assert all((k["attn_mask"] is None) == (c or i < 2) for i, (k, c) in enumerate(zip(calls, causal)))
                assert [k["is_causal"] for k in cross] == [False, False]  # one a decoder layer
            else:
                assert not calls
            calls.clear()
            cross.clear()
        torch.testing.assert_close(results[0][0], results[1][0], rtol=1e-10, atol=0)
        for name in results[1][1]:
            torch.testing.assert_close(results[0][1][name], results[1][1][name], rtol=1e-9, atol=1e-12, msg=name)


@pytest.mark.parametrize("spec", ["dense+vanilla", "factorized_random+vanilla"])
def test_cached_decoding_of_fused_forms(spec):
    # generation: each new position through the cache (its own rows of Q' against every key so far, the mask one
    # row of the causal mask) equals the whole decoder at once and the materialised model (float64, no gradients)
    cfg = dataclasses.replace(CFG, encoder_attention=spec, decoder_attention=spec, position_bias="none",
                              num_layers=1, num_decoder_layers=2)
    g = torch.Generator().manual_seed(1)
    ids, dec = torch.randint(2, 256, (2, 9), generator=g), torch.randint(2, 256, (2, 6), generator=g)
    full = {}
    with torch.no_grad():
        for form in (None, False):
            init_single_process()
            torch.manual_seed(0)
            model = build_model(cfg, sdpa=form).double().eval()
            memory = model.encode(ids)
            full[form] = model.decode(dec, memory, None)  # [b, 6, vocab]
        caches = [{} for _ in model.decoder.layers]
        init_single_process()
        torch.manual_seed(0)
        model = build_model(cfg).double().eval()
        steps = [model.decode(dec[:, t : t + 1], memory, None, None, caches) for t in range(dec.shape[1])]
    torch.testing.assert_close(full[None], full[False], rtol=1e-10, atol=1e-10)
    torch.testing.assert_close(torch.cat(steps, dim=1), full[None], rtol=1e-10, atol=1e-10)


def test_bf16_mask_terms_are_summed_in_fp32():
    # the fused form's mask (bias + weighted synthesized logits + masks) in bf16: one rounding of the fp32 sum
    # 256 + 0.75 + 0.75 = 257.5 -> 258, where summing in bf16 rounds 256.75 to 256 and then 256.75 to 256 again
    terms = [torch.tensor([256.0, 1.0], dtype=torch.bfloat16), torch.tensor([0.75, 0.0], dtype=torch.bfloat16),
             torch.tensor([0.75, 0.0], dtype=torch.bfloat16), None]
    assert sum_wide(terms, torch.bfloat16).tolist() == [258.0, 1.0]
    assert sum_wide([None], torch.bfloat16) is None


@pytest.mark.parametrize("spec, fused", [("factorized_random", False), ("dense", True), ("vanilla", True),
                                         ("factorized_random+vanilla", True), ("random+vanilla", True)])
def test_cuda_training_with_a_trained_bias_takes_the_form_measured_best(spec, fused, monkeypatch):
    # on an H200 (docs/model.md, "Fused attention") the fused form with T5's bias as a trained mask wins for every
    # layer with a Q' K'^T mixer but factorized_random alone, whose batch-shared softmax is 2.1-2.9x faster and 0.7x
    # the memory at N 2048-4096; the kernels want head dimensions padded to a multiple of 8 (dense's d_kv + 1). Run on
    # meta as the planner traces a CUDA job (sdpa.meta_as), so the plan counts the form the GPU takes
    from pretrain.model.sdpa import meta_as

    calls = []
    monkeypatch.setattr(F, "scaled_dot_product_attention", lambda q, k, v, **kw: calls.append((q, k, v)) or
                        torch.empty(*q.shape[:-1], v.shape[-1], device="meta"))
    attn = _layer(spec).float().to("meta").train()
    n = 11
    bias = torch.empty(1, CFG.num_heads, n, n, device="meta", requires_grad=True)
    with meta_as("cuda"):
        attn(torch.empty(2, n, CFG.d_model, device="meta"), bias, None)
    assert bool(calls) == fused
    assert all(t.shape[-1] % 8 == 0 for call in calls for t in call), [t.shape for call in calls for t in call]
