"""What only a GPU can check, run on one (skipped without CUDA; bench/gpu_check.sh's `cuda_tests` section runs them
on the one-GPU kit, docs/cluster.md): each fused attention form on the kernel pretrain/model/sdpa.py names, against
the float64 materialised reference, in fp32 and bf16, T5's bias trained; torch's own kernel choice for the project's
calls against the rules the fake-CUDA tests assume (tests/fake_cuda/sdpa_rules.py); selective and full recompute with
dropout 0.1 replaying the forward's masks (megatron's CUDA RNG tracker) through the same kernel; torch.compile on
CUDA against eager. `PRETRAIN_TEST_DEVICE=cpu` runs the same bodies on the CPU, to check the tests themselves."""
from __future__ import annotations

import dataclasses
import os

import pytest
import torch
from megatron.core import tensor_parallel
from torch.nn.attention import SDPBackend

from pretrain.distributed.parallel import init_rng, init_single_process
from pretrain.model import build_model
from pretrain.model.mixers import parse_mixers
from pretrain.model.t5 import padding_mask
from tests.fake_cuda.sdpa_rules import torch_choice
from tests.test_attention import CFG as LAYER_CFG
from tests.test_attention import _reference
from tests.test_fast_paths import CFG, _batch, _run
from tests.test_fused_attention import FUSED, Ops, _grads, _layer

DEVICE = os.environ.get("PRETRAIN_TEST_DEVICE") or ("cuda" if torch.cuda.is_available() else None)
pytestmark = pytest.mark.skipif(DEVICE is None, reason="needs a CUDA device (bench/gpu_check.sh runs these on one)")
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
# relative error (norm of the difference over the reference's) of a whole output or gradient: fp32 kernels sum in
# another order than float64 (the memory-efficient kernel's softmax is online); bf16 keeps 8 bits of mantissa. On an
# H200 (2026-12-04) the worst was 2.2e-7 / 6.4e-7 (fp32 output / gradient) and 5.6e-3 / 1.3e-2 (bf16). A wrong
# formula is off by O(1): a weight not folded in, a lost column
RELATIVE = {"fp32": 1e-5, "bf16": 3e-2}


@pytest.fixture
def cuda_rng():
    """megatron's CUDA RNG tracker for the test (dropout streams, the state recompute restores), the CPU one after."""
    init_single_process()
    init_rng(0, cuda=DEVICE == "cuda")
    yield
    init_rng(0, cuda=False)


