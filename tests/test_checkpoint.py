"""The run folder: which checkpoint a run resumes from (a lost `latest`, damaged content, `checkpoint.resume`),
what counts as complete and intact, pruning, the refusal of a changed model, tokenizer or shard list, a cut
metrics.jsonl and the run lock; and a real save and resume of a tiny DeepSpeed engine in one process (the marker
lists every file, and is written after them). Training runs that save, load and reshard are in
tests/test_train.py and tests/test_faults.py."""
from __future__ import annotations

import dataclasses
import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from pretrain.core.config import CheckpointConfig, ModelConfig, UsageError
from pretrain.core.manifest import COMPLETE, complete_steps, describe, missing_parts, write_marker
from pretrain.runtime.checkpoint import CheckpointManager, Progress, RunInputs
from pretrain.runtime.metrics import MetricsLogger
from pretrain.runtime.resume import check_same_model, find_resume
from pretrain.runtime.run_lock import RunLock
from tests.distributed import run_distributed


def _checkpoint(root, step: int, complete: bool = True):
    """A folder shaped like a saved checkpoint: two files and, when complete, the marker listing them."""
    path = root / f"step_{step}"
    path.mkdir(parents=True)
    (path / "trainer_state.json").write_text(json.dumps({"step": step}))
    (path / "mp_rank_00_model_states.pt").write_bytes(b"x" * 100)
    if complete:
        write_marker(path, describe(path, sorted(path.iterdir())))
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
    (root / "latest").unlink()  # `latest` is a hint: the run's own checkpoints win without it too
    assert find_resume(CheckpointConfig(resume=str(elsewhere)), root) == root / "step_24"


def test_resume_none_is_refused_where_the_run_dir_holds_checkpoints(tmp_path):
    root = tmp_path / "run" / "checkpoints"
    _checkpoint(root, 8, complete=False)  # a first save that died: nothing to continue, a fresh start is fine
    assert find_resume(CheckpointConfig(resume="none"), root) is None
    _checkpoint(root, 30)
    _checkpoint(root, 40)
    with pytest.raises(UsageError, match=rf"checkpoint.resume=none, but {tmp_path / 'run'} holds checkpoints of a run "
                                         r"\(step_30, step_40\); a fresh run goes in a fresh run.dir"):
        find_resume(CheckpointConfig(resume="none"), root)


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
    with pytest.raises(UsageError, match=r"latest names step_30, but no complete intact checkpoint is in"):
        find_resume(CheckpointConfig(), root)
    _checkpoint(root, 10)
    _checkpoint(root, 20)
    _checkpoint(root, 30, complete=False)
    assert find_resume(CheckpointConfig(), root) == root / "step_20"


@pytest.mark.parametrize("latest", ["deleted", "a folder", "not UTF-8", "older"])
def test_a_lost_latest_resumes_from_the_newest_complete_intact_checkpoint(tmp_path, caplog, latest):
    root = tmp_path / "checkpoints"
    for step in (30, 40):
        _checkpoint(root, step)
    _checkpoint(root, 50, complete=False)
    if latest == "a folder":
        (root / "latest").mkdir()
    elif latest == "not UTF-8":
        (root / "latest").write_bytes(b"step_\xff\xfe40")
    elif latest == "older":
        (root / "latest").write_text("step_30\n")
    assert find_resume(CheckpointConfig(), root) == root / "step_40"
    said = {"deleted": "is missing", "a folder": "is unreadable (IsADirectoryError)",
            "not UTF-8": "is unreadable (UnicodeDecodeError)", "older": "names step_30"}[latest]
    assert f"latest {said}: resuming from step_40, the newest complete intact checkpoint" in caplog.text


def _overwrite_middle(file, count: int = 1000) -> None:
    """`count` float32 values of 1e4 in the middle of `file`: the same size, other content."""
    data = bytearray(file.read_bytes())
    middle = len(data) // 2
    data[middle: middle + 4 * count] = (b"\x00\x40\x1c\x46" * count)[: len(data) - middle]
    file.write_bytes(bytes(data))


