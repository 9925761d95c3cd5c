"""Whole-model properties: decoder causality for every variant, parameter counts against the formulas,
the shared parameters of every variant initialised alike, length and config errors, mixture weights,
activation recompute with dropout, universal-checkpoint patterns."""
from __future__ import annotations

import dataclasses
import math
import re

import pytest
import torch

from pretrain.core.config import ModelConfig
from pretrain.distributed.parallel import init_single_process
from pretrain.model import build_local_model, check_model, universal_checkpoint_info
from pretrain.model.mixers import MIXERS
from pretrain.model.mixers.factorized_dense import factor_pair
from tests.registry import SPECS, assert_covers

CFG = ModelConfig(vocab_size=256, d_model=32, d_ff=48, d_kv=8, num_heads=4, num_layers=2, num_decoder_layers=2,
                  max_length=16, factorized_k=3, relative_attention_num_buckets=8, relative_attention_max_distance=16)


def _model(**changes):
    torch.manual_seed(0)
    return build_local_model(dataclasses.replace(CFG, **changes))


@pytest.mark.parametrize("spec", [*MIXERS, "random+vanilla+factorized_dense"])
def test_decoder_is_causal(spec):
    model = _model(decoder_attention=spec, encoder_attention=spec).eval()
    ids, mask = torch.randint(2, 256, (2, 12)), torch.ones(2, 12, dtype=torch.long)
    dec = torch.randint(2, 256, (2, 10))
    base = model(ids, mask, dec).logits
    for i in (0, 4, 8):
        changed = dec.clone()
        changed[:, i + 1 :] = torch.randint(2, 256, changed[:, i + 1 :].shape)
        out = model(ids, mask, changed).logits
        torch.testing.assert_close(out[:, : i + 1], base[:, : i + 1], rtol=0, atol=1e-6)
        assert not torch.allclose(out[:, i + 1 :], base[:, i + 1 :])  # later positions do see the change


def _extra() -> dict[str, int]:
    """Per registered mixer, its self-attention parameters of one layer beyond the output projection (docs/model.md,
    "Mixers and their parameters")."""
    d, h, dkv, n, k = CFG.d_model, CFG.num_heads, CFG.d_kv, CFG.max_length, CFG.factorized_k
    inner = h * dkv
    a, b = factor_pair(n)
    return {
        "vanilla": 2 * d * inner,  # Q, K (V is counted by every variant)
        "dense": d * inner + inner + inner * n + h * n,  # W1_h, b1_h; W2_h [N, d_kv], b2_h: ~ d x N
        "random": h * n * n,  # R_h: N x N per head
        "fixed_random": h * n * n,  # same, frozen
        "factorized_dense": d * inner + inner + h * (a + b) * (dkv + 1),
        "factorized_random": 2 * h * n * k,  # R1_h, R2_h: 2 N k per head
    }


def _count(model) -> int:
    return sum(p.numel() for p in model.parameters())


@pytest.mark.parametrize("spec", SPECS)
@pytest.mark.parametrize("per_head", [False, True])
def test_parameter_counts_follow_formulas(spec, per_head):
    vanilla = _count(_model())
    model = _model(encoder_attention=spec, decoder_attention=spec, mixture_per_head=per_head)
    mixers = spec.split("+")
    mix = (CFG.num_heads if per_head else 1) * len(mixers) if len(mixers) > 1 else 0
    extra = _extra()
    per_layer = sum(extra[m] for m in mixers) + mix - extra["vanilla"]
    assert _count(model) - vanilla == (CFG.num_layers + CFG.num_decoder_layers) * per_layer
    frozen = sum(p.numel() for p in model.parameters() if not p.requires_grad)
    assert frozen == (4 * CFG.num_heads * CFG.max_length**2 if "fixed_random" in mixers else 0)


def test_length_beyond_max_length_is_a_clear_error():
    model = _model(encoder_attention="random")
    ids = torch.randint(2, 256, (1, CFG.max_length + 1))
    with pytest.raises(ValueError, match=r"sequence length 17 exceeds model.max_length \(16\)"):
        model(ids, torch.ones_like(ids), ids[:, :4])
    vanilla = _model()  # dot-product attention has no length limit
    assert vanilla(ids, torch.ones_like(ids), ids[:, :4]).logits.shape == (1, 4, 256)


def test_check_model_rejects_bad_config_in_one_line():
    with pytest.raises(ValueError, match="model.decoder_attention 'dense\\+randm': unknown mixer 'randm'"):
        check_model(dataclasses.replace(CFG, decoder_attention="dense+randm"))
    with pytest.raises(ValueError, match=r"model.max_length \(0\) must be >= 1"):
        check_model(dataclasses.replace(CFG, max_length=0))


