"""Checkpoints in `run.dir/checkpoints/`: DeepSpeed's sharded layout (every rank writes its part) plus what
DeepSpeed does not keep, and the `latest` pointer.

`checkpoints/step_N/` holds DeepSpeed's files (model and ZeRO shards, LR schedule, universal-checkpoint
metadata in the client state) and ours: `data_dp{r}.pt` (the loader position of DP rank r, written by its
TP rank 0), `rng_rank{r}.pt` (every rank's generators), `trainer_state.json` (step, tokens seen, skipped
steps, the layout) and `config.yaml` (the resolved config). `checkpoints/latest` names the newest complete
tag; rank 0 replaces it atomically only after a barrier that every rank reaches once its files are written,
so a crash during a save leaves `latest` on the previous checkpoint. The newest `checkpoint.keep` are kept.

Resuming on another TP/DP layout goes through DeepSpeed's universal checkpoint: `prepare_resume` converts
`step_N/` into `step_N_universal/` (once, on rank 0) and the engine is built with `load_universal`.
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
from typing import Any

import torch
import torch.distributed as dist
import yaml
from megatron.core.tensor_parallel import random as mp_random

from pretrain.config import CheckpointConfig, ModelConfig
from pretrain.parallel import ParallelDims

log = logging.getLogger(__name__)

_TAG = re.compile(r"^step_(\d+)$")
LATEST = "latest"
UNIVERSAL_SUFFIX = "_universal"


def tag_for(step: int) -> str:
    return f"step_{step}"


@dataclass(frozen=True)
class TrainerState:
    step: int  # optimizer updates applied (a skipped step is retried under the same number)
    tokens_seen: int  # input + target tokens over all DP ranks
    skipped_steps: int  # steps skipped for a non-finite loss
    tp: int
    dp: int


@dataclass(frozen=True)
class ResumePlan:
    """What `prepare_resume` decided: the checkpoint folder, its state, and where DeepSpeed loads from."""

    path: Path
    state: TrainerState
    load_dir: Path  # the folder above DeepSpeed's tag folder
    load_tag: str  # step_N, or step_N_universal when the layout changed
    universal: bool


def find_resume(cfg: CheckpointConfig, root: Path) -> Path | None:
    """The checkpoint folder to resume from: `latest` under `root` (auto), none, or an explicit path."""
    if cfg.resume == "none":
        return None
    if cfg.resume == "auto":
        latest = root / LATEST
        return root / latest.read_text().strip() if latest.is_file() else None
    path = Path(cfg.resume)
    if not (path / "trainer_state.json").is_file():
        raise ValueError(f"checkpoint.resume '{cfg.resume}' is not a checkpoint folder (no trainer_state.json)")
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
        raise ValueError(
            f"cannot resume from {path}: the model changed ({'; '.join(diffs)}); "
            "restore those values or start a new run.dir (or set checkpoint.resume=none)"
        )


def prepare_resume(path: Path, model_cfg: ModelConfig, dims: ParallelDims) -> ResumePlan:
    """Validate the checkpoint against this run and convert it to a universal one if the layout changed."""
    state = TrainerState(**json.loads((path / "trainer_state.json").read_text()))
    saved_model = yaml.safe_load((path / "config.yaml").read_text())["model"]
    check_same_model(saved_model, model_cfg, path)
    if (state.tp, state.dp) == (dims.tp, dims.dp):
        return ResumePlan(path, state, path.parent, path.name, universal=False)
    universal = path.parent / (path.name + UNIVERSAL_SUFFIX)
    if dims.rank == 0 and not (universal / "zero").is_dir():
        log.info("layout TP %d x DP %d -> TP %d x DP %d: converting %s to a universal checkpoint",
                 state.tp, state.dp, dims.tp, dims.dp, path)
        convert_to_universal(path, universal)
    dist.barrier()
    return ResumePlan(path, state, universal.parent, universal.name, universal=True)


def convert_to_universal(path: Path, output: Path) -> None:
    """DeepSpeed's ds_to_universal (the same as `python -m deepspeed.checkpoint.ds_to_universal`)."""
    # imported where used: only a layout change needs the converter (~0.6 s of imports per process)
    from deepspeed.checkpoint.ds_to_universal import main as ds_to_universal

    tmp = output.with_name(output.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    ds_to_universal(SimpleNamespace(
        input_folder=str(path), output_folder=str(tmp), num_extract_workers=1, num_merge_workers=1,
        keep_temp_folder=False, strict=True, inject_missing_state=False,
    ))
    shutil.rmtree(output, ignore_errors=True)
    tmp.rename(output)  # a half-converted folder is never mistaken for a finished one


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
    """Saves and restores everything a run needs to continue exactly; all ranks call `save` and `load`."""

    def __init__(self, cfg: CheckpointConfig, root: Path, dims: ParallelDims) -> None:
        self.cfg = cfg
        self.root = root
        self.dims = dims

    def save(self, engine, state: TrainerState, loader_state: dict, config_yaml: str, universal_info: dict) -> Path:
        tag = tag_for(state.step)
        path = self.root / tag
        if self.dims.rank == 0:
            shutil.rmtree(path, ignore_errors=True)  # leftovers of a save that died at this very step
        dist.barrier()
        engine.save_checkpoint(
            str(self.root), tag=tag, client_state={"universal_checkpoint_info": universal_info}, save_latest=False
        )
        if self.dims.tp_rank == 0:
            torch.save(loader_state, path / f"data_dp{self.dims.dp_rank}.pt")
        torch.save(_rng_state(), path / f"rng_rank{self.dims.rank}.pt")
        if self.dims.rank == 0:
            (path / "trainer_state.json").write_text(json.dumps(dataclasses.asdict(state), indent=1))
            (path / "config.yaml").write_text(config_yaml)
        self._commit(tag)
        return path

    def _commit(self, tag: str) -> None:
        """After every rank finished writing: point `latest` at `tag` atomically, drop old checkpoints."""
        dist.barrier()
        if self.dims.rank == 0:
            tmp = self.root / (LATEST + ".tmp")
            with tmp.open("w") as f:
                f.write(tag + "\n")
                f.flush()
                os.fsync(f.fileno())
            tmp.replace(self.root / LATEST)
            self._prune(keep_tag=tag)
        dist.barrier()
        log.info("checkpoint %s saved", self.root / tag)

    def _prune(self, keep_tag: str) -> None:
        steps = sorted(int(m.group(1)) for p in self.root.iterdir() if (m := _TAG.match(p.name)))
        keep = {tag_for(s) for s in steps[-max(self.cfg.keep, 1):]} | {keep_tag}
        for step in steps:
            if tag_for(step) not in keep:
                shutil.rmtree(self.root / tag_for(step), ignore_errors=True)
                shutil.rmtree(self.root / (tag_for(step) + UNIVERSAL_SUFFIX), ignore_errors=True)

    def load(self, engine, plan: ResumePlan) -> dict | None:
        """Restore engine, RNG and trainer state; returns this DP rank's loader state (None if DP changed)."""
        load_path, _ = engine.load_checkpoint(str(plan.load_dir), tag=plan.load_tag)
        if load_path is None:
            raise ValueError(f"DeepSpeed found no checkpoint in {plan.load_dir / plan.load_tag}")
        rng = plan.path / f"rng_rank{self.dims.rank}.pt"
        if not plan.universal and rng.is_file():
            _set_rng_state(torch.load(rng, weights_only=False))
        data = plan.path / f"data_dp{self.dims.dp_rank}.pt"
        if plan.state.dp != self.dims.dp:
            log.warning("DP changed (%d -> %d): the data stream restarts from a fresh position", plan.state.dp,
                        self.dims.dp)
            return None
        return torch.load(data, weights_only=False)
