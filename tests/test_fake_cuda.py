"""The CUDA path rehearsed on a CPU machine (issue 47): the model on device "cuda" as fake tensors, through forward,
loss, backward and torch's fused AdamW, for every mixer of the registry and every mixture a shipped config names, at
tiny.yaml's and base.yaml's widths, in bf16 (DeepSpeed's cast of the weights, padded and unpadded batches, selective
and full recompute), under bf16 autocast and in fp32, at TP 1 (and TP 2 on torch's fake process group); each
gradient's device, dtype and shape checked, every matmul's operands held to one dtype as the CUDA kernels hold them
(tests/fake_cuda/rehearsal.py), and each attention call to the kernel rules of an H200 (tests/fake_cuda/sdpa_rules.py).

The cases run in a fresh interpreter per TP that preloads a fake CUDA device compiled from tests/fake_cuda/shim.cpp
(ATen reads its CUDA hooks once, at `import torch`); each test reads its case's result. What fake tensors cannot
reach (kernels, numerics, streams, events, pinned memory, NCCL, DeepSpeed's CUDA paths) is docs/cluster.md's list.
"""
from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode

from pretrain.data.fetch import default_cache
from pretrain.model import MIXERS
from tests.fake_cuda import build_shim, compiler, fake_cuda_env
from tests.fake_cuda.rehearsal import VARIANTS, WIDTHS, StrictDtypes, case_id, parse_case
from tests.fake_cuda.sdpa_rules import refusal, torch_choice
from tests.registry import REPO, SPECS, shipped_mixtures

# TP 1 in every variant at both widths; TP 2 (torch's fake process group) at base width with padding, full recompute
# and DeepSpeed's bf16 cast, the variant that reaches the most (it keeps the module under a minute on 2 cores)
CASES = [case_id(width, 1, spec, variant) for width in WIDTHS for spec in SPECS for variant in VARIANTS] + \
        [case_id("base", 2, spec, "bf16-padded-full") for spec in SPECS]
NO_COMPILER = "no C++ compiler (c++, or $CXX): the fake CUDA device is built from tests/fake_cuda/shim.cpp; install g++"


@pytest.fixture(scope="module")
def rehearsal(tmp_path_factory) -> dict[str, dict]:
    """{case: {"error": None or its traceback, "sdpa": its attention calls}}: every case in one interpreter with the
    fake CUDA device preloaded."""
    if compiler() is None:
        pytest.skip(NO_COMPILER)
    shim = build_shim(default_cache())
    folder = tmp_path_factory.mktemp("fake_cuda")
    runs = {}
    for tp in sorted({parse_case(case)[1] for case in CASES}):  # megatron's groups: one TP per process, side by side
        out = folder / f"tp{tp}.json"
        runs[out] = subprocess.Popen([sys.executable, "-m", "tests.fake_cuda.rehearsal", str(out), str(tp),
                                      *(case for case in CASES if parse_case(case)[1] == tp)],
                                     cwd=REPO, env=fake_cuda_env(shim))
    results = {}
    for out, run in runs.items():
        assert run.wait() == 0, f"the rehearsal of {out.stem} exited {run.returncode}"
        results |= json.loads(out.read_text())
    return results


@pytest.mark.parametrize("case", CASES)
def test_cuda_train_step(rehearsal: dict[str, dict], case: str):
    assert rehearsal[case]["error"] is None, rehearsal[case]["error"]


# torch 2.13 on an H200 ranks cuDNN first where the runtime cuDNN is newer than 9.15.0, flash first otherwise
CUDNN_FIRST, FLASH_FIRST = 91600, 91500


def _calls(rehearsal: dict[str, dict]) -> list[tuple[str, dict]]:
    calls = [(case, call) for case, result in rehearsal.items() for call in result["sdpa"]]
    assert len(calls) >= 2 * len(rehearsal), "every case has self- and cross-attention calls"
    return calls


def _show(case: str, call: dict) -> str:
    mask = call["mask"] and f"mask {call['mask']['shape']} {call['mask']['dtype']} grad {call['mask']['grad']}"
    return f"{case}: q {call['q']} k {call['k']} v {call['v']} {call['dtype']} {mask or 'no mask'}"


def test_cuda_sdpa_names_a_kernel_an_h200_runs(rehearsal: dict[str, dict]):
    """pretrain/model/sdpa.py names one kernel per call (sdpa_kernel([backend])): on an H200, a kernel torch's rules
    refuse for the call's shapes, dtypes or mask is "No available kernel" there."""
    refused = [f"{_show(case, call)}: {call['named']} refuses: {why}" for case, call in _calls(rehearsal)
               if (why := refusal(call["named"], call, CUDNN_FIRST))]
    assert not refused, "\n".join(refused)


def test_cuda_sdpa_kernels_are_what_the_planner_and_docs_assume(rehearsal: dict[str, dict]):
    """The planner counts every CUDA attention call as a fused kernel (no probabilities saved) and a trained mask's
    gradient as the memory-efficient kernel's backward allocates it (pretrain/planning/memory.py); docs/model.md:
    flash without a mask in bf16, else memory-efficient. Torch's own choice, ranking flash first, is the same kernel;
    ranking cuDNN first (cuDNN > 9.15) it may take cuDNN for calls without a trained mask (docs/cluster.md)."""
    for case, call in _calls(rehearsal):
        half = call["dtype"] == "torch.bfloat16"
        expected = "FLASH_ATTENTION" if call["mask"] is None and half else "EFFICIENT_ATTENTION"
        assert call["named"] == expected, _show(case, call)
        assert torch_choice(call, FLASH_FIRST) == expected, _show(case, call)
        trained_mask = call["mask"] is not None and call["mask"]["grad"]
        allowed = {expected} if trained_mask else {expected, "CUDNN_ATTENTION"}
        assert torch_choice(call, CUDNN_FIRST) in allowed, _show(case, call)


def test_cuda_cases_cover_the_registry_and_the_shipped_mixtures():
    assert {"random+vanilla", "dense+vanilla"} <= set(shipped_mixtures())  # tiny.yaml's, long.yaml's
    assert set(MIXERS) <= set(SPECS)


def test_cuda_strict_dtypes_refuse_what_fake_tensors_let_pass():
    with FakeTensorMode():
        a, b = torch.ones(4, 8, dtype=torch.bfloat16), torch.ones(8, 2)
        assert (a @ b).shape == (4, 2)  # fake tensors compute bf16 @ fp32 (CUDA raises)
        with StrictDtypes():
            assert (a @ b.bfloat16()).dtype == torch.bfloat16
            with pytest.raises(RuntimeError, match=r"aten.mm.default: operands of dtypes \['torch.bfloat16', "
                                                   r"'torch.float32'\]"):
                a @ b
            with pytest.raises(RuntimeError, match="operands of dtypes"):
                torch.nn.functional.linear(a, b.T)
