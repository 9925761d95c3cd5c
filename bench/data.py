"""`python -m bench.data`: data pipeline throughput on one core, against sentencepiece and a per-example collator.

Measures, on the fetched real text (pretrain.data.fetch) with a tokenizer trained on it:
- the end-to-end train loader (shards -> documents -> chunks -> span corruption -> batch tensors), in the
  main process (workers=0), as tokens of encoder input per second;
- (a) sentencepiece's own batched encoding speed on the same text (one thread);
- (b) a per-example span-corruption collator in the style of HuggingFace's `DataCollatorForT5MLM` (what
  nanoT5 uses), written here as the baseline, on the same chunks; and our corruption (one vectorised call per
  micro batch; the loader makes one per shuffle block) + collation on them;
- prepare throughput: MB of C4 json.gz (and of uncompressed JSON) per second for one process;
- corpus mixtures (`data.sources`): the loader over two sources (0.7 and 0.3) against one source, the same shards
  and streams, in the same run; the realised shares after 1k, 10k and 100k examples; host
  memory per rank at DP 1 and DP 8 for 1 and 16 sources over full C4's shard list (1,024 empty files and an index.json:
  what building the loader holds), and what each live stream holds once reading (measured on the shards here).
Rates are per second of CPU time (one core). Targets: loader >= 1M tokens/s per core and >= 3x the baseline;
mixture >= 0.9x one source.
"""
from __future__ import annotations

import argparse
import dataclasses
import gzip
import json
import os
import pickle
import tempfile
import time
import tracemalloc
from collections import Counter
from pathlib import Path

import numpy as np
from webdataset import TarWriter

from pretrain.core.config import DataConfig, SourceConfig
from pretrain.data.documents import read_documents
from pretrain.data.fetch import default_cache, fetch
from pretrain.data.loader import build_train_loader
from pretrain.data.prepare import prepare_file
from pretrain.data.shards import FORMAT_VERSION, PACK_TOKENS, encode_pack, shard_name, token_suffix
from pretrain.data.sources import Schedule
from pretrain.data.span_corruption import input_and_target_lengths, span_corrupt
from pretrain.data.stream import collate, examples, start_position
from tokenizer.spm import Tokenizer
from tokenizer.train import train


class PerExampleT5Collator:
    """The baseline: HF `DataCollatorForT5MLM` logic (global numpy RNG, Python per-example loops)."""

    def __init__(self, vocab_size: int, eos_id: int, noise_density=0.15, mean_noise_span_length=3.0):
        self.vocab_size, self.eos_id = vocab_size, eos_id
        self.noise_density, self.mean_noise_span_length = noise_density, mean_noise_span_length

    def random_spans_noise_mask(self, length: int) -> np.ndarray:
        num_noise_tokens = int(np.round(length * self.noise_density))
        num_noise_tokens = min(max(num_noise_tokens, 1), length - 1)
        num_noise_spans = int(np.round(min(num_noise_tokens, length) / self.mean_noise_span_length))
        num_noise_spans = max(num_noise_spans, 1)
        num_nonnoise_tokens = length - num_noise_tokens

        def _random_segmentation(num_items, num_segments):
            mask_indices = np.arange(num_items - 1) < (num_segments - 1)
            np.random.shuffle(mask_indices)
            first_in_segment = np.pad(mask_indices, [[1, 0]])
            segment_id = np.cumsum(first_in_segment)
            _, segment_length = np.unique(segment_id, return_counts=True)
            return segment_length

        noise_span_lengths = _random_segmentation(num_noise_tokens, num_noise_spans)
        nonnoise_span_lengths = _random_segmentation(num_nonnoise_tokens, num_noise_spans)
        interleaved = np.reshape(np.stack([nonnoise_span_lengths, noise_span_lengths], axis=1), [num_noise_spans * 2])
        span_starts = np.cumsum(interleaved)[:-1]
        span_start_indicator = np.zeros((length,), dtype=np.int8)
        span_start_indicator[span_starts] = True
        span_num = np.cumsum(span_start_indicator)
        return np.equal(span_num % 2, 1)[:length]

    def create_sentinel_ids(self, mask_indices: np.ndarray) -> np.ndarray:
        start_indices = mask_indices - np.roll(mask_indices, 1, axis=-1) * mask_indices
        start_indices[:, 0] = mask_indices[:, 0]
        sentinel_ids = np.where(start_indices != 0, np.cumsum(start_indices, axis=-1), start_indices)
        sentinel_ids = np.where(sentinel_ids != 0, (self.vocab_size - sentinel_ids), 0)
        sentinel_ids -= mask_indices - start_indices
        return sentinel_ids

    def filter_input_ids(self, input_ids: np.ndarray, sentinel_ids: np.ndarray) -> np.ndarray:
        batch_size = input_ids.shape[0]
        input_ids_full = np.where(sentinel_ids != 0, sentinel_ids, input_ids)
        input_ids = input_ids_full[input_ids_full >= 0].reshape((batch_size, -1))
        return np.concatenate([input_ids, np.full((batch_size, 1), self.eos_id, dtype=np.int32)], axis=-1)

    def __call__(self, chunks: np.ndarray) -> dict:
        batch_size, length = chunks.shape
        mask = np.asarray([self.random_spans_noise_mask(length) for _ in range(batch_size)])
        labels_mask = ~mask
        inputs = self.filter_input_ids(chunks, self.create_sentinel_ids(mask.astype(np.int8)))
        labels = self.filter_input_ids(chunks, self.create_sentinel_ids(labels_mask.astype(np.int8)))
        return {"input_ids": inputs, "labels": labels}


