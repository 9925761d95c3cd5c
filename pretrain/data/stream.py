"""The global data order: shards -> documents -> raw chunks -> seeded block shuffle -> span corruption, dealt
into one sequence of examples that depends on the seed alone (Megatron's global sample index, for streams).

The train shards are dealt to S streams (`data.streams`). Stream s reads, in its epoch e, the shards
permutation(seed, e)[s::S], joins their documents with EOS, cuts raw chunks, permutes them a block
(`data.shuffle_buffer` chunks) at a time and span-corrupts each block, every random draw seeded by
(seed, epoch, stream, block). Global example i is example i // S of stream i % S:

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

    epoch   passes over this stream's shards; shard order is reshuffled from (seed, epoch)
    shard   index into this epoch's shard list of the block being drained
    doc     documents of that shard before the block's first token
    offset  tokens (EOS included) of that document before the block's first token
    block   blocks started in this epoch (a block is `shuffle_buffer` chunks, shuffled as a whole)
    next    chunks of the block already emitted

Resuming re-reads one block (at most `shuffle_buffer` chunks; the head of one shard is read but its packs
before the resume point are not decoded); the cost never grows with the data consumed. The hot path works
on whole arrays: documents are joined with EOS a pack (~0.5M tokens) at a time, and a block is permuted and
span-corrupted in one vectorised call; examples travel from the workers in arrays of `ROWS` per lane.
"""
from __future__ import annotations

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

POSITION_KEYS = ("epoch", "shard", "doc", "offset", "block", "next")


def start_position(epoch: int = 0) -> dict:
    return {k: (epoch if k == "epoch" else 0) for k in POSITION_KEYS}


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


def _epoch_order(spec: StreamSpec, epoch: int, stream: int) -> np.ndarray:
    order = np.random.default_rng([spec.seed, epoch]).permutation(len(spec.shards))
    return order[stream :: spec.num_streams]


def epoch_shards(spec: StreamSpec, epoch: int, stream: int) -> list[str]:
    """Stream `stream`'s shards in its epoch `epoch`: a seeded permutation of all shards, dealt to the streams."""
    return [spec.shards[i] for i in _epoch_order(spec, epoch, stream)]


def epoch_progress(spec: StreamSpec, stream: int, position: dict) -> float:
    """Passes over its shards a stream has made at `position`: its epoch plus the share of that epoch's documents
    (index.json; without one, of its shards) before the block being drained."""
    order = _epoch_order(spec, position["epoch"], stream)
    docs = [spec.expected_docs[i] for i in order] if spec.expected_docs else [1] * len(order)
    shard = min(position["shard"], len(order))
    done = sum(docs[:shard]) + (position["doc"] if spec.expected_docs and shard < len(order) else 0)
    return position["epoch"] + done / max(1, sum(docs))


def _read_checked(spec: StreamSpec, url: str, skip_docs: int,
                  damaged: dict[int, int]) -> Iterator[tuple[int, np.ndarray, np.ndarray]]:
    """(index of the first document, token ids, tokens per document) of each pack of one shard, from the
    pack holding document `skip_docs` on; packs before it are counted but not decoded. Damage (a read
    error, a pack failing its checksum, or fewer documents than the index lists) warns, ends the shard and
    records it in `damaged` (shard index -> documents read before the damage): a garbled member header ends a
    tar stream silently, so the index's count is what reveals it.

    A shard `damaged` already holds (found by this worker, or recorded in the checkpoint) is read only up to its
    damage, as its first read ended: a dead URL costs its timeouts once, not every epoch, and a requeue reads what
    the run read even where a transient failure has healed since.
    """
    shard = spec.shards.index(url)
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
        except ValueError as exn:
            errors.append(exn)
            n = first
            break
        if len(tokens) and int(tokens.max()) >= spec.num_ids:
            # ids the embedding does not hold: an IndexError at TP 1, silently zero embeddings at TP > 1
            raise UsageError(f"shard {redact(url)} holds token id {int(tokens.max())}, beyond the {spec.num_ids} ids of "
                             "data.tokenizer: it was prepared with another tokenizer; prepare it again with this one")
        empty += int((lengths == 0).sum())
        yield first, tokens, lengths
    if empty:
        log.warning("skipped %d empty documents (no tokens) of shard %s", empty, redact(url))
    expected = spec.expected_docs[shard] if spec.expected_docs else None
    if known is None and (errors or (expected is not None and n < expected)):
        damaged[shard] = n
        why = str(errors[0]).splitlines()[0][:200] if errors else f"it ended after {n} of {expected} documents"
        log.warning("skipping the rest of damaged shard %s: %s", redact(url), redact(why))