def test_mixture_weights_per_layer_and_per_head():
    model = _model(encoder_attention="random+vanilla", decoder_attention="dense", mixture_per_head=True)
    with torch.no_grad():
        model.encoder.layers[1].attn.mix.copy_(torch.log(torch.tensor([1.0, 3.0])).expand(4, 2))
    w = model.mixture_weights()
    assert sorted(w) == ["encoder.layers.0", "encoder.layers.1"] and model.mixers["encoder"] == ("random", "vanilla")
    torch.testing.assert_close(w["encoder.layers.1"], torch.tensor([[0.25, 0.75]] * 4))
    assert _model().mixture_weights() == {}
    assert _model(decoder_attention="random+dense").mixture_weights()["decoder.layers.0"].shape == (2,)


def test_activation_recompute_replays_dropout_masks():
    init_single_process()
    from megatron.core import tensor_parallel

    batch = (torch.randint(2, 256, (2, 12)), torch.ones(2, 12, dtype=torch.long), torch.randint(2, 256, (2, 6)))
    labels = torch.randint(2, 256, (2, 6))
    grads = []
    tracker = tensor_parallel.get_cuda_rng_tracker()
    for checkpointing in (False, True):
        torch.manual_seed(0)
        model = build_local_model(dataclasses.replace(CFG, dropout=0.3, encoder_attention="random+vanilla"))
        for stack in (model.encoder, model.decoder):
            stack.activation_checkpointing = checkpointing
        torch.manual_seed(1)
        tracker.set_states({name: torch.Generator().manual_seed(5).get_state() for name in tracker.get_states()})
        model(*batch, labels).loss.backward()
        grads.append({n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None})
    assert grads[0].keys() == grads[1].keys()
    for name in grads[0]:
        torch.testing.assert_close(grads[1][name], grads[0][name], rtol=1e-5, atol=1e-7)


def test_universal_checkpoint_patterns_are_exclusive_and_all_used():
    model = _model(encoder_attention="random+vanilla", decoder_attention="dense+factorized_dense")
    info = universal_checkpoint_info(model, original_vocab_size=250)
    assert info["original_vocab_size"] == 250 and "universal_checkpoint_version" in info
    names = [n for n, _ in model.named_parameters()]
    categories = ["tp_replicated_parameter_patterns", "parameter_with_row_parallelism_patterns",
                  "parameter_with_2_sub_params_cat_dim_0"]
    for name in names:
        hits = [c for c in categories for p in info[c] if re.match(p, name)]
        assert len(hits) <= 1, (name, hits)
    for c in categories + ["vocabulary_parameter_patterns"]:
        assert all(any(re.match(p, n) for n in names) for p in info[c])
    replicated = [n for n in names if any(re.match(p, n) for p in info["tp_replicated_parameter_patterns"])]
    assert all(n.endswith("norm.weight") or n.endswith(".mix") for n in replicated)
    assert [n for n in names if any(re.match(p, n) for p in info["vocabulary_parameter_patterns"])] == \
        ["embed.weight", "lm_head.weight"]


def test_flops_match_a_count_of_the_vanilla_matmuls():
    from pretrain.model.flops import flops_per_sequence

    cfg = ModelConfig(vocab_size=32128)  # T5 v1.1 small, its tokenizer padded to 128
    n, m, d, f, inner, v = 512, 114, 512, 1024, 384, 32128
    attn = lambda q, k: 2 * (3 * q * d * inner + q * k * inner * 2 + q * inner * d)  # noqa: E731
    cross = 2 * m * d * inner + 2 * 2 * n * d * inner + 2 * 2 * m * n * inner + 2 * m * inner * d
    ffn = lambda t: 2 * 3 * t * d * f  # noqa: E731
    forward = 8 * (attn(n, n) + ffn(n)) + 8 * (attn(m, m) + cross + ffn(m)) + 2 * m * d * v
    assert flops_per_sequence(cfg, n, m) == 3 * forward
    synth = dataclasses.replace(cfg, encoder_attention="random", decoder_attention="random")
    assert flops_per_sequence(synth, n, m) == 3 * forward - 3 * 8 * (4 * n * d * inner + 2 * n * n * inner) \
        - 3 * 8 * (4 * m * d * inner + 2 * m * m * inner)


