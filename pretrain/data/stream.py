"""One data stream: shards -> documents -> raw chunks -> seeded block shuffle -> span corruption -> batches.

A train loader runs one stream per DataLoader worker ("logical worker"); each stream owns a disjoint slice of
the shards, split by DP rank first and worker second (never by global rank: the TP peers of one DP replica
read identical batches). Everything random is a function of (seed, epoch, DP rank, stream, block),
and a stream's position is six integers, so a restart rebuilds the exact same batches:

    epoch   passes over this stream's shards; shard order is reshuffled from (seed, epoch)
    shard   index into this epoch's shard list of the block being drained
    doc     documents of that shard before the block's first token
    offset  tokens (EOS included) of that document before the block's first token
    block   blocks started in this epoch (a block is `shuffle_buffer` chunks, shuffled as a whole)
    next    chunks of the block already emitted

Resuming re-reads one block (at most `shuffle_buffer` chunks plus the skipped head of one shard); the cost
never grows with the data consumed.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Iterator

import numpy as np
import torch
from torch.utils.data import IterableDataset, get_worker_info

from pretrain.data.shards import decode_tokens, read_samples
from pretrain.data.span_corruption import noise_span_lengths, span_corrupt

log = logging.getLogger(__name__)

POSITION_KEYS = ("epoch", "shard", "doc", "offset", "block", "next")
IGNORE_INDEX = -100  # labels on padding; the loss skips them


def start_position(epoch: int = 0) -> dict:
    return {k: (epoch if k == "epoch" else 0) for k in POSITION_KEYS}


@dataclass(frozen=True)
class StreamSpec:
    """What a stream needs besides its position; plain values so DataLoader workers can pickle it."""

    shards: tuple[str, ...]
    seed: int
    dp_rank: int
    dp_size: int
    num_streams: int  # logical workers per DP rank
    raw_length: int  # tokens per chunk before span corruption
    input_length: int
    target_length: int
    block_chunks: int  # the shuffle buffer, in chunks
    num_ids: int  # tokenizer ids: sentinels count down from num_ids - 1
    eos_id: int
    noise_density: float
    mean_noise_span_length: float
    micro_batch: int
    expected_docs: tuple[int, ...] | None  # documents per shard from index.json: a short read is damage


def epoch_shards(spec: StreamSpec, epoch: int, stream: int) -> list[str]:
    """This stream's shards in epoch `epoch`: a seeded global permutation, split by DP rank, then by stream."""
    order = np.random.default_rng([spec.seed, epoch]).permutation(len(spec.shards))
    mine = order[spec.dp_rank :: spec.dp_size][stream :: spec.num_streams]
    return [spec.shards[i] for i in mine]


def _read_checked(spec: StreamSpec, url: str, damaged: list[int]) -> Iterator[dict]:
    """Samples of one shard; damage (a read error, or fewer documents than the index lists) warns and counts.

    A garbled member header ends a tar stream silently, so the index's document count is what reveals it.
    """
    errors: list[Exception] = []
    n = 0
    for n, sample in enumerate(read_samples(url, errors.append), 1):
        yield sample
    expected = spec.expected_docs[spec.shards.index(url)] if spec.expected_docs else None
    if errors or (expected is not None and n < expected):
        damaged[0] += 1
        why = str(errors[0]).splitlines()[0][:200] if errors else f"it ended after {n} of {expected} documents"
        log.warning("skipping the rest of damaged shard %s: %s", url, why)


def documents(spec: StreamSpec, shards: list[str], shard: int, doc: int,
              damaged: list[int]) -> Iterator[tuple[int, int, np.ndarray]]:
    """(shard index, document index, ids + EOS) from (shard, doc) to the end of the epoch's shard list."""
    for si in range(shard, len(shards)):
        for di, sample in enumerate(_read_checked(spec, shards[si], damaged)):
            if si == shard and di < doc:
                continue  # before the resume point: skipped without decoding
            ids = decode_tokens(sample)
            with_eos = np.empty(len(ids) + 1, dtype=np.int32)
            with_eos[:-1], with_eos[-1] = ids, spec.eos_id  # documents are joined with EOS
            yield si, di, with_eos


