"""The global data order: shards -> units -> documents -> raw chunks -> seeded block shuffle -> span corruption,
dealt into one sequence of examples that depends on the seed alone (Megatron's global sample index, for streams).

The run has S lanes (`data.streams`, 64 unless set). A source's shards are cut into *units* so that every lane has
one in every epoch, however the files were cut: a shard is one unit when there are at least S shards, else
ceil(S / shards) slices of its documents (from index.json's counts; a source without an index repeats its whole
shards instead, one replica a slice). Stream s reads, in its epoch e, the units permutation(seed, e)[s::S], joins
their documents with EOS and cuts raw chunks from them continuously, epoch after epoch (an epoch's last partial
chunk goes on with the next epoch's text, so a unit smaller than a chunk, or a source smaller than S chunks, still
feeds every lane). It permutes the chunks a block (`data.shuffle_buffer` chunks) at a time and span-corrupts each
block, every random draw seeded by (seed, stream, block). Global example i is example i // S of stream i % S:

    stream    0    1    2    3    0    1    2    3    0  ...      (S = 4)
    example   0    1    2    3    4    5    6    7    8  ...      global batch k: examples [kG, (k+1)G)

DP rank r of D computes the examples i = r (mod D), in order. D divides S, so rank r owns the streams
s = r (mod D) whole and reads nothing it does not use; its loader workers split those streams among them, and
its micro batches are its examples cut in order. DP size, micro batch and workers decide who computes an
example, never which example it is; a checkpoint holds every stream's position, so a resume on any layout
continues with the next example.

With several sources (a corpus mixture, pretrain.data.sources), every source is dealt to the same S streams and
the S lanes interleave them: lane s's next example is the next of stream s of the source the mixture's schedule
draws for that global index. Each stream below is one source's.

A stream's position is six integers, so a restart rebuilds the exact same examples:

    epoch   the stream's epoch where its current block starts; unit order is reshuffled from (seed, epoch)
    unit    index into that epoch's unit list of the stream
    doc     documents of that unit's shard before the block's first token
    offset  tokens (EOS included) of that document before the block's first token
    block   blocks the stream started (a block is `shuffle_buffer` chunks, shuffled as a whole)
    next    chunks of the block already emitted

Resuming re-reads one block (at most `shuffle_buffer` chunks; the head of one shard is read but its packs
before the resume point are not decoded); the cost never grows with the data consumed. The hot path works
on whole arrays: documents are joined with EOS a pack (~0.5M tokens) at a time, and a block is permuted and
span-corrupted in one vectorised call; examples travel from the workers in arrays of `ROWS` per lane. Blocks
are held in the tokens' own width (uint16 below 65,536 ids): a live stream costs its corrupted block and the
rest of one pack.
"""
from __future__ import annotations

import functools
import logging
from dataclasses import dataclass
from typing import Iterator, Sequence

import numpy as np
import torch

from pretrain.core.config import UsageError
from pretrain.core.redact import redact
from pretrain.data.remote import Retry
from pretrain.data.shards import decode_pack, num_pack_documents, read_packs
from pretrain.data.span_corruption import span_corrupt
from pretrain.model.loss import IGNORE_INDEX

log = logging.getLogger(__name__)

POSITION_KEYS = ("epoch", "unit", "doc", "offset", "block", "next")
BLOCK_KEY = 0xB10C  # keeps the blocks' draws apart from the epochs' unit permutations of the same seed


def start_position(epoch: int = 0) -> dict:
    return {k: (epoch if k == "epoch" else 0) for k in POSITION_KEYS}


