"""The span probe's files: a sentence-pair task whose label is decided only by matching tokens across the two
sentences (the task: pretrain.tasks.pair). A probe for the study (does an attention variant let the encoder compare sentence 2 with sentence 1?), not a
benchmark: its text and labels are made here from real text, in GLUE's TSV layout.

Each example is a real sentence (sentence1: its first `max_words` words) and a `span` of `span_words`
consecutive words (sentence2). Label 1 ("yes"): the span was cut from sentence1. Label 0 ("no"): it was cut
from another sentence of the same split and occurs nowhere in sentence1. Both kinds of span are cut the same way
from the same kind of text, so nothing in either sentence alone tells them apart: only looking sentence2's
tokens up in sentence1 does. Every sentence1 gives as many positives as negatives (balanced labels).

The text is the held-out documents the study already has: the c4-validation file(s) of make demo's data
chain, which pretraining never trains on (it only scores its evaluation loss on them). Documents, not
sentences, are dealt to test, dev and train, so no sentence1 of dev or test was seen in fine-tuning. The
output is a function of the input files and `seed`. With `tokenizer`, sentence1 loses its last words until
the input with sentence2 left empty takes at most max_input_length - 16 tokens (room for the span), and a pair
whose whole input would still be cut at max_input_length tokens is dropped (both examples): the model always
sees the whole span.

    python -m pretrain.tasks.pair_data --input 'DATA/text/c4-validation.*.json.gz' --output DATA/pair \\
        [--tokenizer spiece.model --max-input-length 64] [--seed 0]

Files: train.tsv and dev.tsv (`sentence1\\tsentence2\\tlabel`), test.tsv (`index\\tsentence1\\tsentence2`),
read by the task `pair` (configs/finetune/pair.yaml).
"""
from __future__ import annotations

import argparse
import random
import re
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

from pretrain.core.config import UsageError
from pretrain.tasks.pair import pair_input

_SENTENCE_END = re.compile(r"(?<=[.!?])\s+")
SPAN_ROOM = 16  # tokens kept free for sentence2 when sentence1 is cut to the tokenizer's budget


@dataclass(frozen=True)
class PairSpec:
    seed: int = 0
    dev: int = 400  # examples (half positive)
    test: int = 400
    train_pairs: int = 4  # (positive, negative) pairs per training sentence, each with its own spans
    span_words: int = 4
    min_words: int = 8  # shorter sentences are skipped
    max_words: int = 16  # sentence1: a sentence's first max_words words
    max_input_length: int = 64  # tokens including EOS (with a tokenizer)


def sentences(text: str, spec: PairSpec) -> list[tuple[str, ...]]:
    """The document's sentences of at least min_words words, each cut to its first max_words words."""
    out = []
    for sentence in _SENTENCE_END.split(text):
        words = tuple(sentence.split())
        if len(words) >= spec.min_words:
            out.append(words[: spec.max_words])
    return out


def contains(words: tuple[str, ...], span: tuple[str, ...]) -> bool:
    n = len(span)
    return any(words[i : i + n] == span for i in range(len(words) - n + 1))


def _spans(words: tuple[str, ...], k: int, count: int, rng: random.Random) -> list[tuple[str, ...]]:
    starts = rng.sample(range(len(words) - k + 1), min(count, len(words) - k + 1))
    return [words[s : s + k] for s in starts]


def no_limit(text: str) -> int:
    return 0


def fit_sentence(words: tuple[str, ...], length, spec: PairSpec) -> tuple[str, ...]:
    """`words` without the last ones until the input with an empty sentence2 leaves SPAN_ROOM tokens free."""
    while len(words) > spec.min_words and length(pair_input(" ".join(words), "")) + 1 > spec.max_input_length - SPAN_ROOM:
        words = words[:-1]
    return words


def make_pairs(split: list[tuple[str, ...]], pairs_per_sentence: int, spec: PairSpec, rng: random.Random,
               length) -> list[tuple[str, str, int]]:
    """(sentence1, sentence2, label) rows of one split: per sentence, positives from its own spans and as many
    negatives from other sentences of the split that do not occur in it. `length(text)`: its tokens."""
    rows = []
    fits = lambda a, b: length(pair_input(a, b)) + 1 <= spec.max_input_length  # + EOS
    split = [fit_sentence(words, length, spec) for words in split]  # both kinds of span from the same cut sentences
    for i, words in enumerate(split):
        for span in _spans(words, spec.span_words, pairs_per_sentence, rng):
            for _ in range(100):  # a span of another sentence that is not in this one (almost always the first)
                j = rng.randrange(len(split))
                other = _spans(split[j], spec.span_words, 1, rng)[0]
                if j != i and not contains(words, other):
                    break
            else:
                continue
            a, pos, neg = " ".join(words), " ".join(span), " ".join(other)
            if fits(a, pos) and fits(a, neg):
                rows += [(a, pos, 1), (a, neg, 0)]
    return rows


