"""Every fine-tuning result is printed beside the majority-class baseline and chance: the baselines of hand-counted
validation sets in each task's own metrics, and the evaluation job's table and results.md naming them (what
`make demo` prints is fine-tuning's results.md: tests/test_finetune.py checks that run's rows); the job's two passes
(validation, test) name their files in the progress lines."""
from __future__ import annotations

import logging
from pathlib import Path

import pytest

from pretrain.tasks import Example, get_task
from pretrain.tasks.baselines import baselines
from tests.test_evaluate import CFG, sst2_folder


def _examples(labels: list) -> list[Example]:
    return [Example(i, f"x {i}", "", label) for i, label in enumerate(labels)]


def test_baselines_in_each_tasks_metrics():
    # sst2: 3 negative, 2 positive -> every example "negative": 3/5 right; a guess between 2 words: 1/2
    assert baselines(get_task("sst2"), _examples([0, 1, 0, 1, 0])) == {
        "majority class (negative)": {"accuracy": 0.6}, "chance (2 classes)": {"accuracy": 0.5}}
    # mrpc (F1 of class 1, then accuracy): 3 of 4 equivalent -> tp 3, fp 1: F1 = 6 / 7; accuracy 3/4
    mrpc = baselines(get_task("mrpc"), _examples([1, 1, 0, 1]))
    assert mrpc["majority class (equivalent)"] == pytest.approx({"f1": 6 / 7, "accuracy": 0.75})
    assert mrpc["chance (2 classes)"] == {"accuracy": 0.5}
    # cola: a constant prediction correlates with nothing (Matthews 0); so does a guess
    cola = baselines(get_task("cola"), _examples([1, 0, 1]))
    assert cola == {"majority class (acceptable)": {"matthews_corr": 0.0}, "chance (2 classes)": {"matthews_corr": 0.0}}
    assert baselines(get_task("mnli"), _examples([2, 2, 0]))["chance (3 classes)"] == {"accuracy": pytest.approx(1 / 3)}
    assert baselines(get_task("stsb"), _examples([3.2, 1.0])) == {}  # a regression has no class to guess


def test_the_evaluation_job_prints_its_score_beside_the_baselines(tmp_path, tokenizer_model, capsys, caplog):
    from pretrain.evaluate import main
    from pretrain.model import build_local_model
    from pretrain.transfer.exporting import write_export

    export = write_export(build_local_model(CFG), Path(tokenizer_model), tmp_path / "export")
    caplog.set_level(logging.INFO, logger="pretrain")
    main(["--export", str(export), "--task", "sst2", "--data", str(sst2_folder(tmp_path / "glue")),
          "--output", str(tmp_path / "out"), "--device", "meta", "--batch", "2"])
    # tests/test_evaluate.py's 5 sentences, labelled i % 2: 3 negative, 2 positive
    rows = ["| sst2: majority class (negative) | 60.00 | 60.00 |", "| sst2: chance (2 classes) | 50.00 | 50.00 |"]
    printed = capsys.readouterr().out
    for text in (printed, (tmp_path / "out" / "results.md").read_text()):
        lines = text.splitlines()
        assert lines[0] == "| task | accuracy | accuracy_rank |" and lines[2].startswith("| sst2 | ")
        assert lines[3:5] == rows, text
    passes = {r.getMessage().split(":")[0] for r in caplog.records if r.name == "pretrain.core.progress"}
    assert passes == {"sst2 dev.tsv both", "sst2 test.tsv both"}
