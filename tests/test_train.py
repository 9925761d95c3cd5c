"""The training loop on real gloo process groups, the tiny config and real text shards.

Runs are shared between assertions where that is honest: the ZeRO-0 run is also the "loss falls" and
"metrics contract" run; the ZeRO-1 run is the uninterrupted reference of the resume tests
(tests/test_resume.py launches like `srun` does and compares against it); the TP=1 runs that the TP=2 runs
are compared with also provide the checkpoint that a TP=2 run resumes (layout change, universal checkpoint).
"""
from __future__ import annotations

import contextlib
import json
import math
import os
import signal
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from pretrain.config import Config, load_config
from pretrain.faults import EXIT_DIVERGED, EXIT_FAILED, EXIT_PREEMPTED
from tests.distributed import run_distributed
from tests.test_metrics import read_metrics, read_tensorboard

REPO = Path(__file__).resolve().parents[1]
TINY = str(REPO / "configs" / "tiny.yaml")
STEPS = 8
# every step logged, evaluation and a checkpoint every 4 steps; 8 steps at lr warmup 10 (tiny.yaml)
COMMON = [f"train.steps={STEPS}", "log.every=1", "eval.every=4", "checkpoint.every=4", "checkpoint.keep=2"]


def data_overrides(shards, workers: int = 0) -> list[str]:
    """The fixture shards; in-process groups read without DataLoader workers (daemonic processes cannot
    have children), which gives the same batches as 1 worker (one stream per DP rank either way)."""
    return [f"data.train={shards.train}", f"data.valid={shards.valid}", f"data.tokenizer={shards.tokenizer}",
            f"data.workers={workers}"]


def _train_each(rank: int, world_size: int, runs: list[tuple[str, list[str], str | None]]) -> list[int | str]:
    """In one process group, train every (run_dir, overrides, fault) in turn; returns the exit codes, or the
    message of a ValueError (a refused config) for a run that raised one.

    Faults are injected in this process: "nan" makes rank 1's training loss NaN at its forward calls 3, 5
    and 6 and runs through `main` (which then tears the process group down: it must come last);
    "sigterm" sends SIGTERM to rank 1 itself after its second step.
    """
    from pretrain import train as train_module

    codes = []
    for run_dir, overrides, fault in runs:
        argv = ["--config", TINY, f"run.dir={run_dir}", *overrides]
        if fault == "nan":
            with _nan_loss_at({3, 5, 6} if rank == 1 else set()):
                codes.append(train_module.main(argv))
        elif fault == "sigterm":
            with _signal_after_steps(2 if rank == 1 else None, train_module):
                codes.append(train_module.train(load_config(Config, TINY, argv[2:])))
        else:
            try:
                codes.append(train_module.train(load_config(Config, TINY, argv[2:])))
            except ValueError as e:
                codes.append(str(e))
    return codes


@contextlib.contextmanager
def _nan_loss_at(calls: set[int]):
    from pretrain.model.t5 import T5Model

    original, count = T5Model.forward, [0]

    def forward(self, *args, **kwargs):
        out = original(self, *args, **kwargs)
        count[0] += 1
        if count[0] in calls:
            out.loss = out.loss * float("nan")
        return out

    T5Model.forward = forward
    try:
        yield
    finally:
        T5Model.forward = original


@contextlib.contextmanager
def _signal_after_steps(steps: int | None, train_module):
    original, count = train_module.train_step, [0]

    def train_step(*args, **kwargs):
        result = original(*args, **kwargs)
        count[0] += 1
        if count[0] == steps:
            os.kill(os.getpid(), signal.SIGTERM)  # a real signal, caught by the loop's handler
        return result

    train_module.train_step = train_step
    try:
        yield
    finally:
        train_module.train_step = original


def losses(run_dir: Path) -> list[float]:
    return [r["loss"] for r in read_metrics(run_dir) if "loss" in r]


