"""What the tests cover, read from the mixer registry (pretrain.model.mixers.MIXERS) and the shipped configs, so
that a mixer added to the registry is tested without editing the tests' lists: `SPECS`, every mixer and every
shipped mixture; `assert_covers`, the check that a test's table of per-mixer references (a formula, a count, a
shape) or its hand-picked cases name every registered mixer, and nothing else; it fails naming what is missing."""
from __future__ import annotations

from pathlib import Path
from typing import Iterable

import yaml

from pretrain.model.mixers import MIXERS, parse_mixers

REPO = Path(__file__).resolve().parents[1]
ATTENTION_KEYS = ("encoder_attention", "decoder_attention", "encoder", "decoder")  # model sections, study variants


def shipped_mixtures(pattern: str = "**/*.yaml") -> list[str]:
    """Every mixture ("a+b") a config under configs/ matching `pattern` names for a stack (the default: any config;
    "*.yaml": the size configs), in the registry's order of its parts."""
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

    for file in sorted((REPO / "configs").glob(pattern)):
        walk(yaml.safe_load(file.read_text()))
    order = list(MIXERS)
    return sorted(found, key=lambda spec: [order.index(name) for name in parse_mixers(spec)])


SPECS = [*MIXERS, *shipped_mixtures()]  # every mixer alone, then every mixture a shipped config trains


def assert_covers(specs: Iterable[str], what: str) -> None:
    """The mixers that `specs` (a reference table's keys, or the specs of a test's cases) name are the registry's."""
    named = {name for spec in specs for name in spec.split("+")}
    missing, unknown = [n for n in MIXERS if n not in named], sorted(named - set(MIXERS))
    assert not missing and not unknown, f"{what}: no entry for registered mixer(s) {missing}; unregistered {unknown}"


def has_fused_form(spec: str) -> bool:
    """Whether every mixer of `spec` has logits of the form Q' K'^T (vanilla, or a module with `factors`): the layer
    then runs one fused attention call with nothing full-rank in its mask (pretrain/model/attention.py)."""
    return all(MIXERS[name].build is None or hasattr(MIXERS[name].build, "factors") for name in parse_mixers(spec))
