"""Initialisation keyed by parameter name: the draws of each part of the model come from the global generator
reseeded with (the model's base seed, the part's dotted name), so a parameter's initial value depends on
neither which other modules the model has nor the order they are built in. A variant that adds a
synthesizer (random+vanilla) starts with vanilla's embeddings, FFNs, norms and dot-product projections bit
for bit, which is what pairs a study's cells of one seed. Every TP rank still draws the same full tensor and
keeps its slice, so TP=N and TP=1 start as the same function.

    with model_init():                  # T5Model.__init__: one base draw from the caller's generator
        with init_scope("encoder"):     # nested scopes name the parts: "encoder.layers.0.attn.qkv"
            ...
"""
from __future__ import annotations

import contextlib
import hashlib
from typing import Iterator

import torch
from torch._subclasses.fake_tensor import is_fake, unset_fake_temporarily

_base: int | None = None  # the base seed of the model being built (None: scopes are no-ops)
_path: list[str] = []


def _seed(base: int, path: str) -> int:
    return int.from_bytes(hashlib.sha256(f"{base}/{path}".encode()).digest()[:8], "little") >> 1


def _host_seed() -> int:
    """One draw from the host's generator. Under fake tensors (the CUDA path rehearsed without a GPU, tests/fake_cuda)
    tensors hold no values, so the draw is made outside them: the same number, the generator left where it is."""
    with unset_fake_temporarily():  # a no-op outside FakeTensorMode
        return int(torch.randint(0, 2**31 - 1, (), dtype=torch.int32, device="cpu"))


def holds_values(t: torch.Tensor) -> bool:
    """False for tensors of shapes and dtypes only (meta, fake): an initialiser that reads its draws on the host
    (rejection sampling) skips them, as torch's own initialisers skip meta tensors."""
    return not (t.is_meta or is_fake(t))


@contextlib.contextmanager
def model_init() -> Iterator[None]:
    """Draw the base seed from the caller's CPU generator (so two models built in a row differ, and the same
    `torch.manual_seed` gives the same model); afterwards the generators are back where the base draw left
    them, whatever the model holds (training-time draws such as dropout do not depend on the variant)."""
    global _base
    # one int32 scalar on the host, whatever the device (a model built on the GPU holds nothing there); a build
    # on `meta` (the planner's shapes, a model whose weights come from a file) draws nothing at all
    meta = torch.get_default_device().type == "meta"
    base = 0 if meta else _host_seed()
    devices = range(torch.cuda.device_count()) if torch.cuda.is_initialized() else []
    outer, _base = _base, base
    try:
        with torch.random.fork_rng(devices=devices):
            yield
    finally:
        _base = outer


@contextlib.contextmanager
def init_scope(name: str) -> Iterator[None]:
    """The draws inside come from a generator seeded by (base seed, the dotted path of the enclosing scopes and
    `name`); outside `model_init` (a module built on its own) the caller's generator is left alone."""
    _path.append(name)
    try:
        if _base is not None:
            torch.manual_seed(_seed(_base, ".".join(_path)))
        yield
    finally:
        _path.pop()
