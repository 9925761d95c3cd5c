"""Asynchronous checkpoints (`checkpoint.async_save`) on real gloo groups of 2 ranks, the tiny config, real shards.

The in-flight windows are made by the test's hold on the writers (tests/writer_hold.py): the writer of step N waits,
before its first write, until the test creates `release_step_N`; nothing sleeps and hopes.
"""
from __future__ import annotations

import json
import os
import signal
import threading
import time
from pathlib import Path

import pytest
import torch

from pretrain.core.config import Config, load_config
from pretrain.runtime.checkpoint_writer import HostBuffers, HostCopies, snapshot
from pretrain.runtime.faults import EXIT_FAILED, EXIT_PREEMPTED
from tests.distributed import disk_full, launch_like_srun, run_distributed
from tests.test_metrics import read_metrics, read_tensorboard
from tests.test_train import REPO, TINY, TRAIN, data_overrides, losses
from tests.writer_hold import held_writers, train_holding_writers

# 8 steps (the LR warms up over 10), a checkpoint every 2: the saves at 2, 4 and 6 are periodic, 8 is the last
COMMON = ["train.steps=8", "log.every=1", "eval.every=0", "checkpoint.every=2", "checkpoint.keep=3", "zero.stage=1"]
ASYNC = "checkpoint.async_save=true"


def _train_each(rank: int, world: int, runs: list[tuple[str, list[str], str | None]]) -> list[int]:
    """Train each (run_dir, overrides, hold) in turn. With a hold folder (its `release_step_2` made by the test),
    step 4's writer is held (until every rank's loop waits for it: `_release_when_waited`) while rank 1 sends
    itself SIGTERM after step 5; step 6's collective carries it."""
    from pretrain import train as train_module
    from pretrain.runtime import loop as loop_module

    codes = []
    for run_dir, overrides, hold in runs:
        cfg = load_config(Config, TINY, [f"run.dir={run_dir}", *overrides])
        if hold is None:
            codes.append(train_module.train(cfg))
            continue
        original, count = loop_module.train_step, [0]

        def train_step(*args, **kwargs):
            result = original(*args, **kwargs)
            count[0] += 1
            if count[0] == 5 and rank == 1:
                os.kill(os.getpid(), signal.SIGTERM)  # a real signal, caught by the loop's handler
            if result.preempted:
                assert result.writing  # step 4's save is in flight
            return result

        loop_module.train_step = train_step
        try:
            with held_writers(hold):
                codes.append(train_module.train(cfg))
        finally:
            loop_module.train_step = original
    return codes


@pytest.fixture(scope="module")
def runs(shards, tmp_path_factory) -> dict[str, Path]:
    """In one process group: "sync" (the uninterrupted reference), "async", and "preempted" (async, SIGTERM while
    step 4's save is in flight), which is then run again to the end."""
    root = tmp_path_factory.mktemp("async")
    hold = root / "hold"
    hold.mkdir()
    (hold / "release_step_2").touch()
    base = [*COMMON, *data_overrides(shards)]
    plan = [(str(root / "sync"), base, None), (str(root / "async"), [*base, ASYNC], None),
            (str(root / "preempted"), [*base, ASYNC], str(hold)), (str(root / "preempted"), [*base, ASYNC], None)]
    done = threading.Event()
    _release_when_waited(hold, 4, done)
    try:
        assert run_distributed(_train_each, 2, plan) == [[0, 0, EXIT_PREEMPTED, 0]] * 2
    finally:
        done.set()
    return {name: root / name for name in ("sync", "async", "preempted")}


def _release_when_waited(hold: Path, step: int, done: threading.Event) -> threading.Thread:
    """Release the writers of `step` once the loop of every rank waits for them (or the run ended)."""
    def release() -> None:
        while not all((hold / f"waiting_step_{step}_rank_{r}").exists() for r in range(2)) and not done.is_set():
            time.sleep(0.05)
        (hold / f"release_step_{step}").touch()

    thread = threading.Thread(target=release, daemon=True)
    thread.start()
    return thread