def cpu_rate(fn, units_per_call: float, min_seconds: float = 3.0) -> float:
    """Units (tokens, documents, calls) per second of this process's CPU time: everything measured runs on one
    thread, so this is the per-core rate, and other load on a shared machine (which stretches wall time) does not
    skew the ratios."""
    fn()  # warm up
    calls, start = 0, time.process_time()
    while time.process_time() - start < min_seconds:
        fn()
        calls += 1
    return calls * units_per_call / (time.process_time() - start)


def bench_text(vocab_size: int, name: str) -> tuple[list[str], Path, str]:
    """The fetched train files, a fresh work folder and a `vocab_size`-piece tokenizer trained on all their text."""
    cache = default_cache()
    files = [str(f) for f in fetch(cache / "c4", cache) if "train" in f.name]
    work = Path(tempfile.mkdtemp(prefix=f"{name}-"))
    return files, work, str(train(files, work / "tok", vocab_size, max_bytes=10**9, seed=0))


C4_SHARDS = 1024  # allenai/c4 en: c4-train.00000-of-01024 .. 01023
C4_DOCUMENTS = 365_000_000  # documents of C4 en train, for the fake index


def mixture_rates(cfg: DataConfig, shards: Path, micro_batch: int, input_length: int,
                  rounds: int = 5) -> tuple[float, float, float]:
    """CPU-time loader rates (encoder tokens/s, the median of `rounds`) of one source of the shards and of two
    sources of the same shards (at 0.7 and 0.3) over as many streams (half the shards), and the median of the ratios
    of each round's adjacent measurements (on a shared machine the rate of one configuration moves by +-10% from one
    measurement to the next; the same code measured twice in a row varies as much). The same shards in both: each
    stream of either reads as many per epoch, so the epochs' fixed costs (opening shards, the partial last block)
    weigh alike; the bench's shards are ~160 chunks, C4's ~270,000."""
    streams = len(list(shards.glob("*.tar"))) // 2
    one = dataclasses.replace(cfg, streams=streams)
    two = dataclasses.replace(cfg, train="", streams=streams, sources=[
        SourceConfig("c4", str(shards), 0.7), SourceConfig("mine", str(shards), 0.3)])
    rates: dict[str, list[float]] = {"one": [], "two": []}
    for _ in range(rounds):  # alternate, so a change of load hits both alike
        for name, c in [("one", one), ("two", two)]:
            loader = iter(build_train_loader(c, seed=0, dp_rank=0, dp_size=1, micro_batch=micro_batch))
            rates[name].append(cpu_rate(lambda: next(loader), micro_batch * input_length, 2.0))
    ratio = float(np.median([b / a for a, b in zip(rates["one"], rates["two"])]))
    return float(np.median(rates["one"])), float(np.median(rates["two"])), ratio


def realised_shares(weights: tuple[float, ...], seed: int = 0) -> str:
    """Each source's share of the first 1k, 10k and 100k examples, and the largest miss at any prefix up to 100k."""
    schedule = Schedule.of(seed, weights)
    source = schedule.sources(np.arange(100_000))
    worst = max(np.abs(np.cumsum(source == k) - w * np.arange(1, len(source) + 1)).max() for k, w in enumerate(weights))
    shares = "; ".join(f"{n}: " + ", ".join(f"{c / n:.4f}" for c in schedule.counts(0, n))
                       for n in (1000, 10_000, 100_000))
    return (f"weights {', '.join(map(str, weights))} -> {shares}; largest miss at any prefix <= 100k: {worst:.2f} "
            "examples")


