"""How far a study cell's learned weights moved from their initialisation (the paper's question 3).

- `moved/random`: the relative Frobenius change ||R_end - R_0|| / ||R_0|| of all the cell's input-independent
  synthesizer matrices together (Random, Fixed Random, Factorized Random as R1 R2^T, every layer and head).
  R_end is the export; R_0 is rebuilt exactly: `initial_model` seeds and builds as `pretrain.train` does
  (init_rng(run.seed), then build_model), on the CPU. A run trained on GPUs drew its initialisation from the
  CUDA generator, so for it R_0 is not the one it started from: tests/test_study_report.py checks the rebuild
  against a run that took one step of lr 1e-30 (its export equals its initialisation) on the CPU.
- `moved/mixture`: the mean total-variation distance 1/2 sum_i |w_i - 1/k| of the mixture weights (softmax of
  `mix`, initialised at 0, i.e. uniform) from uniform, over layers (and heads for per-head weights), read from
  the export's config.json (`synthesizer.mixture_weights`).
"""
from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import load_file

from pretrain.core.config import ModelConfig
from pretrain.distributed.parallel import init_rng, init_single_process
from pretrain.model import T5Model, build_local_model
from pretrain.model.pretrained import CONFIG, export_config, weight_files
from pretrain.runtime.pictures import synthesizer_matrices


def initial_model(cfg: ModelConfig, seed: int) -> T5Model:
    """The model `pretrain.train` starts from with run.seed = `seed` on the CPU (TP 1); the caller's global
    random state is left as it was."""
    init_single_process()
    state = torch.get_rng_state()
    try:
        init_rng(seed, cuda=False)
        return build_local_model(cfg)
    finally:
        torch.set_rng_state(state)


def relative_change(start: dict[str, torch.Tensor], end: dict[str, torch.Tensor]) -> float:
    """||end - start|| / ||start|| over all tensors of `start` together (Frobenius norms)."""
    moved = sum(float((end[k].float() - t.float()).pow(2).sum()) for k, t in start.items())
    size = sum(float(t.float().pow(2).sum()) for t in start.values())
    return (moved / size) ** 0.5


def distance_from_uniform(mixture: dict[str, list]) -> float:
    """Mean total-variation distance from uniform of the mixture weights {layer: [k] or [heads][k]}."""
    tensors = [torch.tensor(w, dtype=torch.float64) for w in mixture.values()]
    weights = torch.cat([t.reshape(-1, t.shape[-1]) for t in tensors])  # [layers (x heads), k]
    return float((weights - 1.0 / weights.shape[1]).abs().sum(dim=1).mean() / 2)


def movement(export: Path, seed: int) -> dict[str, float]:
    """{"moved/random": ..., "moved/mixture": ...} of one cell's export (each key only when the model has them)."""
    out = {}
    end = synthesizer_matrices({k: v for f in weight_files(export) for k, v in load_file(str(f)).items()})
    if end:
        start = synthesizer_matrices(initial_model(export_config(export), seed).state_dict())
        out["moved/random"] = relative_change(start, end)
    mixture = json.loads((export / CONFIG).read_text())["synthesizer"].get("mixture_weights") or {}
    if mixture:
        out["moved/mixture"] = distance_from_uniform(mixture)
    return out
