"""Checkpoints in `run.dir/checkpoints/`: DeepSpeed's sharded layout (every rank writes its part), what DeepSpeed
does not keep, a completion marker, and the `latest` pointer. The manager is handed the components that save and
restore themselves (the engine, the progress counters, the data stream) once; `save(step)` writes them and
`load(plan)` restores them in place (torchtitan's Stateful pattern).

`checkpoints/step_N/` holds DeepSpeed's files (model and ZeRO shards, LR schedule, universal-checkpoint metadata
in the client state) and ours: `data_dp{r}.pt` (the data position of DP rank r, written by its TP rank 0),
`rng_rank{r}.pt` (every rank's generators), `trainer_state.json` (progress and layout), `config.yaml` and, last,
`complete.json`: written by rank 0 only after every rank wrote and closed its files (a barrier) and every file
was fsync'd, it lists every file with its size. A folder without it, or with a listed file missing or cut, is
incomplete: resume, export and pruning never use it. `latest` is moved (write, fsync, rename, fsync the folder)
only after the marker, so a crash or a full disk during a save leaves `latest` on the previous complete
checkpoint. The newest `checkpoint.keep` complete checkpoints are kept; the newest complete one never goes.

Which checkpoint a run starts from: its own `latest` when there is one (so a requeued job continues where it
stopped, whatever `checkpoint.resume` says), else `checkpoint.resume` (`auto`: none; a path: that complete
checkpoint; `none`: start fresh). Resuming on another TP/DP layout goes through DeepSpeed's universal checkpoint:
`prepare_resume` converts `step_N/` into `step_N_universal/` (on rank 0) when that finishes well inside the
process-group timeout, and otherwise asks for `python -m pretrain.reshard` first.

Our files are loaded with `weights_only=True`; DeepSpeed's own files are pickles (resume only from checkpoints
you trust: docs/training.md).
"""
from __future__ import annotations

import dataclasses
import json
import logging
import os
import re
import shutil
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace
from typing import Any, Protocol

import torch
import torch.distributed as dist
import yaml
from megatron.core.tensor_parallel import random as mp_random

from pretrain.config import CheckpointConfig, ModelConfig, UsageError
from pretrain.parallel import ParallelDims

log = logging.getLogger(__name__)

_TAG = re.compile(r"^step_(\d+)$")
LATEST = "latest"
COMPLETE = "complete.json"
UNIVERSAL_SUFFIX = "_universal"
# a conservative rate for DeepSpeed's universal conversion on one process (it reads and rewrites every shard)
CONVERT_BYTES_PER_S = 20e6


def tag_for(step: int) -> str:
    return f"step_{step}"


class CheckpointWriteError(RuntimeError):
    """A save that could not write its files (disk full, quota, I/O error); the run stops, nothing is lost."""


class DataStateful(Protocol):
    """A data stream: `state_dict()` is this DP rank's part; `load_state_dict({"ranks": [...]})` gets the parts of
    every DP rank of the saving run, so it can continue on another DP size."""

    def state_dict(self) -> dict: ...

    def load_state_dict(self, state: dict) -> None: ...


@dataclass
class Progress:
    """The loop's counters; saved in `trainer_state.json` with the layout that wrote it."""

    step: int = 0  # optimizer updates applied (a skipped step is retried under the same number)
    tokens_seen: int = 0  # input + target tokens consumed over all DP ranks, skipped steps included
    skipped_steps: int = 0  # steps DeepSpeed did not apply (non-finite loss or gradients)

    def state_dict(self) -> dict:
        return dataclasses.asdict(self)

    def load_state_dict(self, state: dict) -> None:
        self.step, self.tokens_seen, self.skipped_steps = state["step"], state["tokens_seen"], state["skipped_steps"]