def test_a_damaged_checkpoint_is_named_set_aside_and_the_one_before_it_used(tmp_path, caplog):
    root = tmp_path / "run" / "checkpoints"
    for step in (20, 30, 40):
        _checkpoint(root, step)
    (root / "latest").write_text("step_40\n")
    _overwrite_middle(root / "step_40" / "mp_rank_00_model_states.pt", count=10)
    (root / "step_30" / "trainer_state.json").write_text('{"step": 99}')  # a damaged header, the same size
    assert missing_parts(root / "step_40") == [] and complete_steps(root) == [20, 30, 40]  # sizes cannot tell
    assert find_resume(CheckpointConfig(), root) == root / "step_20"
    assert (f"checkpoint {root / 'step_40'} (step 40) is damaged: mp_rank_00_model_states.pt (checksum mismatch)"
            in caplog.text)
    assert "(step 30) is damaged: trainer_state.json (checksum mismatch)" in caplog.text
    # moved aside: never chosen, pruned or exported again, kept for a look
    assert sorted(p.name for p in root.iterdir()) == ["latest", "step_20", "step_30.damaged", "step_40.damaged"]
    # a damaged checkpoint the user names is refused, naming the file
    with pytest.raises(UsageError, match=r"step_40.damaged is damaged: mp_rank_00_model_states.pt \(checksum"):
        find_resume(CheckpointConfig(resume=str(root / "step_40.damaged")), tmp_path / "fresh")
    # every complete checkpoint damaged: refused rather than a restart from step 0
    _overwrite_middle(root / "step_20" / "mp_rank_00_model_states.pt", count=10)
    with pytest.raises(UsageError, match=r"latest names step_40, but no complete intact checkpoint is in .*"
                                         r"the run cannot continue"):
        find_resume(CheckpointConfig(), root)


def test_a_marker_without_checksums_is_accepted_with_a_warning(tmp_path, caplog):
    root = tmp_path / "checkpoints"
    path = _checkpoint(root, 10, complete=False)
    (path / COMPLETE).write_text(json.dumps({"files": {p.name: p.stat().st_size for p in path.iterdir()}}))
    assert find_resume(CheckpointConfig(), root) == path
    assert "lists no checksums (written before they were recorded): its content is not checked" in caplog.text


def test_another_tokenizer_or_shard_list_is_refused_naming_the_change(tmp_path, tokenizer_model):
    shards = []
    for i in range(4):
        shards.append(tmp_path / "shards" / f"shard-{i:06d}.tar")
        shards[-1].parent.mkdir(exist_ok=True)
        shards[-1].write_bytes(b"x" * (100 + i))
    inputs = RunInputs.of(tokenizer_model, [str(s) for s in shards])
    path = _checkpoint(tmp_path / "checkpoints", 8, complete=False)
    (path / "inputs.json").write_text(json.dumps(inputs.record()))
    inputs.check_resume(path)
    moved = tmp_path / "elsewhere"
    shutil.copytree(tmp_path / "shards", moved)  # the same shards in another folder are the same data
    RunInputs.of(tokenizer_model, sorted(str(s) for s in moved.iterdir())).check_resume(path)
    with pytest.raises(UsageError, match=r"data.train changed \(4 shards in the checkpoint, 2 now; not listed now: "
                                         r"shard-000002.tar, shard-000003.tar\); the saved data position"):
        RunInputs.of(tokenizer_model, [str(s) for s in shards[:2]]).check_resume(path)
    shards[1].write_bytes(b"y" * 7)
    with pytest.raises(UsageError, match=r"another size: shard-000001.tar"):
        RunInputs.of(tokenizer_model, [str(s) for s in shards]).check_resume(path)
    other = tmp_path / "other.model"
    other.write_bytes(Path(tokenizer_model).read_bytes() + b"\0")
    with pytest.raises(UsageError, match=rf"data.tokenizer changed \({other} has sha256 .*; a copy of it is "
                                         rf"{path / 'spiece.model'}\)"):
        RunInputs.of(other, [str(s) for s in shards]).check_resume(path)


