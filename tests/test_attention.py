"""Each mixer's forward, through SDPA and through materialised logits, against a plain per-head reference
written from the paper's formulas (masks, slicing to n < N, factorized tile/repeat), and mixer-name validation."""
from __future__ import annotations

import dataclasses

import pytest
import torch
from megatron.core import ModelParallelConfig

from pretrain.core.config import ModelConfig
from pretrain.distributed.parallel import init_single_process
from pretrain.model.attention import SelfAttention
from pretrain.model.mixers import MIXERS, parse_mixers
from pretrain.model.mixers.factorized_dense import factor_pair
from tests.registry import SPECS, assert_covers

CFG = ModelConfig(vocab_size=256, d_model=24, d_ff=32, d_kv=6, num_heads=4, num_layers=1, num_decoder_layers=1,
                  max_length=16, factorized_k=3)
NEG = torch.finfo(torch.float32).min


def _vanilla(attn: SelfAttention, name: str, x: torch.Tensor, h: int, m: int) -> torch.Tensor:
    w = attn.qkv.weight.view(CFG.num_heads, 3, CFG.d_kv, CFG.d_model)
    return (x @ w[h, 0].T) @ (x @ w[h, 1].T).transpose(1, 2)  # Q K^T, T5: no 1/sqrt(d)


def _random(attn: SelfAttention, name: str, x: torch.Tensor, h: int, m: int) -> torch.Tensor:
    b, n, _ = x.shape
    return attn.synth[name].r[h, :n, :m].expand(b, n, m)  # R[:n, :m]


def _factorized_random(attn: SelfAttention, name: str, x: torch.Tensor, h: int, m: int) -> torch.Tensor:
    s, (b, n, _) = attn.synth[name], x.shape
    return (s.r1[h, :n] @ s.r2[h, :m].T).expand(b, n, m)  # R1 R2^T


def _hidden(s, x: torch.Tensor, h: int) -> torch.Tensor:
    rows = slice(h * CFG.d_kv, (h + 1) * CFG.d_kv)
    return torch.relu(x @ s.hidden.w1.weight[rows].T + s.hidden.w1.bias[rows])  # relu(W1 x + b1)


def _dense(attn: SelfAttention, name: str, x: torch.Tensor, h: int, m: int) -> torch.Tensor:
    s = attn.synth[name]
    return (_hidden(s, x, h) @ s.w2[h].T + s.b2[h])[..., :m]  # W2 (.) + b2, sliced to m keys


def _factorized_dense(attn: SelfAttention, name: str, x: torch.Tensor, h: int, m: int) -> torch.Tensor:
    s = attn.synth[name]
    hidden = _hidden(s, x, h)
    a, b = factor_pair(CFG.max_length)
    fa = hidden @ s.wa[h].T + s.ba[h]  # [b, n, a]
    fb = hidden @ s.wb[h].T + s.bb[h]  # [b, n, b]
    # H_A repeats each element b times, H_B tiles the whole vector a times
    return (fa.repeat_interleave(b, dim=-1) * fb.repeat(1, 1, a))[..., :m]


# head h's logits [b, n, m] from the layer's parameters, one formula per registered mixer (paper notation)
LOGITS = {"vanilla": _vanilla, "dense": _dense, "random": _random, "fixed_random": _random,
          "factorized_dense": _factorized_dense, "factorized_random": _factorized_random}


def _reference_logits(attn: SelfAttention, name: str, x: torch.Tensor, h: int, m: int) -> torch.Tensor:
    """Head h's logits [b, n, m]: `LOGITS`'s formula for mixer `name`."""
    return LOGITS[name](attn, name, x, h, m)


def _reference(attn: SelfAttention, mixers, x, bias, mask) -> torch.Tensor:
    b, n, _ = x.shape
    dkv = CFG.d_kv
    w_v = attn.qkv.weight.view(CFG.num_heads, 3, dkv, CFG.d_model)[:, 2] if "vanilla" in mixers \
        else attn.v.weight.view(CFG.num_heads, dkv, CFG.d_model)
    alpha = torch.softmax(attn.mix, -1) if len(mixers) > 1 else torch.ones(1)
    heads = []
    for h in range(CFG.num_heads):
        a = alpha[h] if alpha.dim() == 2 else alpha
        logits = sum(a[i] * _reference_logits(attn, name, x, h, n) for i, name in enumerate(mixers))
        probs = torch.softmax(logits + bias[0, h] + (0 if mask is None else mask[:, 0]), dim=-1)  # [b, n, n]
        heads.append(probs @ (x @ w_v[h].T))
    return torch.cat(heads, dim=-1) @ attn.o.weight.T


