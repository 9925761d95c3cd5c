"""Checkpoints in `run.dir/checkpoints/`: DeepSpeed's sharded layout (every rank writes its part), what DeepSpeed
does not keep, what the run was made from, and the `latest` pointer. The manager is handed the components that
save and restore themselves (the engine, the progress counters, the data stream) once; `save(step)` writes them
and `load(plan)` restores them in place (torchtitan's Stateful pattern).

`checkpoints/step_N/` holds DeepSpeed's files (model and ZeRO shards, LR schedule, universal-checkpoint metadata
in the client state) and ours: `data_dp{r}.pt` (the data position of DP rank r, written by its TP rank 0),
`rng_rank{r}.pt` (every rank's generators), `trainer_state.json` (progress and layout), `config.yaml`,
`inputs.json` (the tokenizer's sha256 and the train shards, by name and size, in the stream's order) with a copy
of the tokenizer (`spiece.model`, which the export ships) and, last, `complete.json`: written by rank 0 only
after every rank wrote, fsync'd and checksummed its files, it lists every file with its size and crc32
(`pretrain.core.manifest`, which also decides which checkpoints are complete and intact). `latest` is moved (write,
fsync, rename, fsync the folder) after the marker, so a crash or a full disk during a save leaves `latest` on the
previous complete checkpoint; it is a hint for people: the newest complete intact checkpoint is what a run
continues from. The newest `checkpoint.keep` complete checkpoints are kept; the newest complete one never goes.
With `checkpoint.async_save` the periodic saves stage the same files in host memory and a thread per rank writes
them (`pretrain.runtime.checkpoint_writer`); the marker, `latest` and pruning wait until every rank's writer is
done, agreed in a step's collective (`poll`) or at the next save or the run's end (`finish`); one is in flight
at most, and pruning runs only when none is.

Which checkpoint a run starts from, and how DeepSpeed loads it on another layout: `pretrain.runtime.resume`.

Our files are loaded with `weights_only=True`; DeepSpeed's own files are pickles (resume only from checkpoints
you trust: docs/training.md).
"""
from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import json
import logging
import os
import shutil
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator, Protocol, Sequence

import torch
import torch.distributed as dist
from megatron.core.tensor_parallel import random as mp_random

from pretrain.core.config import CheckpointConfig, UsageError
from pretrain.core.files import (
    STORAGE_ERRNOS,
    describe_storage_failure,
    fsync_path,
    storage_failure,
    write_atomic,
    writing,
)
from pretrain.core.manifest import (
    COMPLETE,
    LATEST,
    complete_steps,
    describe,
    describe_shards,
    shard_change,
    step_of,
    tag_for,
    write_marker,
)
from pretrain.distributed.parallel import ParallelDims
from pretrain.runtime.checkpoint_writer import BackgroundWriter, HostCopies, snapshot, staging_saves
from pretrain.runtime.faults import StorageError

log = logging.getLogger(__name__)

INPUTS, TOKENIZER = "inputs.json", "spiece.model"
UNIVERSAL_SUFFIX = "_universal"


def universal_path(path: Path) -> Path:
    """Where checkpoint `path` (step_N) has its universal conversion: beside it, step_N_universal."""
    return path.parent / (path.name + UNIVERSAL_SUFFIX)


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
    # the metrics record of `step` when it was a logged step: a resume writes its line again if a kill after the
    # save lost it (the loop writes the line after the save and the evaluation)
    record: dict[str, float] | None = None

    def state_dict(self) -> dict:
        return dataclasses.asdict(self)

    def load_state_dict(self, state: dict) -> None:
        self.step, self.tokens_seen, self.skipped_steps = state["step"], state["tokens_seen"], state["skipped_steps"]
        self.record = state.get("record")  # absent from checkpoints written before it was kept


@dataclass(frozen=True)
class ResumePlan:
    """What `pretrain.runtime.resume.plan_resume` decided: the checkpoint folder, its state, and whether DeepSpeed
    loads its universal conversion."""

    path: Path  # checkpoints/step_N
    state: dict  # trainer_state.json: the Progress fields, tp, dp, precision, zero_stage (not in older ones)
    universal: bool  # load its universal conversion beside it, step_N_universal (the layout changed)


def sha256_of(file: Path) -> str:
    return hashlib.sha256(file.read_bytes()).hexdigest()


