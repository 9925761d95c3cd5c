"""Progress of long waits (generation over a dev set, export, checkpoint conversion) readable both on a
terminal and in a SLURM log file.

    for batch in progress(batches, total=len(batches), desc="sst2 generate", enabled=rank == 0):
        ...

On a terminal this is a tqdm bar on stderr. Elsewhere (stderr redirected to a log file, as under SLURM) a
redrawn bar would be one endless line of carriage returns, so it logs a plain line instead: at the start,
at most once every `every_s` seconds, and at the end, each with count, rate and ETA
(`sst2 generate:  40%|####      | 4/10 [00:12<00:18, 3.01s/it]`).
"""
from __future__ import annotations

import logging
import sys
import time
from typing import Iterable, Iterator, TypeVar

from tqdm import tqdm

T = TypeVar("T")
log = logging.getLogger(__name__)


def progress(iterable: Iterable[T], total: int | None = None, desc: str = "", enabled: bool = True,
             every_s: float = 30.0) -> Iterator[T]:
    """Yield from `iterable`, showing progress when `enabled` (pass rank 0's flag: other ranks stay quiet)."""
    if not enabled:
        yield from iterable
        return
    if total is None and hasattr(iterable, "__len__"):
        total = len(iterable)  # type: ignore[arg-type]
    if sys.stderr.isatty():
        yield from tqdm(iterable, total=total, desc=desc, file=sys.stderr, mininterval=1.0, dynamic_ncols=True)
        return
    start = last = time.monotonic()
    n = 0
    log.info(tqdm.format_meter(0, total, 0.0, prefix=desc, ascii=True))
    for item in iterable:
        yield item
        n += 1
        now = time.monotonic()
        if now - last >= every_s and n != total:
            last = now
            log.info(tqdm.format_meter(n, total, now - start, prefix=desc, ascii=True))
    log.info(tqdm.format_meter(n, total, time.monotonic() - start, prefix=desc, ascii=True))
