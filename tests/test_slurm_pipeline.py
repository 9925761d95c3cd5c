"""slurm/pipeline.sh and the data steps on a real SLURM (tests/slurm_cluster.py): the data-preparation array
job writes the same shards as one process, its steps run in dependency order, and a failed step cancels
every step that depends on it."""
from __future__ import annotations

import filecmp
import shutil
from datetime import datetime
from pathlib import Path

from tests.conftest import PreparedData
from tests.slurm_cluster import SlurmCluster

REPO = Path(__file__).resolve().parents[1]


def _pipeline(cluster: SlurmCluster, *args: str, **env: str) -> dict[str, str]:
    """Run slurm/pipeline.sh; returns {step: job id} from its `STEP JOBID` lines."""
    out = cluster.run("slurm/pipeline.sh", *args, cwd=REPO, extra_env={"OMP_NUM_THREADS": "1", **env})
    return dict(line.split() for line in out.stdout.splitlines())


def _time(stamp: str) -> datetime:
    return datetime.fromisoformat(stamp)


def test_prepare_array_matches_single_process(slurm_cluster: SlurmCluster, c4_dir: Path, shards: PreparedData,
                                              tmp_path: Path) -> None:
    (tmp_path / "tokenizer").mkdir()
    shutil.copy(shards.tokenizer, tmp_path / "tokenizer" / "spiece.model")
    # 8 files over 3 array tasks (3 + 3 + 2 files), then the index job
    jobs = _pipeline(slurm_cluster, "--stages", "prepare", "--input", f"{c4_dir}/c4-train.*.json.gz",
                     "--work", str(tmp_path), PREPARE_TASKS="3")
    assert list(jobs) == ["prepare", "index"]
    tasks = slurm_cluster.wait(jobs["prepare"])
    index = slurm_cluster.wait(jobs["index"])[0]
    logs = "\n".join(p.read_text() for p in sorted((tmp_path / "logs").iterdir()))
    assert [t["JobState"] for t in tasks] == ["COMPLETED"] * 3, logs
    assert index["JobState"] == "COMPLETED", logs
    assert _time(index["StartTime"]) >= max(_time(t["EndTime"]) for t in tasks)  # afterok held it back

    # byte-identical to the single-process run of the same files with the same tokenizer (conftest's shards)
    single = Path(shards.train)
    names = sorted(p.name for p in single.iterdir())
    assert sorted(p.name for p in (tmp_path / "shards").iterdir()) == names
    match, mismatch, errors = filecmp.cmpfiles(single, tmp_path / "shards", names, shallow=False)
    assert (mismatch, errors) == ([], [])
    assert len(match) == 2 * 8 + 1  # 8 tars, 8 sidecars, index.json


def test_failed_step_cancels_what_depends_on_it(slurm_cluster: SlurmCluster, c4_dir: Path, tmp_path: Path) -> None:
    # --vocab-size 0 makes tokenizer training exit 2 at once; nothing after it may start
    jobs = _pipeline(slurm_cluster, "--input", f"{c4_dir}/c4-train.*.json.gz", "--work", str(tmp_path),
                     "--config", "configs/tiny.yaml", "--vocab-size", "0", "--finetune-tasks", "cola,rte",
                     "--finetune-data", str(tmp_path / "glue"))
    assert list(jobs) == ["tokenizer", "prepare", "index", "pretrain", "export", "finetune"]
    tokenizer = slurm_cluster.wait(jobs["tokenizer"])[0]
    assert (tokenizer["JobState"], tokenizer["ExitCode"]) == ("FAILED", "2:0")
    for step in ["prepare", "index", "pretrain", "export", "finetune"]:
        for rec in slurm_cluster.wait(jobs[step]):
            assert (rec["JobState"], rec["Reason"]) == ("CANCELLED", "DependencyNeverSatisfied"), (step, rec)
            assert rec["StartTime"] in ("Unknown", rec["EndTime"]), (step, rec)
    assert [p.name for p in (tmp_path / "logs").iterdir()] == [f"tokenizer-{jobs['tokenizer']}.out"]
    assert not (tmp_path / "shards").exists()
    assert not (tmp_path / "run").exists()


def test_pipeline_rejects_unknown_stage(slurm_cluster: SlurmCluster, tmp_path: Path) -> None:
    out = slurm_cluster.run("slurm/pipeline.sh", "--work", str(tmp_path), "--stages", "tokenizer,pretrian",
                            cwd=REPO, check=False)
    assert out.returncode == 2
    assert "unknown stage 'pretrian'" in out.stderr
    assert not (tmp_path / "logs").exists()  # refused before submitting anything