def _listed(checkpoint: Path) -> dict[str, dict]:
    return json.loads((checkpoint / "complete.json").read_text())["files"]


def test_async_and_sync_checkpoints_hold_the_same_bytes_and_train_alike(runs):
    for step in (4, 6, 8):  # keep=3; 4 and 6 written in the background
        sync, background = (runs[name] / "checkpoints" / f"step_{step}" for name in ("sync", "async"))
        # the same files with the same checksums; config.yaml names checkpoint.async_save, and trainer_state.json's
        # metrics record holds the step's timings
        same = set(_listed(sync)) - {"config.yaml", "trainer_state.json"}
        assert set(_listed(sync)) == set(_listed(background))
        assert {n: _listed(sync)[n] for n in same} == {n: _listed(background)[n] for n in same}
        states = [json.loads((c / "trainer_state.json").read_text()) for c in (sync, background)]
        assert [{k: v for k, v in s.items() if k != "record"} for s in states] == \
            [{k: v for k, v in states[0].items() if k != "record"}] * 2
        assert states[0]["step"] == step
    assert losses(runs["async"]) == losses(runs["sync"])  # exactly: fp32 on CPU


def test_the_metrics_lines_time_every_save(runs):
    records = {r["step"]: r for r in read_metrics(runs["async"])}
    for step in (2, 4, 6, 8):
        assert records[step]["checkpoint_blocking_s"] >= 0
    # the periodic saves complete at a later step (at the first step after the writers are done, at the latest at
    # the next save: two completions before one line leave the newer's figures), the last one at once
    completed = [s for s, r in records.items() if "checkpoint_s" in r]
    assert 3 <= len(completed) <= 4 and completed[-1] == 8 and all(2 < s < 8 for s in completed[:-1])
    sizes = [records[s]["checkpoint_bytes"] for s in completed]
    listed = sum(e["bytes"] for e in _listed(runs["async"] / "checkpoints" / "step_8").values())
    assert sizes[-1] == pytest.approx(listed, rel=0.01)  # DeepSpeed's recovery scripts are listed by the commit
    assert {"checkpoint_blocking_s", "checkpoint_s", "checkpoint_bytes"} <= set(read_tensorboard(runs["async"]))


def test_sigterm_during_an_in_flight_save_completes_it_and_saves_its_own(runs):
    checkpoints = runs["preempted"] / "checkpoints"
    records = read_metrics(runs["preempted"])
    assert [r["step"] for r in records] == list(range(1, 9))
    assert losses(runs["preempted"]) == losses(runs["sync"])
    # the SIGTERM run saved step 6 after completing the in-flight step 4 (keep=3 then kept 4, 6 and 8): every
    # file of each is listed, as in the synchronous run, with its size
    assert sorted(p.name for p in checkpoints.glob("step_*")) == ["step_4", "step_6", "step_8"]
    for step in (4, 6, 8):
        folder = checkpoints / f"step_{step}"
        files = {str(f.relative_to(folder)) for f in folder.rglob("*") if f.is_file()} - {"complete.json"}
        assert set(_listed(folder)) == files == set(_listed(runs["sync"] / "checkpoints" / f"step_{step}"))
        assert all((folder / name).stat().st_size == entry["bytes"] for name, entry in _listed(folder).items())
    assert (checkpoints / "latest").read_text().strip() == "step_8"


def test_a_save_reuses_the_host_buffers_of_the_one_before_once_its_writer_is_done():
    """The pool of a CUDA save's pinned buffers (HostBuffers; its bookkeeping is the same in pageable memory):
    a buffer is lent to one copy at a time, the next save gets the same buffers back once the writer gave them
    back, and a size the last save did not ask for again is dropped."""
    buffers = HostBuffers(pin=False)
    sizes = [4096, 1024, 4096]  # two storages of one size: two buffers
    first = [buffers.take(n) for n in sizes]
    assert len({id(b) for b in first}) == 3 and [b.nbytes() for b in first] == sizes
    buffers.trim()
    buffers.give_back()  # the first save's writer is done
    second = [buffers.take(n) for n in sizes]
    assert [b.nbytes() for b in second] == sizes
    assert {id(b) for b in second} == {id(b) for b in first}  # the same buffers, none allocated
    buffers.trim()
    buffers.give_back()
    third = buffers.take(1024)  # a save with one storage of 1024 bytes
    buffers.trim()  # the 4096-byte buffers go
    buffers.give_back()
    fresh = buffers.take(4096)
    assert any(third is b for b in second) and all(fresh is not b for b in first)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="the CUDA path of a background save's copies")
