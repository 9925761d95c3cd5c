"""Corpus mixtures: the run's sources at set weights in the one global order, and the lanes that deal them to DP
ranks and loader workers.

A run reads `data.sources` (a list of {name, train, weight}) or `data.train`, which is the one source named `train`
with weight 1 (and draws exactly as before mixtures existed).

The schedule. Example i of the run comes from the source whose share of [0, 1) holds u_i = frac(offset + i / phi)
(phi the golden ratio, offset drawn from the seed): a Kronecker sequence, the one-dimensional low-discrepancy
sequence of lowest discrepancy, computed exactly in 64-bit fixed point (u_i = offset + i * 0x9E3779B97F4A7C15 mod
2^64, the cuts at the cumulative weights x 2^64). So the source of example i is a function of (seed, i) alone, and
every prefix realises the weights: measured over the first 10^6 examples for 2, 3 and 16 sources (weights down to
0.001), every prefix of n examples holds n x w_k of source k within 3.5 examples (i.i.d. draws would be off by
sqrt(n w (1 - w)): ~460 examples at 10^6 for 0.7 / 0.3).

Lanes. The run has S lanes (`data.streams`). Global example i is example i // S of lane i % S, as in the one-source
order (pretrain.data.stream). Every source is dealt to the same S streams (its stream s reads, in its epoch e, its
units permutation(source seed, e)[s::S]: whole shards, or slices of them where the source has fewer shards than S,
pretrain.data.stream), and lane s holds stream s of every source: the lane's example m is the
next example of stream s of the source of global example m S + s. So DP rank r owns the lanes s = r (mod D) whole
and reads only its lanes' streams, every source's; workers split the lanes; and which source an example comes
from, and which example of that source's stream it is, depend on (seed, i) alone: every DP size dividing S, micro
batch and number of workers computes the same examples, and a checkpoint of every stream's position continues on
any of them. Each lane's own sub-sequence u_{mS+s} is again a Kronecker sequence (step S / phi), so every source's
streams advance at its weight's pace on every lane (measured for S = 8, 64, 89, 96: within 50 lane examples), and a
source's epochs stay passes over all its shards. Within a source, examples follow its streams' orders; a source that
runs out starts its next epoch (pretrain.data.stream.examples), reshuffled by its seed and the epoch.

A source of any size serves every lane (a source of one small file repeats inside each lane, at its weight's
pace). Each lane holds one live stream per source it has drawn from: host memory grows with lanes x sources
(docs/data.md, "Corpus mixtures").
"""
from __future__ import annotations

import functools
import hashlib
import itertools
import math
from dataclasses import dataclass
from typing import Iterator

import numpy as np
from torch.utils.data import IterableDataset, get_worker_info

from pretrain.core.manifest import describe_shards, shard_change
from pretrain.data.stream import StreamSpec, examples

ONE_SOURCE = "train"  # the name of data.train's source: it draws with the run's seed, as before mixtures
GOLDEN = 0x9E3779B97F4A7C15  # round(2^64 / phi), odd: the Kronecker step in 64-bit fixed point
SCHEDULE_KEY = 0x5C4ED  # keeps the schedule's offset apart from the streams' draws of the same seed
LOOKAHEAD = 256  # lane examples whose sources one vectorised schedule call decides
ROWS = 8  # examples per lane in one item from a loader worker
COUNT_CHUNK = 1 << 20  # examples per vectorised call when counting sources


def source_seed(seed: int, name: str) -> int:
    """The seed of a source's draws (shard permutations, shuffle blocks, noise): the run's seed for `train`, else a
    64-bit mix of (seed, name), so sources draw independently and a source keeps its draws when others change."""
    if name == ONE_SOURCE:
        return seed
    digest = hashlib.sha256(f"{seed}/{name}".encode()).digest()
    return int.from_bytes(digest[:8], "little") | 1 << 62  # two words of entropy, never the bare seed's one


@dataclass(frozen=True)
class Schedule:
    """Which source example i comes from (module docstring): cuts of [0, 2^64) at the cumulative weights."""

    offset: int
    cuts: tuple[int, ...]  # K - 1 cut points

    @classmethod
    def of(cls, seed: int, weights: tuple[float, ...]) -> Schedule:
        total = math.fsum(weights)
        cuts = tuple(min(int(c / total * 2**64), 2**64 - 1) for c in itertools.accumulate(weights[:-1]))
        offset = int(np.random.SeedSequence([seed, SCHEDULE_KEY]).generate_state(1, np.uint64)[0])
        return cls(offset, cuts)

    def sources(self, indices: np.ndarray) -> np.ndarray:
        """[n] source index of each global example index (uint64 arithmetic wraps: the mod 2^64 is the point)."""
        u = np.uint64(self.offset) + indices.astype(np.uint64) * np.uint64(GOLDEN)
        return np.searchsorted(np.array(self.cuts, dtype=np.uint64), u, side="right")

    def counts(self, start: int, stop: int) -> np.ndarray:
        """[K] examples of each source among the global examples [start, stop)."""
        out = np.zeros(len(self.cuts) + 1, dtype=np.int64)
        for a in range(start, stop, COUNT_CHUNK):
            idx = np.arange(a, min(stop, a + COUNT_CHUNK), dtype=np.uint64)
            out += np.bincount(self.sources(idx), minlength=len(out))
        return out