@dataclass(frozen=True)
class RunInputs:
    """What a run reads besides its config, recorded in every checkpoint (`inputs.json`): the tokenizer's sha256
    and the train shards in the order the stream reads them, by name and size (a moved shard folder is the same
    data; a URL's size is unknown, so its name alone). Fine-tuning records the tokenizer and its task's training
    file (path, size, sha256: its data position indexes that file's examples); a mixture (data.sources) the
    tokenizer only, its data state records and checks the shard lists (pretrain.data.loader)."""

    tokenizer: Path
    tokenizer_sha256: str
    shards: tuple[tuple[str, int | None], ...]
    task_file: tuple[str, int, str] | None = None  # fine-tuning's training file: (path, size, sha256)

    @classmethod
    def of(cls, tokenizer: str | Path, shards: Sequence[str] = (), task_file: Path | None = None) -> RunInputs:
        """`shards` as `pretrain.data.shards.expand_shards` resolves `data.train`."""
        task = (str(task_file), task_file.stat().st_size, sha256_of(task_file)) if task_file else None
        return cls(Path(tokenizer), sha256_of(Path(tokenizer)), describe_shards(shards), task)

    def record(self) -> dict:
        task = {"task_file": list(self.task_file)} if self.task_file else {}
        return {"tokenizer_sha256": self.tokenizer_sha256, "train_shards": [list(s) for s in self.shards], **task}

    def check_resume(self, path: Path) -> None:
        """Refuse a resume from `path` with another tokenizer or other train shards, in one line naming the change."""
        if not (path / INPUTS).is_file():
            log.warning("%s records no tokenizer hash or shard list (written before they were recorded): "
                        "not checked", path)
            return
        saved = json.loads((path / INPUTS).read_text())
        if saved["tokenizer_sha256"] != self.tokenizer_sha256:
            raise UsageError(f"cannot resume from {path}: data.tokenizer changed ({self.tokenizer} has sha256 "
                             f"{self.tokenizer_sha256[:12]}..., the run's has {saved['tokenizer_sha256'][:12]}...; "
                             f"a copy of it is {path / TOKENIZER}); use the run's tokenizer or start a new run.dir")
        then, now = [tuple(s) for s in saved["train_shards"]], list(self.shards)
        if then and now and then != now:  # a mixture's (data.sources) are its loader's to check
            raise UsageError(f"cannot resume from {path}: data.train changed ({shard_change(then, now)}); the saved "
                             "data position would apply to other text: restore data.train or start a new run.dir")
        if self.task_file:
            self._check_task_file(path, saved.get("task_file"))

    def _check_task_file(self, path: Path, saved: list | None) -> None:
        """The same training file by content (a moved data.dir is the same data)."""
        if saved is None:
            log.warning("%s records no task training file (written before it was recorded): not checked", path)
        elif tuple(saved[1:]) != self.task_file[1:]:
            raise UsageError(f"cannot resume from {path}: data.dir changed (the task's training file {self.task_file[0]} "
                             f"has {self.task_file[1]} bytes, sha256 {self.task_file[2][:12]}..., the run's {saved[0]} "
                             f"had {saved[1]} bytes, sha256 {saved[2][:12]}...); the saved data position would apply "
                             "to other examples: restore data.dir or start a new run.dir")


# ----------------------------------------------------------------------------------------------------------------
# Files
# ----------------------------------------------------------------------------------------------------------------
def _save_torch(obj: Any, path: Path) -> None:
    with writing(path), path.open("wb") as f:
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


def _precision_of(engine) -> str:
    return "bf16" if engine.bfloat16_enabled() else "fp16" if engine.fp16_enabled() else "fp32"