def test_cuda_copies_into_pinned_buffers_hold_the_state_as_saved():
    """What the side stream copied is the state before the next update (which waits for the copy's event), the
    same values as the plain `.cpu()`; the next save reuses the buffers."""
    copies = HostCopies()
    flat = torch.randn(3000, device="cuda")
    state = {"flat": flat, "view": flat[1000:2000], "moment": torch.randn(500, device="cuda")}
    expected = {k: v.cpu() for k, v in state.items()}
    staged = snapshot(state, copies)
    copied = copies.copied()
    torch.cuda.current_stream().wait_event(copied)  # the loop's before_update
    flat.add_(1.0)
    copied.synchronize()  # the writer
    assert all(torch.equal(staged[k], expected[k]) for k in state)
    assert staged["view"].untyped_storage().data_ptr() == staged["flat"].untyped_storage().data_ptr()
    assert staged["flat"].is_pinned()
    copies.buffers.give_back()
    again = snapshot(state, copies)
    copies.copied().synchronize()
    assert again["flat"].untyped_storage().data_ptr() == staged["flat"].untyped_storage().data_ptr()
    assert torch.equal(again["flat"], flat.cpu())


def _launch_in_background(code: str, argv: list[str], results: list) -> threading.Thread:
    thread = threading.Thread(target=lambda: results.extend(launch_like_srun(2, code, argv, cwd=REPO)))
    thread.start()
    return thread


def test_a_rank_killed_during_an_async_save_then_a_full_disk_resume_from_the_previous_one(runs, shards, tmp_path):
    run, hold = tmp_path / "run", tmp_path / "hold"
    hold.mkdir()
    (hold / "release_step_2").touch()
    checkpoints = run / "checkpoints"
    argv = ["--config", TINY, f"run.dir={run}", *COMMON, *data_overrides(shards), ASYNC]
    # rank 1 is killed (SIGKILL) while its writer of step 4 is held and rank 0's loop waits for its own (at the
    # save of step 6: one save in flight at most); then the writers are released
    results: list = []
    job = _launch_in_background(train_holding_writers(hold), argv, results)
    held, waiting = hold / "held_step_4_rank_1", hold / "waiting_step_4_rank_0"
    while not waiting.exists() or not held.exists() or not held.read_text():
        assert job.is_alive(), f"the job ended before its loop waited for the save of step 4: {results}"
        time.sleep(0.05)
    os.kill(int(held.read_text()), signal.SIGKILL)
    (hold / "release_step_4").touch()
    job.join()
    assert [code for code, _ in results] == [EXIT_FAILED, -signal.SIGKILL]
    assert not (checkpoints / "step_4" / "complete.json").exists()
    assert (checkpoints / "latest").read_text().strip() == "step_2"
    # the rerun resumes step 2; the disk is full when step 4 is written in the background: one line per rank, exit 1
    results = launch_like_srun(2, TRAIN, argv, cwd=REPO, preexec_fn=disk_full)
    assert [code for code, _ in results] == [EXIT_FAILED] * 2
    assert "rank 0: checkpoint step_4 not saved: file too large (EFBIG): " in results[0][1]
    assert "step_2 stays the newest checkpoint" in results[0][1]
    assert all("Traceback" not in err for _, err in results)
    assert not (checkpoints / "step_4" / "complete.json").exists()
    assert (checkpoints / "latest").read_text().strip() == "step_2"
    # then to the end: the uninterrupted run's losses
    assert [code for code, _ in launch_like_srun(2, TRAIN, argv, cwd=REPO)] == [0, 0]
    assert [r["step"] for r in read_metrics(run)] == list(range(1, 9))
    assert losses(run) == losses(runs["sync"])