@dataclass(frozen=True)
class Sources:
    """The run's sources: names, weights, each one's stream settings (the same lanes, lengths and noise; its own
    shards and seed), the schedule; `mixture` is False for data.train's one source."""

    names: tuple[str, ...]
    weights: tuple[float, ...]
    specs: tuple[StreamSpec, ...]
    seed: int
    mixture: bool

    @property
    def num_streams(self) -> int:
        return self.specs[0].num_streams

    @functools.cached_property
    def schedule(self) -> Schedule:
        return Schedule.of(self.seed, self.weights)

    def record(self) -> list[dict]:
        """What a checkpoint keeps of the mixture: names, weights and shard lists (name, size), in order."""
        return [{"name": n, "weight": w, "shards": [list(s) for s in describe_shards(spec.shards)]}
                for n, w, spec in zip(self.names, self.weights, self.specs)]


def changes(saved: list[dict], now: list[dict], shards: bool = True) -> tuple[list[str], set[str]]:
    """(what changed between two `Sources.record()`s, in words; the names whose shards are unchanged). `shards`
    False: the shard lists are not compared (data.train's on both sides: the run's inputs, RunInputs, check it). A
    list of None (a checkpoint of before mixtures) is unknown: unchanged only if not compared."""
    then, current = {s["name"]: s for s in saved}, {s["name"]: s for s in now}
    listed = lambda s: s["shards"] and [tuple(x) for x in s["shards"]]  # noqa: E731  (lists once saved)
    both = [n for n in then if n in current]
    same = {n for n in both if not shards or (then[n]["shards"] is not None and listed(then[n]) == listed(current[n]))}
    words = [f"{n} left" for n in then if n not in current] + [f"{n} is new" for n in current if n not in then]
    words += [f"{n}'s shards ({_shard_words(listed(then[n]), listed(current[n]))})" for n in both if n not in same]
    words += [f"{n}'s weight ({then[n]['weight']:g} in the checkpoint, {current[n]['weight']:g} now)"
              for n in both if then[n]["weight"] != current[n]["weight"]]
    if not words and both != [n for n in current if n in then]:
        words.append(f"the order ({', '.join(then)} in the checkpoint, {', '.join(current)} now)")
    return words, same


def _shard_words(then: list | None, now: list) -> str:
    return "not recorded in the checkpoint" if then is None else shard_change(then, now)


# ---------------------------------------------------------------------------------------------------------------
# Lanes, in the loader workers
# ---------------------------------------------------------------------------------------------------------------
def lane_examples(sources: Sources, lane: int, start: int, positions: dict[int, dict],
                  damaged: list[dict[int, int]]) -> Iterator[tuple]:
    """(source index, inputs, targets, position after) of lane `lane` from its example `start` on, forever.
    `positions[k]`: where stream `lane` of source k stands; a source's stream is opened when first drawn."""
    schedule, lanes = sources.schedule, np.uint64(sources.num_streams)
    opened: dict[int, Iterator] = {}
    for m in itertools.count(start, LOOKAHEAD):
        for k in schedule.sources(np.arange(m, m + LOOKAHEAD, dtype=np.uint64) * lanes + np.uint64(lane)).tolist():
            if k not in opened:
                opened[k] = examples(sources.specs[k], lane, positions[k], damaged[k])
            yield (k, *next(opened[k]))


def rows(sources: Sources, lanes: list[int], starts: dict[int, int], positions: list[dict[int, dict]],
         known: list[dict[int, int]]) -> Iterator[tuple[list[tuple], dict[int, dict[int, int]]]]:
    """One loader worker's output: items of `ROWS` examples from each of its `lanes`, as ([(lane, source of each
    row, inputs [ROWS, input_length], targets [ROWS, target_length], position after each row)], the shards found
    damaged since the last item {source: {shard index: documents read}}). Its lanes share what is known damaged of
    each source, from `known` on (the loader's record). The loader deals the rows into the rank's order."""
    damaged = [dict(d) for d in known]
    reported = [len(d) for d in damaged]
    its = {s: lane_examples(sources, s, starts[s], {k: p[s] for k, p in enumerate(positions)}, damaged)
           for s in lanes}
    while True:
        item = []
        for s in lanes:
            got = [next(its[s]) for _ in range(ROWS)]
            item.append((s, [g[0] for g in got], np.stack([g[1] for g in got]), np.stack([g[2] for g in got]),
                         [g[3] for g in got]))
        found = {k: dict(list(d.items())[reported[k]:]) for k, d in enumerate(damaged) if len(d) > reported[k]}
        reported = [len(d) for d in damaged]  # a shard is added once, never moved
        yield item, found


class WorkerRows(IterableDataset):
    """The lanes of one DP rank, dealt to the DataLoader workers: worker w of W runs lanes[w::W]."""

    def __init__(self, sources: Sources, lanes: list[int], starts: dict[int, int], positions: list[dict[int, dict]],
                 workers: int, known: list[dict[int, int]]):
        self.sources, self.lanes, self.starts, self.positions = sources, lanes, starts, positions
        self.workers, self.known = workers, known

    def __iter__(self) -> Iterator[tuple[list[tuple], dict[int, dict[int, int]]]]:
        info = get_worker_info()
        worker = info.id if info is not None else 0
        return rows(self.sources, self.lanes[worker :: max(1, self.workers)], self.starts, self.positions, self.known)