def test_a_fine_tuning_task_file_of_other_content_is_refused_a_moved_one_is_not(tmp_path, tokenizer_model):
    # before: a fine-tuning run.dir resumed with another data.dir continued on the other examples without a word
    train = tmp_path / "SST-2" / "train.tsv"
    train.parent.mkdir()
    train.write_text("sentence\tlabel\na triumph\t1\n")
    path = _checkpoint(tmp_path / "checkpoints", 8, complete=False)
    (path / "inputs.json").write_text(json.dumps(RunInputs.of(tokenizer_model, task_file=train).record()))
    moved = shutil.copytree(train.parent, tmp_path / "moved" / "SST-2") / "train.tsv"
    RunInputs.of(tokenizer_model, task_file=moved).check_resume(path)  # the same file elsewhere is the same data
    moved.write_text("sentence\tlabel\na triumph\t0\n")  # the same size, another label
    with pytest.raises(UsageError, match=rf"^cannot resume from {path}: data.dir changed \(the task's training file "
                                         rf"{moved} has 27 bytes, sha256 \w{{12}}\.\.\., the run's {train} had 27 bytes, "
                                         r"sha256 \w{12}\.\.\.\); the saved data position would apply to other examples"):
        RunInputs.of(tokenizer_model, task_file=moved).check_resume(path)


def test_pruning_keeps_the_newest_complete_checkpoints_and_drops_leftovers(tmp_path):
    root = tmp_path / "checkpoints"
    for step in (4, 8, 12):
        _checkpoint(root, step)
    _checkpoint(root, 6, complete=False)  # a save that died, older than the newest complete one
    (root / "step_4_universal").mkdir()
    manager = CheckpointManager(CheckpointConfig(keep=2), root, dims=None, engine=None, progress=Progress(),
                                data=None, inputs=None, config_yaml="", universal_info={})
    manager._prune(newest="step_12")
    assert sorted(p.name for p in root.iterdir()) == ["step_12", "step_8"]
    manager = CheckpointManager(CheckpointConfig(keep=1), root, dims=None, engine=None, progress=Progress(),
                                data=None, inputs=None, config_yaml="", universal_info={})
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


def test_a_checkpoint_older_than_a_model_key_resumes_under_the_keys_old_behaviour(tmp_path):
    # position_bias and synthesizer_init came later: a checkpoint without them was trained with the bias everywhere
    # and T5's synthesizer initialisation, and resumes under those values only
    saved = {k: v for k, v in dataclasses.asdict(ModelConfig()).items()
             if k not in ("position_bias", "synthesizer_init")}
    check_same_model(saved, dataclasses.replace(ModelConfig(), position_bias="all", synthesizer_init="t5"), tmp_path)
    with pytest.raises(UsageError) as e:
        check_same_model(saved, dataclasses.replace(ModelConfig(), position_bias="none", synthesizer_init="mesh_tf"),
                         tmp_path)
    assert ("model.position_bias: 'all' (the checkpoint predates the key) in the checkpoint, 'none' now; "
            "model.synthesizer_init: 't5' (the checkpoint predates the key) in the checkpoint, 'mesh_tf' now); "
            "restore those values or start a new run.dir") in str(e.value)
    with pytest.raises(UsageError, match="model.position_bias: 'vanilla' in the checkpoint, 'all' now"):
        check_same_model({**saved, "position_bias": "vanilla", "synthesizer_init": "t5"},
                         dataclasses.replace(ModelConfig(), synthesizer_init="t5"), tmp_path)


