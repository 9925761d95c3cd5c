"""The loaders the trainer uses: a resumable streaming train loader and a fixed validation slice.

`build_train_loader` yields dict batches (`input_ids`, `attention_mask`, `decoder_input_ids`, `labels`,
`decoder_attention_mask`) forever: DP rank r's examples of the global order (pretrain.data.stream), cut into
micro batches in order. Examples are a function of (seed, global index) alone; the DP size, the micro batch
and the workers only decide who computes which example. `state_dict()` is plain data (each owned stream's
position and the examples consumed); `load_state_dict` takes every saved DP rank's state, so a resume on any
DP size, micro batch or number of workers continues with the next example, bit for bit. The state also
records the settings that decide the examples (seed, streams, shuffle buffer, lengths, noise): a resume that
changed one is refused, since the saved positions would then repeat or skip text; and the damaged shards found so
far (pretrain.data.damage), whose share of the data may not exceed data.max_damaged_share.
"""
from __future__ import annotations

import copy
import functools
import logging
import os
import signal
from collections import deque
from multiprocessing.connection import wait
from typing import Iterator

from torch.utils.data import DataLoader

from launch.env import die_with_parent
from pretrain.core.config import DataConfig, UsageError
from pretrain.core.redact import redact
from pretrain.data.damage import DamagedShards
from pretrain.data.remote import Retry
from pretrain.data.shards import FORMAT_VERSION, expand_shards, read_index
from pretrain.data.span_corruption import input_and_target_lengths
from pretrain.data.stream import StreamSpec, WorkerRows, collate, examples, start_position
from pretrain.runtime.faults import PREEMPTION_SIGNALS
from tokenizer.spm import Tokenizer

log = logging.getLogger(__name__)

STATE_VERSION = 2  # 1: positions per (DP rank, worker), before the global order


MAX_AUTO_STREAMS = 64  # data.streams 0: min(shards, 64); every power-of-two DP size up to 64 divides it


def _spec(cfg: DataConfig, spec: str, *, seed: int, num_streams: int | None,
          block_chunks: int) -> tuple[StreamSpec, dict | None]:
    """The stream settings of `spec` and its index.json (None when absent); `num_streams` None: `cfg.streams` (0:
    min(shards, MAX_AUTO_STREAMS))."""
    tok = Tokenizer(cfg.tokenizer)
    shards = expand_shards(spec)
    retry = Retry(cfg.http_timeout_s, cfg.http_retries)
    index = read_index(spec, retry)
    if index is not None and index.get("format", 1) != FORMAT_VERSION:
        raise UsageError(f"shards in {redact(spec)!r} are in format {index.get('format', 1)}, this loader reads format "
                         f"{FORMAT_VERSION}; prepare them again with `python -m pretrain.data.prepare`")
    if index is not None and index.get("num_ids") != tok.num_ids:
        raise UsageError(f"shards in {redact(spec)!r} were prepared with a tokenizer of {index.get('num_ids')} ids but "
                         f"data.tokenizer ({cfg.tokenizer}) has {tok.num_ids}; prepare them with that tokenizer")
    if num_streams is None:
        num_streams = cfg.streams or min(len(shards), MAX_AUTO_STREAMS)
        if num_streams > len(shards):
            raise UsageError(f"data.streams ({num_streams}) exceeds the {len(shards)} shards of data.train: every "
                             "stream needs a shard; lower data.streams or prepare more shards")
    raw_length, target_length = input_and_target_lengths(cfg.input_length, cfg.noise_density,
                                                         cfg.mean_noise_span_length)
    return StreamSpec(
        shards=tuple(shards), seed=seed, num_streams=num_streams, raw_length=raw_length,
        input_length=cfg.input_length, target_length=target_length, block_chunks=block_chunks, num_ids=tok.num_ids,
        eos_id=tok.eos_id, noise_density=cfg.noise_density, mean_noise_span_length=cfg.mean_noise_span_length,
        expected_docs=_expected_docs(shards, index), retry=retry), index


def _expected_docs(shards: list[str], index: dict | None) -> tuple[int, ...] | None:
    """Documents per shard from the index, when it lists every shard of the spec."""
    if index is None:
        return None
    counts = {name: entry["documents"] for name, entry in index["shards"].items()}
    names = [s.rsplit("/", 1)[-1] for s in shards]
    return tuple(counts[n] for n in names) if all(n in counts for n in names) else None


