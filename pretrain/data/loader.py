"""The loaders the trainer uses: a resumable streaming train loader and a fixed validation slice.

`build_train_loader` yields dict batches (`input_ids`, `attention_mask`, `decoder_input_ids`, `labels`,
`decoder_attention_mask`) forever, epoch after epoch. Batches are a function of (seed, epoch, DP rank, DP
size, worker count) alone. `state_dict()` is plain JSON-able data (a few integers per worker); after
`load_state_dict` the next batches are bit-identical to the uninterrupted run's, with any number of
DataLoader workers: each worker tags its batches with its position, the loader keeps the position of the
last batch it handed out per worker, and a resumed DataLoader rotates workers so the round-robin continues.
The state also records the settings that decide the batches (shuffle buffer, lengths, noise, micro batch): a
resume that changed one is refused, since the saved position would then repeat or skip text.
"""
from __future__ import annotations

import copy
import logging
import signal
from multiprocessing.connection import wait
from typing import Iterator

from torch.utils.data import DataLoader

from pretrain.config import DataConfig, UsageError
from pretrain.data.remote import redact
from pretrain.data.shards import FORMAT_VERSION, expand_shards, read_index
from pretrain.data.span_corruption import input_and_target_lengths
from pretrain.data.stream import StreamSpec, TrainStreams, collate, examples, start_position
from tokenizer.spm import Tokenizer

log = logging.getLogger(__name__)

STATE_VERSION = 1


def _spec(cfg: DataConfig, spec: str, *, seed: int, dp_rank: int, dp_size: int, num_streams: int,
          micro_batch: int, block_chunks: int) -> StreamSpec:
    if not 0 <= dp_rank < dp_size:
        raise ValueError(f"dp_rank ({dp_rank}) must be in [0, dp_size ({dp_size}))")
    if micro_batch < 1:
        raise ValueError(f"micro_batch must be at least 1, got {micro_batch}")
    tok = Tokenizer(cfg.tokenizer)
    shards = expand_shards(spec)
    index = read_index(spec)
    if index is not None and index.get("format", 1) != FORMAT_VERSION:
        raise UsageError(f"shards in {redact(spec)!r} are in format {index.get('format', 1)}, this loader reads format "
                         f"{FORMAT_VERSION}; prepare them again with `python -m pretrain.data.prepare`")
    if index is not None and index.get("num_ids") != tok.num_ids:
        raise UsageError(f"shards in {redact(spec)!r} were prepared with a tokenizer of {index.get('num_ids')} ids but "
                         f"data.tokenizer ({cfg.tokenizer}) has {tok.num_ids}; prepare them with that tokenizer")
    raw_length, target_length = input_and_target_lengths(cfg.input_length, cfg.noise_density,
                                                         cfg.mean_noise_span_length)
    return StreamSpec(
        shards=tuple(shards), seed=seed, dp_rank=dp_rank, dp_size=dp_size, num_streams=num_streams,
        raw_length=raw_length, input_length=cfg.input_length, target_length=target_length,
        block_chunks=block_chunks, num_ids=tok.num_ids, eos_id=tok.eos_id, noise_density=cfg.noise_density,
        mean_noise_span_length=cfg.mean_noise_span_length, micro_batch=micro_batch,
        expected_docs=_expected_docs(shards, index))


def _expected_docs(shards: list[str], index: dict | None) -> tuple[int, ...] | None:
    """Documents per shard from the index, when it lists every shard of the spec."""
    if index is None:
        return None
    counts = {name: entry["documents"] for name, entry in index["shards"].items()}
    names = [s.rsplit("/", 1)[-1] for s in shards]
    return tuple(counts[n] for n in names) if all(n in counts for n in names) else None


def _ignore_preemption_signals(worker_id: int) -> None:
    """Workers leave SIGTERM/SIGUSR1 to the trainer: SLURM signals every process of a step, and a worker that
    died of it would kill the trainer before it could checkpoint. Workers still exit when the trainer does."""
    for sig in (signal.SIGTERM, signal.SIGUSR1, signal.SIGINT):
        signal.signal(sig, signal.SIG_IGN)


