"""`python -m tokenizer.train --input 'GLOB' --output DIR --vocab-size N`: a T5-style SentencePiece model.

Trains a unigram model on text streamed from input files (C4 json.gz, other JSON lines, plain text, Parquet:
pretrain/data/documents.py): files are visited in a seeded random order and whole documents are taken until
`--max-bytes` of text is collected (C4 files are already shuffled, so this is a random sample with memory
bounded by the budget). Ids as T5: pad 0, eos 1, unk 2, no BOS; the 100 sentinels are added on top by
`tokenizer.spm.Tokenizer`, as T5 and HuggingFace do. Writes DIR/spiece.model, which names no path of this
machine (sentencepiece would record its output path in it: exports ship the file).
"""
from __future__ import annotations

import argparse
import io
import logging
import os
import random
import re
from collections import Counter
from pathlib import Path
from typing import Iterator

import sentencepiece as spm
from tqdm import tqdm

from pretrain.core.config import UsageError
from pretrain.data.documents import InputLayout, add_layout_arguments, expand_glob, layout_from_args, read_documents
from tokenizer.spm import EOS_ID, PAD_ID, SPIECE, UNK_ID, Tokenizer

log = logging.getLogger(__name__)

MAX_SENTENCE_BYTES = 4192  # sentencepiece's own limit; longer lines are cut, not dropped
CHARACTER_COVERAGE = 0.9999  # T5's value for English C4: rare characters fall back to unk
MIN_CHARACTER_COVERAGE = 0.98  # sentencepiece refuses less
# sentencepiece's two ways of saying the vocabulary does not fit the sample (trainer_interface.cc, unigram)
_TOO_FEW_PIECES = re.compile(r"Vocabulary size is smaller than required_chars\. (\d+) vs (\d+)")
_TOO_MANY_PIECES = re.compile(r"Vocabulary size too high \((\d+)\)\. Please set it to a value <= (\d+)")


def sample_lines(files: list[str], max_bytes: int, seed: int, bad: Counter, layout: InputLayout) -> Iterator[str]:
    """Lines of documents from `files` (in a seeded order) until `max_bytes` of text; bad input counted."""
    order = list(files)
    random.Random(seed).shuffle(order)
    taken = 0
    # the bar counts input files read (their bytes on disk), the text taken beside it: a corpus below --max-bytes
    # ends at 100%, one above it where the sample is full (a terminal only: no `\r` bars in log files)
    sizes = [os.path.getsize(p) for p in order]
    with tqdm(total=sum(sizes), unit="B", unit_scale=True, desc="tokenizer sample", disable=None) as bar:
        for path, size in zip(order, sizes):
            for doc in read_documents(path, bad, layout):
                for line in doc.text.splitlines():
                    line = line.strip().encode("utf-8")[:MAX_SENTENCE_BYTES].decode("utf-8", "ignore")
                    if line:
                        taken += len(line.encode("utf-8"))
                        yield line
                if taken >= max_bytes:
                    bar.total = bar.n + size  # the sample is full: the bar ends here
                    break
            bar.update(size)
            bar.set_postfix_str(f"text {taken / 1e6:.1f} of at most {max_bytes / 1e6:g} MB", refresh=False)
            if taken >= max_bytes:
                return


def advice(error: str, character_coverage: float) -> str:
    """One line for a sentencepiece training failure: what happened, in our flags, and the one thing to change."""
    first = error.strip().splitlines()[0] if error.strip() else "no message"
    if m := _TOO_FEW_PIECES.search(error):
        vocab, needed = m.groups()
        lower = (f", or lower --character-coverage (down to {MIN_CHARACTER_COVERAGE}; the rarer characters then "
                 "become unk)" if character_coverage > MIN_CHARACTER_COVERAGE else "")
        return (f"the characters that --character-coverage {character_coverage} keeps need {needed} pieces (with pad, "
                f"eos, unk), more than --vocab-size {vocab}: raise --vocab-size to {needed} or more{lower}")
    if m := _TOO_MANY_PIECES.search(error):
        vocab, most = m.groups()
        return (f"the sample yields at most {most} pieces, fewer than --vocab-size {vocab}: lower --vocab-size to "
                f"{most} or less, or train on more text (more input, or a larger --max-bytes if the sample stopped "
                "at it)")
    return f"sentencepiece failed: {first}"


