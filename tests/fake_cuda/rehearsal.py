"""The model's CUDA path rehearsed on fake tensors: one training step (forward, loss, backward, torch's fused AdamW)
per case, on device "cuda" of a CPU-only torch, with every gradient's device, dtype and shape checked, under a
strict dtype mode that refuses what CUDA refuses and fake tensors let pass.

Run by tests/test_fake_cuda.py in a fresh interpreter that preloads the fake CUDA device (tests/fake_cuda/__init__.py):
    python -m tests.fake_cuda.rehearsal OUT.json TP CASE [CASE ...]
writes {case: {"error": None or the traceback, "sdpa": the distinct attention calls (SdpaCalls)}} for each case. A case is WIDTH-tpTP-SPEC-VARIANT, e.g. base-tp1-random+vanilla-bf16-padded-full
(`case_id`); the test module holds the list, and runs one interpreter per TP.
"""
from __future__ import annotations

import contextlib
import dataclasses
import json
import sys
import traceback
from types import SimpleNamespace
from typing import Iterator
from unittest import mock

import torch
import torch.distributed as dist
import torch.nn.functional as F
from deepspeed.runtime.engine import DeepSpeedEngine
from megatron.core import parallel_state
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.testing._internal.distributed.fake_pg import FakeStore
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from pretrain.core.config import Config, ModelConfig, load_config
from pretrain.distributed.parallel import init_rng, init_single_process
from pretrain.model import build_model

aten = torch.ops.aten

# the widths of the shipped configs at one layer a stack (every layer of a stack runs the same code on the stack's
# shared bias) and short sequences: fake tensors cost per op, not per element
WIDTHS = {"tiny": "configs/tiny.yaml", "base": "configs/base.yaml"}
NUM_LAYERS = 1
BATCH, INPUT_LENGTH, TARGET_LENGTH = 2, 24, 8
VOCAB = 1100  # configs/tiny.yaml's; base reads its vocabulary from the tokenizer (0)

# precision x batch x recompute. bf16: the weights cast as DeepSpeed's bf16 engine casts them (module.bfloat16()),
# no autocast; autocast: fp32 weights under torch.autocast("cuda", bfloat16); padded: masks on both sides (fine-tuning
# batches), unpadded: none (pretraining after span corruption)
VARIANTS = ("bf16-padded-selective", "bf16-unpadded-selective", "bf16-padded-full", "bf16-unpadded-full",
            "autocast-padded-none", "fp32-unpadded-none")

# CUDA's GEMM and attention kernels take operands of one float dtype; fake tensors (and the CPU) promote or accept
MATMULS = {aten.mm, aten.bmm, aten.addmm, aten.baddbmm, aten.addbmm, aten.linear, aten.matmul,
           aten._scaled_dot_product_efficient_attention, aten._scaled_dot_product_flash_attention,
           aten._scaled_dot_product_cudnn_attention, aten._efficient_attention_forward, aten._flash_attention_forward,
           aten._scaled_dot_product_efficient_attention_backward, aten._scaled_dot_product_flash_attention_backward,
           aten._scaled_dot_product_cudnn_attention_backward}


class StrictDtypes(TorchDispatchMode):
    """Raises where a matmul-like op gets floating operands of different dtypes (bf16 @ fp32, an fp32 attention bias
    beside bf16 queries), as the CUDA kernels do."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func.overloadpacket in MATMULS:
            dtypes = {t.dtype for t in tree_leaves((args, kwargs))
                      if isinstance(t, torch.Tensor) and t.is_floating_point()}
            if len(dtypes) > 1:
                raise RuntimeError(f"{func}: operands of dtypes {sorted(map(str, dtypes))} (CUDA takes one)")
        return func(*args, **kwargs)


class SdpaCalls:
    """Records each `F.scaled_dot_product_attention` call as tests/fake_cuda/sdpa_rules.py reads it: shapes, dtype,
    mask, gradients and the kernel the caller named (the one `sdpa_kernel` left enabled). A pass-through in SDPA's
    place while entered, as the planner counts it (pretrain/planning/memory.py): a torch function mode would miss the
    recompute, which runs on autograd's device thread."""

    def __init__(self) -> None:
        self.calls: list[dict] = []
        self.real = F.scaled_dot_product_attention

    def __enter__(self) -> SdpaCalls:
        def recording(*args, **kwargs):
            self.calls.append(_describe(*args, **kwargs))
            return self.real(*args, **kwargs)

        F.scaled_dot_product_attention = recording
        return self

    def __exit__(self, *exc) -> None:
        F.scaled_dot_product_attention = self.real


def _describe(q, k, v, attn_mask=None, dropout_p=0.0, is_causal=False, **_) -> dict:
    enabled = {"FLASH_ATTENTION": torch.backends.cuda.flash_sdp_enabled(),
               "EFFICIENT_ATTENTION": torch.backends.cuda.mem_efficient_sdp_enabled(),
               "CUDNN_ATTENTION": torch.backends.cuda.cudnn_sdp_enabled(), "MATH": torch.backends.cuda.math_sdp_enabled()}
    named = [name for name, on in enabled.items() if on]
    # under autocast the kernel gets every floating input, the mask too, in autocast's dtype
    cast = torch.get_autocast_dtype("cuda") if torch.is_autocast_enabled("cuda") and q.is_cuda else None
    dtype = (lambda t: str(cast if cast is not None and t.is_floating_point() else t.dtype))  # noqa: E731
    return {"q": list(q.shape), "k": list(k.shape), "v": list(v.shape), "dtype": dtype(q),
            "last_stride_1": all(t.stride(-1) == 1 for t in (q, k, v, attn_mask) if t is not None),
            "mask": None if attn_mask is None else {"shape": list(attn_mask.shape), "dtype": dtype(attn_mask),
                                                     "grad": attn_mask.requires_grad},
            "dropout": dropout_p, "causal": is_causal,
            "grad": torch.is_grad_enabled() and any(t.requires_grad for t in (q, k, v)),
            "named": named[0] if len(named) == 1 else "any"}