def build_pairs(documents: list[str], spec: PairSpec, length=no_limit) -> dict[str, list[tuple[str, str, int]]]:
    """{"train", "dev", "test"} rows. Documents are shuffled with the seed and dealt to test, then dev, until each
    has enough sentences; the rest is train. Each split is shuffled."""
    rng = random.Random(spec.seed)
    docs = [sentences(d, spec) for d in documents]
    docs = [d for d in docs if d]
    rng.shuffle(docs)
    splits: dict[str, list] = {"test": [], "dev": [], "train": []}
    wanted = {"test": spec.test // 2, "dev": spec.dev // 2}
    for doc in docs:
        name = next((s for s in ("test", "dev") if len(splits[s]) < wanted[s]), "train")
        splits[name] += doc
    rows = {}
    for name, split in splits.items():
        if len(split) < 2:
            raise UsageError(f"only {sum(len(d) for d in docs)} sentences of {spec.min_words}+ words in the input: "
                             f"too few for --dev {spec.dev} and --test {spec.test} plus a training split")
        per = spec.train_pairs if name == "train" else 1
        made = make_pairs(split, per, spec, rng, length)
        rows[name] = made if name == "train" else made[: wanted[name] * 2]
        rng.shuffle(rows[name])
    return rows


def write_pairs(rows: dict[str, list[tuple[str, str, int]]], out: Path) -> None:
    """GLUE's TSV layout, written to a temporary folder, then renamed."""
    tmp = out.with_name(out.name + ".tmp")
    tmp.mkdir(parents=True, exist_ok=True)
    for name in ("train", "dev"):
        lines = ["sentence1\tsentence2\tlabel"] + [f"{a}\t{b}\t{y}" for a, b, y in rows[name]]
        (tmp / f"{name}.tsv").write_text("\n".join(lines) + "\n", encoding="utf-8")
    lines = ["index\tsentence1\tsentence2"] + [f"{i}\t{a}\t{b}" for i, (a, b, _) in enumerate(rows["test"])]
    (tmp / "test.tsv").write_text("\n".join(lines) + "\n", encoding="utf-8")
    tmp.replace(out)


def token_length(tokenizer: str):
    """length(text): its tokens under the spiece.model `tokenizer` (EOS not counted)."""
    from tokenizer.spm import Tokenizer

    tok = Tokenizer(tokenizer)
    return lambda text: len(tok.encode_batch([text])[0])


def build_pair_task(inputs: list[str], out: str | Path, spec: PairSpec = PairSpec(), tokenizer: str = "") -> Path:
    """The probe's files under `out` from the documents of `inputs` (reused when already there); returns `out`."""
    from pretrain.data.documents import read_documents

    out = Path(out)
    if all((out / f).is_file() for f in ("train.tsv", "dev.tsv", "test.tsv")):
        return out
    if out.exists():
        raise UsageError(f"{out} exists but lacks train.tsv/dev.tsv/test.tsv; remove it or choose another --output")
    bad: Counter = Counter()
    documents = [doc.text for path in inputs for doc in read_documents(path, bad)]
    write_pairs(build_pairs(documents, spec, token_length(tokenizer) if tokenizer else no_limit), out)
    return out


def main(argv: list[str] | None = None) -> None:
    from pretrain.data.documents import expand_glob

    parser = argparse.ArgumentParser(prog="python -m pretrain.tasks.pair_data",
                                     description=" ".join(__doc__.split("\n\n")[0].split()))
    parser.add_argument("--input", required=True, help="glob of held-out documents (c4-validation.*.json.gz)")
    parser.add_argument("--output", required=True, help="folder to write train.tsv, dev.tsv, test.tsv into")
    parser.add_argument("--tokenizer", default="", help="spiece.model: drop pairs longer than --max-input-length")
    parser.add_argument("--max-input-length", type=int, default=PairSpec.max_input_length)
    parser.add_argument("--dev", type=int, default=PairSpec.dev, help="dev examples")
    parser.add_argument("--test", type=int, default=PairSpec.test, help="test examples")
    parser.add_argument("--seed", type=int, default=0, help="seed of the document split, spans and negatives")
    args = parser.parse_args(argv)
    try:
        if min(args.dev, args.test) < 2:
            raise UsageError(f"--dev ({args.dev}) and --test ({args.test}) must each be at least 2")
        spec = PairSpec(seed=args.seed, dev=args.dev, test=args.test, max_input_length=args.max_input_length)
        out = build_pair_task(expand_glob(args.input), args.output, spec, args.tokenizer)
    except (ValueError, RuntimeError) as e:
        parser.exit(2, f"{parser.prog}: error: {e}\n")
    counts = {f: len((out / f).read_text().splitlines()) - 1 for f in ("train.tsv", "dev.tsv", "test.tsv")}
    print(out, " ".join(f"{f} {n}" for f, n in counts.items()))


if __name__ == "__main__":
    main()