def _worker_init(trainer: int, worker_id: int) -> None:
    """Workers leave the preemption signals to the trainer: SLURM signals every process of a step (a terminal's
    Ctrl-C every process of the foreground group), and a worker that died of one would kill the trainer before it
    could checkpoint. Workers end with the trainer (pid `trainer`) however it ends: a trainer that aborts (NCCL's
    watchdog) or is SIGKILLed runs no cleanup, and a forked worker holds the trainer's files (the run lock, its
    sockets, its stderr) until it exits; torch's own check for a dead parent runs only between batches."""
    for sig in PREEMPTION_SIGNALS:
        signal.signal(sig, signal.SIG_IGN)
    die_with_parent(signal.SIGKILL, trainer)


def _ending(exitcode: int) -> str:
    return f"killed by {signal.Signals(-exitcode).name}" if exitcode < 0 else f"exit code {exitcode}"


# the config keys of the settings a loader state records: those that decide the examples
_SETTING_KEYS = {"seed": "run.seed", "streams": "data.streams", "shuffle_buffer": "data.shuffle_buffer",
                 "input_length": "data.input_length", "noise_density": "data.noise_density",
                 "mean_noise_span_length": "data.mean_noise_span_length"}


def _identity(item):
    return item


class TrainLoader:
    """Iterable of DP rank `dp_rank`'s micro batches with `state_dict()` / `load_state_dict()`; iterating again
    continues, it never rewinds. `close()` ends the worker processes of the live iteration (the trainer calls it
    on every way out)."""

    def __init__(self, spec: StreamSpec, *, dp_rank: int, dp_size: int, micro_batch: int, workers: int,
                 max_damaged_share: float):
        if not 0 <= dp_rank < dp_size:
            raise ValueError(f"dp_rank ({dp_rank}) must be in [0, dp_size ({dp_size}))")
        if micro_batch < 1:
            raise ValueError(f"micro_batch must be at least 1, got {micro_batch}")
        if spec.num_streams % dp_size:
            raise UsageError(f"the DP size ({dp_size}) must divide data.streams ({spec.num_streams}; 0 means "
                             f"min(shards, {MAX_AUTO_STREAMS})): each DP rank owns whole streams; set data.streams to "
                             "a multiple of every DP size the run may use, at its start")
        self.spec, self.dp_rank, self.dp_size, self.micro_batch = spec, dp_rank, dp_size, micro_batch
        self.streams = list(range(dp_rank, spec.num_streams, dp_size))  # the streams this rank owns, in its order
        # workers beyond one per stream would idle; 0 streams in the main process
        self.workers = min(workers, len(self.streams))
        self.consumed = 0  # examples this rank handed out; its next one is global example consumed * D + r
        self.positions = {s: start_position() for s in self.streams}
        self.damaged = DamagedShards(spec, max_damaged_share)  # what this rank's streams and the checkpoint found
        self._iterator = None

    def __iter__(self) -> Iterator[dict]:
        source = WorkerRows(self.spec, self.streams, copy.deepcopy(self.positions), self.workers,
                            dict(self.damaged.found))
        loader = DataLoader(source, batch_size=None, collate_fn=_identity, num_workers=self.workers,
                            persistent_workers=False, prefetch_factor=4 if self.workers else None,
                            worker_init_fn=functools.partial(_worker_init, os.getpid()))
        self.close()
        self._iterator = iter(loader)
        queues: dict[int, deque] = {s: deque() for s in self.streams}
        try:
            while True:
                pairs = []
                while len(pairs) < self.micro_batch:
                    stream = self.streams[self.consumed % len(self.streams)]  # round robin: the global order
                    while not queues[stream]:
                        rows, found = self._next_item()
                        self.damaged.add(found)
                        for s, inputs, targets, after in rows:
                            queues[s].extend(zip(inputs, targets, after))
                    inputs, targets, self.positions[stream] = queues[stream].popleft()
                    pairs.append((inputs, targets))
                    self.consumed += 1
                yield collate(pairs, self.spec.input_length, self.spec.target_length)
        finally:
            self.close()

    def _next_item(self) -> tuple[list[tuple], dict[int, int]]:
        """The next item of the workers (round robin over them); a worker that died (OOM killer, SIGKILL) is named
        as such. Torch reports that only when its queue times out: an item already in flight fails first with a
        closed connection to the dead worker."""
        try:
            return next(self._iterator)
        except (ConnectionError, EOFError) as error:
            workers = getattr(self._iterator, "_workers", [])
            # a dying worker's files (its sockets, then the sentinel pipe) close a moment before the kernel lets it
            # be reaped, a moment that can last seconds on a loaded machine: after the sentinel, join's blocking
            # waitpid (a plain `exitcode` looks without waiting and can still see none)
            ready = wait([w.sentinel for w in workers], timeout=5)
            for w in workers:
                if w.sentinel in ready:
                    w.join()
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
        """What decides the examples; a resume with other values would repeat or skip text."""
        s = self.spec
        return {"seed": s.seed, "streams": s.num_streams, "shuffle_buffer": s.block_chunks,
                "input_length": s.input_length, "noise_density": s.noise_density,
                "mean_noise_span_length": s.mean_noise_span_length}

    def state_dict(self) -> dict:
        """This DP rank's part: its streams' positions, the examples of the whole run consumed (at a step
        boundary every rank has handed out the same number), and the damaged shards it knows of."""
        return {"version": STATE_VERSION, "examples": self.consumed * self.dp_size,
                "positions": {str(s): dict(p) for s, p in self.positions.items()}, "settings": self._settings(),
                "damaged": self.damaged.state()}

    def load_state_dict(self, state: dict) -> None:
        """`state`: `{"ranks": [the state_dict of every DP rank of the saving run]}`; any DP size may load it."""
        ranks = state["ranks"]
        if any(r.get("version") != STATE_VERSION for r in ranks):
            raise UsageError(f"the data position in the checkpoint is of another version (not {STATE_VERSION}); it "
                             "cannot be continued exactly: start a new run.dir")
        now = self._settings()
        changed = [f"{_SETTING_KEYS[k]} ({v} in the checkpoint, {now[k]} now)"
                   for k, v in ranks[0]["settings"].items() if now[k] != v]
        if changed:
            raise UsageError(f"the data settings changed since the checkpoint: {', '.join(changed)}; the saved data "
                             "positions would repeat or skip text: restore them, or start a new run.dir")
        examples = {r["examples"] for r in ranks}
        positions = {int(s): p for r in ranks for s, p in r["positions"].items()}
        assert len(examples) == 1 and len(positions) == self.spec.num_streams, "a partial or inconsistent data state"
        (consumed,) = examples
        if consumed % self.dp_size:
            raise ValueError(f"{consumed} examples consumed is not a multiple of the DP size ({self.dp_size})")
        self.consumed = consumed // self.dp_size
        self.positions = {s: dict(positions[s]) for s in self.streams}
        self.damaged.load([r.get("damaged", {}) for r in ranks])  # absent in checkpoints of before the record