def test_a_cut_or_garbled_metrics_line_is_named_and_does_not_block_the_resume(tmp_path, caplog):
    lines = [json.dumps({"step": s, "loss": 1.0}) for s in (1, 2, 3, 4)]
    lines[1] = lines[1][:12] + "\x00\x00\x00"  # a damaged line (blocks of zeros after a crash of the file system)
    (tmp_path / "metrics.jsonl").write_text("\n".join(lines) + "\n" + '{"step": 5, "lo')  # the last one cut by a kill
    with caplog.at_level("WARNING", logger="pretrain.runtime.metrics"):
        logger = MetricsLogger(tmp_path, enabled=True, start_step=3)
    warnings = [r.getMessage() for r in caplog.records]
    assert len(warnings) == 2 and [w.split(" is no metrics record")[0] for w in warnings] == \
        [f"{tmp_path / 'metrics.jsonl'} line 2 of 5", f"{tmp_path / 'metrics.jsonl'} line 5 of 5"], warnings
    assert warnings[1].endswith("""dropped: '{"step": 5, "lo'""")
    assert [logger.lacks(step) for step in (1, 2, 3)] == [False, True, False]  # the resume knows what it lost
    logger.write(4, {"loss": 0.5})
    logger.close()
    records = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert records == [{"step": 1, "loss": 1.0}, {"step": 3, "loss": 1.0}, {"step": 4, "loss": 0.5}]


