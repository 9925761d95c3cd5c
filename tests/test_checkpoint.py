"""The run folder without processes: which checkpoint a run resumes from, what counts as complete, pruning, the
refusal of a changed model, a cut metrics.jsonl and the run lock. Saving, loading and resharding real
checkpoints run in tests/test_train.py and tests/test_faults.py."""
from __future__ import annotations

import dataclasses
import json
import subprocess
import sys

import pytest

from pretrain.checkpoint import (COMPLETE, CheckpointManager, Progress, check_same_model, complete_steps,
                                 find_resume, missing_parts)
from pretrain.config import CheckpointConfig, ModelConfig, UsageError
from pretrain.metrics import MetricsLogger
from pretrain.run_lock import RunLock


def _checkpoint(root, step: int, complete: bool = True):
    """A folder shaped like a saved checkpoint: two files and, when complete, the marker listing them."""
    path = root / f"step_{step}"
    path.mkdir(parents=True)
    (path / "trainer_state.json").write_text(json.dumps({"step": step}))
    (path / "mp_rank_00_model_states.pt").write_bytes(b"x" * 100)
    if complete:
        files = {p.name: p.stat().st_size for p in path.iterdir()}
        (path / COMPLETE).write_text(json.dumps({"files": files}))
    return path


def test_resume_prefers_the_runs_own_latest_over_checkpoint_resume(tmp_path):
    root, other = tmp_path / "run" / "checkpoints", tmp_path / "other" / "checkpoints"
    elsewhere = _checkpoint(other, 20)
    assert find_resume(CheckpointConfig(resume="auto"), root) is None  # a fresh run.dir
    assert find_resume(CheckpointConfig(resume=str(elsewhere)), root) == elsewhere  # the first start
    _checkpoint(root, 24)
    (root / "latest").write_text("step_24\n")
    # a requeued job with the same command line continues from its own checkpoint
    assert find_resume(CheckpointConfig(resume=str(elsewhere)), root) == root / "step_24"
    assert find_resume(CheckpointConfig(resume="auto"), root) == root / "step_24"
    assert find_resume(CheckpointConfig(resume="none"), root) is None


def test_incomplete_checkpoints_are_refused_naming_what_is_missing(tmp_path):
    root = tmp_path / "checkpoints"
    half = _checkpoint(root, 8, complete=False)
    with pytest.raises(UsageError, match=r"step_8 is incomplete: complete.json \(the save was interrupted"):
        find_resume(CheckpointConfig(resume=str(half)), tmp_path / "fresh")
    cut = _checkpoint(root, 9)
    (cut / "mp_rank_00_model_states.pt").write_bytes(b"x" * 40)  # cut short after the marker was written
    (cut / "trainer_state.json").unlink()
    assert missing_parts(cut) == ["mp_rank_00_model_states.pt (40 of 100 bytes)", "trainer_state.json (missing)"]
    with pytest.raises(UsageError, match=r"step_9 is incomplete: mp_rank_00_model_states.pt \(40 of 100 bytes\)"):
        find_resume(CheckpointConfig(resume=str(cut)), tmp_path / "fresh")
    with pytest.raises(UsageError, match="does not exist"):
        find_resume(CheckpointConfig(resume=str(root / "step_7")), tmp_path / "fresh")
    assert complete_steps(root) == []


def test_a_dangling_latest_falls_back_to_the_newest_complete_checkpoint(tmp_path):
    root = tmp_path / "checkpoints"
    (root).mkdir()
    (root / "latest").write_text("step_30\n")
    with pytest.raises(UsageError, match=r"latest names step_30, which is missing or incomplete, and no other"):
        find_resume(CheckpointConfig(), root)
    _checkpoint(root, 10)
    _checkpoint(root, 20)
    _checkpoint(root, 30, complete=False)
    assert find_resume(CheckpointConfig(), root) == root / "step_20"


