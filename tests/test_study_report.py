"""The study's report on hand-made cells (cell.json, export, baseline.json written here): every cell of the
table, the paired differences and their intervals, the verdicts and the figures, checked against numbers
worked out by hand; and the rebuilt initialisation (how far weights moved) against a real run that did not move."""
from __future__ import annotations

import csv
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from tests.conftest import PreparedData

REPO = Path(__file__).resolve().parents[1]


def test_rebuilt_initialisation_equals_a_run_that_did_not_move(tmp_path: Path, shards: PreparedData) -> None:
    """A real one-cell study whose pretraining takes one step of lr 1e-30 (far below an fp32 ulp of the weights):
    its export is its initialisation, so the rebuilt one must equal it bit for bit and nothing has moved."""
    import torch
    from safetensors.torch import load_file

    from pretrain.figures import synthesizer_matrices
    from pretrain.model.pretrained import export_config
    from pretrain.study_movement import initial_model

    config = tmp_path / "study.yaml"
    config.write_text(yaml.safe_dump({
        "study": {"dir": str(tmp_path / "out"), "seeds": [3],
                  "variants": [{"encoder": "random+vanilla", "decoder": "factorized_random+vanilla"}]},
        "data": {"fetch": False, "train": shards.train, "valid": shards.valid, "tokenizer": shards.tokenizer},
        "pretrain": {"config": "configs/tiny.yaml",
                     "overrides": ["train.steps=1", "train.lr=1e-30", "eval.every=0", "data.workers=0"]},
    }))
    proc = subprocess.run([sys.executable, "-m", "pretrain.study", "--config", str(config)], cwd=REPO,
                          env=dict(os.environ, OMP_NUM_THREADS="1"), capture_output=True, text=True)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    export = tmp_path / "out" / "cells" / "random-vanilla-factorized_random-vanilla-s3" / "export"
    end = synthesizer_matrices(load_file(str(export / "model.safetensors")))
    start = synthesizer_matrices(initial_model(export_config(export), 3).state_dict())
    assert sorted(end) == sorted(start) and len(end) == 4  # 2 encoder Random + 2 decoder Factorized Random layers
    for key in end:
        assert torch.equal(end[key], start[key]), key
    with (tmp_path / "out" / "results.csv").open() as f:
        row = next(csv.DictReader(f))
    assert float(row["moved/random"]) == 0.0 and float(row["moved/mixture"]) == 0.0
