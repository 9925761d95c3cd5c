"""The study end to end on real data: a grid of vanilla, a mistyped variant (its cells must fail) and a
Dense+Random mixture, 2 seeds, a few steps each, driven through the real CLIs. The study is killed once after
its first cell finished and the second cell's pretraining saved a checkpoint, then rerun: the first cell is
not redone, the second resumes from its checkpoint, the failing cells are reported and the others finish.
Every number in the table is checked against the run's own metrics.jsonl / results.json / safetensors, and a
paired difference with its interval against scipy's paired t-test on those numbers."""
from __future__ import annotations

import csv
import json
import os
import signal
import statistics
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml
from scipy import stats

from tests.conftest import PreparedData

REPO = Path(__file__).resolve().parents[1]
PNG = b"\x89PNG\r\n\x1a\n"
# the mixture also carries a model setting of its own (variant.model): its label says so, its jobs get it
MIXED, MIXED_SLUG = "dense+random/random(position_bias=none)", "dense-random-random-position_bias-none"
VARIANTS = [{"encoder": "vanilla", "decoder": "vanilla"}, {"encoder": "vanila", "decoder": "vanilla", "name": "typo"},
            {"encoder": "dense+random", "decoder": "random", "model": ["position_bias=none"]}]
CELLS = ["vanilla-s1", "vanilla-s2", "typo-s1", "typo-s2", f"{MIXED_SLUG}-s1", f"{MIXED_SLUG}-s2"]


def _study(config: Path, *extra: str, **popen) -> subprocess.Popen:
    env = dict(os.environ, OMP_NUM_THREADS="1")
    return subprocess.Popen([sys.executable, "-m", "pretrain.study", "--config", str(config), *extra], cwd=REPO,
                            env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, **popen)


@pytest.fixture(scope="module")
def study(tmp_path_factory, shards: PreparedData) -> dict:
    from pretrain.tasks.polarity import fetch_polarity

    tmp = tmp_path_factory.mktemp("study")
    polarity = fetch_polarity(tmp / "polarity")
    config = tmp / "study.yaml"
    config.write_text(yaml.safe_dump({
        "study": {"dir": str(tmp / "out"), "seeds": [1, 2], "variants": VARIANTS,
                  "tasks": [{"name": "polarity", "data": str(polarity)}]},
        "data": {"fetch": False, "train": shards.train, "valid": shards.valid, "tokenizer": shards.tokenizer},
        "pretrain": {"config": "configs/tiny.yaml",
                     "overrides": ["train.steps=6", "checkpoint.every=2", "eval.every=6", "eval.batches=1",
                                   "log.every=2", "data.workers=0"]},
        "finetune": {"overrides": ["train.steps=2", "train.micro_batch=8", "train.global_batch=8", "log.every=1",
                                   "eval.method=rank", "eval.limit=16", "task.train_examples=32",
                                   "eval.submission=false"]},
    }))
    cells = tmp / "out" / "cells"
    # first run: killed (with its jobs) once cell 1 is finished and cell 2's pretraining saved a checkpoint
    first = _study(config, start_new_session=True)
    while first.poll() is None and not (cells / "vanilla-s2" / "pretrain" / "checkpoints" / "latest").is_file():
        time.sleep(0.1)
    if first.poll() is not None:  # ended on its own: every cell failed, see why
        pytest.fail(f"the study ended before it could be killed:\n{first.communicate()[0][-5000:]}")
    os.killpg(first.pid, signal.SIGKILL)
    first.wait()
    killed_at = (cells / "vanilla-s2" / "pretrain" / "checkpoints" / "latest").read_text().strip()
    cell1 = {p: p.stat().st_mtime_ns for p in (cells / "vanilla-s1").rglob("*") if p.is_file()}
    second = _study(config)
    out = second.communicate()[0]
    return {"root": tmp / "out", "config": config, "rc": second.returncode, "out": out, "killed_at": killed_at,
            "cell1": cell1}


def _rows(root: Path) -> list[dict]:
    with (root / "results.csv").open() as f:
        return list(csv.DictReader(f))


