"""slurm/study.sh on the real test SLURM cluster (tests/slurm_cluster.py): a 2-cell study (vanilla, and a
mistyped variant whose pretraining fails) runs as data -> pretraining array -> export array -> report; the
downstream task of the failed cell is cancelled, the other cell finishes, and the report lists both."""
from __future__ import annotations

import csv
from datetime import datetime
from pathlib import Path

import yaml

from tests.conftest import PreparedData
from tests.slurm_cluster import SlurmCluster

REPO = Path(__file__).resolve().parents[1]


def _time(stamp: str) -> datetime:
    return datetime.fromisoformat(stamp)


def test_study_on_slurm(slurm_cluster: SlurmCluster, shards: PreparedData, tmp_path: Path) -> None:
    config = tmp_path / "study.yaml"
    config.write_text(yaml.safe_dump({
        "study": {"dir": str(tmp_path / "out"), "seeds": [1],
                  "variants": [{"encoder": "vanilla", "decoder": "vanilla"}, {"encoder": "vanila", "name": "typo"}]},
        "data": {"fetch": False, "train": shards.train, "valid": shards.valid, "tokenizer": shards.tokenizer},
        "pretrain": {"config": "configs/tiny.yaml",
                     "overrides": ["train.steps=2", "checkpoint.every=0", "eval.every=2", "eval.batches=1",
                                   "log.every=1", "data.workers=0"]},
    }))
    out = slurm_cluster.run("slurm/study.sh", "--config", str(config), "study.seeds=[3]", cwd=REPO,
                            extra_env={"OMP_NUM_THREADS": "1"})
    jobs = dict(line.split() for line in out.stdout.splitlines())
    assert list(jobs) == ["data", "pretrain", "downstream", "report"]
    report = slurm_cluster.wait(jobs["report"])[0]
    logs = "\n".join(f"--- {p.name}\n{p.read_text()[-1500:]}" for p in sorted((tmp_path / "out" / "logs").iterdir()))
    data = slurm_cluster.job(jobs["data"])
    pretrain = {int(t["ArrayTaskId"]): t for t in slurm_cluster.jobs(jobs["pretrain"])}
    downstream = {int(t["ArrayTaskId"]): t for t in slurm_cluster.jobs(jobs["downstream"])}
    assert data["JobState"] == "COMPLETED", logs
    assert (pretrain[0]["JobState"], pretrain[1]["JobState"], pretrain[1]["ExitCode"]) == ("COMPLETED", "FAILED", "1:0"), logs
    assert downstream[0]["JobState"] == "COMPLETED", logs
    assert (downstream[1]["JobState"], downstream[1]["Reason"]) == ("CANCELLED", "DependencyNeverSatisfied")
    assert report["JobState"] == "COMPLETED", logs
    # each downstream task waited for its own pretraining task; the report for every downstream task
    assert _time(downstream[0]["StartTime"]) >= _time(pretrain[0]["EndTime"])
    assert _time(pretrain[0]["StartTime"]) >= _time(data["EndTime"])
    assert _time(report["StartTime"]) >= max(_time(t["EndTime"]) for t in downstream.values())

    with (tmp_path / "out" / "results.csv").open() as f:
        rows = list(csv.DictReader(f))
    assert [(r["variant"], r["seed"], r["status"].split(" (")[0]) for r in rows] == [
        ("vanilla", "3", "ok"), ("typo", "3", "failed at pretrain")]  # the override reached every job
    assert (tmp_path / "out" / "cells" / "vanilla-s3" / "export" / "model.safetensors").is_file()
    assert (tmp_path / "out" / "figures" / "pretrain_loss.png").is_file()
