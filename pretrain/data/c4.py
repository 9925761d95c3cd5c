"""C4's on-disk layout: gzip JSON lines with `text`, `timestamp`, `url`, named like allenai/c4.

Reading never stops on bad input and never passes it silently: each kind of damage is counted in a
`Counter` the caller reports (invalid JSON, non-UTF-8 bytes, missing or empty text, truncated gzip).
"""
from __future__ import annotations

import glob as globlib
import gzip
import json
import logging
import zlib
from collections import Counter
from pathlib import Path
from typing import Iterable, Iterator

from pretrain.config import UsageError

log = logging.getLogger(__name__)

BAD_KINDS = ("invalid_json", "non_utf8", "missing_text", "truncated_gzip")


def train_name(index: int, count: int) -> str:
    return f"c4-train.{index:05d}-of-{count:05d}.json.gz"


def validation_name(index: int, count: int) -> str:
    return f"c4-validation.{index:05d}-of-{count:05d}.json.gz"


def expand_glob(pattern: str) -> list[str]:
    """Sorted files matching `pattern`; matching nothing is a one-line ValueError."""
    files = sorted(globlib.glob(pattern, recursive=True))
    if not files:
        raise UsageError(f"no files match {pattern!r}; pass a glob such as 'DIR/c4-train.*.json.gz' (quoted)")
    return files


def read_documents(path: str | Path, bad: Counter) -> Iterator[dict]:
    """Documents of one C4 file in order; damaged lines (and a truncated tail) are skipped and counted in `bad`."""
    started = False
    try:
        with gzip.open(path, "rb") as f:
            for line in f:
                started = True
                if not line.strip():
                    continue
                try:
                    doc = json.loads(line.decode("utf-8"))
                except UnicodeDecodeError:
                    bad["non_utf8"] += 1
                    continue
                except json.JSONDecodeError:
                    bad["invalid_json"] += 1
                    continue
                text = doc.get("text") if isinstance(doc, dict) else None
                if not isinstance(text, str) or not text.strip():
                    bad["missing_text"] += 1
                    continue
                yield doc
    except (EOFError, gzip.BadGzipFile, zlib.error, OSError) as e:
        if not started:  # not damage partway through: the file is not gzip (or not readable) at all
            raise UsageError(f"{path} is not a gzip file of JSON lines ({e}); C4 files are *.json.gz") from None
        # the documents before the damage were yielded; the rest of the file is unreadable
        bad["truncated_gzip"] += 1
        log.warning("%s: stopped reading at damaged gzip data (%s)", path, e)


def write_documents(path: Path, docs: Iterable[dict]) -> int:
    """Write C4 JSON lines to `path` atomically (temporary name, then rename); returns the count."""
    tmp = path.with_name(path.name + ".tmp")
    n = 0
    with gzip.open(tmp, "wt", encoding="utf-8") as f:
        for doc in docs:
            f.write(json.dumps({"text": doc["text"], "timestamp": doc["timestamp"], "url": doc["url"]}) + "\n")
            n += 1
    tmp.replace(path)
    return n