def test_every_file_written(study: dict) -> None:
    root = study["root"]
    assert study["rc"] == 1, study["out"]  # a cell failed: the study says so in its exit code
    assert {p.name for p in root.iterdir()} >= {"results.csv", "results.md", "figures", "cells"}
    for cell in CELLS:
        finished = not cell.startswith("typo")
        assert (root / "cells" / cell / "cell.json").is_file() == finished, cell
        if finished:
            for part in ("pretrain/metrics.jsonl", "export/model.safetensors", "finetune/polarity/results.json",
                         "scratch/polarity/results.json"):
                assert (root / "cells" / cell / part).is_file(), (cell, part)


def test_killed_study_resumes_without_redoing_finished_cells(study: dict) -> None:
    cells = study["root"] / "cells"
    assert "vanilla seed 1: finished earlier, skipped" in study["out"]
    # nothing of the finished cell was rewritten by the second run
    assert {p: p.stat().st_mtime_ns for p in (cells / "vanilla-s1").rglob("*") if p.is_file()} == study["cell1"]
    # the interrupted pretraining continued from the checkpoint it had saved
    log = (cells / "vanilla-s2" / "logs" / "pretrain.log").read_text()
    assert log.count("$ ") == 2
    step = int(study["killed_at"].removeprefix("step_"))
    assert f"at step {step}" in log.split("$ ")[2]
    steps = [json.loads(line)["step"] for line in (cells / "vanilla-s2" / "pretrain" / "metrics.jsonl").read_text().splitlines()]
    assert steps == sorted(set(steps)) and steps[-1] == 6


def test_failing_cell_reported_while_others_finish(study: dict) -> None:
    rows = _rows(study["root"])
    assert [(r["variant"], r["seed"]) for r in rows] == [(v, s) for v in ("vanilla", "typo", MIXED)
                                                         for s in ("1", "2")]
    for row in rows:
        if row["variant"] == "typo":
            assert row["status"].startswith("failed at pretrain (exit "), row
            assert row["eval_loss"] == ""
            assert "unknown mixer 'vanila'" in (study["root"] / "cells" / f"typo-s{row['seed']}" / "logs" / "pretrain.log").read_text()
        else:
            assert row["status"] == "ok", row
    md = (study["root"] / "results.md").read_text()
    assert "- typo seed 1: failed at pretrain (exit " in md


def test_table_cells_equal_the_runs_own_files(study: dict) -> None:
    from safetensors.torch import load_file

    root = study["root"]
    rows = [r for r in _rows(root) if r["status"] == "ok"]
    for row in rows:
        cell = root / "cells" / f"{'vanilla' if row['variant'] == 'vanilla' else MIXED_SLUG}-s{row['seed']}"
        # the variant's own model setting reached its pretraining and its export (and so its from-scratch runs)
        bias = "all" if row["variant"] == "vanilla" else "none"
        assert row["settings"] == ("" if bias == "all" else "position_bias=none")
        assert yaml.safe_load((cell / "pretrain" / "config.yaml").read_text())["model"]["position_bias"] == bias
        assert json.loads((cell / "export" / "config.json").read_text())["synthesizer"]["model"]["position_bias"] == bias
        records = [json.loads(line) for line in (cell / "pretrain" / "metrics.jsonl").read_text().splitlines()]
        speeds = [r["tokens_per_s"] for r in records if "tokens_per_s" in r][1:]  # the first window: warm-up
        assert float(row["tokens_per_s"]) == pytest.approx(sum(speeds) / len(speeds), rel=1e-12)
        last_eval = [r for r in records if "eval_loss" in r][-1]
        assert last_eval["step"] == 6
        assert float(row["eval_loss"]) == last_eval["eval_loss"]
        assert float(row["eval_accuracy"]) == last_eval["eval_accuracy"]
        results = json.loads((cell / "finetune" / "polarity" / "results.json").read_text())
        assert float(row["polarity/accuracy_rank"]) == results["sst2"]["accuracy_rank"]
        # the from-scratch row: the same task, seed and model config (the export's), from a random initialisation
        scratch = json.loads((cell / "scratch" / "polarity" / "results.json").read_text())
        assert float(row["scratch/polarity/accuracy_rank"]) == scratch["sst2"]["accuracy_rank"]
        config = yaml.safe_load((cell / "scratch" / "polarity" / "config.yaml").read_text())
        assert config["from_scratch"] is True and Path(config["init"]) == (cell / "export").resolve() and config["run"]["seed"] == int(row["seed"])
        assert yaml.safe_load((cell / "finetune" / "polarity" / "config.yaml").read_text())["from_scratch"] is False
        assert int(row["parameters"]) == sum(t.numel() for t in load_file(str(cell / "export" / "model.safetensors")).values())
    # the markdown table: mean +- standard deviation over the two seeds
    md = (root / "results.md").read_text()
    for variant in ("vanilla", MIXED):
        losses = [float(r["eval_loss"]) for r in rows if r["variant"] == variant]
        line = next(line for line in md.splitlines() if line.startswith(f"| {variant} |"))
        assert f"{statistics.fmean(losses):.3f} ± {statistics.stdev(losses):.3f}" in line
        assert line.split(" | ")[1] == "2"  # n
    assert "| vanilla |" in md and "1.865" in md  # the paper's C4 log-perplexity beside vanilla
    # the paired difference to vanilla (seed s minus seed s) with the 95% interval of scipy's paired t-test
    loss = {(r["variant"], r["seed"]): float(r["eval_loss"]) for r in rows}
    mixed, vanilla = ([loss[(v, s)] for s in ("1", "2")] for v in (MIXED, "vanilla"))
    lo, hi = stats.ttest_rel(mixed, vanilla).confidence_interval(0.95)
    line = next(line for line in md[md.index("## Paired differences"):].splitlines()
                if line.startswith(f"| {MIXED} |"))
    assert line.split(" | ")[2] == f"{statistics.fmean(mixed) - statistics.fmean(vanilla):.3f} [{lo:.3f}, {hi:.3f}]"
    # how far the mixture's learned weights moved: a number per finished cell, none for vanilla
    for row in rows:
        moved = [row[k] for k in ("moved/random", "moved/mixture")]
        assert all(float(m) > 0 for m in moved) if row["variant"] != "vanilla" else moved == ["", ""], row
    assert f"| Q3 learned weights | {MIXED}'s Random matrices moved beyond noise |" in md