@pytest.fixture(scope="module")
def zero_runs(shards, tmp_path_factory) -> dict[int | str, Path]:
    """In one TP 1 x DP 2 group, fp32, the same seed and data: {stage: run_dir} for ZeRO 0-3, "stopped":
    ZeRO 1 ended by train.exit_after=3, "nan": ZeRO 1 with NaN losses injected (exits EXIT_DIVERGED)."""
    root = tmp_path_factory.mktemp("zero")
    base = [*COMMON, *data_overrides(shards)]
    runs = [(str(root / f"zero{s}"), [*base, f"zero.stage={s}"], None) for s in range(4)]
    runs.append((str(root / "stopped"), [*base, "zero.stage=1", "train.exit_after=3"], None))
    runs.append((str(root / "nan"), [*base, "zero.stage=1", "checkpoint.every=2", "train.max_skipped_steps=2"], "nan"))
    assert run_distributed(_train_each, 2, runs) == [[0] * 5 + [EXIT_DIVERGED]] * 2
    return {**{s: root / f"zero{s}" for s in range(4)}, "stopped": root / "stopped", "nan": root / "nan"}


def test_loss_falls_on_real_text(zero_runs):
    curve = losses(zero_runs[0])
    assert len(curve) == STEPS
    assert curve[-1] < 0.8 * curve[0], curve


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_zero_stages_match_zero0(zero_runs, stage):
    reference = losses(zero_runs[0])
    torch.testing.assert_close(losses(zero_runs[stage]), reference, rtol=1e-5, atol=0)
    grad_norms = [[r["grad_norm"] for r in read_metrics(zero_runs[s])] for s in (0, stage)]
    torch.testing.assert_close(grad_norms[1], grad_norms[0], rtol=1e-4, atol=0)
    # mixture weights are read from the (ZeRO-3: gathered) parameters
    mixtures = [{k: v for k, v in read_metrics(zero_runs[s])[-1].items() if k.startswith("mixture/")} for s in (0, stage)]
    assert mixtures[1] == pytest.approx(mixtures[0], rel=1e-4)


def test_metrics_contract_and_tensorboard_read_back(zero_runs):
    run = zero_runs[0]
    records = read_metrics(run)
    assert [r["step"] for r in records] == list(range(1, STEPS + 1))
    for r in records:
        assert {"step", "loss", "lr", "grad_norm", "tokens_per_s", "samples_per_s", "mfu"} <= set(r)
        assert r["tokens_per_s"] > 0 and r["grad_norm"] > 0
    assert [("eval_loss" in r) for r in records] == [s % 4 == 0 for s in range(1, STEPS + 1)]
    assert all(0 <= r["eval_accuracy"] <= 1 for r in records if "eval_accuracy" in r)
    # lr follows the warmup of tiny.yaml: the t-th update uses 3e-3 * t / 10
    assert [r["lr"] for r in records] == pytest.approx([3e-3 * t / 10 for t in range(1, STEPS + 1)])
    # mixture weights of every layer of random+vanilla, summing to 1
    mix = {k: v for k, v in records[-1].items() if k.startswith("mixture/")}
    assert len(mix) == 2 * 4  # 2 encoder + 2 decoder layers x (random, vanilla)
    assert mix["mixture/encoder.layers.0/random"] + mix["mixture/encoder.layers.0/vanilla"] == pytest.approx(1)
    scalars = read_tensorboard(run)
    for key in ("loss", "lr", "grad_norm", "tokens_per_s", "eval_loss", "mixture/decoder.layers.1/random"):
        logged = [(r["step"], r[key]) for r in records if key in r]
        assert [s for s, _ in scalars[key]] == [s for s, _ in logged]
        assert [v for _, v in scalars[key]] == pytest.approx([v for _, v in logged], rel=1e-6)
    assert (run / "config.yaml").is_file()
    checkpoints = run / "checkpoints"
    assert (checkpoints / "latest").read_text().strip() == f"step_{STEPS}"
    assert sorted(p.name for p in checkpoints.glob("step_*")) == ["step_4", "step_8"]
    state = json.loads((checkpoints / "step_8" / "trainer_state.json").read_text())
    assert state == {"step": 8, "tokens_seen": 8 * 8 * (64 + 14), "skipped_steps": 0, "tp": 1, "dp": 2}
    assert sorted(p.name for p in (checkpoints / "step_8").glob("data_dp*.pt")) == ["data_dp0.pt", "data_dp1.pt"]