@dataclass(frozen=True)
class ResumePlan:
    """What `prepare_resume` decided: the checkpoint folder, its state, and where DeepSpeed loads from."""

    path: Path
    state: dict[str, int]  # trainer_state.json: the Progress fields + tp, dp
    load_dir: Path  # the folder above DeepSpeed's tag folder
    load_tag: str  # step_N, or step_N_universal when the layout changed
    universal: bool


# ----------------------------------------------------------------------------------------------------------------
# Completeness
# ----------------------------------------------------------------------------------------------------------------
def missing_parts(path: Path) -> list[str]:
    """What keeps `path` from being a complete checkpoint ([] when complete)."""
    if not path.is_dir():
        return [f"{path} does not exist"]
    marker = path / COMPLETE
    try:
        files = json.loads(marker.read_text())["files"]
    except (OSError, ValueError, KeyError):
        return [f"{COMPLETE} (the save was interrupted or the folder is not a checkpoint)"]
    problems = []
    for name, size in files.items():
        file = path / name
        if not file.is_file():
            problems.append(f"{name} (missing)")
        elif file.stat().st_size != size:
            problems.append(f"{name} ({file.stat().st_size} of {size} bytes)")
    return problems


def check_complete(path: Path) -> None:
    """A one-line refusal naming what is missing, for resume and export."""
    problems = missing_parts(path)
    if problems:
        shown = ", ".join(problems[:3]) + (f" and {len(problems) - 3} more" if len(problems) > 3 else "")
        raise UsageError(f"checkpoint {path} is incomplete: {shown}")


def complete_steps(root: Path) -> list[int]:
    """Steps of the complete checkpoints under `root`, ascending."""
    if not root.is_dir():
        return []
    steps = sorted(int(m.group(1)) for p in root.iterdir() if (m := _TAG.match(p.name)))
    return [s for s in steps if (root / tag_for(s) / COMPLETE).is_file() and not missing_parts(root / tag_for(s))]


def find_resume(cfg: CheckpointConfig, root: Path) -> Path | None:
    """The checkpoint folder to resume from: the run's own `latest` first, then `checkpoint.resume`."""
    if cfg.resume == "none":
        return None
    latest = root / LATEST
    if latest.is_file():
        path = root / latest.read_text().strip()
        if not missing_parts(path):
            return path
        steps = complete_steps(root)
        if not steps:
            raise UsageError(f"{latest} names {path.name}, which is missing or incomplete, and no other complete "
                             f"checkpoint is in {root}; set checkpoint.resume=none to start over")
        log.warning("%s names %s, which is missing or incomplete; resuming from %s, the newest complete one",
                    latest, path.name, tag_for(steps[-1]))
        return root / tag_for(steps[-1])
    if cfg.resume == "auto":
        return None
    path = Path(cfg.resume)
    check_complete(path)
    return path


def check_same_model(saved: dict[str, Any], current: ModelConfig, path: Path) -> None:
    """Refuse a resume whose model differs in anything but dropout; name every difference."""
    now = dataclasses.asdict(current)
    diffs = [
        f"model.{k}: {saved.get(k)!r} in the checkpoint, {v!r} now"
        for k, v in now.items()
        if k != "dropout" and saved.get(k) != v
    ]
    if diffs:
        raise UsageError(
            f"cannot resume from {path}: the model changed ({'; '.join(diffs)}); "
            "restore those values or start a new run.dir (or set checkpoint.resume=none)"
        )


def _bytes(path: Path) -> int:
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file())