def test_every_mixers_flops_are_the_matmuls_torch_counts():
    # each mixer's Mixer.flops (pretrain/model/flops.py) against torch's count of the matmuls of its materialised
    # layers, for a forward above a vanilla model's (which cancels the cross-attention SDPA the counter leaves out), of
    # one sequence (a batch computes input-independent logits once)
    from torch.utils.flop_counter import FlopCounterMode

    from pretrain.model import build_model
    from pretrain.model.flops import flops_per_sequence

    init_single_process()
    ids, dec = torch.randint(2, 256, (1, 12)), torch.randint(2, 256, (1, 6))
    counted, modelled = {}, {}
    for spec in SPECS:
        cfg = dataclasses.replace(CFG, encoder_attention=spec, decoder_attention=spec)
        with FlopCounterMode(display=False) as counter:
            build_model(cfg, sdpa=False)(ids, torch.ones_like(ids), dec)
        counted[spec], modelled[spec] = counter.get_total_flops(), flops_per_sequence(cfg, 12, 6)
    for spec in SPECS:
        assert 3 * (counted[spec] - counted["vanilla"]) == modelled[spec] - modelled["vanilla"], spec


def test_loss_matches_log_softmax_and_keeps_gradients_normal():
    from pretrain.model.loss import vocab_parallel_cross_entropy

    init_single_process()
    torch.manual_seed(0)
    logits = (torch.randn(3, 5, 4096) * 30).requires_grad_()  # T5 v1.1 init scale: many subnormal probs
    labels = torch.randint(0, 4096, (3, 5))
    labels[0, 0] = logits[0, 0].argmin()  # a label ~200 below the maximum keeps its full loss
    ref_logits = logits.detach().double().requires_grad_()
    ref = torch.nn.functional.cross_entropy(ref_logits.flatten(0, 1), labels.flatten(), reduction="none")
    before = logits.detach().clone()
    loss = vocab_parallel_cross_entropy(logits, labels)  # [3, 5]
    torch.testing.assert_close(loss.double(), ref.view(3, 5), rtol=1e-6, atol=0)
    assert torch.equal(logits.detach(), before)  # the input logits are not overwritten
    (loss.sum() / 15).backward()
    (ref.sum() / 15).backward()
    grad, ref_grad = logits.grad, ref_logits.grad.float()
    assert (ref_grad.abs() < torch.finfo(torch.float32).tiny).logical_and(ref_grad != 0).any()  # reference has some
    assert not (grad.abs() < torch.finfo(torch.float32).tiny).logical_and(grad != 0).any()  # ours: none
    torch.testing.assert_close(grad, ref_grad, rtol=1e-5, atol=1e-20)  # floor: < 2e-22 x 1/15


def test_shared_parameters_start_equal_whatever_the_mixers():
    # a study pairs seed s of every variant: the parameters two variants share (embeddings, norms, FFNs,
    # cross-attention, output projections, vanilla's Q/K/V in a mixture) start bit for bit equal, and the
    # generator is left in the same state (training-time draws), though the variants draw different extras
    states, after = {}, {}
    for spec in SPECS:
        model = _model(encoder_attention=spec, decoder_attention=spec)
        states[spec] = dict(model.named_parameters())
        after[spec] = torch.rand(4)
    vanilla = states["vanilla"]
    for spec in SPECS:
        shared = vanilla.keys() & states[spec].keys()
        assert len(shared) > len(vanilla) // 2 and "encoder.layers.1.attn.o.weight" in shared, spec
        for name in shared:
            assert torch.equal(vanilla[name], states[spec][name]), (spec, name)
        assert torch.equal(after["vanilla"], after[spec]), spec
    assert "encoder.layers.0.attn.qkv.weight" in states["random+vanilla"]  # vanilla's Q/K/V are shared too
    torch.manual_seed(0)  # the base seed is a draw of the caller's generator: two models in a row differ
    first, second = build_local_model(CFG), build_local_model(CFG)
    assert not torch.equal(first.embed.weight, second.embed.weight)


def test_the_position_bias_ablation_pairs_with_vanilla():
    # random(position_bias=none) of seed s starts with vanilla's shared parameters too: the bias is left out, nothing
    # else is drawn differently; without a bias anywhere no stack has the parameter
    vanilla = dict(_model().named_parameters())
    ablation = dict(_model(encoder_attention="random", decoder_attention="random", position_bias="none").named_parameters())
    assert not [n for n in ablation if "relative_bias" in n]
    shared = vanilla.keys() & ablation.keys()
    assert "encoder.layers.1.attn.o.weight" in shared and "decoder.layers.0.cross.q.weight" in shared
    assert all(torch.equal(vanilla[n], ablation[n]) for n in shared)
    # vanilla keeps its bias under "vanilla" (the same function as "all"); a stack of Random does not
    mixed = dict(_model(encoder_attention="random", position_bias="vanilla").named_parameters())
    assert "decoder.relative_bias.weight" in mixed and "encoder.relative_bias.weight" not in mixed


