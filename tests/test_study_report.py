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

    from pretrain.experiments.movement import initial_model
    from pretrain.model.pretrained import export_config
    from pretrain.runtime.pictures import synthesizer_matrices

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


def _write_cell(cell: Path, row: dict, model, spiece: Path) -> None:
    """A finished cell's files as the study writes them: cell.json, metrics.jsonl (two records), export/."""
    from pretrain.transfer.exporting import write_export

    cell.mkdir(parents=True)
    (cell / "cell.json").write_text(json.dumps({k: v for k, v in row.items() if not k.startswith("moved/")}))
    mix = {f"mixture/encoder.layers.0/{m}": w for m, w in zip(("random", "vanilla"), model.mixture_weights().get(
        "encoder.layers.0", [0.5, 0.5]).tolist())} if "+" in row["encoder"] else {}
    (cell / "pretrain").mkdir()
    (cell / "pretrain" / "metrics.jsonl").write_text("".join(
        json.dumps({"step": step, "loss": 6.0 - step, **mix}) + "\n" for step in (1, 2)))
    write_export(model, spiece, cell / "export")


@pytest.fixture(scope="module")
def hand_study(tmp_path_factory, shards: PreparedData) -> Path:
    """tests/test_study_stats.py's hand study as cell folders: each cell's export is its rebuilt initialisation
    with the Random matrices scaled by 1 + moved/random and the mixture weights set to 0.5 +- moved/mixture,
    so the report must measure exactly the hand numbers; vanilla seed 4 failed; baseline.json by hand."""
    import math

    import torch

    from pretrain.core.config import ModelConfig
    from pretrain.experiments.movement import initial_model
    from pretrain.study import main as study_main
    from tests.test_study_stats import hand_rows

    root = tmp_path_factory.mktemp("hand") / "study"
    tiny = yaml.safe_load((REPO / "configs" / "tiny.yaml").read_text())["model"]
    for row in hand_rows():
        cell = root / "cells" / f"{row['variant'].replace('+', '-')}-s{row['seed']}"
        if row["status"] != "ok":
            cell.mkdir(parents=True)
            (cell / "failed.json").write_text(json.dumps({"stage": "pretrain", "exit_code": 1, "log": "x.log"}))
            continue
        model = initial_model(ModelConfig(**{**tiny, "encoder_attention": row["encoder"],
                                             "decoder_attention": row["encoder"]}), row["seed"])
        with torch.no_grad():
            for name, p in model.named_parameters():
                if name.endswith("synth.random.r"):
                    p.mul_(1 + row["moved/random"])
                elif name.endswith("attn.mix"):  # softmax([a, 0]) = (0.5 + d, 0.5 - d) for a = logit(0.5 + d)
                    d = row["moved/mixture"]
                    p.copy_(torch.tensor([math.log((0.5 + d) / (0.5 - d)), 0.0]))
        _write_cell(cell, row, model, Path(shards.tokenizer))
    (root / "baseline.json").write_text(json.dumps({"unigram_loss": 6.0, "unigram_accuracy": 0.1, "tokens": 1234,
                                                    "source": "written by hand"}))
    config = root / "study.yaml"
    config.write_text(yaml.safe_dump({
        "study": {"dir": str(root), "seeds": [1, 2, 3, 4],
                  "variants": [{"encoder": e, "decoder": e} for e in ("vanilla", "random", "random+vanilla")]},
        "data": {"fetch": False, "train": shards.train, "valid": shards.valid, "tokenizer": shards.tokenizer}}))
    assert study_main(["--config", str(config), "--stage", "report"]) == 0
    return root


def _line(md: str, start: str, after: str = "") -> list[str]:
    """The cells of the first table row starting with `start` below the line `after`."""
    text = md[md.index(after):] if after else md
    line = next(l for l in text.splitlines() if l.startswith(f"| {start} |"))
    return [c.strip() for c in line.strip("|").split(" | ")]


def test_report_of_hand_made_cells(hand_study: Path) -> None:
    from tests.test_study_stats import hand_rows

    with (hand_study / "results.csv").open() as f:
        rows = {(r["variant"], r["seed"]): r for r in csv.DictReader(f)}
    assert len(rows) == 12 and rows[("vanilla", "4")]["status"] == "failed at pretrain (exit 1; x.log)"
    for row in (r for r in hand_rows() if r["status"] == "ok"):  # the movement measured from the exports
        got = rows[(row["variant"], str(row["seed"]))]
        for key in ("moved/random", "moved/mixture"):
            assert (float(got[key]) if got[key] else None) == (pytest.approx(row[key], abs=1e-6) if key in row else None)
    md = (hand_study / "results.md").read_text()
    # main table: vanilla over its 3 finished seeds; the unigram row from baseline.json; scratch: 0.50, 0.52, 0.55
    assert _line(md, "vanilla")[:2] == ["vanilla", "3"] and _line(md, "vanilla")[5] == "5.033 ± 0.153"
    assert _line(md, "unigram (baseline)")[5:7] == ["6.000", "0.100"]
    scratch = _line(md, "vanilla, from random init")
    assert scratch[1] == "3" and scratch[7] == "0.523 ± 0.025" and scratch[5] == "-"
    # differences (worked out in tests/test_study_stats.py): eval loss, eval acc., polarity, pair, tokens/s ratio
    assert _line(md, "random", "## Paired differences") == [
        "random", "3", "0.200 [-0.048, 0.448]", "-0.010 [-0.035, 0.015]", "-0.060 [-0.103, -0.017]",
        "-0.140 [-0.183, -0.097]", "1.15 [1.03, 1.27]"]
    assert _line(md, "vanilla", "## Pretrained minus")[1] == "0.077 [-0.024, 0.177]"
    assert _line(md, "random+vanilla", "## How far")[1:] == ["0.050 [0.025, 0.075]", "0.015 [0.003, 0.027]"]
    assert _line(md, "Q1 pretraining", "## Verdicts") == [
        "Q1 pretraining", "Random is close to vanilla (eval loss within 6% of vanilla's)", "**cannot tell**",
        "eval_loss(random) - eval_loss(vanilla) = 0.200 [-0.048, 0.448] (n=3); rule: within ±0.302"]
    # random+vanilla beats vanilla (supports) has its answer; Random's closeness ([-0.048, 0.448]) does not
    assert ("\n**Q1 not decided**: Random is close to vanilla (eval loss within 6% of vanilla's): cannot tell with an "
            "interval wider than ±0.05 nats (more seeds, or more steps, narrow it).\n") in md
    verdict_lines = [l for l in md[md.index("## Verdicts"):].splitlines() if l.startswith("| Q")]
    assert len(verdict_lines) == 13 and sum("**supports**" in l for l in verdict_lines) == 8
    figures = sorted(p.name for p in (hand_study / "figures").iterdir())
    assert figures == ["differences.png", "downstream.png", "matrices_random-vanilla.png", "matrices_random.png",
                       "mixture_random-vanilla.png", "pretrain_loss.png"]