def _ending(exitcode: int) -> str:
    return f"killed by {signal.Signals(-exitcode).name}" if exitcode < 0 else f"exit code {exitcode}"


# the config keys of the settings a loader state records
_SETTING_KEYS = {"shuffle_buffer": "data.shuffle_buffer", "input_length": "data.input_length",
                 "noise_density": "data.noise_density", "mean_noise_span_length": "data.mean_noise_span_length",
                 "micro_batch": "train.micro_batch"}


class TrainLoader:
    """Iterable of batches with `state_dict()` / `load_state_dict()`; iterating again continues, it never rewinds.
    `close()` ends the worker processes of the live iteration (the trainer calls it on every way out)."""

    def __init__(self, spec: StreamSpec, workers: int, pin_memory: bool = False):
        self.spec, self.workers, self.pin_memory = spec, workers, pin_memory
        self.batches = 0  # batches handed out; selects which worker's batch comes next
        self.positions = [start_position() for _ in range(spec.num_streams)]
        self.num_damaged_shards = 0  # damaged shard reads skipped so far, summed over workers
        self._iterator = None

    def __iter__(self) -> Iterator[dict]:
        streams = TrainStreams(self.spec, copy.deepcopy(self.positions), self.batches % self.spec.num_streams)
        loader = DataLoader(streams, batch_size=None, num_workers=self.workers, pin_memory=self.pin_memory,
                            persistent_workers=False, prefetch_factor=4 if self.workers else None,
                            worker_init_fn=_ignore_preemption_signals)
        self.close()
        self._iterator = iter(loader)
        damaged = [0] * self.spec.num_streams
        try:
            while (batch := self._next_batch()) is not None:
                stream = batch.pop("_stream")
                self.positions[stream] = batch.pop("_position")
                damaged[stream] = batch.pop("_damaged")
                if sum(damaged) > self.num_damaged_shards:
                    self.num_damaged_shards = sum(damaged)
                    log.warning("%d damaged shard reads skipped so far", self.num_damaged_shards)
                self.batches += 1
                yield batch
        finally:
            self.close()

    def _next_batch(self) -> dict | None:
        """The next batch (None at the end); a worker that died (OOM killer, SIGKILL) is named as such. Torch reports that only when
        its queue times out: a batch already in flight fails first with a closed connection to the dead worker."""
        try:
            return next(self._iterator)
        except StopIteration:
            return None
        except (ConnectionError, EOFError) as error:
            workers = getattr(self._iterator, "_workers", [])
            wait([w.sentinel for w in workers], timeout=5)  # its sockets close a moment before it can be reaped
            dead = [f"pid {w.pid}, {_ending(w.exitcode)}" for w in workers if w.exitcode is not None]
            if dead:
                raise RuntimeError(f"DataLoader worker ({'; '.join(dead)}) exited unexpectedly; out of host "
                                   "memory? the kernel log (dmesg) names what the OOM killer ended") from error
            raise

    def close(self) -> None:
        iterator, self._iterator = self._iterator, None
        if iterator is not None and hasattr(iterator, "_shutdown_workers"):
            iterator._shutdown_workers()  # workers ignore SIGTERM: they must be told to stop

    def _settings(self) -> dict:
        """What decides the batch contents; a resume with other values would repeat or skip data."""
        s = self.spec
        return {"shuffle_buffer": s.block_chunks, "input_length": s.input_length,
                "noise_density": s.noise_density, "mean_noise_span_length": s.mean_noise_span_length,
                "micro_batch": s.micro_batch}

    def state_dict(self) -> dict:
        s = self.spec
        return {"version": STATE_VERSION, "seed": s.seed, "dp_rank": s.dp_rank, "dp_size": s.dp_size,
                "workers": s.num_streams, "batches": self.batches, "positions": copy.deepcopy(self.positions),
                "settings": self._settings()}

    def load_state_dict(self, state: dict) -> None:
        s = self.spec
        if state.get("version") != STATE_VERSION:
            raise UsageError(f"data loader state version {state.get('version')} is not {STATE_VERSION}")
        if state["dp_size"] == s.dp_size and state["dp_rank"] != s.dp_rank:
            raise ValueError(f"data loader state of DP rank {state['dp_rank']} loaded on DP rank {s.dp_rank}; "
                             "each DP rank must load its own state")
        now = self._settings()
        changed = [f"{_SETTING_KEYS[k]} ({v} in the checkpoint, {now[k]} now)"
                   for k, v in state.get("settings", {}).items() if now[k] != v]
        if changed:
            raise UsageError(f"the data settings changed since the checkpoint: {', '.join(changed)}; the saved data "
                             "position would repeat or skip text: restore them, or start a new run.dir")
        if (state["dp_size"], state["workers"], state["seed"]) != (s.dp_size, s.num_streams, s.seed):
            epoch = max(p["epoch"] for p in state["positions"]) + 1
            log.warning("data loader state is for DP size %d, %d workers, seed %d; now DP size %d, %d workers, "
                        "seed %d: starting a new deterministic data order at epoch %d", state["dp_size"],
                        state["workers"], state["seed"], s.dp_size, s.num_streams, s.seed, epoch)
            self.batches, self.positions = 0, [start_position(epoch) for _ in range(s.num_streams)]
            return
        self.batches, self.positions = state["batches"], copy.deepcopy(state["positions"])