def test_pruning_keeps_the_newest_complete_checkpoints_and_drops_leftovers(tmp_path):
    root = tmp_path / "checkpoints"
    for step in (4, 8, 12):
        _checkpoint(root, step)
    _checkpoint(root, 6, complete=False)  # a save that died, older than the newest complete one
    (root / "step_4_universal").mkdir()
    manager = CheckpointManager(CheckpointConfig(keep=2), root, dims=None, engine=None, progress=Progress(),
                                data=None, config_yaml="", universal_info={})
    manager._prune(newest="step_12")
    assert sorted(p.name for p in root.iterdir()) == ["step_12", "step_8"]
    manager = CheckpointManager(CheckpointConfig(keep=0), root, dims=None, engine=None, progress=Progress(),
                                data=None, config_yaml="", universal_info={})
    manager._prune(newest="step_12")
    assert [p.name for p in root.iterdir()] == ["step_12"]  # never the newest complete one


def test_changed_model_is_refused_naming_every_difference(tmp_path):
    saved = dataclasses.asdict(ModelConfig())
    check_same_model(saved, dataclasses.replace(ModelConfig(), dropout=0.1), tmp_path)  # dropout may change
    changed = dataclasses.replace(ModelConfig(), d_model=256, encoder_attention="random")
    with pytest.raises(UsageError) as e:
        check_same_model(saved, changed, tmp_path)
    assert "model.d_model: 512 in the checkpoint, 256 now" in str(e.value)
    assert "model.encoder_attention: 'vanilla' in the checkpoint, 'random' now" in str(e.value)


def test_a_metrics_file_cut_by_a_crash_does_not_block_the_resume(tmp_path):
    lines = [json.dumps({"step": s, "loss": 1.0}) for s in (1, 2, 3)]
    (tmp_path / "metrics.jsonl").write_text("\n".join(lines) + "\n" + '{"step": 4, "lo')
    logger = MetricsLogger(tmp_path, enabled=True, start_step=2)
    logger.write(3, {"loss": 0.5})
    logger.close()
    records = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert records == [{"step": 1, "loss": 1.0}, {"step": 2, "loss": 1.0}, {"step": 3, "loss": 0.5}]


_HOLD = """
import sys, time
from pathlib import Path
from pretrain.run_lock import RunLock
RunLock(Path(sys.argv[1])).acquire()
print("held", flush=True)
time.sleep(3600)
"""


def test_the_run_lock_refuses_a_second_job_and_takes_over_a_dead_ones(tmp_path, caplog):
    holder = subprocess.Popen([sys.executable, "-c", _HOLD, str(tmp_path)], stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "held"
        with pytest.raises(UsageError, match=rf"is in use by another job \(pid {holder.pid} on "):
            RunLock(tmp_path).acquire()
    finally:
        holder.kill()
        holder.wait()
    lock = RunLock(tmp_path)
    lock.acquire()  # the holder died without releasing: its lock is stale
    assert f"taking over the stale lock of pid {holder.pid}" in caplog.text
    lock.release()
    caplog.clear()
    RunLock(tmp_path).acquire()  # after a clean release there is nobody to report
    assert "stale" not in caplog.text


def test_a_conversion_too_long_for_the_timeout_is_refused_naming_reshard(tmp_path):
    from pretrain.checkpoint import prepare_resume
    from pretrain.config import Config, to_yaml
    from pretrain.parallel import ParallelDims

    path = _checkpoint(tmp_path / "run" / "checkpoints", 100)
    (path / "trainer_state.json").write_text(json.dumps({"step": 100, "tokens_seen": 0, "skipped_steps": 0,
                                                         "tp": 1, "dp": 8}))
    (path / "config.yaml").write_text(to_yaml(Config()))
    with open(path / "zero_pp_rank_0_mp_rank_00_optim_states.pt", "wb") as f:
        f.truncate(200_000_000)  # 200 MB (sparse): ~10 s of conversion, more than a quarter of 20 s
    dims = ParallelDims(world=4, rank=0, local_rank=0, tp=2, dp=2, tp_rank=0, dp_rank=0, device=None)
    with pytest.raises(UsageError, match=r"at TP 2 x DP 2 needs a universal checkpoint, about 10 s of conversion.*"
                                         r"python -m pretrain.reshard --run .*run"):
        prepare_resume(path, ModelConfig(), dims, timeout_s=20)