def cut_units(num_shards: int, docs: tuple[int, ...] | None, num_streams: int) -> tuple[tuple[int, int, int], ...]:
    """(shard, first document, end document; -1: the shard's end) of each unit: whole shards when there are at
    least `num_streams` of them, else ceil(streams / shards) slices of each shard's documents, so that every
    stream has a unit in every epoch. Without document counts (no index.json) a slice is a replica of the whole
    shard: a source of fewer shards than streams then repeats inside an epoch."""
    parts = -(-num_streams // num_shards)
    if parts == 1 or docs is None:
        return tuple((i, 0, -1) for i in range(num_shards) for _ in range(parts))
    return tuple((i, docs[i] * j // parts, docs[i] * (j + 1) // parts if j < parts - 1 else -1)
                 for i in range(num_shards) for j in range(parts))


@dataclass(frozen=True)
class StreamSpec:
    """What a stream needs besides its position; plain values so DataLoader workers can pickle it."""

    shards: tuple[str, ...]
    seed: int
    num_streams: int  # S: the streams of the whole run (data.streams), whatever the layout
    raw_length: int  # tokens per chunk before span corruption
    input_length: int
    target_length: int
    block_chunks: int  # the shuffle buffer, in chunks
    num_ids: int  # tokenizer ids: sentinels count down from num_ids - 1
    eos_id: int
    noise_density: float
    mean_noise_span_length: float
    expected_docs: tuple[int, ...] | None  # documents per shard from index.json: a short read is damage
    retry: Retry  # http(s) shards: timeout per attempt and retries (data.http_timeout_s, data.http_retries)
    label: str = "data.train"  # the shards' key in messages (a source of a mixture: data.sources 'NAME')

    @functools.cached_property
    def units(self) -> tuple[tuple[int, int, int], ...]:
        return cut_units(len(self.shards), self.expected_docs, self.num_streams)

    @property
    def replicas(self) -> int:
        """How many times an epoch of all streams reads each document: 1 unless whole shards are repeated."""
        return len(self.units) // len(self.shards) if self.expected_docs is None else 1


def epoch_units(spec: StreamSpec, epoch: int, stream: int) -> np.ndarray:
    """Stream `stream`'s units (indices into spec.units) in its epoch `epoch`: a seeded permutation of all units,
    dealt to the streams."""
    return np.random.default_rng([spec.seed, epoch]).permutation(len(spec.units))[stream :: spec.num_streams]


def epoch_shards(spec: StreamSpec, epoch: int, stream: int) -> list[str]:
    """The shards of stream `stream`'s units in its epoch `epoch`, in order."""
    return [spec.shards[spec.units[u][0]] for u in epoch_units(spec, epoch, stream)]


def epoch_progress(spec: StreamSpec, stream: int, position: dict) -> float:
    """Passes over its units a stream has made at `position`: its epoch plus the share of that epoch's documents
    (index.json; without one, of its units) before the block being drained."""
    units = [spec.units[u] for u in epoch_units(spec, position["epoch"], stream)]
    if spec.expected_docs:
        docs = [(spec.expected_docs[s] if end < 0 else end) - first for s, first, end in units]
    else:
        docs = [1] * len(units)
    unit = min(position["unit"], len(units))
    done = sum(docs[:unit]) + (max(0, position["doc"] - units[unit][1]) if spec.expected_docs and unit < len(units)
                               else 0)
    return position["epoch"] + done / max(1, sum(docs))


def _take(handed: list) -> tuple:
    """The items of a list a generator yielded to hand them over, the list emptied: a suspended generator keeps its
    locals, so the readers below yield their pack in a list and hold no reference to it once it is taken (a live
    stream holds one copy of its text, not one per generator frame)."""
    items = tuple(handed)
    handed.clear()
    return items


def _read_checked(spec: StreamSpec, shard: int, skip_docs: int,
                  damaged: dict[int, int]) -> Iterator[tuple[int, np.ndarray, np.ndarray]]:
    """(index of the first document, token ids, tokens per document) of each pack of shard `shard`, from the
    pack holding document `skip_docs` on; packs before it are counted but not decoded. Damage (a read
    error, a pack failing its checksum, or fewer documents than the index lists) warns, ends the shard and
    records it in `damaged` (shard index -> documents read before the damage): a garbled member header ends a
    tar stream silently, so the index's count is what reveals it.

    A shard `damaged` already holds (found by this worker, or recorded in the checkpoint) is read only up to its
    damage, as its first read ended: a dead URL costs its timeouts once, not every epoch, and a requeue reads what
    the run read even where a transient failure has healed since.
    """
    url = spec.shards[shard]
    known = damaged.get(shard)
    if known == 0:
        return
    errors: list[Exception] = []
    n = empty = 0
    for sample in read_packs(url, errors.append, spec.retry):
        first, n = n, n + num_pack_documents(sample)
        if known is not None and n > known:
            n = first
            break  # the pack the damage is in
        if n <= skip_docs:
            continue  # before the resume point: skipped without decoding
        try:
            tokens, lengths = decode_pack(sample)
            sample.clear()  # webdataset's group_by_keys holds this dict while suspended: only the tokens keep
            del sample  # their bytes, and they are let go once the pack is joined with EOS
        except ValueError as exn:
            errors.append(exn)
            n = first
            break
        if len(tokens) and int(tokens.max()) >= spec.num_ids:
            # ids the embedding does not hold: an IndexError at TP 1, silently zero embeddings at TP > 1
            raise UsageError(f"shard {redact(url)} holds token id {int(tokens.max())}, beyond the {spec.num_ids} ids of "
                             "data.tokenizer: it was prepared with another tokenizer; prepare it again with this one")
        empty += int((lengths == 0).sum())
        pack = [first, tokens, lengths]
        del tokens, lengths
        yield pack  # handed over: the reader empties the list, so this suspended generator holds no pack
    if empty:
        log.warning("skipped %d empty documents (no tokens) of shard %s", empty, redact(url))
    expected = spec.expected_docs[shard] if spec.expected_docs else None
    if known is None and (errors or (expected is not None and n < expected)):
        damaged[shard] = n
        why = str(errors[0]).splitlines()[0][:200] if errors else f"it ended after {n} of {expected} documents"
        log.warning("skipping the rest of damaged shard %s: %s", redact(url), redact(why))


def _with_eos(tokens: np.ndarray, lengths: np.ndarray, eos_id: int) -> tuple[np.ndarray, np.ndarray]:
    """(the pack's documents each followed by EOS, in the tokens' width (uint16 holds ids below 65,536, EOS and
    sentinels included), start of each document in it plus the end).

    An empty document adds nothing, not even an EOS (shards of other tools or older versions may hold them; a
    stream of them alone would be EOS after EOS, which the loss learns to predict while learning nothing); it
    keeps its index, starting where the next document starts, so positions stay document counts of the shard.
    """
    ends = np.cumsum(lengths + (lengths > 0))  # document i's end, its EOS included
    eos_at = ends[lengths > 0] - 1
    flat = np.empty(len(tokens) + len(eos_at), dtype=np.uint16 if tokens.dtype.itemsize == 2 else np.int32)
    is_token = np.ones(len(flat), dtype=bool)
    is_token[eos_at] = False
    flat[is_token], flat[eos_at] = tokens, eos_id
    starts = np.empty(len(lengths) + 1, dtype=np.int64)
    starts[0], starts[1:] = 0, ends
    return flat, starts


def _unit_packs(spec: StreamSpec, unit: tuple[int, int, int], doc: int,
                damaged: dict[int, int]) -> Iterator[tuple[int, np.ndarray, np.ndarray]]:
    """(index of the first document, its documents joined with EOS, document starts) of each pack of `unit` from
    its document `doc` on, the last pack cut at the unit's end."""
    shard, _, end = unit
    for pack in _read_checked(spec, shard, doc, damaged):
        first, tokens, lengths = _take(pack)
        if 0 <= end <= first:
            return
        flat, starts = _with_eos(tokens, lengths, spec.eos_id)
        last = 0 <= end < first + len(lengths)
        del tokens, lengths  # a live stream holds one copy of its pack, not two
        if last:
            starts = starts[: end - first + 1]
            flat = flat[: starts[-1]]
        pack = [first, flat, starts]
        del flat, starts
        yield pack  # handed over as _read_checked's
        if last:
            return


def blocks(spec: StreamSpec, stream: int, position: dict, damaged: dict[int, int],
           cycle: bool = True) -> Iterator[tuple[np.ndarray, tuple[int, int, int, int]]]:
    """(chunks [n, raw_length], where the block starts: epoch, unit, doc, offset) from `position` on: forever,
    epoch after epoch, the text running on across epochs (`cycle`), or until epoch `position["epoch"]` ends, its
    last partial chunk dropped (a validation slice).

    Documents are joined with EOS a pack at a time; a block start is mapped back to (unit, document, offset)
    with a binary search over the pack's document starts. An epoch whose units give no token (damaged, empty) is
    passed over; when the epochs passed over in a row have tried every unit of the source, nothing is readable.
    """
    need = spec.block_chunks * spec.raw_length
    epoch, unit, doc, offset = (position[k] for k in ("epoch", "unit", "doc", "offset"))
    order = epoch_units(spec, epoch, stream)
    if unit < len(order):
        doc = max(doc, spec.units[order[unit]][1])  # a fresh position (doc 0) starts at its unit's first document
    pieces: list[np.ndarray] = []
    total, start = 0, (epoch, unit, doc, offset)
    unreadable: set[int] = set()  # the units of the epochs passed over in a row
    whole = (unit, doc, offset) == (0, spec.units[order[0]][1], 0)  # this epoch is read from its start
    while True:
        order = epoch_units(spec, epoch, stream)
        read = 0
        for ui in range(unit, len(order)):
            for pack in _unit_packs(spec, spec.units[order[ui]], doc, damaged):
                first, flat, starts = _take(pack)
                skip = starts[doc - first] + offset if first <= doc else 0
                pieces.append(flat[skip:])
                total += len(flat) - skip
                read += len(flat) - skip
                doc, offset = -1, 0  # only the first pack read starts inside
                if total < need:
                    continue
                carried = total - (len(flat) - skip)  # tokens before this pack's first used token
                joined = np.concatenate(pieces)
                pieces, flat = [], None
                cut = 0
                while len(joined) >= need:
                    # the block goes out and, at the last block of this text, only the text after it stays here (a
                    # copy): a suspended stream holds its corrupted block and one pack's tail, not the joined text
                    rest = joined[need:]
                    split = [joined[:need].reshape(-1, spec.raw_length), rest.copy() if len(rest) < need else rest]
                    del rest
                    joined = split.pop()
                    yield split.pop(), start
                    cut += need
                    at = cut - carried + skip  # where the next block starts, in this pack's coordinates
                    d = int(np.searchsorted(starts, at, side="right")) - 1
                    start = (epoch, ui, first + d, int(at - starts[d]))
                pieces, total = [joined], len(joined)
                joined = None
            if ui + 1 < len(order):
                doc, offset = spec.units[order[ui + 1]][1], 0
        if not cycle:
            n = total // spec.raw_length  # the epoch's last partial chunk is dropped
            if n:
                yield np.concatenate(pieces)[: n * spec.raw_length].reshape(n, spec.raw_length), start
            return
        if whole:
            unreadable = set() if read else unreadable | set(order.tolist())
            _check_readable(spec, stream, epoch, order, read, unreadable)
        epoch, unit, whole = epoch + 1, 0, True
        doc, offset = spec.units[epoch_units(spec, epoch, stream)[0]][1], 0
        if not total:
            start = (epoch, 0, doc, 0)


def _check_readable(spec: StreamSpec, stream: int, epoch: int, order: np.ndarray, read: int,
                    unreadable: set[int]) -> None:
    """After an epoch of a stream: nothing to say when it read tokens; a line when it read none; a UsageError when
    the epochs that read none in a row have tried every unit of the source."""
    if read:
        return
    if len(unreadable) == len(spec.units):
        names = ", ".join(redact(s) for s in spec.shards[:3]) + (", ..." if len(spec.shards) > 3 else "")
        raise UsageError(f"no readable data in any of the {len(spec.shards)} shards ({names}): damaged, empty or "
                         f"only empty documents; check {spec.label}")
    shards = [spec.shards[spec.units[u][0]] for u in order]
    names = ", ".join(redact(s) for s in shards[:3]) + (", ..." if len(shards) > 3 else "")
    log.info("data stream %d of %s: nothing readable in its epoch %d (%s); it goes on with its epoch %d",
             stream, spec.label, epoch, names, epoch + 1)


def examples(spec: StreamSpec, stream: int, position: dict, damaged: dict[int, int],
             cycle: bool = True) -> Iterator[tuple]:
    """(inputs, targets, position after this example) from `position` on: forever (`cycle`), or to the end of
    the position's epoch.

    A block's chunks are permuted and corrupted in one vectorised call; resuming mid-block redoes that call
    (bounded by the block) and skips the chunks already emitted. A damaged or empty unit only gives less text:
    the rule reads nothing but this stream's own units, so example j of the stream stays a function of the seed
    (and the shards' bytes) alone, whichever rank or worker computes it and whenever.
    """
    nxt, block = position["next"], position["block"]
    for chunks, start in blocks(spec, stream, position, damaged, cycle):  # not enumerate: it keeps its last item
        rng = np.random.default_rng([spec.seed, stream, block, BLOCK_KEY])
        inputs, targets = span_corrupt(
            chunks[rng.permutation(len(chunks))], rng, vocab_size=spec.num_ids, eos_id=spec.eos_id,
            noise_density=spec.noise_density, mean_noise_span_length=spec.mean_noise_span_length)
        del chunks
        for j in range(nxt, len(inputs)):
            yield inputs[j], targets[j], dict(zip(POSITION_KEYS, (*start, block, j + 1)))
        nxt, block = 0, block + 1


def pad_pairs(pairs: Sequence[tuple[Sequence[int], Sequence[int]]], input_length: int,
              target_length: int) -> tuple[np.ndarray, np.ndarray]:
    """[b, input_length] inputs padded with 0 and [b, target_length] labels padded with IGNORE_INDEX."""
    input_ids = np.zeros((len(pairs), input_length), np.int64)
    labels = np.full((len(pairs), target_length), IGNORE_INDEX, np.int64)
    for i, (inputs, targets) in enumerate(pairs):
        input_ids[i, : len(inputs)] = inputs
        labels[i, : len(targets)] = targets
    return input_ids, labels


def shift_right(labels: np.ndarray) -> np.ndarray:
    """[b, m] decoder inputs: the labels shifted right, starting with pad id 0; IGNORE_INDEX padding becomes 0."""
    decoder_input_ids = np.zeros_like(labels)
    decoder_input_ids[:, 1:] = np.maximum(labels[:, :-1], 0)
    return decoder_input_ids


def collate(pairs: list[tuple[np.ndarray, np.ndarray]], input_length: int, target_length: int) -> dict:
    """Fixed-shape batch tensors; decoder inputs are the targets shifted right, starting with pad 0.

    `attention_mask` / `decoder_attention_mask` are present only when some input / target is padded: the model
    reads a missing mask as "nothing padded", so it never has to check a mask on the device (a host sync).
    """
    input_ids, labels = pad_pairs(pairs, input_length, target_length)
    decoder_input_ids = shift_right(labels)
    batch = {
        "input_ids": torch.from_numpy(input_ids),  # [b, input_length]
        "decoder_input_ids": torch.from_numpy(decoder_input_ids),  # [b, target_length]
        "labels": torch.from_numpy(labels),
    }
    keep, keep_targets = input_ids != 0, labels != IGNORE_INDEX
    if not keep.all():
        batch["attention_mask"] = torch.from_numpy(keep.astype(np.int64))
    if not keep_targets.all():
        batch["decoder_attention_mask"] = torch.from_numpy(keep_targets.astype(np.int64))
    return batch