def build_train_loader(cfg: DataConfig, *, seed: int, dp_rank: int, dp_size: int, micro_batch: int,
                       pin_memory: bool = False) -> TrainLoader:
    """The train loader of one DP rank over `cfg.train`; TP peers (same dp_rank) get identical batches."""
    num_streams = max(1, cfg.workers)
    spec = _spec(cfg, cfg.train, seed=seed, dp_rank=dp_rank, dp_size=dp_size, num_streams=num_streams,
                 micro_batch=micro_batch, block_chunks=max(1, cfg.shuffle_buffer))
    if len(spec.shards) < dp_size * num_streams:
        raise UsageError(
            f"data.train has {len(spec.shards)} shards but DP size ({dp_size}) x data.workers ({num_streams}) = "
            f"{dp_size * num_streams} streams need at least one each; prepare more shards or lower data.workers")
    index = read_index(cfg.train)
    if index is not None:
        log.info("train data: %d shards, %d tokens (~%d chunks of %d per epoch over all DP ranks)",
                 len(spec.shards), index["tokens"], index["tokens"] // spec.raw_length, spec.raw_length)
    return TrainLoader(spec, cfg.workers, pin_memory)


class EvalLoader:
    """A fixed list of validation batches: the same every time it is iterated and on every call."""

    def __init__(self, batches: list[dict]):
        self.batches = batches

    def __iter__(self) -> Iterator[dict]:
        return iter(self.batches)

    def __len__(self) -> int:
        return len(self.batches)


def build_eval_loader(cfg: DataConfig, *, dp_rank: int, dp_size: int, micro_batch: int, num_batches: int) -> EvalLoader:
    """`num_batches` batches for this DP rank from the start of `cfg.valid`, with a fixed seed (0) for the
    order and the corruption whatever the run's seed; example i goes to DP rank i % dp_size (disjoint)."""
    spec = _spec(cfg, cfg.valid, seed=0, dp_rank=0, dp_size=1, num_streams=1, micro_batch=micro_batch,
                 block_chunks=max(1, cfg.shuffle_buffer))
    needed = num_batches * micro_batch
    mine: list = []
    for i, (inputs, targets, after) in enumerate(examples(spec, 0, start_position(), [0])):
        if after["epoch"] > 0:
            raise UsageError(f"data.valid ({redact(cfg.valid)}) holds {i} examples, too few for {num_batches} batches of "
                             f"{micro_batch} on each of {dp_size} DP ranks; lower eval.batches")
        if i % dp_size == dp_rank:
            mine.append((inputs, targets))
            if len(mine) == needed:
                break
    return EvalLoader([collate(mine[k : k + micro_batch], spec.input_length, spec.target_length)
                       for k in range(0, needed, micro_batch)])
