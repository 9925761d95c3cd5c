"""The CUDA path rehearsed on a CPU machine (issue 47): the model on device "cuda" as fake tensors, through forward,
loss, backward and torch's fused AdamW, for every mixer of the registry and every mixture a shipped config names, at
tiny.yaml's and base.yaml's widths, in bf16 (DeepSpeed's cast of the weights, padded and unpadded batches, selective
and full recompute), under bf16 autocast and in fp32; each gradient's device, dtype and shape checked, and every
matmul's operands held to one dtype as the CUDA kernels hold them (tests/fake_cuda/rehearsal.py).

The cases run in one fresh interpreter that preloads a fake CUDA device compiled from tests/fake_cuda/shim.cpp
(ATen reads its CUDA hooks once, at `import torch`); each test reads its case's result. What fake tensors cannot
reach (kernels, numerics, streams, events, pinned memory, NCCL, DeepSpeed's CUDA paths) is docs/cluster.md's list.
"""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import yaml
from torch._subclasses.fake_tensor import FakeTensorMode

from pretrain.data.fetch import default_cache
from pretrain.model import MIXERS
from pretrain.model.mixers import parse_mixers
from tests.fake_cuda import build_shim, compiler, fake_cuda_env
from tests.fake_cuda.rehearsal import VARIANTS, WIDTHS, StrictDtypes, case_id

REPO = Path(__file__).resolve().parents[1]
ATTENTION_KEYS = ("encoder_attention", "decoder_attention", "encoder", "decoder")  # model sections, study variants


def shipped_mixtures() -> list[str]:
    """Every mixture ("a+b") a config under configs/ names for a stack, in the registry's order of its parts."""
    found = set()

    def walk(node) -> None:
        if isinstance(node, dict):
            for key, value in node.items():
                if key in ATTENTION_KEYS and isinstance(value, str) and "+" in value:
                    found.add(value)
                walk(value)
        elif isinstance(node, list):
            for item in node:
                walk(item)

    for file in sorted((REPO / "configs").rglob("*.yaml")):
        walk(yaml.safe_load(file.read_text()))
    order = list(MIXERS)
    return sorted(found, key=lambda spec: [order.index(name) for name in parse_mixers(spec)])


SPECS = [*MIXERS, *shipped_mixtures()]
CASES = [case_id(width, spec, variant) for width in WIDTHS for spec in SPECS for variant in VARIANTS]
NO_COMPILER = "no C++ compiler (c++, or $CXX): the fake CUDA device is built from tests/fake_cuda/shim.cpp; install g++"


@pytest.fixture(scope="module")
def rehearsal(tmp_path_factory) -> dict[str, str]:
    """{case: "ok" or its error}: every case in one interpreter with the fake CUDA device preloaded."""
    if compiler() is None:
        pytest.skip(NO_COMPILER)
    shim = build_shim(default_cache())
    out = tmp_path_factory.mktemp("fake_cuda") / "results.json"
    subprocess.run([sys.executable, "-m", "tests.fake_cuda.rehearsal", str(out), *CASES], cwd=REPO,
                   env=fake_cuda_env(shim), check=True)
    return json.loads(out.read_text())


@pytest.mark.parametrize("case", CASES)
def test_cuda_train_step(rehearsal: dict[str, str], case: str):
    assert rehearsal[case] == "ok", rehearsal[case]


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
