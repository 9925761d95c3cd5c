"""slurm/pretrain.sbatch on a real SLURM (tests/slurm_cluster.py), the tiny config on CPU (gloo):

- 2 nodes x 2 processes train to the last step;
- `scontrol requeue` in the middle: the job restarts (SLURM_RESTART_COUNT=1) and continues from the
  checkpoint its trainer saved on SIGTERM, with every step logged exactly once and the losses of an
  uninterrupted run (launch.local, same world size) step for step;
- the time-limit path: USR1 to the batch shell, as slurmctld sends it `--signal=B:USR1@<s>` before the limit
  (here with `scancel --batch --signal=USR1`, since a real limit is at least a minute and the signal comes up
  to 30 s late); the trainer checkpoints, the script requeues the job, the job resumes; with MAX_RESTARTS=1 the
  second USR1 ends it with the trainer's "preempted" exit code instead of a third run;
- a node lost mid-run (rank 1's python SIGKILLed after its third step, loader workers on): the job ends FAILED
  at once, is not requeued, and rank 0 says in one line that another rank failed first.

The three jobs and the reference run go at once (--oversubscribe), so the requeue delays overlap.
"""
from __future__ import annotations

import json
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

import pytest

from pretrain.runtime.faults import EXIT_PREEMPTED
from tests.conftest import PreparedData
from tests.slurm_cluster import TERMINAL_STATES, SlurmCluster

REPO = Path(__file__).resolve().parents[1]
STEPS = 60  # ~0.1 s each: the interruptions land while the trainer still has seconds to go
STOP_AT = 6  # interrupt once this step is logged (the trainer stops at the next step boundary)


def _train_args(run_dir: Path, data: PreparedData) -> list[str]:
    return ["--config", "configs/tiny.yaml", f"run.dir={run_dir}", f"data.train={data.train}",
            f"data.valid={data.valid}", f"data.tokenizer={data.tokenizer}", f"train.steps={STEPS}",
            "log.every=1", "checkpoint.every=10", "eval.every=0"]


def _losses(run_dir: Path) -> list[tuple[int, float]]:
    """(step, loss) in the order metrics.jsonl logged them."""
    path = run_dir / "metrics.jsonl"
    if not path.exists():
        return []
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    return [(row["step"], row["loss"]) for row in rows if "loss" in row]


def _last_step(run_dir: Path) -> int:
    steps = _losses(run_dir)
    return steps[-1][0] if steps else 0


@dataclass
class Job:
    id: str
    run_dir: Path
    output: Path
    stops: list[int]  # last logged step when each interruption was sent

    def text(self) -> str:
        return self.output.read_text() if self.output.exists() else ""

    def summary(self) -> str:
        """The script's own lines, SLURM's and the errors from the job output: what a failed assert shows."""
        keep = ("pretrain.sbatch", "srun", "slurmstepd", "Error", "error", "preempted", "resumed")
        return "\n".join(line for line in self.text().splitlines() if any(k in line for k in keep))


@dataclass
class Runs:
    full: Job  # 2 nodes x 2 processes, uninterrupted
    requeued: Job  # 2 x 1, `scontrol requeue` once
    usr1: Job  # 2 x 1, USR1 twice, MAX_RESTARTS=1
    lost: Job  # 2 x 1, rank 1 killed after step 3
    reference: list[tuple[int, float]]  # launch.local, 2 processes
    info: dict[str, dict[str, str]]  # final `scontrol show job` per job id


def _submit(cluster: SlurmCluster, tmp: Path, name: str, data: PreparedData, nproc: int, *overrides: str,
            **env: str) -> Job:
    run_dir, output = tmp / name, tmp / f"{name}.out"
    exports = ",".join(["ALL", f"NPROC_PER_NODE={nproc}", "OMP_NUM_THREADS=1", *(f"{k}={v}" for k, v in env.items())])
    job = cluster.sbatch("--nodes=2", "--oversubscribe", f"--job-name={name}", f"--output={output}",
                         f"--export={exports}", "slurm/pretrain.sbatch", *_train_args(run_dir, data), *overrides, cwd=REPO)
    return Job(job, run_dir, output, [])


