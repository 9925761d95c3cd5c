"""Which checkpoint a run resumes from and how it is loaded (`plan_resume`; the checkpoint manager,
pretrain.runtime.checkpoint, then restores it).

Which checkpoint a run starts from (`find_resume`): its own newest complete intact checkpoint when there is one
(so a requeued job continues where it stopped, whatever `checkpoint.resume` says), else `checkpoint.resume`
(`auto`: none; a path: that complete intact checkpoint; `none`: none, and refused where the run.dir holds
checkpoints: two runs never share a folder). A resume with another model, tokenizer or train shard list is
refused. Resuming on another TP/DP layout, precision or ZeRO stage (recorded in `trainer_state.json`) goes
through DeepSpeed's universal checkpoint: `prepare_resume` converts `step_N/` into `step_N_universal/` (on rank 0)
when that finishes well inside the process-group timeout, and otherwise asks for `python -m pretrain.reshard`
first; a change DeepSpeed cannot carry (ZeRO 0 on either side, ZeRO 3 <-> 1/2) is refused in one line.
"""
from __future__ import annotations

import contextlib
import dataclasses
import io
import json
import logging
import shutil
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import torch.distributed as dist
import yaml

from pretrain.core.config import MODEL_KEYS_ADDED, CheckpointConfig, ModelConfig, UsageError
from pretrain.core.manifest import (
    check_complete,
    check_intact,
    complete_steps,
    damaged_parts,
    describe,
    missing_parts,
    newest_intact,
    tag_for,
    write_marker,
)
from pretrain.distributed.parallel import ParallelDims
from pretrain.runtime.checkpoint import ResumePlan, RunInputs, universal_path

log = logging.getLogger(__name__)

# a conservative rate for DeepSpeed's universal conversion on one process (it reads and rewrites every shard)
CONVERT_BYTES_PER_S = 20e6


def plan_resume(cfg: CheckpointConfig, root: Path, model_cfg: ModelConfig, inputs: RunInputs, dims: ParallelDims,
                timeout_s: float, *, precision: str, zero_stage: int, global_batch: int) -> ResumePlan | None:
    """The checkpoint this run continues from (`find_resume`), checked against the run and converted where the
    layout changed (`prepare_resume`); None for a fresh start. Every rank calls it, before the engine is built
    (the engine must know whether it loads a universal checkpoint)."""
    path = find_resume(cfg, root, dims.rank, dims.world)
    return prepare_resume(path, model_cfg, inputs, dims, timeout_s, precision=precision, zero_stage=zero_stage,
                          global_batch=global_batch) if path else None


# ----------------------------------------------------------------------------------------------------------------
# Which checkpoint, and is it this run's
# ----------------------------------------------------------------------------------------------------------------
def find_resume(cfg: CheckpointConfig, root: Path, rank: int = 0, world: int = 1) -> Path | None:
    """The checkpoint folder to resume from: the run's own newest complete intact one first, then
    `checkpoint.resume`. Every rank of the default process group calls it when `world` > 1 (they share the
    checksum reads and agree on the outcome)."""
    if cfg.resume == "none":
        steps = complete_steps(root)
        if steps:
            raise UsageError(f"checkpoint.resume=none, but {root.parent} holds checkpoints of a run "
                             f"({', '.join(tag_for(s) for s in steps[-3:])}); a fresh run goes in a fresh run.dir "
                             "(to continue that run: checkpoint.resume=auto)")
        return None
    own = newest_intact(root, rank, world)
    if own is not None:
        if cfg.resume != "auto":
            log.info("continuing from this run's own %s (checkpoint.resume=%s is for its first start)", own.name,
                     cfg.resume)
        return own
    if cfg.resume == "auto":
        return None
    path = Path(cfg.resume)
    check_intact(path, rank, world)
    return path


def check_same_model(saved: dict[str, Any], current: ModelConfig, path: Path) -> None:
    """Refuse a resume whose model differs in anything but dropout; name every difference. A key the checkpoint
    predates has its old behaviour's value (MODEL_KEYS_ADDED): such a checkpoint resumes under that value."""
    older = {k: f"{v!r} (the checkpoint predates the key)" for k, v in MODEL_KEYS_ADDED.items() if k not in saved}
    saved = {**MODEL_KEYS_ADDED, **saved}
    now = dataclasses.asdict(current)
    diffs = [
        f"model.{k}: {older.get(k, repr(saved.get(k)))} in the checkpoint, {v!r} now"
        for k, v in now.items()
        if k != "dropout" and saved.get(k) != v
    ]
    if diffs:
        raise UsageError(
            f"cannot resume from {path}: the model changed ({'; '.join(diffs)}); "
            "restore those values or start a new run.dir"
        )


def _bytes(path: Path) -> int:
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file())


def usable_universal(universal: Path, rank: int = 0, world: int = 1) -> bool:
    """Whether a finished, intact universal conversion is there (collective when `world` > 1)."""
    return not missing_parts(universal) and not damaged_parts(universal, rank, world)


def _changes(state: dict, dims: ParallelDims, precision: str, zero_stage: int) -> list[str]:
    """What this run changes of what wrote the checkpoint, in words; a checkpoint from before precision and ZeRO
    stage were recorded in trainer_state.json counts as written with this run's."""
    then, now = f"TP {state['tp']} x DP {state['dp']}", f"TP {dims.tp} x DP {dims.dp}"
    changes = [f"{then} -> {now}"] if then != now else []
    for key, saved, current in (("precision", state.get("precision", precision), precision),
                                ("zero.stage", state.get("zero_stage", zero_stage), zero_stage)):
        if saved != current:
            changes.append(f"{key} {saved} -> {current}")
    return changes