@pytest.fixture(scope="module")
def tp_runs(shards, tmp_path_factory) -> dict[str, Path]:
    """vanilla and mixture at TP 1 (world 1) and TP 2 (world 2), DP 1 in both, so the data is the same.

    The TP 2 group also resumes the TP 1 mixture run from its step 4 (layout change: universal checkpoint).
    The vocabulary is padded to 1280 = 128 x 2 x 5 so that it splits over TP 2.
    """
    root = tmp_path_factory.mktemp("tp")
    base = [*COMMON, *data_overrides(shards), "model.vocab_size=1280", "eval.every=0"]
    variants = {"vanilla": ["model.encoder_attention=vanilla", "model.decoder_attention=vanilla"],
                "mixture": ["model.encoder_attention=dense+vanilla", "model.decoder_attention=random+vanilla"]}
    tp1 = [(str(root / f"{name}_tp1"), [*base, *extra], None) for name, extra in variants.items()]
    assert run_distributed(_train_each, 1, tp1) == [[0, 0]]
    tp2 = [(str(root / f"{name}_tp2"), [*base, *extra, "parallel.tensor=2"], None) for name, extra in variants.items()]
    resumed = (str(root / "mixture_resumed_tp2"), [*base, *variants["mixture"], "parallel.tensor=2",
                                                   f"checkpoint.resume={root / 'mixture_tp1'}/checkpoints/step_4"], None)
    assert run_distributed(_train_each, 2, [*tp2, resumed]) == [[0, 0, 0]] * 2
    return {p.name: p for p in root.iterdir()}


@pytest.mark.parametrize("variant", ["vanilla", "mixture"])
def test_tp2_matches_tp1(tp_runs, variant):
    reference = losses(tp_runs[f"{variant}_tp1"])
    assert len(reference) == STEPS
    torch.testing.assert_close(losses(tp_runs[f"{variant}_tp2"]), reference, rtol=1e-5, atol=0)


def test_resume_on_another_tp_layout_continues_the_curve(tp_runs):
    resumed = read_metrics(tp_runs["mixture_resumed_tp2"])
    assert [r["step"] for r in resumed] == list(range(5, STEPS + 1))
    reference = losses(tp_runs["mixture_tp1"])[4:]
    torch.testing.assert_close([r["loss"] for r in resumed], reference, rtol=1e-5, atol=0)
    assert (tp_runs["mixture_tp1"] / "checkpoints" / "step_4_universal" / "zero").is_dir()


# ------------------------------------------------------------------------------------------------------
# Faults and exact resume: stop (exit_after) -> killed during a save -> SIGTERM -> finish == uninterrupted
# ------------------------------------------------------------------------------------------------------
_KILL_IN_COMMIT = """
import os, signal, sys
from pretrain.checkpoint import CheckpointManager
def commit(self, tag):  # every rank has written its files for `tag`; die before `latest` moves
    os.kill(os.getpid(), signal.SIGKILL)
CheckpointManager._commit = commit
from pretrain.train import main
sys.exit(main())
"""