def prepare_resume(path: Path, model_cfg: ModelConfig, dims: ParallelDims, timeout_s: float) -> ResumePlan:
    """Validate the checkpoint against this run; on another layout, convert it to a universal one (rank 0) when
    that finishes well inside the process-group timeout (the other ranks wait at a barrier), else refuse."""
    state = json.loads((path / "trainer_state.json").read_text())
    saved_model = yaml.safe_load((path / "config.yaml").read_text())["model"]
    check_same_model(saved_model, model_cfg, path)
    if (state["tp"], state["dp"]) == (dims.tp, dims.dp):
        return ResumePlan(path, state, path.parent, path.name, universal=False)
    universal = path.parent / (path.name + UNIVERSAL_SUFFIX)
    if not (universal / "zero").is_dir():
        seconds = _bytes(path) / CONVERT_BYTES_PER_S
        if seconds > timeout_s / 4:
            raise UsageError(
                f"resuming {path} (TP {state['tp']} x DP {state['dp']}) at TP {dims.tp} x DP {dims.dp} needs a "
                f"universal checkpoint, about {seconds:.0f} s of conversion, too long to wait for inside "
                f"parallel.timeout_s ({timeout_s:.0f} s); run `python -m pretrain.reshard --run "
                f"{path.parent.parent}` (or slurm/reshard.sbatch) first")
        if dims.rank == 0:
            log.info("layout TP %d x DP %d -> TP %d x DP %d: converting %s to a universal checkpoint",
                     state["tp"], state["dp"], dims.tp, dims.dp, path)
            convert_to_universal(path, universal)
    dist.barrier()
    return ResumePlan(path, state, universal.parent, universal.name, universal=True)