def _check_universal_stages(path: Path, state: dict, changes: list[str], zero_stage: int) -> None:
    """Refuse, in one line, a change DeepSpeed's universal checkpoint cannot carry (DeepSpeed 0.19.8). ZeRO 0 writes
    no optimizer partitions to convert, and a universal load at ZeRO 0 loads neither weights nor optimizer (read from
    its engine.py); ZeRO 3 and ZeRO 1/2 read each other's universal optimizer state as `KeyError:
    'optimizer_state_dict'` (1 -> 3) and `Empty ds_version in checkpoint` (3 -> 1), tried on CPU. What loads there:
    fp32 <-> bf16 at ZeRO 1, 2 and 3, and ZeRO 1 <-> 2."""
    written = state.get("zero_stage", zero_stage)
    fix = {0: "zero.stage=0 and none of those changes", 3: "zero.stage=3"}.get(written, "zero.stage 1 or 2")
    if written == 0 or zero_stage == 0:
        why = "which needs ZeRO >= 1 on both sides (ZeRO 0 writes no optimizer partitions and loads none)"
    elif (written == 3) != (zero_stage == 3):
        why = "whose ZeRO 3 and ZeRO 1/2 forms DeepSpeed cannot load into each other"
    else:
        return
    raise UsageError(f"cannot resume {path} with {', '.join(changes)}: DeepSpeed carries a checkpoint across that "
                     f"only as a universal checkpoint, {why}; resume with {fix}, or export it (python -m "
                     "pretrain.export) and start a new run.dir with init=EXPORT (its weights, a fresh optimizer)")


def prepare_resume(path: Path, model_cfg: ModelConfig, inputs: RunInputs, dims: ParallelDims, timeout_s: float, *,
                   precision: str, zero_stage: int, global_batch: int | None = None) -> ResumePlan:
    """Validate the checkpoint against this run. On another layout, precision or ZeRO stage, whose files DeepSpeed
    cannot load directly (fp32 -> bf16 looks for files the fp32 run never wrote; 1 -> 3 and 1 -> 0 fail inside
    DeepSpeed), convert it to a universal one (rank 0) when that finishes well inside the process-group timeout
    (the other ranks wait at a barrier); else, or where DeepSpeed cannot carry the change, refuse in one line.
    Another `global_batch` than the checkpoint's continues, said in one line."""
    state = json.loads((path / "trainer_state.json").read_text())
    saved = yaml.safe_load((path / "config.yaml").read_text())
    check_same_model(saved["model"], model_cfg, path)
    inputs.check_resume(path)
    saved_batch = saved.get("train", {}).get("global_batch", global_batch)
    if saved_batch != global_batch and global_batch is not None and dims.rank == 0:
        log.warning("train.global_batch %d -> %d: %s was trained with %d sequences a step, the steps from %d on take "
                    "%d (the LR schedule counts steps; the data goes on with its next example)", saved_batch,
                    global_batch, path.name, saved_batch, state["step"] + 1, global_batch)
    changes = _changes(state, dims, precision, zero_stage)
    if not changes:
        return ResumePlan(path, state, universal=False)
    _check_universal_stages(path, state, changes, zero_stage)
    universal = universal_path(path)
    if not usable_universal(universal, dims.rank, dims.world):
        seconds = _bytes(path) / CONVERT_BYTES_PER_S
        if seconds > timeout_s / 4:
            raise UsageError(
                f"resuming {path} with {', '.join(changes)} needs a universal checkpoint, about {seconds:.0f} s of "
                f"conversion, too long to wait for inside parallel.timeout_s ({timeout_s:.0f} s); run "
                f"`python -m pretrain.reshard --run {path.parent.parent}` (or slurm/reshard.sbatch) first")
        if dims.rank == 0:
            log.info("%s: converting %s to a universal checkpoint", ", ".join(changes), path)
            convert_to_universal(path, universal)
    dist.barrier()
    return ResumePlan(path, state, universal=True)


def convert_to_universal(path: Path, output: Path, workers: int = 1) -> None:
    """DeepSpeed's ds_to_universal (the same as `python -m deepspeed.checkpoint.ds_to_universal`); the output gets
    its own complete.json, so a damaged conversion is made again rather than loaded."""
    # imported where used: only a layout change needs the converter (~0.6 s of imports per process)
    from deepspeed.checkpoint.ds_to_universal import main as ds_to_universal

    check_complete(path)
    tmp = output.with_name(output.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    said = io.StringIO()  # its prints and tqdm bars (stdout and stderr): to the log at DEBUG, not the job's output
    with contextlib.redirect_stdout(said), contextlib.redirect_stderr(said):
        ds_to_universal(SimpleNamespace(
            input_folder=str(path), output_folder=str(tmp), num_extract_workers=workers, num_merge_workers=workers,
            keep_temp_folder=False, strict=True, inject_missing_state=False,
        ))
    for line in said.getvalue().replace("\r", "\n").splitlines():
        if line.strip():
            log.debug("ds_to_universal: %s", line.strip())
    write_marker(tmp, describe(tmp, sorted(p for p in tmp.rglob("*") if p.is_file())))
    shutil.rmtree(output, ignore_errors=True)
    tmp.rename(output)  # a half-converted folder is never mistaken for a finished one