def launch_like_srun(world_size: int, code: str, argv: list[str]) -> list[int]:
    """`world_size` processes of `python -c code argv` with the launcher's variables; their exit codes."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    procs = [
        subprocess.Popen([sys.executable, "-c", code, *argv], cwd=REPO, start_new_session=True, env={
            **os.environ, "RANK": str(r), "WORLD_SIZE": str(world_size), "LOCAL_RANK": str(r),
            "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "OMP_NUM_THREADS": "1"})
        for r in range(world_size)
    ]
    return [p.wait() for p in procs]


def test_stop_kill_preempt_resume_equals_uninterrupted(zero_runs, shards):
    run = zero_runs["stopped"]
    checkpoints = run / "checkpoints"
    assert (checkpoints / "latest").read_text().strip() == "step_3"  # exit_after=3 saved and stopped
    overrides = [*COMMON, *data_overrides(shards), "zero.stage=1"]
    # killed (SIGKILL, every rank) while saving step 4: step_4 is written but never committed; launched as
    # `srun` does, with a DataLoader worker process (the same batches as none, see data_overrides)
    argv = ["--config", TINY, f"run.dir={run}", *COMMON, *data_overrides(shards, workers=1), "zero.stage=1"]
    assert launch_like_srun(2, _KILL_IN_COMMIT, argv) == [-signal.SIGKILL] * 2
    assert (checkpoints / "step_4" / "trainer_state.json").is_file()
    assert (checkpoints / "latest").read_text().strip() == "step_3"
    # resume from step 3 (auto), rank 1 gets SIGTERM after its second step: all ranks save step 5 and exit;
    # then run again to the end; then a resume that changed the model shape is refused
    changed = [*overrides, "model.d_ff=96"]
    runs = [(str(run), overrides, "sigterm"), (str(run), overrides, None), (str(run), changed, None)]
    codes = run_distributed(_train_each, 2, runs)
    assert [c[:2] for c in codes] == [[EXIT_PREEMPTED, 0]] * 2
    assert "model.d_ff: 128 in the checkpoint, 96 now" in codes[0][2]
    assert sorted(p.name for p in checkpoints.glob("step_*")) == ["step_5", "step_8"]  # checkpoint.keep=2
    records = read_metrics(run)
    assert [r["step"] for r in records] == list(range(1, STEPS + 1))
    assert losses(run) == losses(zero_runs[1])  # exactly: fp32 on CPU
    assert [r.get("eval_loss") for r in records] == [r.get("eval_loss") for r in read_metrics(zero_runs[1])]


def test_nan_loss_is_skipped_then_stops_the_run(zero_runs):
    run = zero_runs["nan"]
    records = read_metrics(run)
    # forward calls 1, 2 -> steps 1, 2 (checkpoint); 3 NaN (skipped); 4 -> step 3; 5, 6 NaN -> stop naming step 4
    assert [(r["step"], r["skipped_steps"]) for r in records] == [(1, 0), (2, 0), (3, 1)]
    assert records[2]["lr"] == pytest.approx(3e-3 * 3 / 10)  # the skipped step did not advance the schedule
    assert all(math.isfinite(r["loss"]) for r in records)
    assert (run / "checkpoints" / "latest").read_text().strip() == "step_2"


_DIE_AFTER_TWO_STEPS = """
import os, signal, sys
from pretrain import train
original, count = train.train_step, [0]
def train_step(*args, **kwargs):
    result = original(*args, **kwargs)
    count[0] += 1
    if count[0] == 2 and os.environ["RANK"] == "1":
        os.kill(os.getpid(), signal.SIGKILL)  # a node lost mid-run
    return result
train.train_step = train_step
sys.exit(train.main())
"""


def test_a_dead_rank_makes_the_others_fail_instead_of_hanging(shards, tmp_path):
    # the survivor blocks in the next step's collective; the process-group timeout (or gloo's closed
    # connection, whichever comes first) turns that into an error and exit code 1, never a hang
    argv = ["--config", TINY, f"run.dir={tmp_path}", *COMMON, *data_overrides(shards), "parallel.timeout_s=30"]
    assert launch_like_srun(2, _DIE_AFTER_TWO_STEPS, argv) == [EXIT_FAILED, -signal.SIGKILL]
    assert not (tmp_path / "checkpoints" / "latest").exists()