def c4_loader_memory(tokenizer: str, num_ids: int, num_sources: int, dp: int) -> dict[str, float]:
    """Bytes the loader of DP rank 0 (of `dp`) holds over C4's 1,024 shard names split into `num_sources` sources:
    after building it (shard lists, indexes read, positions, damage records), its pickled sources (what each worker
    gets) and its state (rank 0's records the mixture's shard lists)."""
    with tempfile.TemporaryDirectory() as tmp:
        for i in range(C4_SHARDS):
            Path(tmp, shard_name(i)).touch()
        docs = C4_DOCUMENTS // C4_SHARDS
        Path(tmp, "index.json").write_text(json.dumps({"format": FORMAT_VERSION, "num_ids": num_ids,
                                                       "tokens": 156e9, "shards": {shard_name(i): {
                                                           "documents": docs, "tokens": 152_000_000}
                                                           for i in range(C4_SHARDS)}}))
        per = C4_SHARDS // num_sources
        sources = [SourceConfig(f"s{k}", f"{tmp}/shard-{{{k * per:06d}..{(k + 1) * per - 1:06d}}}.tar",
                                1 / num_sources) for k in range(num_sources)]
        sources[-1] = dataclasses.replace(sources[-1], weight=1 - sum(s.weight for s in sources[:-1]))
        cfg = DataConfig(sources=sources, tokenizer=tokenizer, input_length=512, workers=0)  # the default lanes
        tracemalloc.start()
        loader = build_train_loader(cfg, seed=0, dp_rank=0, dp_size=dp, micro_batch=32)
        held, peak = tracemalloc.get_traced_memory()
        tracemalloc.stop()
        return {"held": held, "peak": peak, "pickled": len(pickle.dumps(loader.sources)),
                "state0": len(pickle.dumps(loader.state_dict())),
                "lanes": len(loader.lanes), "streams": len(loader.lanes) * num_sources}