class Shapes(Ops):
    """The ATen ops that run under it, with their first argument's shape."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        first = args[0] if args and isinstance(args[0], torch.Tensor) else None
        self.seen.append((func.overloadpacket.__name__, tuple(first.shape) if first is not None else ()))
        return func(*args, **(kwargs or {}))


def _relative(got: torch.Tensor, ref: torch.Tensor) -> float:
    return float((got.detach().double().cpu() - ref.detach()).norm() / ref.detach().norm())


# the layers with a fused form, a mixture whose other mixer goes into the trained mask, and one without a fused form
SPECS = [*FUSED, "random+vanilla", "random"]


@pytest.mark.parametrize("dtype", sorted(DTYPES))
@pytest.mark.parametrize("spec", SPECS)
def test_cuda_attention_layer_equals_float64_reference(spec, dtype):
    mixers = parse_mixers(spec)
    per_head = len(mixers) > 1
    reference = _layer(spec, per_head).train()  # float64 on the CPU
    b, n, h = 3, 11, LAYER_CFG.num_heads  # n < max_length: synthesized matrices sliced
    x, g = torch.randn(b, n, LAYER_CFG.d_model, dtype=torch.float64), torch.randn(b, n, LAYER_CFG.d_model,
                                                                                 dtype=torch.float64)
    keep = torch.ones(b, n, dtype=torch.long)
    keep[1, 8:] = 0
    bias = torch.randn(1, h, n, n, dtype=torch.float64, requires_grad=True)  # T5's bias: trained
    ref = _reference(reference, mixers, x, bias, padding_mask(keep, torch.float64))
    (ref * g).sum().backward()
    expected = {**_grads(reference), "bias": bias.grad}

    dt = DTYPES[dtype]
    layer = _layer(spec, per_head).to(DEVICE, dt).train()  # the same parameters (same seed), on the device
    on = {name: t.to(DEVICE, dt) for name, t in (("x", x), ("g", g))}
    bias_on = bias.detach().to(DEVICE, dt).requires_grad_()
    with Shapes() as ops:
        out = layer(on["x"], bias_on, padding_mask(keep.to(DEVICE), dt))
        (out * on["g"]).sum().backward()
    got = {**_grads(layer), "bias": bias_on.grad}
    # on CUDA every layer with a Q' K'^T mixer takes its fused form, but an input-independent one under a trained mask
    fused = DEVICE == "cuda" and layer.dot and not layer.cuda_materialises_with_trained_mask
    kernel = "_scaled_dot_product_efficient_attention"  # the trained mask: sdpa.py names the memory-efficient kernel
    # materialised logits (or SDPA's math path): a softmax over [.., n, m] (a mixture's weights take one over mixers)
    logits = [op for op, shape in ops.seen if "softmax" in op and shape[-2:] == (n, n)]
    assert (kernel in [op for op, _ in ops.seen] and not logits) if fused else logits, sorted(set(ops.seen))
    assert _relative(out, ref) < RELATIVE[dtype], f"output: {_relative(out, ref):.2e}"
    assert got.keys() == expected.keys()
    errors = {name: _relative(got[name], expected[name]) for name in expected}
    print(f"{spec} {dtype}: relative error output {_relative(out, ref):.1e}, worst gradient {max(errors.values()):.1e} "
          f"({max(errors, key=errors.get)})")
    assert all(e < RELATIVE[dtype] * 3 for e in errors.values()), {k: f"{e:.1e}" for k, e in errors.items()}


def _backend_name(value: int) -> str:
    return next(name for name, b in SDPBackend.__members__.items() if int(b.value) == value)


@pytest.mark.skipif(DEVICE != "cuda", reason="torch's kernel choice needs a CUDA device")
@pytest.mark.parametrize("dtype", ["bf16", "fp32"])
@pytest.mark.parametrize("mask", ["none", "trained", "fixed", "causal"])
def test_cuda_torch_chooses_the_kernel_the_rules_predict(mask, dtype):
    # the project's base shapes (12 heads of 64, N 512); the fake-CUDA tests rely on these rules (priority and
    # refusals transcribed from torch's sdp_utils.cpp) for what an H200 runs; here torch's own choice on this GPU
    dt = DTYPES[dtype]
    b, h, n, d = 4, 12, 512, 64
    q, k, v = (torch.randn(b, h, n, d, device="cuda", dtype=dt, requires_grad=True) for _ in range(3))
    attn_mask = None if mask in ("none", "causal") else torch.randn(1, h, n, n, device="cuda", dtype=dt,
                                                                      requires_grad=mask == "trained")
    chosen = _backend_name(torch._fused_sdp_choice(q, k, v, attn_mask, 0.0, mask == "causal", scale=1.0))
    call = {"q": q.shape, "k": k.shape, "v": v.shape, "dtype": str(dt), "last_stride_1": True, "dropout": 0.0,
            "mask": None if attn_mask is None else {"shape": tuple(attn_mask.shape), "dtype": str(dt),
                                                     "grad": attn_mask.requires_grad},
            "causal": mask == "causal", "grad": True}
    cudnn = torch.backends.cudnn.version() or 0
    print(f"torch {torch.__version__}, cuDNN {cudnn}: {mask} mask, {dtype}: torch chooses {chosen}")
    assert chosen == torch_choice(call, cudnn), f"cuDNN {cudnn}: torch chose {chosen}"


def _model(spec: str, dropout: float, mode: str = "none", compile: bool = False):
    cfg = dataclasses.replace(CFG, encoder_attention=spec, decoder_attention=spec, dropout=dropout,
                              mixture_per_head=True)
    torch.manual_seed(0)  # the device's generator draws the weights: the same model in every call
    return build_model(cfg, activation_checkpointing=mode, compile=compile, device=DEVICE)


def _on_device(batch):
    return [t if t is None else t.to(DEVICE) for t in batch]


@pytest.mark.parametrize("spec", ["random+vanilla", "dense+vanilla"])
def test_cuda_recompute_with_dropout_replays_the_forward(spec, cuda_rng):
    # attention dropout 0.1 (fine-tuning's) inside the kernel and on the hidden states: megatron's recompute runs the
    # core (selective) or the layer (full) again in the backward, restoring the CUDA generator and the tracker's TP
    # stream, through the kernel the forward took; its gradients are those of no recompute
    batch = _on_device(_batch(padded=True))
    results, kernels = [], {}
    for mode in ("none", "selective", "full"):
        model = _model(spec, 0.1, mode)
        tensor_parallel.model_parallel_cuda_manual_seed(5) if DEVICE == "cuda" else init_rng(5, cuda=False)
        torch.manual_seed(5)
        with Ops() as forward:
            out = model(*batch)
        with Ops() as backward:
            out.loss.backward()
        results.append((out.loss.detach(), out.logits.detach(),
                        {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}))
        kernels[mode] = [op for op in forward.seen if op.startswith("_scaled_dot_product")], \
            [op for op in backward.seen if op.startswith("_scaled_dot_product") and not op.endswith("backward")]
    for mode, result in zip(("selective", "full"), results[1:]):
        errors = _errors(result, results[0])
        print(f"{spec}, dropout 0.1, {mode} recompute against none: worst relative error {max(errors.values()):.1e}")
        assert max(errors.values()) < 1e-4, errors
    if DEVICE == "cuda":  # (the CPU runs dropout through SDPA's math path: no kernel op to compare)
        forward, recomputed = kernels["selective"]
        assert forward and sorted(set(recomputed)) == sorted(set(forward)), kernels  # the same kernel in both passes
        assert not kernels["none"][1]  # without recompute the backward runs no forward kernel
    errors = _errors(_run(_model(spec, 0.1), *batch), results[0])  # the masks matter: another stream, others
    assert max(errors.values()) > 1e-2, errors


def _errors(got, ref) -> dict[str, float]:
    """Relative errors of a (loss, logits, gradients) result against another."""
    pairs = {"loss": (got[0], ref[0]), "logits": (got[1], ref[1]), **{n: (got[2][n], ref[2][n]) for n in ref[2]}}
    return {name: float((a.double() - b.double()).norm() / b.double().norm()) for name, (a, b) in pairs.items()}


@pytest.mark.parametrize("dtype", sorted(DTYPES))
def test_cuda_compiled_layers_equal_eager(dtype, cuda_rng):
    # torch.compile (inductor's Triton kernels on CUDA) of an encoder layer (vanilla) and a decoder layer (a mixture)
    ids, _, dec, labels, _ = _on_device(_batch(padded=False))
    results = []
    for compiled in (False, True):
        model = _model("random+vanilla", 0.0, compile=compiled).to(DTYPES[dtype])
        results.append(_run(model, ids, None, dec, labels, None))
    errors = _errors(results[1], results[0])
    print(f"compiled against eager, {dtype}: worst relative error {max(errors.values()):.1e} "
          f"({max(errors, key=errors.get)})")
    assert errors["loss"] < RELATIVE[dtype] and errors["logits"] < RELATIVE[dtype], errors
    assert max(errors.values()) < RELATIVE[dtype] * 10, errors
