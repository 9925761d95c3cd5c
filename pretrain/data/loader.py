"""The loaders the trainer uses: a resumable streaming train loader and a fixed validation slice.

`build_train_loader` yields dict batches (`input_ids`, `attention_mask`, `decoder_input_ids`, `labels`,
`decoder_attention_mask`) forever: DP rank r's examples of the global order (pretrain.data.stream; with several
sources, pretrain.data.sources), cut into micro batches in order. Examples are a function of (seed, global index)
alone; the DP size, the micro batch and the workers only decide who computes which example. `state_dict()` is plain
data (each owned stream's position, every source's examples so far); `load_state_dict` takes every saved DP rank's
state, so a resume on any DP size, micro batch or number of workers continues with the next example, bit for bit.
The state also records the settings that decide the examples (seed, streams, shuffle buffer, lengths, noise): a
resume that changed one is refused, since the saved positions would then repeat or skip text; the mixture (names,
weights, shard lists), whose change is refused too unless `data.reweight` asks for it; and the damaged shards found so
far (pretrain.data.damage), whose share of a source may not exceed data.max_damaged_share.
"""
from __future__ import annotations

import copy
import functools
import itertools
import logging
import math
import os
import signal
from collections import deque
from multiprocessing.connection import wait
from typing import Iterator

import numpy as np
from torch.utils.data import DataLoader

from pretrain.core.config import DataConfig, UsageError
from pretrain.core.redact import redact
from pretrain.core.signals import PREEMPTION_SIGNALS, die_with_parent
from pretrain.data.damage import DamagedShards
from pretrain.data.remote import Retry
from pretrain.data.shards import FORMAT_VERSION, expand_shards, read_index
from pretrain.data.sources import ONE_SOURCE, Sources, WorkerRows, changes, source_seed
from pretrain.data.span_corruption import input_and_target_lengths
from pretrain.data.stream import StreamSpec, collate, epoch_progress, examples, start_position
from tokenizer.spm import Tokenizer

log = logging.getLogger(__name__)

# 1: positions per (DP rank, worker), before the global order; 2: one source, before mixtures; 3: streams over whole
# shards, each epoch's last partial chunk dropped
STATE_VERSION = 4

DEFAULT_STREAMS = 64  # data.streams 0: every power-of-two DP size up to 64 divides it, whatever the shards


def _stream_spec(cfg: DataConfig, spec: str, *, seed: int, num_streams: int, block_chunks: int,
                 label: str) -> tuple[StreamSpec, dict | None]:
    """The stream settings of the shards `spec` and their index.json (None when absent)."""
    tok = Tokenizer(cfg.tokenizer)
    shards = _expand(spec, label)
    retry = Retry(cfg.http_timeout_s, cfg.http_retries)
    index = read_index(spec, retry)
    if index is not None and index.get("format", 1) != FORMAT_VERSION:
        raise UsageError(f"shards in {redact(spec)!r} are in format {index.get('format', 1)}, this loader reads format "
                         f"{FORMAT_VERSION}; prepare them again with `python -m pretrain.data.prepare`")
    if index is not None and index.get("num_ids") != tok.num_ids:
        raise UsageError(f"shards in {redact(spec)!r} were prepared with a tokenizer of {index.get('num_ids')} ids but "
                         f"data.tokenizer ({cfg.tokenizer}) has {tok.num_ids}; prepare them with that tokenizer")
    raw_length, target_length = input_and_target_lengths(cfg.input_length, cfg.noise_density,
                                                         cfg.mean_noise_span_length)
    return StreamSpec(
        shards=tuple(shards), seed=seed, num_streams=num_streams, raw_length=raw_length,
        input_length=cfg.input_length, target_length=target_length, block_chunks=block_chunks, num_ids=tok.num_ids,
        eos_id=tok.eos_id, noise_density=cfg.noise_density, mean_noise_span_length=cfg.mean_noise_span_length,
        expected_docs=_expected_docs(shards, index), retry=retry, label=label), index


def _expand(spec: str, label: str) -> list[str]:
    """The shards of `spec`; a source of a mixture is named in the line when it has none."""
    try:
        return expand_shards(spec)
    except UsageError as e:
        if label.startswith("data.sources"):
            raise UsageError(f"{label}: {e}") from None
        raise