@pytest.fixture(scope="module")
def runs(slurm_cluster: SlurmCluster, shards: PreparedData, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Runs]:
    tmp = tmp_path_factory.mktemp("pretrain")
    full = _submit(slurm_cluster, tmp, "full", shards, 2, "train.micro_batch=2")  # global 8 = 2 x 4 ranks
    requeued = _submit(slurm_cluster, tmp, "requeued", shards, 1)
    usr1 = _submit(slurm_cluster, tmp, "usr1", shards, 1, MAX_RESTARTS="1")
    # the interpreter of rank 1 (SLURM_PROCID 1) is SIGKILLed once the run has logged 3 steps: a node lost
    killer = tmp / "python_lost_rank1"
    killer.write_text(f"""#!/bin/bash
if [ "$SLURM_PROCID" = 1 ]; then
  ( while [ "$(wc -l < {tmp / 'lost' / 'metrics.jsonl'} 2>/dev/null || echo 0)" -lt 3 ]; do sleep 0.2; done
    kill -9 $$ ) &
fi
exec {REPO / '.venv' / 'bin' / 'python'} "$@"
""")
    killer.chmod(0o755)
    lost = _submit(slurm_cluster, tmp, "lost", shards, 1, "data.workers=1", "parallel.timeout_s=60", PYTHON=str(killer))
    with open(tmp / "reference.out", "w") as reference_log:
        reference = subprocess.Popen(
            [sys.executable, "-m", "launch.local", "--nproc-per-node", "2", *_train_args(tmp / "reference", shards)],
            cwd=REPO, stdout=subprocess.DEVNULL, stderr=reference_log)

    def state(job: Job) -> dict[str, str]:
        return slurm_cluster.job(job.id)

    while True:
        if not requeued.stops and _last_step(requeued.run_dir) >= STOP_AT:
            requeued.stops.append(_last_step(requeued.run_dir))
            slurm_cluster.run("scontrol", "requeue", requeued.id)
        # the first USR1 early in run 0; the second once run 1 has trained past the first stop
        usr1_run = state(usr1)
        if not usr1.stops and _last_step(usr1.run_dir) >= STOP_AT or (
                len(usr1.stops) == 1 and usr1_run["Restarts"] == "1" and usr1_run["JobState"] == "RUNNING"
                and _last_step(usr1.run_dir) >= usr1.stops[0] + STOP_AT):
            usr1.stops.append(_last_step(usr1.run_dir))
            slurm_cluster.run("scancel", "--batch", "--signal=USR1", usr1.id)
        # a requeued job is PENDING, not finished, from the moment `scontrol requeue` returns
        jobs_ended = all(state(j)["JobState"] in TERMINAL_STATES for j in (full, requeued, usr1, lost))
        if jobs_ended and reference.poll() is not None:
            break
        time.sleep(0.3)
    assert reference.returncode == 0, (tmp / "reference.out").read_text()[-3000:]
    yield Runs(full, requeued, usr1, lost, _losses(tmp / "reference"),
               {j.id: state(j) for j in (full, requeued, usr1, lost)})


def test_two_nodes_two_processes_train_to_the_end(runs: Runs) -> None:
    job, info = runs.full, runs.info[runs.full.id]
    assert (info["JobState"], info["ExitCode"], info["Restarts"]) == ("COMPLETED", "0:0", "0"), job.summary()
    assert "on 2 nodes x 2 processes" in job.text()
    losses = _losses(job.run_dir)
    assert [s for s, _ in losses] == list(range(1, STEPS + 1))
    assert losses[-1][1] < losses[0][1] - 1.0  # it learned: the tiny model drops well over a nat in 60 steps
    assert (job.run_dir / "checkpoints" / f"step_{STEPS}").is_dir()


def test_scontrol_requeue_continues_without_a_gap(runs: Runs) -> None:
    job, info = runs.requeued, runs.info[runs.requeued.id]
    assert (info["JobState"], info["ExitCode"], info["Restarts"]) == ("COMPLETED", "0:0", "1"), job.summary()
    text = job.text()  # --open-mode=append: both runs' output in one file
    assert "run 0 on 2 nodes x 1 processes" in text and "run 1 on 2 nodes x 1 processes" in text
    assert f"checkpoint saved, exiting {EXIT_PREEMPTED}" in text, job.summary()  # run 0 checkpointed on SIGTERM
    assert "requeueing" not in text  # SLURM requeued it; the script must not requeue a second time
    losses = _losses(job.run_dir)
    assert [s for s, _ in losses] == list(range(1, STEPS + 1))  # every step logged once: no gap, no repeat
    assert STOP_AT <= job.stops[0] < STEPS
    assert [l for _, l in losses] == pytest.approx([l for _, l in runs.reference], rel=1e-5)


def test_usr1_checkpoints_requeues_and_stops_at_max_restarts(runs: Runs) -> None:
    job, info = runs.usr1, runs.info[runs.usr1.id]
    assert len(job.stops) == 2, job.summary()  # else it trained to the end before the second USR1
    assert (info["JobState"], info["ExitCode"], info["Restarts"]) == ("FAILED", f"{EXIT_PREEMPTED}:0", "1"), job.summary()
    text = job.text()
    assert "requeueing job" in text and "run 1 on 2 nodes" in text  # run 0 requeued itself
    assert "MAX_RESTARTS=1 reached, not requeueing" in text  # run 1 stopped for good
    losses = _losses(job.run_dir)
    last = losses[-1][0]
    assert job.stops[1] <= last < STEPS
    assert [s for s, _ in losses] == list(range(1, last + 1))
    assert [l for _, l in losses] == pytest.approx([l for _, l in runs.reference[:last]], rel=1e-5)
    assert (job.run_dir / "checkpoints" / "latest").read_text().strip() == f"step_{last}"


def test_a_lost_node_ends_the_job_without_a_requeue(runs: Runs) -> None:
    job, info = runs.lost, runs.info[runs.lost.id]
    assert info["JobState"] == "FAILED" and info["ExitCode"] != "0:0" and info["Restarts"] == "0", job.summary()
    text = job.text()
    assert "requeueing" not in text
    # rank 0 either noticed first (one line) or srun's --kill-on-bad-exit ended it: never a hang to the time limit
    assert "another rank failed first" in text or "task 0: Killed" in text or "Terminating" in text, job.summary()
    assert not (job.run_dir / "checkpoints" / "latest").exists()  # checkpoint.every=10: nothing half saved