_HOLD = """
import sys, time
from pathlib import Path
from pretrain.runtime.run_lock import RunLock
from tests.distributed import run_distributed
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


def test_a_removed_lock_file_does_not_admit_a_second_job(tmp_path):
    # `rm run.dir/lock` under a running job: before, the next job created a new lock file, locked it and trained
    # beside the first; the run folder's own lock is still held, and /proc/locks names its holder
    holder = subprocess.Popen([sys.executable, "-c", _HOLD, str(tmp_path)], stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "held"
        (tmp_path / "lock").unlink()
        with pytest.raises(UsageError) as e:
            RunLock(tmp_path).acquire()
        assert str(e.value) == (f"{tmp_path} is in use by another job (pid {holder.pid} on this host, by /proc/locks; "
                                "run.dir/lock was removed); give this run its own run.dir, or stop that job first")
    finally:
        holder.kill()
        holder.wait()
    lock = RunLock(tmp_path)
    lock.acquire()  # the holder is gone: its locks went with it
    lock.release()


def test_a_stale_lock_of_another_host_says_what_was_checked(tmp_path, caplog):
    # the lock file names a job on another node and nobody holds the lock: that only this host's kernel was asked
    # is said, not "that job is gone"
    (tmp_path / "lock").write_text(json.dumps({"host": "node-elsewhere", "pid": 4242, "slurm_job": "77"}))
    lock = RunLock(tmp_path)
    lock.acquire()
    lock.release()
    assert ("taking over the stale lock of pid 4242 on node-elsewhere, SLURM job 77: no process on this host holds "
            "it; that the job on node-elsewhere is gone is not checked: only a filesystem that shares flock between "
            "nodes tells") in caplog.text
    assert "that job is gone" not in caplog.text


@pytest.mark.parametrize("written, now, refusal", [
    ({"precision": "fp32", "zero_stage": 1}, ("fp32", 3), "with zero.stage 1 -> 3: DeepSpeed carries a checkpoint "
     "across that only as a universal checkpoint, whose ZeRO 3 and ZeRO 1/2 forms DeepSpeed cannot load into each "
     "other; resume with zero.stage 1 or 2, or export it"),
    ({"precision": "fp32", "zero_stage": 1}, ("fp32", 0), "with zero.stage 1 -> 0: DeepSpeed carries a checkpoint "
     "across that only as a universal checkpoint, which needs ZeRO >= 1 on both sides (ZeRO 0 writes no optimizer "
     "partitions and loads none); resume with zero.stage 1 or 2, or export it"),
    ({"precision": "fp32", "zero_stage": 0}, ("bf16", 0), "with precision fp32 -> bf16: DeepSpeed carries"),
    ({"precision": "bf16", "zero_stage": 3}, ("fp32", 2), "with precision bf16 -> fp32, zero.stage 3 -> 2: "),
    ({}, ("bf16", 3), None),  # written before precision and ZeRO stage were recorded: loads as before
], ids=["zero 1 to 3", "zero 1 to 0", "zero 0 fp32 to bf16", "zero 3 bf16 to zero 2 fp32", "unrecorded"])
def test_a_resume_with_another_precision_or_zero_stage_is_refused_where_deepspeed_cannot_carry_it(
        tmp_path, written, now, refusal):
    from pretrain.core.config import Config, to_yaml
    from pretrain.distributed.parallel import ParallelDims
    from pretrain.runtime.resume import prepare_resume

    path = _checkpoint(tmp_path / "run" / "checkpoints", 8)
    (path / "trainer_state.json").write_text(json.dumps({"step": 8, "tokens_seen": 0, "skipped_steps": 0, "tp": 1,
                                                         "dp": 1, **written}))
    (path / "config.yaml").write_text(to_yaml(Config()))
    dims = ParallelDims(world=1, rank=0, local_rank=0, tp=1, dp=1, tp_rank=0, dp_rank=0, device=None)
    resume = lambda: prepare_resume(path, ModelConfig(), RunInputs(Path("spiece.model"), "", ()), dims, timeout_s=60,
                                    precision=now[0], zero_stage=now[1])
    if refusal is None:
        assert not resume().universal
        return
    with pytest.raises(UsageError) as e:
        resume()
    assert str(e.value).startswith(f"cannot resume {path} {refusal}")


def test_another_global_batch_on_resume_is_said_in_one_line(tmp_path, caplog):
    # before: a resume at another global batch (8 -> 16) continued without a word
    from pretrain.core.config import Config, to_yaml
    from pretrain.distributed.parallel import ParallelDims
    from pretrain.runtime.resume import prepare_resume

    path = _checkpoint(tmp_path / "run" / "checkpoints", 40)
    (path / "trainer_state.json").write_text(json.dumps({"step": 40, "tokens_seen": 0, "skipped_steps": 0, "tp": 1,
                                                         "dp": 1}))
    (path / "config.yaml").write_text(to_yaml(Config()))  # global batch 8
    dims = ParallelDims(world=1, rank=0, local_rank=0, tp=1, dp=1, tp_rank=0, dp_rank=0, device=None)
    for batch in (8, 16):
        assert not prepare_resume(path, ModelConfig(), RunInputs(Path("spiece.model"), "", ()), dims, timeout_s=60,
                                  precision="fp32", zero_stage=1, global_batch=batch).universal
    said = [r.getMessage() for r in caplog.records if r.getMessage().startswith("train.global_batch")]
    assert said == ["train.global_batch 8 -> 16: step_40 was trained with 8 sequences a step, the steps from 41 on "
                    "take 16 (the LR schedule counts steps; the data goes on with its next example)"]


def test_a_conversion_too_long_for_the_timeout_is_refused_naming_reshard(tmp_path):
    from pretrain.core.config import Config, to_yaml
    from pretrain.distributed.parallel import ParallelDims
    from pretrain.runtime.resume import prepare_resume

    path = _checkpoint(tmp_path / "run" / "checkpoints", 100)
    (path / "trainer_state.json").write_text(json.dumps({"step": 100, "tokens_seen": 0, "skipped_steps": 0,
                                                         "tp": 1, "dp": 8}))
    (path / "config.yaml").write_text(to_yaml(Config()))
    with open(path / "zero_pp_rank_0_mp_rank_00_optim_states.pt", "wb") as f:
        f.truncate(200_000_000)  # 200 MB (sparse): ~10 s of conversion, more than a quarter of 20 s
    dims = ParallelDims(world=4, rank=0, local_rank=0, tp=2, dp=2, tp_rank=0, dp_rank=0, device=None)
    with pytest.raises(UsageError, match=r"with TP 1 x DP 8 -> TP 2 x DP 2 needs a universal checkpoint, about 10 s of "
                                         r"conversion.*python -m pretrain.reshard --run .*run"):
        prepare_resume(path, ModelConfig(), RunInputs(Path("spiece.model"), "", ()), dims, timeout_s=20,
                       precision="fp32", zero_stage=1)


def _save_damage_resume(rank: int, world: int, root: str, tokenizer: str) -> dict:
    """A tiny real DeepSpeed engine (ZeRO 1, one process): steps 1 and 2, each saved by CheckpointManager.save;
    then the middle of step 2's optimizer shard is overwritten and the run resumes on its own; then step 1's
    header is overwritten too. Returns what the test checks: the marker and mtimes of step 2 as saved, the step
    the resume restored, and the refusal once no checkpoint is intact."""
    import torch

    from pretrain.core.config import Config, ParallelConfig, load_config, to_yaml
    from pretrain.distributed.parallel import init_distributed
    from pretrain.model import build_model, universal_checkpoint_info
    from pretrain.runtime.engine import build_engine
    from pretrain.runtime.resume import prepare_resume

    cfg = load_config(Config, "configs/tiny.yaml")
    dims = init_distributed(ParallelConfig(), seed=3)
    model = build_model(cfg.model)
    engine = build_engine(model, dataclasses.replace(cfg.train, micro_batch=2, global_batch=2), cfg.zero, "fp32", 1)
    progress, inputs = Progress(), RunInputs.of(tokenizer)
    manager = CheckpointManager(cfg.checkpoint, Path(root), dims, engine=engine, progress=progress, data=None,
                                inputs=inputs, config_yaml=to_yaml(cfg),
                                universal_info=universal_checkpoint_info(model, cfg.model.vocab_size))
    ids = torch.randint(2, 1000, (2, 12), generator=torch.Generator().manual_seed(0))
    for step in (1, 2):
        engine.backward(engine(input_ids=ids, attention_mask=torch.ones_like(ids), decoder_input_ids=ids[:, :6],
                               labels=ids[:, 1:7]).loss)
        engine.step()
        progress.step = step
        path = manager.save(step)
    saved = {"marker": json.loads((path / COMPLETE).read_text())["files"],
             "mtimes": {str(p.relative_to(root)): p.stat().st_mtime_ns for p in Path(root).rglob("*") if p.is_file()}}
    _overwrite_middle(next(path.glob("*optim_states.pt")))
    plan = prepare_resume(find_resume(cfg.checkpoint, Path(root), dims.rank, dims.world), cfg.model, inputs, dims, 60,
                          precision="fp32", zero_stage=cfg.zero.stage)
    manager.load(plan)
    # a damaged header of step 1's model states too: no intact checkpoint is left, one line instead of an
    # UnpicklingError on every requeue
    model_states = Path(root) / "step_1" / "mp_rank_00_model_states.pt"
    with model_states.open("r+b") as f:
        f.write(b"\0" * 64)
    refusal = ""
    try:
        find_resume(cfg.checkpoint, Path(root), dims.rank, dims.world)
    except UsageError as e:
        refusal = str(e)
    return {**saved, "resumed_step": progress.step, "refusal": refusal}


def test_a_real_save_lists_every_file_after_writing_it_and_a_damaged_one_is_skipped(tmp_path, tokenizer_model):
    root = tmp_path / "checkpoints"
    result = run_distributed(_save_damage_resume, 1, str(root), tokenizer_model)[0]
    # the marker lists every file of the folder (DeepSpeed's, ours, the tokenizer copy) with its size and crc32
    step2 = {name.removeprefix("step_2/"): t for name, t in result["mtimes"].items() if name.startswith("step_2/")}
    assert set(result["marker"]) == set(step2) - {COMPLETE}
    assert {"mp_rank_00_model_states.pt", "zero_pp_rank_0_mp_rank_00_optim_states.pt", "rng_rank0.pt",
            "trainer_state.json", "config.yaml", "inputs.json", "spiece.model"} <= set(result["marker"])
    assert (root / "step_2.damaged" / "spiece.model").read_bytes() == Path(tokenizer_model).read_bytes()
    # ...and it was written after all of them, and `latest` after it
    assert max(t for name, t in step2.items() if name != COMPLETE) <= step2[COMPLETE] <= result["mtimes"]["latest"]
    # the damaged step 2 was set aside and the run continued from step 1
    assert result["resumed_step"] == 1
    assert result["refusal"] == (f"{root / 'latest'} names step_2, but no complete intact checkpoint is in {root} "
                                 "(a missing, incomplete or damaged one is never resumed); the run cannot continue: "
                                 "start a new run.dir")
    assert sorted(p.name for p in root.glob("step_*")) == ["step_1.damaged", "step_2.damaged"]