# every mixer and shipped mixture, and a mixture of three
VARIANTS = [*SPECS, "factorized_random+vanilla+dense"]


def test_every_registered_mixer_has_a_reference_formula():
    assert_covers(LOGITS, "test_attention.LOGITS")


@pytest.mark.parametrize("sdpa", [True, False])
@pytest.mark.parametrize(
    "spec, per_head", [(v, False) for v in VARIANTS] + [(v, True) for v in VARIANTS if "+" in v]
)
def test_mixer_matches_paper_formula(spec, per_head, sdpa):
    init_single_process()
    torch.manual_seed(0)
    mixers = parse_mixers(spec)
    cfg = dataclasses.replace(CFG, mixture_per_head=per_head)
    attn = SelfAttention(cfg, mixers, ModelParallelConfig(use_cpu_initialization=True), 0, 1, sdpa=sdpa).eval()
    with torch.no_grad():  # non-trivial mixture weights and biases
        for name, p in attn.named_parameters():
            if name.endswith(("mix", "b2", "ba", "bb", "bias")):
                p.normal_()
    b, n = 3, 11  # n < N = 16: synthesized matrices are sliced
    x = torch.randn(b, n, CFG.d_model)
    bias = torch.randn(1, CFG.num_heads, n, n)
    pad = torch.zeros(b, 1, 1, n)
    pad[1, ..., 8:] = NEG
    causal = torch.full((n, n), NEG).triu(1)[None, None]
    # no mask (unpadded batch: logits shared by the batch); encoder padding; decoder causal (+ padding)
    for mask in (None, pad, causal, torch.minimum(causal, pad)):
        out = attn(x, bias, mask)
        ref = _reference(attn, mixers, x, bias, mask)
        torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)


def test_factorized_dense_is_not_block_constant():
    # tile x repeat: column j uses A[j // b] and B[j % b]; neither factor alone decides a column block
    assert factor_pair(512) == (16, 32) and factor_pair(64) == (8, 8) and factor_pair(12) == (3, 4)
    init_single_process()
    torch.manual_seed(0)
    cfg = dataclasses.replace(CFG, max_length=12)  # a, b = 3, 4: a != b, so a transposed grid shows too
    synth = MIXERS["factorized_dense"].build(cfg, ModelParallelConfig(use_cpu_initialization=True), 0, 1)
    with torch.no_grad():
        for p in (synth.ba, synth.bb):
            p.normal_()  # zero biases would leave rows whose relu hidden is all zero at 0 everywhere
        logits = synth(torch.randn(2, 5, cfg.d_model), 0, cfg.max_length)  # [b, heads, n, N]
    grid = logits.unflatten(-1, (3, 4))  # [b, heads, n, a, b]: row i_a holds columns i_a * b .. i_a * b + b - 1
    assert (grid.std(dim=-1) > 0).all()  # varies inside each block of b columns (B tiled)
    assert (grid.std(dim=-2) > 0).all()  # and across blocks (A repeated)
    assert (torch.linalg.matrix_rank(grid) == 1).all()  # each row's N logits are the outer product A B^T


@pytest.mark.parametrize("spec, bad", [("randon", "randon"), ("random+vanila", "vanila"), ("", "")])
def test_unknown_mixer_is_one_line_error_listing_valid_names(spec, bad):
    with pytest.raises(ValueError) as e:
        parse_mixers(spec, "model.encoder_attention")
    msg = str(e.value)
    assert "\n" not in msg and f"unknown mixer '{bad}'" in msg and "factorized_random" in msg


def test_repeated_mixer_rejected():
    with pytest.raises(ValueError, match="names a mixer twice"):
        parse_mixers("random+random")


def test_bf16_logits_and_bias_are_summed_in_fp32():
    from pretrain.model.attention import _softmax

    # logits 256 and a relative bias of 0.5, both bf16 (the engine's dtype): their bf16 sum 256.5 rounds to 256
    # (bf16 spacing there is 2), which would make both weights 0.5
    logits = torch.tensor([[256.0, 256.0]], dtype=torch.bfloat16)
    bias = torch.tensor([[0.5, 0.0]], dtype=torch.bfloat16)
    expected = torch.softmax(torch.tensor([[256.5, 256.0]]), dim=-1).to(torch.bfloat16)  # 0.62 / 0.38
    torch.testing.assert_close(_softmax(logits, bias, torch.bfloat16), expected, rtol=0, atol=0)
