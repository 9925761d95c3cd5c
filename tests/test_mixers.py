"""The registry of mixers (pretrain/model/mixers) and what must agree with it without importing it: the remote code
that exports ship (self-contained, so it keeps its own names and classes) and docs/model.md's table of mixers."""
from __future__ import annotations

import dataclasses
import re
from pathlib import Path

import pytest
import torch
from megatron.core import ModelParallelConfig

from pretrain.core.config import ModelConfig
from pretrain.distributed.parallel import init_single_process
from pretrain.model.hf_convert import hf_config
from pretrain.model.hf_synthesizer import configuration_synthesizer_t5 as remote_config
from pretrain.model.hf_synthesizer import modeling_synthesizer_t5 as remote_model
from pretrain.model.mixers import MIXERS

ROOT = Path(__file__).resolve().parents[1]
# N = 12 = 3 x 4: factorized_dense's a != b, so a transposed tile/repeat would show
CFG = ModelConfig(vocab_size=64, d_model=16, d_ff=32, d_kv=4, num_heads=2, num_layers=1, num_decoder_layers=1,
                  max_length=12, factorized_k=3)
SYNTHESIZERS = [name for name, mixer in MIXERS.items() if mixer.build is not None]


def test_remote_code_names_the_registered_mixers_in_order():
    assert remote_config.MIXERS == tuple(MIXERS)  # what a synthesizer_t5 config.json may name
    assert sorted(remote_model.SYNTHESIZERS) == sorted(SYNTHESIZERS)  # the classes it builds them with


def _parameters(module: torch.nn.Module) -> dict[str, tuple[tuple[int, ...], bool]]:
    return {name: (tuple(p.shape), p.requires_grad) for name, p in module.named_parameters()}


@pytest.mark.parametrize("name", SYNTHESIZERS)
@pytest.mark.parametrize("synthesizer_init", ["t5", "mesh_tf"])
def test_remote_synthesizer_has_our_parameters_and_logits(name: str, synthesizer_init: str) -> None:
    """Each registered synthesizer's remote class: our parameter names, shapes and trainability (an export copies
    `synth.NAME.*` across unchanged), and our logits from our weights, for rows past the start as in decoding."""
    init_single_process()
    torch.manual_seed(0)
    cfg = dataclasses.replace(CFG, encoder_attention=name, synthesizer_init=synthesizer_init)
    ours = MIXERS[name].build(cfg, ModelParallelConfig(use_cpu_initialization=True), 0, 1)
    theirs = remote_model.SYNTHESIZERS[name](hf_config(cfg))
    assert _parameters(theirs) == _parameters(ours)
    with torch.no_grad():
        for p in ours.parameters():
            p.normal_()  # zero biases would hide a bias that the other side leaves out
        theirs.load_state_dict(dict(ours.named_parameters()))
        x = torch.randn(2, 5, cfg.d_model)
        for start, m in ((0, 5), (3, 8), (7, 12)):
            torch.testing.assert_close(theirs(x, start, m), ours(x, start, m))  # [b|1, heads, 5, m]


def test_docs_table_lists_every_mixer():
    section = (ROOT / "docs/model.md").read_text().split("## Mixers and their parameters", 1)[1].split("\n## ", 1)[0]
    names = {n.strip() for row in re.findall(r"^\| ([\w /]+) \|", section, re.M) for n in row.split("/")}
    assert set(MIXERS) <= names