def train(
    files: list[str], output: Path, vocab_size: int = 32000, max_bytes: int = 200_000_000, seed: int = 0,
    num_threads: int = 2, character_coverage: float = CHARACTER_COVERAGE, layout: InputLayout = InputLayout(),
) -> Path:
    """Train and write output/spiece.model; returns its path. sentencepiece's own failures are RuntimeErrors
    (`advice` words them); the reader's (a UsageError naming a file) pass through its iterator as they are."""
    bad: Counter = Counter()
    probe = sample_lines(files, max_bytes, seed, bad, layout)
    found = next(probe, None)
    probe.close()
    if found is None:  # sentencepiece would fail inside with `INTERNAL ... [!sentences_.empty()]`
        skipped = ", ".join(f"{k}={v}" for k, v in bad.items() if v) or "every line empty"
        raise UsageError(f"no text to train on in {len(files)} input file(s) ({files[0]}, ...): {skipped}; check "
                         "--input, --format and --text-field")
    output.mkdir(parents=True, exist_ok=True)
    bad.clear()
    spm.set_random_generator_seed(seed)
    model = io.BytesIO()
    spm.SentencePieceTrainer.train(
        sentence_iterator=sample_lines(files, max_bytes, seed, bad, layout),
        model_writer=model,  # not model_prefix=DIR/spiece, which the model file would hold as trainer_spec.model_prefix
        model_type="unigram",
        vocab_size=vocab_size,
        character_coverage=character_coverage,
        pad_id=PAD_ID, eos_id=EOS_ID, unk_id=UNK_ID, bos_id=-1,
        input_sentence_size=0,  # the byte budget above already bounds the sample
        max_sentence_length=MAX_SENTENCE_BYTES,
        num_threads=num_threads,
        minloglevel=2,
    )
    (output / SPIECE).write_bytes(model.getvalue())
    if sum(bad.values()):
        log.warning("skipped bad input: %s", dict(bad))
    return output / SPIECE


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m tokenizer.train", description=__doc__.splitlines()[0])
    p.add_argument("--input", required=True, help="quoted glob of input files (C4 json.gz, .jsonl, .txt, .parquet)")
    p.add_argument("--output", required=True, type=Path, help="folder for spiece.model")
    p.add_argument("--vocab-size", type=int, default=32000, help="pieces, without the 100 sentinels")
    p.add_argument("--character-coverage", type=float, default=CHARACTER_COVERAGE,
                   help=f"share of the sample's characters the vocabulary keeps as pieces, {MIN_CHARACTER_COVERAGE}-1; "
                        f"the rarest others become unk (default {CHARACTER_COVERAGE}, T5's for English; 0.9995 is "
                        "usual for CJK)")
    p.add_argument("--max-bytes", type=int, default=200_000_000, help="text sample budget in bytes")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=2)
    add_layout_arguments(p)
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    if args.vocab_size < 4:
        p.error(f"--vocab-size must be at least 4, got {args.vocab_size}")
    if args.max_bytes < 1:
        p.error(f"--max-bytes must be at least 1, got {args.max_bytes}")
    if not MIN_CHARACTER_COVERAGE <= args.character_coverage <= 1:
        p.error(f"--character-coverage must be in [{MIN_CHARACTER_COVERAGE}, 1], got {args.character_coverage}")
    try:
        layout = layout_from_args(args)
        files = expand_glob(args.input, layout)
        model = train(files, args.output, args.vocab_size, args.max_bytes, args.seed, args.threads,
                      args.character_coverage, layout)
    except UsageError as e:
        p.error(str(e))
    except RuntimeError as e:  # sentencepiece's way of reporting a sample that does not fit the vocabulary
        p.error(advice(str(e), args.character_coverage))
    tok = Tokenizer(model)
    print(f"{model}: {tok.num_pieces} pieces + 100 sentinels = {tok.num_ids} ids (model.vocab_size 0 reads them; "
          "the model pads its rows per TP)")


if __name__ == "__main__":
    main()