def test_figures_are_pngs_of_the_expected_count(study: dict) -> None:
    import matplotlib.image

    figures = sorted(p.name for p in (study["root"] / "figures").iterdir())
    # vanilla has no mixture and no random matrices; the mixture has both; dense vs vanilla attention
    assert figures == ["attention_dense_vs_vanilla.png", "differences.png", "downstream.png",
                       f"matrices_{MIXED_SLUG}.png", f"mixture_{MIXED_SLUG}.png", "pretrain_loss.png"]
    for name in figures:
        path = study["root"] / "figures" / name
        assert path.read_bytes()[:8] == PNG
        image = matplotlib.image.imread(path)
        assert image.ndim == 3 and min(image.shape[:2]) > 100 and image.std() > 0, name


def test_report_alone_rewrites_the_same_table(study: dict) -> None:
    before = (study["root"] / "results.csv").read_text()
    proc = _study(study["config"], "--stage", "report")
    out = proc.communicate()[0]
    assert proc.returncode == 0, out
    assert (study["root"] / "results.csv").read_text() == before


def test_bad_study_config_is_one_line(tmp_path: Path) -> None:
    config = tmp_path / "s.yaml"
    config.write_text(yaml.safe_dump({"study": {"variants": [{"encoder": "random", "decoder": "random"}] * 2}}))
    proc = _study(config)
    out = proc.communicate()[0]
    assert proc.returncode == 2
    assert out.strip().splitlines() == ["python -m pretrain.study: error: study.variants: two variants are labelled "
                                        "the same (['random', 'random']); set their name"]
    config.write_text(yaml.safe_dump({"study": {"tasks": [{"name": "pair"}, {"name": "rte"}]}}))
    out = _study(config).communicate()[0]
    assert out.strip().splitlines() == ["python -m pretrain.study: error: study.tasks 'rte': set its data folder (only "
                                        "polarity and pair are fetched)"]
    proc = _study(config, "study.sedes=[1]")
    out = proc.communicate()[0]
    assert proc.returncode == 2 and "did you mean 'study.seeds'" in out
    config.write_text(yaml.safe_dump({"study": {"variants": [{"encoder": "random", "decoder": "random",
                                                              "model": ["positon_bias=none"]}]}}))
    out = _study(config).communicate()[0]
    assert out.strip().splitlines() == ["python -m pretrain.study: error: study.variants 'random(positon_bias=none)': "
                                        "model setting 'positon_bias=none' is not KEY=VALUE of a model key (encoder and "
                                        "decoder are the variant's own; e.g. position_bias=none)"]
