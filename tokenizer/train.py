"""`python -m tokenizer.train --input 'GLOB' --output DIR --vocab-size N`: a T5-style SentencePiece model.

Trains a unigram model on text streamed from C4 json.gz files: files are visited in a seeded random order
and whole documents are taken until `--max-bytes` of text is collected (C4 files are already shuffled, so
this is a random sample with memory bounded by the budget). Ids as T5: pad 0, eos 1, unk 2, no BOS; the
100 sentinels are added on top by `tokenizer.spm.Tokenizer`, as T5 and HuggingFace do. Writes
DIR/spiece.model (and spiece.vocab).
"""
from __future__ import annotations

import argparse
import logging
import random
from collections import Counter
from pathlib import Path
from typing import Iterator

import sentencepiece as spm
from tqdm import tqdm

from pretrain.data.c4 import expand_glob, read_documents
from tokenizer.spm import EOS_ID, PAD_ID, UNK_ID, Tokenizer

log = logging.getLogger(__name__)

MAX_SENTENCE_BYTES = 4192  # sentencepiece's own limit; longer lines are cut, not dropped


def sample_lines(files: list[str], max_bytes: int, seed: int, bad: Counter) -> Iterator[str]:
    """Lines of documents from `files` (in a seeded order) until `max_bytes` of text; bad input counted."""
    order = list(files)
    random.Random(seed).shuffle(order)
    taken = 0
    with tqdm(total=max_bytes, unit="B", unit_scale=True, desc="tokenizer sample") as bar:
        for path in order:
            for doc in read_documents(path, bad):
                for line in doc["text"].splitlines():
                    line = line.strip().encode("utf-8")[:MAX_SENTENCE_BYTES].decode("utf-8", "ignore")
                    if line:
                        taken += len(line.encode("utf-8"))
                        bar.update(len(line.encode("utf-8")))
                        yield line
                if taken >= max_bytes:
                    return


def train(
    files: list[str], output: Path, vocab_size: int = 32000, max_bytes: int = 200_000_000, seed: int = 0,
    num_threads: int = 2,
) -> Path:
    """Train and write output/spiece.model; returns its path."""
    output.mkdir(parents=True, exist_ok=True)
    bad: Counter = Counter()
    spm.set_random_generator_seed(seed)
    spm.SentencePieceTrainer.train(
        sentence_iterator=sample_lines(files, max_bytes, seed, bad),
        model_prefix=str(output / "spiece"),
        model_type="unigram",
        vocab_size=vocab_size,
        character_coverage=0.9999,  # T5's value for English C4: rare characters fall back to unk
        pad_id=PAD_ID, eos_id=EOS_ID, unk_id=UNK_ID, bos_id=-1,
        input_sentence_size=0,  # the byte budget above already bounds the sample
        max_sentence_length=MAX_SENTENCE_BYTES,
        num_threads=num_threads,
        minloglevel=2,
    )
    if sum(bad.values()):
        log.warning("skipped bad input: %s", dict(bad))
    return output / "spiece.model"


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m tokenizer.train", description=__doc__.splitlines()[0])
    p.add_argument("--input", required=True, help="quoted glob of C4 json.gz files")
    p.add_argument("--output", required=True, type=Path, help="folder for spiece.model")
    p.add_argument("--vocab-size", type=int, default=32000, help="pieces, without the 100 sentinels")
    p.add_argument("--max-bytes", type=int, default=200_000_000, help="text sample budget in bytes")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=2)
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    if args.vocab_size < 4:
        p.error(f"--vocab-size must be at least 4, got {args.vocab_size}")
    if args.max_bytes < 1:
        p.error(f"--max-bytes must be at least 1, got {args.max_bytes}")
    try:
        files = expand_glob(args.input)
    except ValueError as e:
        p.error(str(e))
    try:
        model = train(files, args.output, args.vocab_size, args.max_bytes, args.seed, args.threads)
    except RuntimeError as e:  # sentencepiece reports a sample too small for the vocabulary this way
        p.error(f"sentencepiece failed: {str(e).splitlines()[0]}; lower --vocab-size or raise --max-bytes")
    tok = Tokenizer(model)
    print(f"{model}: {tok.num_pieces} pieces + 100 sentinels = {tok.num_ids} ids (model.vocab_size 0 reads them; "
          "the model pads its rows per TP)")


if __name__ == "__main__":
    main()