def build_train_loader(cfg: DataConfig, *, seed: int, dp_rank: int, dp_size: int, micro_batch: int) -> TrainLoader:
    """The train loader of one DP rank over `cfg.train`; TP peers (same dp_rank) get identical batches."""
    spec, index = _spec(cfg, cfg.train, seed=seed, num_streams=None, block_chunks=max(1, cfg.shuffle_buffer))
    loader = TrainLoader(spec, dp_rank=dp_rank, dp_size=dp_size, micro_batch=micro_batch, workers=cfg.workers,
                         max_damaged_share=cfg.max_damaged_share)
    if cfg.workers > loader.workers:
        log.info("data.workers %d: %d per DP rank are used, one per data stream it owns (data.streams %d / DP %d)",
                 cfg.workers, loader.workers, spec.num_streams, dp_size)
    if index is not None:
        log.info("train data: %d shards in %d streams, %d tokens (~%d chunks of %d per epoch)", len(spec.shards),
                 spec.num_streams, index["tokens"], index["tokens"] // spec.raw_length, spec.raw_length)
    return loader


class EvalLoader:
    """A fixed list of validation batches: the same every time it is iterated and on every call."""

    def __init__(self, batches: list[dict]):
        self.batches = batches

    def __iter__(self) -> Iterator[dict]:
        return iter(self.batches)

    def __len__(self) -> int:
        return len(self.batches)


def build_eval_loader(cfg: DataConfig, *, dp_rank: int, dp_size: int, micro_batch: int,
                      num_examples: int) -> EvalLoader:
    """DP rank r's part of the first `num_examples` examples of `cfg.valid` (one stream, seed 0 for the order and
    the corruption whatever the run's seed): examples i = r (mod DP), in micro batches. The examples, and so
    the loss over all ranks, are the same on every layout."""
    spec, _ = _spec(cfg, cfg.valid, seed=0, num_streams=1, block_chunks=max(1, cfg.shuffle_buffer))
    mine: list = []
    for i, (inputs, targets, after) in enumerate(examples(spec, 0, start_position(), {})):
        if i == num_examples:
            break
        if after["epoch"] > 0:
            raise UsageError(f"data.valid ({redact(cfg.valid)}) holds {i} examples, too few for {num_examples} "
                             "(eval.batches x train.global_batch); lower eval.batches")
        if i % dp_size == dp_rank:
            mine.append((inputs, targets))
    return EvalLoader([collate(mine[k : k + micro_batch], spec.input_length, spec.target_length)
                       for k in range(0, len(mine), micro_batch)])