# Initial logit std per mixer at T5 v1.1 small widths (d_model 512, 6 heads of 64, N = 512, k = 8), docs/model.md
# "Initial scale": closed forms, where a variant has one, of the real modules' logits on unit-RMS inputs
SMALL = ModelConfig(d_model=512, d_kv=64, num_heads=6, max_length=512, factorized_k=8)
TRUNCATED = 0.8796  # std of a normal truncated at 2 standard deviations, in units of the untruncated one
INITIAL_STD = {
    "t5": {"vanilla": 1.0, "random": 1.0, "fixed_random": 1.0, "factorized_random": 1.0,
           "dense": 0.5**0.5,  # relu of unit-variance W1 x: second moment 1/2, times d_kv weights of variance 1/d_kv
           "factorized_dense": 0.5},  # two such factors, multiplied
    "mesh_tf": {"vanilla": 1.0,
                "random": (2 / (6 * 512 + 512 * 512)) ** 0.5,  # glorot of Mesh TF's R [N, heads, N]: 0.0027
                "fixed_random": (2 / (6 * 512 + 512 * 512)) ** 0.5,
                "factorized_random": 2 / (8**0.5 * (6 + 512)),  # sqrt(k) x glorot of R1, R2 [k, heads, N], squared
                # relu(q), q of std 1/sqrt(d_kv) (T5's query), times W2 of Mesh TF's dense kernel: 0.078
                "dense": TRUNCATED * (0.5 / 64) ** 0.5,
                "factorized_dense": 0.0067},  # A and B share their hidden layer: measured, near 0.387 / d_kv = 0.006
}


@pytest.mark.parametrize("init", ["t5", "mesh_tf"])
def test_initial_logit_std_per_mixer(init):
    from bench.synthesizer_init import initial_logit_std

    for mixer, expected in INITIAL_STD[init].items():
        got = initial_logit_std(dataclasses.replace(SMALL, synthesizer_init=init), mixer)
        assert got == pytest.approx(expected, rel=0.05 if mixer != "factorized_dense" else 0.15), (mixer, got)


def test_every_registered_mixer_has_its_parameter_count_and_initial_std():
    assert_covers(_extra(), "test_model._extra()")
    for init, table in INITIAL_STD.items():
        assert_covers(table, f"test_model.INITIAL_STD[{init!r}]")


def test_the_remote_code_draws_synthesizers_as_ours():
    # a model built from an export's config.json by HF (not loaded) starts from the same distributions as ours
    from pretrain.model.hf_convert import hf_config
    from pretrain.model.hf_synthesizer.modeling_synthesizer_t5 import SynthesizerT5ForConditionalGeneration
    from pretrain.model.pretrained import self_attention_hf_name

    synthesizers = [name for name, mixer in MIXERS.items() if mixer.build is not None]
    spec = "+".join(synthesizers)
    for init in ("t5", "mesh_tf"):
        cfg = dataclasses.replace(SMALL, vocab_size=128, num_layers=1, num_decoder_layers=1, encoder_attention=spec,
                                  decoder_attention="vanilla", synthesizer_init=init)
        torch.manual_seed(0)
        ours = {n: p for n, p in build_local_model(cfg).named_parameters() if ".synth." in n}
        hf = dict(SynthesizerT5ForConditionalGeneration(hf_config(cfg)).named_parameters())
        assert len(ours) == len([n for n in hf if n.startswith("encoder.") and ".synth." in n])
        assert {n.split(".synth.")[1].split(".")[0] for n in ours} == set(synthesizers)
        for name, p in ours.items():
            other = hf[self_attention_hf_name(name)]
            std, expected = float(other.detach().std()), float(p.detach().std())
            assert other.shape == p.shape and std == pytest.approx(expected, rel=0.05, abs=1e-9), (init, name)


def test_the_untied_lm_head_starts_as_mesh_tf_and_the_first_loss_near_ln_vocab():
    # Mesh TF / T5X draw the untied lm_head with std d_model^-0.5 (HF's T5 draws 1.0: logits of variance d_model and
    # a first loss of 20+ nats at configs/tiny.yaml); the padding rows stay zero
    from pretrain.core.config import Config, load_config

    cfg = load_config(Config, "configs/tiny.yaml").model
    torch.manual_seed(0)
    model = build_local_model(cfg).eval()
    head = model.lm_head.weight.detach()
    assert float(head[: cfg.vocab_size].std()) == pytest.approx(cfg.d_model**-0.5, rel=0.02)
    assert not head[cfg.vocab_size :].any()
    assert float(model.embed.weight.detach()[: cfg.vocab_size].std()) == pytest.approx(1.0, rel=0.02)  # the input: 1.0
    ids, targets = torch.randint(2, cfg.vocab_size, (8, 64)), torch.randint(2, cfg.vocab_size, (8, 14))  # [b, n], [b, m]
    with torch.no_grad():
        loss = float(model(ids, None, targets, labels=targets).loss)
    assert abs(loss - math.log(cfg.vocab_size)) < 1.0, (loss, math.log(cfg.vocab_size))