def num_streams(cfg: DataConfig) -> int:
    """S, the run's lanes: data.streams, 0 meaning DEFAULT_STREAMS (any number of shards serves any S)."""
    return cfg.streams or DEFAULT_STREAMS


def dp_sizes(streams: int, limit: int = 4096) -> list[int]:
    """The DP sizes a run of `streams` lanes may use and move between on a requeue: the divisors of S."""
    return [d for d in range(1, min(streams, limit) + 1) if streams % d == 0]


def build_sources(cfg: DataConfig, seed: int) -> tuple[Sources, list[dict | None]]:
    """The run's sources (data.sources, or data.train as the one source `train`) over the same S streams
    (`num_streams`), and their index.json files."""
    entries = [(s.name, s.train, s.weight) for s in cfg.sources] or [(ONE_SOURCE, cfg.train, 1.0)]
    labels = [f"data.sources {name!r}" if cfg.sources else "data.train" for name, _, _ in entries]
    built = [_stream_spec(cfg, train, seed=source_seed(seed, name), num_streams=num_streams(cfg),
                          block_chunks=max(1, cfg.shuffle_buffer), label=label)
             for (name, train, _), label in zip(entries, labels)]
    sources = Sources(names=tuple(e[0] for e in entries), weights=tuple(e[2] for e in entries),
                      specs=tuple(spec for spec, _ in built), seed=seed, mixture=bool(cfg.sources))
    return sources, [index for _, index in built]


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

    def __init__(self, sources: Sources, *, dp_rank: int, dp_size: int, micro_batch: int, workers: int,
                 max_damaged_share: float, reweight: bool = False):
        if not 0 <= dp_rank < dp_size:
            raise ValueError(f"dp_rank ({dp_rank}) must be in [0, dp_size ({dp_size}))")
        if micro_batch < 1:
            raise ValueError(f"micro_batch must be at least 1, got {micro_batch}")
        num_streams = sources.num_streams
        if num_streams % dp_size:
            raise UsageError(f"the DP size ({dp_size}) must divide data.streams ({num_streams}; 0 means "
                             f"{DEFAULT_STREAMS}): each DP rank owns whole streams; set data.streams at the run's start "
                             f"to a multiple of every DP size it may use (e.g. {math.lcm(dp_size, num_streams)})")
        self.sources, self.dp_rank, self.dp_size, self.micro_batch = sources, dp_rank, dp_size, micro_batch
        self.reweight = reweight
        self.lanes = list(range(dp_rank, num_streams, dp_size))  # the lanes (streams) this rank owns, in its order
        # workers beyond one per lane would idle; 0 runs the lanes in the main process
        self.workers = min(workers, len(self.lanes))
        self.consumed = 0  # examples this rank handed out; its next one is global example consumed * D + r
        # positions[k][s]: stream s of source k; damaged[k]: what this rank's streams and the checkpoint found
        self.positions = [{s: start_position() for s in self.lanes} for _ in sources.names]
        self.damaged = [DamagedShards(spec, max_damaged_share) for spec in sources.specs]
        self._counted = (0, np.zeros(len(sources.names), dtype=np.int64))  # (global examples, of each source)
        self._iterator = None

    def __iter__(self) -> Iterator[dict]:
        num_lanes = self.sources.num_streams
        done = self.consumed * self.dp_size  # global examples handed out: lane s has had those = s (mod S) of them
        starts = {s: max(0, -(-(done - s) // num_lanes)) for s in self.lanes}
        source = WorkerRows(self.sources, self.lanes, starts, copy.deepcopy(self.positions), self.workers,
                            [dict(d.found) for d in self.damaged])
        loader = DataLoader(source, batch_size=None, collate_fn=_identity, num_workers=self.workers,
                            persistent_workers=False, prefetch_factor=4 if self.workers else None,
                            worker_init_fn=functools.partial(_worker_init, os.getpid()))
        self.close()
        self._iterator = iter(loader)
        queues: dict[int, deque] = {s: deque() for s in self.lanes}
        try:
            while True:
                pairs = []
                while len(pairs) < self.micro_batch:
                    lane = self.lanes[self.consumed % len(self.lanes)]  # round robin: the global order
                    while not queues[lane]:
                        rows, found = self._next_item()
                        for k, shards in found.items():
                            self.damaged[k].add(shards)
                        for s, ks, inputs, targets, after in rows:
                            queues[s].extend(zip(ks, inputs, targets, after))
                    k, inputs, targets, self.positions[k][lane] = queues[lane].popleft()
                    pairs.append((inputs, targets))
                    self.consumed += 1
                yield collate(pairs, self.sources.specs[0].input_length, self.sources.specs[0].target_length)
        finally:
            self.close()

    def _next_item(self) -> tuple[list[tuple], dict[int, dict[int, int]]]:
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

    def source_counts(self) -> np.ndarray:
        """[K] examples of each source among the run's examples so far (at a step boundary every rank has handed
        out the same number); counted from the schedule from the last count on."""
        done, counts = self._counted
        now = self.consumed * self.dp_size
        if now > done:
            more = self.sources.schedule.counts(done, now) if len(counts) > 1 else np.array([now - done])
            self._counted = (now, counts + more)
        return self._counted[1]

    def metrics(self, dp_sum) -> dict[str, float]:
        """`tokens_seen/NAME` and `epochs/NAME` of every source of a mixture (none for data.train's one source).
        The epochs are passes over the source (its streams' epochs plus the share of the current one read, averaged
        over its streams); each rank knows its own streams: `dp_sum` adds a list of numbers over the DP ranks."""
        if not self.sources.mixture:
            return {}
        spec = self.sources.specs[0]
        tokens = self.source_counts() * (spec.input_length + spec.target_length)  # every example has both, unpadded
        passes = dp_sum([sum(epoch_progress(self.sources.specs[k], s, p[s]) for s in self.lanes)
                         for k, p in enumerate(self.positions)])
        out = {}
        for name, n, e in zip(self.sources.names, tokens.tolist(), passes):
            spec = self.sources.specs[self.sources.names.index(name)]
            out[f"tokens_seen/{name}"], out[f"epochs/{name}"] = n, e / self.sources.num_streams * spec.replicas
        return out

    def _settings(self) -> dict:
        """What decides the examples; a resume with other values would repeat or skip text."""
        s = self.sources.specs[0]
        return {"seed": self.sources.seed, "streams": s.num_streams, "shuffle_buffer": s.block_chunks,
                "input_length": s.input_length, "noise_density": s.noise_density,
                "mean_noise_span_length": s.mean_noise_span_length}

    def state_dict(self) -> dict:
        """This DP rank's part: its streams' positions of every source, the examples of the whole run consumed (at a
        step boundary every rank has handed out the same number) and of each source, and the damaged shards it
        knows of; DP rank 0's also records the mixture (names, weights, shard lists)."""
        names = self.sources.names
        state = {"version": STATE_VERSION, "examples": self.consumed * self.dp_size, "settings": self._settings(),
                 "positions": {n: {str(s): dict(p) for s, p in self.positions[k].items()} for k, n in enumerate(names)},
                 "counts": dict(zip(names, self.source_counts().tolist())),
                 "damaged": {n: self.damaged[k].state() for k, n in enumerate(names)}}
        if self.dp_rank == 0:
            state["sources"], state["mixture"] = self.sources.record(), self.sources.mixture
        return state

    def load_state_dict(self, state: dict) -> None:
        """`state`: `{"ranks": [the state_dict of every DP rank of the saving run]}`; any DP size may load it."""
        ranks = state["ranks"]
        if any(r.get("version") != STATE_VERSION for r in ranks):
            raise UsageError(f"the data position in the checkpoint is of data order version {ranks[0].get('version')}, "
                             f"this code's is {STATE_VERSION} (streams over units of shards, docs/data.md): it cannot be "
                             "continued exactly; finish the run with the code that started it, or start a new run.dir "
                             "(init=EXPORT keeps the weights)")
        now = self._settings()
        changed = [f"{_SETTING_KEYS[k]} ({v} in the checkpoint, {now[k]} now)"
                   for k, v in ranks[0]["settings"].items() if now[k] != v]
        if changed:
            raise UsageError(f"the data settings changed since the checkpoint: {', '.join(changed)}; the saved data "
                             "positions would repeat or skip text: restore them, or start a new run.dir")
        # data.train on both sides: its shard list is the run's inputs' to check (RunInputs, with the sizes)
        words, same = changes(ranks[0]["sources"], self.sources.record(),
                              shards=ranks[0]["mixture"] or self.sources.mixture)
        if words and not self.reweight:
            raise UsageError(f"the data mixture changed since the checkpoint: {'; '.join(words)}; the saved positions "
                             "belong to its mixture: restore data.sources, set data.reweight=true to go on with this "
                             "one (the sources whose shards are unchanged keep their positions), or start a new "
                             "run.dir")
        if words:
            log.warning("data.reweight: the mixture changed since the checkpoint (%s); %s keep their positions, "
                        "%s start afresh", "; ".join(words), ", ".join(sorted(same)) or "no sources",
                        ", ".join(n for n in self.sources.names if n not in same) or "no source")
        totals = {r["examples"] for r in ranks}
        assert len(totals) == 1, "a partial or inconsistent data state"
        (consumed,) = totals
        if consumed % self.dp_size:
            raise ValueError(f"{consumed} examples consumed is not a multiple of the DP size ({self.dp_size})")
        self.consumed = consumed // self.dp_size
        counts = ranks[0]["counts"]
        self._counted = (consumed, np.array([counts.get(n, 0) for n in self.sources.names], dtype=np.int64))
        for k, name in enumerate(self.sources.names):
            if name not in same:
                continue  # a new source, or other shards under its name: fresh positions
            positions = {int(s): p for r in ranks for s, p in r["positions"][name].items()}
            assert len(positions) == self.sources.num_streams, "a partial or inconsistent data state"
            self.positions[k] = {s: dict(positions[s]) for s in self.lanes}
            self.damaged[k].load([r["damaged"].get(name, {}) for r in ranks])


def build_train_loader(cfg: DataConfig, *, seed: int, dp_rank: int, dp_size: int, micro_batch: int) -> TrainLoader:
    """The train loader of one DP rank over `cfg.sources` (or `cfg.train`); TP peers (same dp_rank) get identical
    batches."""
    sources, indexes = build_sources(cfg, seed)
    loader = TrainLoader(sources, dp_rank=dp_rank, dp_size=dp_size, micro_batch=micro_batch, workers=cfg.workers,
                         max_damaged_share=cfg.max_damaged_share, reweight=cfg.reweight)
    if cfg.workers > loader.workers:
        log.info("data.workers %d: %d per DP rank are used, one per data stream it owns (data.streams %d / DP %d)",
                 cfg.workers, loader.workers, sources.num_streams, dp_size)
    raw = sources.specs[0].raw_length
    for name, weight, spec, index in zip(sources.names, sources.weights, sources.specs, indexes):
        if index is not None:
            log.info("train data%s: %d shards in %d streams, %d tokens (~%d chunks of %d per epoch)",
                     f" {name} (weight {weight:g})" if sources.mixture else "", len(spec.shards), spec.num_streams,
                     index["tokens"], index["tokens"] // raw, raw)
    return loader


class EvalLoader:
    """A fixed list of validation batches: the same every time it is iterated and on every call."""

    def __init__(self, batches: list[dict]):
        self.batches = batches

    def __iter__(self) -> Iterator[dict]:
        return iter(self.batches)

    def __len__(self) -> int:
        return len(self.batches)


def build_eval_loader(cfg: DataConfig, *, dp_rank: int, dp_size: int, micro_batch: int, num_examples: int,
                      source: str = "") -> EvalLoader:
    """DP rank r's part of the first `num_examples` examples of `cfg.valid` (or of the `valid` of the source named
    `source`; one stream, seed 0 for the order and the corruption whatever the run's seed): examples i = r (mod DP),
    in micro batches. The examples, and so the loss over all ranks, are the same on every layout."""
    valid, label = cfg.valid, "data.valid"
    if source:
        valid, label = next(s.valid for s in cfg.sources if s.name == source), f"data.sources {source!r} valid"
    spec, _ = _stream_spec(cfg, valid, seed=0, num_streams=1, block_chunks=max(1, cfg.shuffle_buffer), label=label)
    mine: list = []
    found = 0
    for inputs, targets, _ in itertools.islice(examples(spec, 0, start_position(), {}, cycle=False), num_examples):
        if found % dp_size == dp_rank:
            mine.append((inputs, targets))
        found += 1
    if found < num_examples:
        raise UsageError(f"{label} ({redact(valid)}) holds {found} examples, too few for {num_examples} "
                         "(eval.batches x train.global_batch); lower eval.batches")
    return EvalLoader([collate(mine[k : k + micro_batch], spec.input_length, spec.target_length)
                       for k in range(0, len(mine), micro_batch)])