def convert_to_universal(path: Path, output: Path, workers: int = 1) -> None:
    """DeepSpeed's ds_to_universal (the same as `python -m deepspeed.checkpoint.ds_to_universal`)."""
    # imported where used: only a layout change needs the converter (~0.6 s of imports per process)
    from deepspeed.checkpoint.ds_to_universal import main as ds_to_universal

    check_complete(path)
    tmp = output.with_name(output.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    ds_to_universal(SimpleNamespace(
        input_folder=str(path), output_folder=str(tmp), num_extract_workers=workers, num_merge_workers=workers,
        keep_temp_folder=False, strict=True, inject_missing_state=False,
    ))
    shutil.rmtree(output, ignore_errors=True)
    tmp.rename(output)  # a half-converted folder is never mistaken for a finished one


# ----------------------------------------------------------------------------------------------------------------
# Files
# ----------------------------------------------------------------------------------------------------------------
def _fsync(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_atomic(path: Path, text: str) -> None:
    """Write, fsync, rename over `path`, fsync the folder: readers see the old or the new text, never a part."""
    tmp = path.with_name(path.name + ".tmp")
    with tmp.open("w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    tmp.replace(path)
    _fsync(path.parent)


def _save_torch(obj: Any, path: Path) -> None:
    with path.open("wb") as f:
        torch.save(obj, f)
        f.flush()
        os.fsync(f.fileno())


def _rng_state() -> dict[str, Any]:
    state = {"cpu": torch.get_rng_state(), "tracker": mp_random.get_cuda_rng_tracker().get_states()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def _set_rng_state(state: dict[str, Any]) -> None:
    torch.set_rng_state(state["cpu"])
    mp_random.get_cuda_rng_tracker().set_states(state["tracker"])
    if "cuda" in state:
        torch.cuda.set_rng_state(state["cuda"])


class CheckpointManager:
    """Saves and restores everything a run needs to continue exactly; every rank calls `save` and `load`."""

    def __init__(self, cfg: CheckpointConfig, root: Path, dims: ParallelDims, *, engine, progress: Progress,
                 data: DataStateful | None, config_yaml: str, universal_info: dict) -> None:
        self.cfg, self.root, self.dims = cfg, root, dims
        self.engine, self.progress, self.data = engine, progress, data
        self.config_yaml, self.universal_info = config_yaml, universal_info

    def maybe_save(self, step: int, *, last: bool, preempted: bool) -> bool:
        """Save at the end of the run, on preemption, and every `checkpoint.every` steps."""
        if last or preempted or (self.cfg.every and step % self.cfg.every == 0):
            self.save(step)
            return True
        return False

    def save(self, step: int) -> Path:
        tag = tag_for(step)
        path = self.root / tag
        if self.dims.rank == 0:
            # leftovers of a save that died at this very step, and a universal copy of an older save of it
            shutil.rmtree(path, ignore_errors=True)
            shutil.rmtree(self.root / (tag + UNIVERSAL_SUFFIX), ignore_errors=True)
        dist.barrier()
        try:
            self._write(path)
        except (OSError, RuntimeError) as e:  # torch's zip writer reports a full disk as a RuntimeError
            first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
            raise CheckpointWriteError(f"rank {self.dims.rank}: writing {path} failed ({first}); is the disk full or "
                                       "over quota? `latest` still names the previous complete checkpoint") from e
        dist.barrier()  # every rank's files are written and closed
        if self.dims.rank == 0:
            self._commit(path)
        dist.barrier()
        log.info("checkpoint %s saved", path)
        return path

    def _write(self, path: Path) -> None:
        """This rank's files of the checkpoint: DeepSpeed's shards, the data position, the generators, and (rank 0)
        the trainer state and config."""
        self.engine.save_checkpoint(str(self.root), tag=path.name,
                                    client_state={"universal_checkpoint_info": self.universal_info}, save_latest=False)
        if self.data is not None and self.dims.tp_rank == 0:
            _save_torch(self.data.state_dict(), path / f"data_dp{self.dims.dp_rank}.pt")
        _save_torch(_rng_state(), path / f"rng_rank{self.dims.rank}.pt")
        if self.dims.rank == 0:
            state = {**self.progress.state_dict(), "tp": self.dims.tp, "dp": self.dims.dp}
            write_atomic(path / "trainer_state.json", json.dumps(state, indent=1))
            write_atomic(path / "config.yaml", self.config_yaml)

    def _commit(self, path: Path) -> None:
        """Rank 0, after every rank wrote its files: fsync them, mark the folder complete, move `latest`, prune."""
        files = {}
        for file in sorted(p for p in path.rglob("*") if p.is_file()):
            _fsync(file)  # DeepSpeed's files are closed but maybe not yet on disk
            files[str(file.relative_to(path))] = file.stat().st_size
        for folder in {f.parent for f in path.rglob("*") if f.is_file()} | {path}:
            _fsync(folder)
        write_atomic(path / COMPLETE, json.dumps({"files": files}, indent=1))
        write_atomic(self.root / LATEST, path.name + "\n")
        self._prune(newest=path.name)

    def _prune(self, newest: str) -> None:
        """Keep the newest `checkpoint.keep` complete checkpoints (`newest` always); drop incomplete leftovers."""
        complete = complete_steps(self.root)
        keep = {tag_for(s) for s in complete[-max(self.cfg.keep, 1):]} | {newest}
        for p in self.root.iterdir():
            m = _TAG.match(p.name)
            if m and p.name not in keep and (int(m.group(1)) in complete or int(m.group(1)) < complete[-1]):
                shutil.rmtree(p, ignore_errors=True)
                shutil.rmtree(self.root / (p.name + UNIVERSAL_SUFFIX), ignore_errors=True)

    def load(self, plan: ResumePlan) -> None:
        """Restore engine (weights, optimizer, LR schedule), progress, RNG and data position in place."""
        load_path, _ = self.engine.load_checkpoint(str(plan.load_dir), tag=plan.load_tag)
        if load_path is None:
            raise UsageError(f"DeepSpeed found no checkpoint in {plan.load_dir / plan.load_tag}")
        self.progress.load_state_dict(plan.state)
        if not plan.universal:  # a new layout starts fresh generators (there is no rank-to-rank mapping)
            _set_rng_state(torch.load(plan.path / f"rng_rank{self.dims.rank}.pt", weights_only=True))
        if self.data is not None:  # every saved DP rank's part: the data continues on any layout
            self.data.load_state_dict({"ranks": [torch.load(plan.path / f"data_dp{r}.pt", weights_only=True)
                                                 for r in range(plan.state["dp"])]})