class CheckpointManager:
    """Saves and restores everything a run needs to continue exactly; every rank calls `save` and `load`."""

    def __init__(self, cfg: CheckpointConfig, root: Path, dims: ParallelDims, *, engine, progress: Progress,
                 data: DataStateful | None, inputs: RunInputs, config_yaml: str, universal_info: dict) -> None:
        self.cfg, self.root, self.dims = cfg, root, dims
        self.engine, self.progress, self.data, self.inputs = engine, progress, data, inputs
        self.config_yaml, self.universal_info = config_yaml, universal_info
        self._in_flight: tuple[Path, BackgroundWriter] | None = None  # the save being written in the background
        self._host = HostCopies()  # where a background save's state is copied (CUDA: pinned buffers, kept)
        self._copied: torch.cuda.Event | None = None  # those copies, until the next optimizer step waited for them
        self._timing: dict[str, float] = {}  # for the next metrics line (`take_metrics`)

    def holds(self, step: int) -> bool:
        """Whether this run's folder holds a checkpoint of `step` (a resume from another run's does not)."""
        return (self.root / tag_for(step)).is_dir()

    def maybe_save(self, step: int, *, last: bool, preempted: bool) -> bool:
        """Save at the end of the run and on preemption (at once: the job ends; a save in flight completes first),
        and every `checkpoint.every` steps (in the background with `checkpoint.async_save`)."""
        if last or preempted or (self.cfg.every and step % self.cfg.every == 0):
            self.save(step, background=self.cfg.async_save and not (last or preempted))
            return True
        return False

    def save(self, step: int, background: bool = False) -> Path:
        """Every rank. `background`: stage the state in host memory and return; a thread writes it, and the save
        completes (complete.json, `latest`, pruning) at the first step after every rank's writer is done (`poll`),
        or at the next save or the run's end (`finish`)."""
        started = time.perf_counter()
        self.finish()  # at most one save in flight: this one waits for it, and the wait counts as blocking
        tag = tag_for(step)
        path = self.root / tag
        if self.dims.rank == 0:
            # leftovers of a save that died at this very step, and a universal copy of an older save of it
            shutil.rmtree(path, ignore_errors=True)
            shutil.rmtree(universal_path(path), ignore_errors=True)
        dist.barrier()
        self._make_folder(path)
        with self._storage_failures(path):
            staged = self._stage(path, self._host if background else None)
        if background:
            copied = self._copied = self._host.copied()

            def write() -> dict[str, dict]:
                if copied is not None:
                    copied.synchronize()  # the device-to-host copies are done (this thread waits, not the loop)
                return self._write(path, staged)

            self._in_flight = (path, BackgroundWriter(write, step, self.dims.rank))
            self._timing["checkpoint_blocking_s"] = time.perf_counter() - started
            log.info("checkpoint %s: staged in %.2f s, writing in the background", path,
                     self._timing["checkpoint_blocking_s"])
            return path
        with self._storage_failures(path):
            # checksummed by the rank that wrote them, while they are in its page cache: every rank in parallel
            mine = self._write(path, staged)
        self._complete(path, mine, started)
        self._timing["checkpoint_blocking_s"] = time.perf_counter() - started
        return path

    def before_update(self) -> None:
        """The loop, before each optimizer step: on CUDA, the step's kernels wait for a background save's copies of
        what the step changes (on the device: the host goes on); nothing otherwise."""
        if self._copied is not None:
            self._host.wait_before_update(self._copied)
            self._copied = None

    @property
    def writing(self) -> bool:
        """Whether this rank's writer of the save in flight is still writing (the step's flags carry it)."""
        return self._in_flight is not None and not self._in_flight[1].done

    def poll(self, any_writing: bool) -> None:
        """Every rank, after a step whose flags say whether any rank's writer was still writing: when none was,
        the save in flight completes now (the same decision on every rank)."""
        if self._in_flight is not None and not any_writing:
            self.finish()

    def finish(self) -> None:
        """Every rank: wait for this rank's writer of the save in flight, if any, and complete the save; a write
        the storage refused on any rank is a `StorageError` on every rank, and `latest` stays."""
        if self._in_flight is None:
            return
        path, writer = self._in_flight
        self._in_flight = None
        writer.join()
        self._host.buffers.give_back()
        mine: dict | tuple[int, str] | None = writer.listed
        if writer.error is not None:
            failure = storage_failure(writer.error)
            if failure is None:
                raise writer.error  # a bug: its traceback (the other ranks learn that this one failed first)
            mine = (failure.errno, describe_storage_failure(failure))
        self._complete(path, mine, writer.launched)

    def close(self) -> None:
        """Wait for the writer without completing its save (a run ending on an error): the run lock, released
        after this, must not admit another job while files of this one are being written."""
        if self._in_flight is not None:
            self._in_flight[1].join()
            self._host.buffers.give_back()
            self._in_flight = None

    def take_metrics(self) -> dict[str, float]:
        """`checkpoint_blocking_s` of the last save, and `checkpoint_s` (launch to complete on every rank) and
        `checkpoint_bytes` (all ranks' files) of the last completed one, once, for the next metrics line."""
        timing, self._timing = self._timing, {}
        return timing

    def _complete(self, path: Path, mine: dict[str, dict] | tuple[int, str], launched: float) -> None:
        """Every rank, once every rank's files of `path` are written, fsync'd and listed (`mine`: this rank's list,
        or the errno and the line of the write its storage refused): rank 0 gets every list (or every rank raises
        the first failure), fsyncs the folders, writes complete.json, moves `latest` and prunes."""
        outcomes: list[dict | tuple | None] = [None] * self.dims.world
        dist.all_gather_object(outcomes, mine)
        for rank, outcome in [(self.dims.rank, mine), *enumerate(outcomes)]:  # this rank's own failure first
            if isinstance(outcome, tuple):
                raise self._not_saved(path, *outcome, rank)
        listed = {name: entry for found in outcomes for name, entry in found.items()}
        if self.dims.rank == 0:
            with self._storage_failures(path):
                self._commit(path, listed)
        dist.barrier()
        self._timing.update(checkpoint_s=time.perf_counter() - launched,
                            checkpoint_bytes=float(sum(e["bytes"] for e in listed.values())))
        log.info("checkpoint %s saved (%.2f s)", path, self._timing["checkpoint_s"])

    def _make_folder(self, path: Path) -> None:
        """Every rank makes the step's folder, and all learn whether one could not (a full disk shows here first):
        a rank that went on into DeepSpeed's save would wait in its first collective for one that had stopped, and
        could only say that another rank failed first. DeepSpeed's own makedirs logs such a failure and goes on to
        "No such file or directory", which names no cause."""
        mine = None
        try:
            path.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            if (failure := storage_failure(e)) is None:
                raise
            mine = (failure.errno, describe_storage_failure(failure))
        outcomes: list[tuple[int, str] | None] = [None] * self.dims.world
        dist.all_gather_object(outcomes, mine)
        for rank, outcome in [(self.dims.rank, mine), *enumerate(outcomes)]:  # this rank's own failure first
            if outcome is not None:
                raise self._not_saved(path, *outcome, rank)

    @contextlib.contextmanager
    def _storage_failures(self, path: Path) -> Iterator[None]:
        """A write the storage refused (full, over quota, read-only) becomes this rank's one line (StorageError);
        any other error keeps its traceback."""
        try:
            yield
        except (OSError, RuntimeError) as e:  # torch's zip writer wraps a failed write in a RuntimeError
            if (failure := storage_failure(e)) is None:
                raise
            raise self._not_saved(path, failure.errno, describe_storage_failure(failure), self.dims.rank) from e

    def _not_saved(self, path: Path, code: int, failure: str, rank: int) -> StorageError:
        """The one line of a save that rank `rank`'s storage refused (`code`: the errno; `failure`: what, where)."""
        kept = complete_steps(self.root)
        newest = f"{tag_for(kept[-1])} stays the newest checkpoint" if kept else \
            "no checkpoint of this run is complete yet"
        whose = "" if rank == self.dims.rank else f"rank {rank} could not write it: "
        return StorageError(f"rank {self.dims.rank}: checkpoint {path.name} not saved: {whose}{failure}; {newest}; "
                            f"once {STORAGE_ERRNOS[code]} (or with run.dir moved), run the same command again")

    def _stage(self, path: Path, copies: HostCopies | None) -> list[tuple[Path, Any]]:
        """This rank's files of the checkpoint, as (path, content): DeepSpeed's shards (its save runs as always,
        collectives included, its writes staged), the data position, the generators, and (rank 0) the trainer
        state, config and inputs (text) and the tokenizer (the file to copy). `copies`: tensors copied to host
        memory there, for a writer that runs while training changes them."""
        staged: list[tuple[Path, Any]] = []
        with staging_saves(self.engine, staged, copies):
            self.engine.save_checkpoint(str(self.root), tag=path.name, save_latest=False,
                                        client_state={"universal_checkpoint_info": self.universal_info})
        own = (lambda state: state) if copies is None else (lambda state: snapshot(state, copies))
        staged.append((path / f"rng_rank{self.dims.rank}.pt", own(_rng_state())))
        if self.data is not None and self.dims.tp_rank == 0:
            staged.append((path / f"data_dp{self.dims.dp_rank}.pt", own(self.data.state_dict())))
        if self.dims.rank == 0:
            # what DeepSpeed's files depend on besides the layout: a resume with another precision or ZeRO stage
            # goes through the universal checkpoint (prepare_resume)
            state = {**self.progress.state_dict(), "tp": self.dims.tp, "dp": self.dims.dp,
                     "precision": _precision_of(self.engine), "zero_stage": self.engine.zero_optimization_stage()}
            staged += [(path / "trainer_state.json", json.dumps(state, indent=1)),
                       (path / "config.yaml", self.config_yaml), (path / INPUTS, json.dumps(self.inputs.record(),
                                                                                            indent=1)),
                       (path / TOKENIZER, self.inputs.tokenizer)]
        return staged

    def _write(self, path: Path, staged: list[tuple[Path, Any]]) -> dict[str, dict]:
        """Write and fsync the staged files (text atomically; a Path is a file to copy; else torch.save into a
        Python file: given a path, torch's own writer reports a full disk as "file write failed", no errno); return
        those in `path` with their sizes and checksums, read while they are in the page cache."""
        for file, content in staged:
            if isinstance(content, str):
                with writing(file):
                    write_atomic(file, content)
            elif isinstance(content, Path):
                with writing(file):
                    shutil.copyfile(content, file)
                    fsync_path(file)
            else:
                _save_torch(content, file)
        return describe(path, [file for file, _ in staged if file.parent == path])

    def _commit(self, path: Path, listed: dict[str, dict]) -> None:
        """Rank 0, after every rank wrote and listed its files: fsync them, mark the folder complete with every
        file's size and checksum, move `latest`, prune."""
        files = sorted(p for p in path.rglob("*") if p.is_file())
        for file in files:
            fsync_path(file)  # DeepSpeed's files are closed but maybe not yet on disk
        for folder in {f.parent for f in files} | {path}:
            fsync_path(folder)
        # DeepSpeed also copies its recovery scripts (rank 0, outside its checkpoint engine): checksummed here
        unlisted = [f for f in files if str(f.relative_to(path)) not in listed]
        with writing(path / COMPLETE):
            write_marker(path, dict(sorted({**listed, **describe(path, unlisted)}.items())))
        if (self.root / LATEST).is_dir() and not (self.root / LATEST).is_symlink():
            shutil.rmtree(self.root / LATEST)  # not ours: `latest` is a file, and only a file can replace it
        with writing(self.root / LATEST):
            write_atomic(self.root / LATEST, path.name + "\n")
        self._prune(newest=path.name)

    def _prune(self, newest: str) -> None:
        """Keep the newest `checkpoint.keep` complete checkpoints (`newest` always); drop incomplete leftovers."""
        complete = complete_steps(self.root)
        keep = {tag_for(s) for s in complete[-self.cfg.keep:]} | {newest}
        for p in self.root.iterdir():
            step = step_of(p.name)
            if step is not None and p.name not in keep and (step in complete or step < complete[-1]):
                shutil.rmtree(p, ignore_errors=True)
                shutil.rmtree(universal_path(p), ignore_errors=True)

    def load(self, plan: ResumePlan) -> None:
        """Restore engine (weights, optimizer, LR schedule), progress, RNG and data position in place."""
        tag = universal_path(plan.path).name if plan.universal else plan.path.name
        load_path, _ = self.engine.load_checkpoint(str(plan.path.parent), tag=tag)
        if load_path is None:
            raise UsageError(f"DeepSpeed found no checkpoint in {plan.path.parent / tag}")
        self.progress.load_state_dict(plan.state)
        # on another layout the generators start fresh: there is no rank-to-rank mapping
        if (plan.state["tp"], plan.state["dp"]) == (self.dims.tp, self.dims.dp):
            _set_rng_state(torch.load(plan.path / f"rng_rank{self.dims.rank}.pt", weights_only=True))
        if self.data is not None:  # every saved DP rank's part: the data continues on any layout
            self.data.load_state_dict({"ranks": [torch.load(plan.path / f"data_dp{r}.pt", weights_only=True)
                                                 for r in range(plan.state["dp"])]})