def _with_eos(tokens: np.ndarray, lengths: np.ndarray, eos_id: int) -> tuple[np.ndarray, np.ndarray]:
    """(the pack's documents each followed by EOS, int32, start of each document in it plus the end).

    An empty document adds nothing, not even an EOS (shards of other tools or older versions may hold them; a
    stream of them alone would be EOS after EOS, which the loss learns to predict while learning nothing); it
    keeps its index, starting where the next document starts, so positions stay document counts of the shard.
    """
    ends = np.cumsum(lengths + (lengths > 0))  # document i's end, its EOS included
    eos_at = ends[lengths > 0] - 1
    flat = np.empty(len(tokens) + len(eos_at), dtype=np.int32)
    is_token = np.ones(len(flat), dtype=bool)
    is_token[eos_at] = False
    flat[is_token], flat[eos_at] = tokens, eos_id
    starts = np.empty(len(lengths) + 1, dtype=np.int64)
    starts[0], starts[1:] = 0, ends
    return flat, starts


def blocks(spec: StreamSpec, shards: list[str], shard: int, doc: int, offset: int,
           damaged: dict[int, int]) -> Iterator[tuple[np.ndarray, tuple[int, int, int]]]:
    """(chunks [n, raw_length], where the block starts) until the epoch ends, from (shard, doc, offset).

    Documents are joined with EOS a pack at a time; a block start is mapped back to (shard, document, offset)
    with a binary search over the pack's document starts.
    """
    need = spec.block_chunks * spec.raw_length
    pieces: list[np.ndarray] = []
    total, start = 0, (shard, doc, offset)
    for si in range(shard, len(shards)):
        skip_docs = doc if si == shard else 0
        for first, tokens, lengths in _read_checked(spec, shards[si], skip_docs, damaged):
            flat, starts = _with_eos(tokens, lengths, spec.eos_id)
            skip = starts[skip_docs - first] + offset if first <= skip_docs and si == shard else 0
            pieces.append(flat[skip:])
            total += len(flat) - skip
            if total < need:
                continue
            carried = total - (len(flat) - skip)  # tokens before this pack's first used token
            joined = np.concatenate(pieces)
            cut = 0
            while len(joined) - cut >= need:
                yield joined[cut : cut + need].reshape(-1, spec.raw_length), start
                cut += need
                at = cut - carried + skip  # where the next block starts, in this pack's coordinates
                d = int(np.searchsorted(starts, at, side="right")) - 1
                start = (si, first + d, int(at - starts[d]))
            pieces, total = [joined[cut:]], len(joined) - cut
        offset = 0
    n = total // spec.raw_length  # the epoch's last partial chunk is dropped
    if n:
        yield np.concatenate(pieces)[: n * spec.raw_length].reshape(n, spec.raw_length), start


def examples(spec: StreamSpec, stream: int, position: dict, damaged: dict[int, int]) -> Iterator[tuple]:
    """(inputs, targets, position after this example) forever, epoch after epoch.

    A block's chunks are permuted and corrupted in one vectorised call; resuming mid-block redoes that call
    (bounded by the block) and skips the chunks already emitted.

    An epoch whose shards give not one chunk (all damaged or empty: with as many streams as shards, one damaged
    shard does it) is passed over: the stream goes on with its next epoch, whose shards are another draw. The
    rule reads nothing but this stream's own shards, so example j of the stream stays a function of the seed
    (and the shards' bytes) alone, whichever rank or worker computes it and whenever: the global order and
    every layout's batches are unchanged, and the position (its epoch) carries the skip into a checkpoint.
    Only when the epochs passed over in a row have tried every shard of the run is there nothing to read.
    """
    epoch, shard, doc, offset, first_block, nxt = (position[k] for k in POSITION_KEYS)
    unreadable: set[str] = set()  # the shards of the epochs passed over in a row
    while True:
        shards = epoch_shards(spec, epoch, stream)
        produced = first_block > 0
        for block, (chunks, start) in enumerate(blocks(spec, shards, shard, doc, offset, damaged), first_block):
            produced = True
            rng = np.random.default_rng([spec.seed, epoch, stream, block])
            inputs, targets = span_corrupt(
                chunks[rng.permutation(len(chunks))], rng, vocab_size=spec.num_ids, eos_id=spec.eos_id,
                noise_density=spec.noise_density, mean_noise_span_length=spec.mean_noise_span_length)
            for j in range(nxt, len(chunks)):
                yield inputs[j], targets[j], dict(zip(POSITION_KEYS, (epoch, *start, block, j + 1)))
            nxt = 0
        unreadable = set() if produced else unreadable | set(shards)
        if len(unreadable) == len(spec.shards):
            names = ", ".join(redact(s) for s in spec.shards[:3]) + (", ..." if len(spec.shards) > 3 else "")
            raise UsageError(f"no readable data in any of the {len(spec.shards)} shards ({names}): damaged, empty, "
                             f"only empty documents, or less than one chunk of {spec.raw_length} tokens each; "
                             f"check {spec.label}")
        if not produced:
            names = ", ".join(redact(s) for s in shards[:3]) + (", ..." if len(shards) > 3 else "")
            log.info("data stream %d of %s: nothing readable in its epoch %d (%s); it goes on with its epoch %d",
                     stream, spec.label, epoch, names, epoch + 1)
        epoch, shard, doc, offset, first_block, nxt = epoch + 1, 0, 0, 0, 0, 0


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