@contextlib.contextmanager
def cuda_autocast_allowed() -> Iterator[None]:
    """torch.autocast("cuda") switches itself off where CUDA is not available: here it is told otherwise."""
    with mock.patch("torch.cuda.amp.common.amp_definitely_not_available", return_value=False), \
            mock.patch("torch.cuda.is_bf16_supported", return_value=True):
        yield


def case_id(width: str, tp: int, spec: str, variant: str) -> str:
    return f"{width}-tp{tp}-{spec}-{variant}"


def parse_case(case: str) -> tuple[str, int, str, str]:
    """case_id's (width, tp, spec, variant)."""
    width, tp, spec, variant = case.split("-", 3)
    return width, int(tp.removeprefix("tp")), spec, variant


def model_config(width: str, spec: str) -> ModelConfig:
    cfg = load_config(Config, WIDTHS[width]).model
    return dataclasses.replace(cfg, vocab_size=cfg.vocab_size or VOCAB, num_layers=NUM_LAYERS,
                               num_decoder_layers=NUM_LAYERS, encoder_attention=spec, decoder_attention=spec)


def batch(cfg: ModelConfig, padded: bool) -> dict[str, torch.Tensor]:
    """One micro batch on "cuda"; padded: the last example's tail is padding on both sides."""
    ids = torch.randint(2, cfg.vocab_size, (BATCH, INPUT_LENGTH), device="cuda")
    targets = torch.randint(2, cfg.vocab_size, (BATCH, TARGET_LENGTH), device="cuda")
    out = {"input_ids": ids, "decoder_input_ids": targets, "labels": targets}
    if padded:
        keep = torch.ones(BATCH, INPUT_LENGTH, dtype=torch.long, device="cuda")
        keep_targets = torch.ones(BATCH, TARGET_LENGTH, dtype=torch.long, device="cuda")
        keep[-1, INPUT_LENGTH // 2:] = 0
        keep_targets[-1, TARGET_LENGTH // 2:] = 0
        out |= {"attention_mask": keep, "decoder_attention_mask": keep_targets}
    return out


def train_step(width: str, spec: str, variant: str, sdpa: SdpaCalls) -> None:
    """Build, cast, forward, loss, backward and one fused AdamW step of one case; raise on any wrong gradient."""
    precision, padding, recompute = variant.split("-")
    cfg = model_config(width, spec)
    with FakeTensorMode(), StrictDtypes(), sdpa:
        model = build_model(cfg, activation_checkpointing=recompute, device="cuda")
        if precision == "bf16":  # DeepSpeed's own cast of a bf16 engine's parameters (p.data = p.data.to(bf16))
            DeepSpeedEngine._cast_module_mixed_precision(SimpleNamespace(module=model), torch.bfloat16, None, False)
        model.train()
        # the check is passed in the backward too: megatron's linear layers re-enter autocast there (custom_bwd)
        with cuda_autocast_allowed():
            with torch.autocast("cuda", torch.bfloat16, enabled=precision == "autocast"):
                loss = model(**batch(cfg, padding == "padded")).loss
            loss.backward()
        dtype = torch.bfloat16 if precision == "bf16" else torch.float32
        for name, p in model.named_parameters():
            if not p.requires_grad:
                continue
            assert p.grad is not None, f"{name}: no gradient"
            got = (p.grad.device.type, p.grad.dtype, tuple(p.grad.shape))
            assert got == ("cuda", dtype, tuple(p.shape)), f"{name}: gradient {got}, expected {('cuda', dtype, tuple(p.shape))}"
        optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-3, fused=True)
        optimizer.step()


def init_groups(tp: int) -> None:
    """TP 1: a 1-process gloo group; TP > 1: this process as rank 0 of torch's fake process group of `tp` ranks (its
    collectives return at once, which fake tensors need: nothing to add up), megatron's groups on it."""
    if tp == 1:
        init_single_process()
        return
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=tp)
    parallel_state.initialize_model_parallel(tensor_model_parallel_size=tp, create_gloo_process_groups=False)
    init_rng(0, cuda=False)


def main(out: str, tp: int, cases: list[str]) -> None:
    """Run `cases` (all of TP `tp`) and write their results to `out`."""
    init_groups(tp)
    results = {}
    for case in cases:
        width, case_tp, spec, variant = parse_case(case)
        assert case_tp == tp, f"{case} is not a TP {tp} case"
        sdpa = SdpaCalls()
        try:
            train_step(width, spec, variant, sdpa)
            error = None
        except Exception:  # noqa: BLE001 (each case's error goes to its test)
            error = traceback.format_exc()
        calls = {json.dumps(call, sort_keys=True) for call in sdpa.calls}  # the distinct calls: one per stack and pass
        results[case] = {"error": error, "sdpa": [json.loads(call) for call in sorted(calls)]}
    with open(out, "w") as f:
        json.dump(results, f)


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]), sys.argv[3:])
