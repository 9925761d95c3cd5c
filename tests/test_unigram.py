"""The unigram baseline (pretrain.data.unigram): a hand-worked stream of labels, and the baseline of a config's
validation slice through the CLI: exactly the targets the trainer's eval scores (every DP rank's part)."""
from __future__ import annotations

import json
import math
from collections import Counter

import pytest
import torch

from pretrain.core.config import UsageError
from pretrain.data.loader import build_eval_loader
from pretrain.data.unigram import main, unigram_baseline
from tests.conftest import PreparedData


def _entropy(counts: Counter) -> float:
    total = sum(counts.values())
    return -sum(c / total * math.log(c / total) for c in counts.values())


def test_a_hand_worked_stream():
    # tokens 5 x5, 7 x3, 9 x1 (the -100 padding is not scored): H = -(5/9 ln 5/9 + 3/9 ln 3/9 + 1/9 ln 1/9)
    labels = [torch.tensor([[5, 5, 7, -100], [9, 5, -100, -100]]), torch.tensor([[7, 7, 5, 5]])]
    out = unigram_baseline(labels)
    assert out["tokens"] == 9 and out["unigram_accuracy"] == pytest.approx(5 / 9)
    assert out["unigram_loss"] == pytest.approx(-(5 / 9 * math.log(5 / 9) + 3 / 9 * math.log(3 / 9) + 1 / 9 * math.log(1 / 9)))
    assert out["unigram_loss"] == pytest.approx(0.9368883, abs=1e-7)
    with pytest.raises(UsageError, match="no target tokens"):
        unigram_baseline([torch.full((2, 3), -100)])


def test_the_validation_slice_the_trainer_scores(shards: PreparedData, tmp_path, capsys):
    # eval.batches 3 x train.global_batch 4 = 12 examples, whatever the micro batch (2) or the DP size (2 here)
    data = shards.config()
    counts: Counter = Counter()
    for rank in range(2):
        for batch in build_eval_loader(data, dp_rank=rank, dp_size=2, micro_batch=2, num_examples=12):
            counts.update(batch["labels"][batch["labels"] != -100].tolist())
    out = tmp_path / "baseline.json"
    assert main(["--config", "configs/tiny.yaml", f"data.train={shards.train}", f"data.valid={shards.valid}",
                 f"data.tokenizer={shards.tokenizer}", "train.global_batch=4", "train.micro_batch=2",
                 "eval.batches=3", "--output", str(out)]) == 0
    result = json.loads(out.read_text())
    assert result == json.loads(capsys.readouterr().out)
    assert result["tokens"] == sum(counts.values()) == 12 * 14  # 64 inputs -> 14 targets per example
    assert result["unigram_loss"] == pytest.approx(_entropy(counts), rel=1e-12)
    assert result["unigram_accuracy"] == max(counts.values()) / sum(counts.values())
    assert "first 12 examples" in result["source"] and shards.valid in result["source"]


def test_a_config_without_validation_data_is_one_line(capsys):
    with pytest.raises(SystemExit) as err:
        main(["--config", "configs/tiny.yaml"])
    assert err.value.code == 2 and "data.valid is empty" in capsys.readouterr().err


def test_the_study_writes_the_baseline_of_its_pretraining_slice(shards: PreparedData, tmp_path):
    from pretrain.core.config import Config, load_config
    from pretrain.data.unigram import eval_baseline
    from pretrain.experiments.grid import StudyConfig
    from pretrain.experiments.runner import write_baseline

    overrides = ["train.global_batch=4", "eval.batches=5", "data.input_length=32"]
    study = load_config(StudyConfig, None, [f"study.dir={tmp_path}", "data.fetch=false", f"data.train={shards.train}",
                                            f"data.valid={shards.valid}", f"data.tokenizer={shards.tokenizer}",
                                            f"pretrain.overrides=[{','.join(overrides)}]"])
    write_baseline(study)
    job = load_config(Config, "configs/tiny.yaml", [*overrides, f"data.train={shards.train}",
                                                    f"data.valid={shards.valid}", f"data.tokenizer={shards.tokenizer}"])
    assert json.loads((tmp_path / "baseline.json").read_text()) == eval_baseline(job)
    assert eval_baseline(job)["tokens"] == 20 * 8  # 32 inputs -> 8 targets per example