def blocks(spec: StreamSpec, shards: list[str], shard: int, doc: int, offset: int,
           damaged: list[int]) -> Iterator[tuple[np.ndarray, tuple[int, int, int]]]:
    """(chunks [n, raw_length], where the block starts) until the epoch ends; shards stay open between blocks."""
    need = spec.block_chunks * spec.raw_length
    pieces: list[np.ndarray] = []
    total, start = 0, (shard, doc, offset)
    for si, di, with_eos in documents(spec, shards, shard, doc, damaged):
        piece = with_eos[offset:] if (si, di) == (shard, doc) else with_eos
        pieces.append(piece)
        total += len(piece)
        while total >= need:
            flat = np.concatenate(pieces)
            yield flat[:need].reshape(-1, spec.raw_length), start
            pieces = [flat[need:]]  # a suffix of the current document: the next block starts inside it
            total, start = len(pieces[0]), (si, di, len(with_eos) - len(pieces[0]))
    n = total // spec.raw_length  # the epoch's last partial chunk is dropped
    if n:
        yield np.concatenate(pieces)[: n * spec.raw_length].reshape(n, spec.raw_length), start


def examples(spec: StreamSpec, stream: int, position: dict, damaged: list[int]) -> Iterator[tuple]:
    """(inputs, targets, position after this example) forever, epoch after epoch."""
    epoch, shard, doc, offset, first_block, nxt = (position[k] for k in POSITION_KEYS)
    while True:
        shards = epoch_shards(spec, epoch, stream)
        produced = first_block > 0
        for block, (chunks, start) in enumerate(blocks(spec, shards, shard, doc, offset, damaged), first_block):
            produced = True
            rng = np.random.default_rng([spec.seed, epoch, spec.dp_rank, stream, block])
            order = rng.permutation(len(chunks))
            for _ in range(nxt):  # resuming mid-block: replay the skipped chunks' draws (bounded by the block)
                noise_span_lengths(spec.raw_length, rng, spec.noise_density, spec.mean_noise_span_length)
            for j in range(nxt, len(chunks)):
                inputs, targets = span_corrupt(
                    chunks[order[j]], rng, vocab_size=spec.num_ids, eos_id=spec.eos_id,
                    noise_density=spec.noise_density, mean_noise_span_length=spec.mean_noise_span_length)
                yield inputs, targets, dict(zip(POSITION_KEYS, (epoch, *start, block, j + 1)))
            nxt = 0
        if not produced:
            raise RuntimeError(f"DP rank {spec.dp_rank} worker {stream} has no readable data in {shards}")
        epoch, shard, doc, offset, first_block, nxt = epoch + 1, 0, 0, 0, 0, 0


def collate(pairs: list[tuple[np.ndarray, np.ndarray]], input_length: int, target_length: int) -> dict:
    """Fixed-shape batch tensors; decoder inputs are the targets shifted right, starting with pad 0."""
    b = len(pairs)
    input_ids = np.zeros((b, input_length), np.int64)
    labels = np.full((b, target_length), IGNORE_INDEX, np.int64)
    for i, (inputs, targets) in enumerate(pairs):
        input_ids[i, : len(inputs)] = inputs
        labels[i, : len(targets)] = targets
    decoder_input_ids = np.zeros_like(labels)
    decoder_input_ids[:, 1:] = np.maximum(labels[:, :-1], 0)  # padding (-100) becomes pad id 0
    return {
        "input_ids": torch.from_numpy(input_ids),  # [b, input_length]
        "attention_mask": torch.from_numpy((input_ids != 0).astype(np.int64)),
        "decoder_input_ids": torch.from_numpy(decoder_input_ids),  # [b, target_length]
        "labels": torch.from_numpy(labels),
        "decoder_attention_mask": torch.from_numpy((labels != IGNORE_INDEX).astype(np.int64)),
    }


def batches(spec: StreamSpec, stream: int, position: dict) -> Iterator[dict]:
    """Batches of one stream; each carries the stream id, its position after the batch and a damage count."""
    damaged = [0]
    pairs: list[tuple[np.ndarray, np.ndarray]] = []
    for inputs, targets, after in examples(spec, stream, position, damaged):
        pairs.append((inputs, targets))
        if len(pairs) == spec.micro_batch:
            batch = collate(pairs, spec.input_length, spec.target_length)
            batch.update(_stream=stream, _position=after, _damaged=damaged[0])
            yield batch
            pairs = []


class TrainStreams(IterableDataset):
    """The streams of one DP rank; DataLoader worker w runs logical stream (w + rotation) % num_streams.

    The rotation lets a resumed loader continue the round-robin over workers where the last run stopped.
    """

    def __init__(self, spec: StreamSpec, positions: list[dict], rotation: int):
        self.spec, self.positions, self.rotation = spec, positions, rotation

    def __iter__(self) -> Iterator[dict]:
        info = get_worker_info()
        worker = info.id if info is not None else 0
        stream = (worker + self.rotation) % self.spec.num_streams
        return batches(self.spec, stream, self.positions[stream])