def stream_memory(tokenizer: str, num_ids: int, input_length: int) -> tuple[int, int]:
    """(bytes a live stream holds between reads, its peak while cutting a block), traced over two blocks of one
    stream at the default shuffle buffer (1,000 chunks), over a shard of C4-sized packs (PACK_TOKENS) of random
    token ids: the fetched text's shards are a fifth of one pack."""
    rng = np.random.default_rng(0)
    with tempfile.TemporaryDirectory() as tmp:
        with open(Path(tmp, shard_name(0)), "wb") as f, TarWriter(f, encoder=False) as writer:
            for p in range(3):  # ~1.5M tokens: two full blocks of 1,000 x 568 and more
                docs = rng.integers(3, num_ids - 100, size=(PACK_TOKENS // 512, 512)).tolist()
                writer.write(encode_pack(f"pack_{p:06d}", docs, [""] * len(docs), token_suffix(num_ids)))
        cfg = DataConfig(train=tmp, tokenizer=tokenizer, input_length=input_length, workers=0, shuffle_buffer=1000)
        spec = build_train_loader(cfg, seed=0, dp_rank=0, dp_size=1, micro_batch=1).sources.specs[0]
        tracemalloc.start()
        it = examples(spec, 0, start_position(), {})
        for _ in range(2 * spec.block_chunks + 1):
            next(it)
        held, peak = tracemalloc.get_traced_memory()
        tracemalloc.stop()
    return held, peak


def bench_mixtures(work: Path, model: str, num_ids: int, args) -> None:
    cfg = DataConfig(train=str(work / "shards"), tokenizer=model, input_length=args.input_length, workers=0,
                     shuffle_buffer=1000)
    one, two, ratio = mixture_rates(cfg, work / "shards", args.micro_batch, args.input_length)
    print(f"mixture: loader over one source {one / 1e6:.2f}M, over two sources (0.7 / 0.3) {two / 1e6:.2f}M encoder "
          f"tokens/s per core (medians of 5); two / one {ratio:.3f}x, the median of 5 adjacent pairs (target >= 0.9x: "
          f"{'met' if ratio >= 0.9 else 'NOT met'})")
    for weights in [(0.7, 0.3), (0.5, 0.3, 0.2), (0.9, 0.05, 0.05)]:
        print(f"realised shares: {realised_shares(weights)}")
    held, peak = stream_memory(model, num_ids, args.input_length)
    mib = 2**20
    print(f"one live stream (C4-sized packs, shuffle buffer 1000, input {args.input_length}): holds "
          f"{held / mib:.1f} MiB between blocks, {peak / mib:.1f} MiB while it cuts one")
    for n in (1, 16):
        for dp in (1, 8):
            m = c4_loader_memory(model, num_ids, n, dp)
            print(f"C4's 1,024 shards as {n} source{'s' if n > 1 else ''}, the default 64 lanes, DP rank 0 of {dp}: "
                  f"building the loader holds {m['held'] / mib:.2f} MiB (peak {m['peak'] / mib:.2f}), its sources "
                  f"pickle to {m['pickled'] / 1024:.0f} KiB per worker, its state to {m['state0'] / 1024:.0f} KiB; "
                  f"once reading, {m['lanes']} lanes x {n} source{'s' if n > 1 else ''} = {m['streams']} live "
                  f"streams hold ~{m['streams'] * held / mib:.0f} MiB, plus {(peak - held) / mib:.0f} MiB per worker "
                  "while one of its streams cuts a block")


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m bench.data", description=__doc__.splitlines()[0])
    p.add_argument("--input-length", type=int, default=512)
    p.add_argument("--micro-batch", type=int, default=32)
    p.add_argument("--vocab-size", type=int, default=8000, help="pieces of the tokenizer trained for the bench")
    args = p.parse_args(argv)
    files, work, model = bench_text(args.vocab_size, "bench-data")
    tok = Tokenizer(model)
    raw, tgt = input_and_target_lengths(args.input_length)

    # prepare, one process: MB/s of C4 files
    (work / "shards").mkdir()
    start = time.process_time()
    stats = [prepare_file(f, work / "shards" / f"shard-{i:06d}.tar", model) for i, f in enumerate(files)]
    took = time.process_time() - start
    gz_mb = sum(s["bytes"] for s in stats) / 1e6
    json_mb = sum(len(gzip.open(f).read()) for f in files) / 1e6
    print(f"prepare (1 process): {gz_mb / took:.2f} MB/s of json.gz, {json_mb / took:.2f} MB/s of JSON "
          f"({sum(s['tokens'] for s in stats) / took / 1e6:.2f}M tokens/s)")

    # (a) sentencepiece's own batched encoding on the same text
    texts = [d.text for f in files for d in read_documents(f, Counter())]
    n_tokens = sum(s["tokens"] for s in stats)
    spm_rate = cpu_rate(lambda: tok.sp.encode(texts, num_threads=1), n_tokens, 2.0)
    print(f"(a) sentencepiece encode, 1 thread: {spm_rate / 1e6:.2f}M tokens/s")

    # end to end: the train loader in the main process
    cfg = DataConfig(train=str(work / "shards"), tokenizer=model, input_length=args.input_length, workers=0,
                     shuffle_buffer=1000)
    loader = iter(build_train_loader(cfg, seed=0, dp_rank=0, dp_size=1, micro_batch=args.micro_batch))
    loader_rate = cpu_rate(lambda: next(loader), args.micro_batch * args.input_length)
    print(f"loader end to end (shards -> batch tensors, 1 core): {loader_rate / 1e6:.2f}M encoder tokens/s")

    # (b) the per-example baseline vs ours, on the same chunks
    stream = np.concatenate([np.asarray(ids + [1], np.int32) for ids in tok.encode_batch(texts[:2000])])
    chunks = stream[: len(stream) // raw * raw].reshape(-1, raw)[: args.micro_batch * 8]
    baseline = PerExampleT5Collator(tok.num_ids, tok.eos_id)
    pos = [0]

    def next_chunks():
        pos[0] = (pos[0] + args.micro_batch) % len(chunks)
        return chunks[pos[0] : pos[0] + args.micro_batch]

    base_rate = cpu_rate(lambda: baseline(next_chunks()), args.micro_batch * args.input_length)
    rng = np.random.default_rng(0)
    ours_rate = cpu_rate(lambda: collate(list(zip(*span_corrupt(next_chunks(), rng, vocab_size=tok.num_ids, eos_id=1))),
                                      args.input_length, tgt), args.micro_batch * args.input_length)
    print(f"(b) per-example DataCollatorForT5MLM-style baseline: {base_rate / 1e6:.2f}M tokens/s; "
          f"ours (corruption + collation): {ours_rate / 1e6:.2f}M tokens/s")
    bench_mixtures(work, model, tok.num_ids, args)
    print(f"load average {os.getloadavg()[0]:.1f} (rates are per second of this process's CPU time)")
    print(f"ratios: loader / sentencepiece = {loader_rate / spm_rate:.2f}x, loader / baseline = "
          f"{loader_rate / base_rate:.2f}x, corruption / baseline = {ours_rate / base_rate:.2f}x; "
          f"target loader >= 1M tokens/s: {'met' if loader_rate >= 1e6 else 'NOT met'}, >= 3x baseline: "
          f"{'met' if loader_rate >= 3 * base_rate else 'NOT met'}")


if __name__ == "__main__":
    main()
