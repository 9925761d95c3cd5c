"""The integrity of checkpoint folders: the completion marker `complete.json`, checking it, and choosing the
checkpoint a run continues from. `pretrain.runtime.checkpoint` writes checkpoints; this module says which ones to trust.

`step_N/complete.json` is written last (by rank 0, after every rank wrote, closed and fsync'd its files) and
lists every file of the folder with its size and its crc32 (zlib's, streamed in 16 MiB pieces: ~3 GB/s on one
core, docs/training.md). Each rank checksums the files it wrote itself, while they are in its page cache, and
rank 0 gathers the lists. A folder is
- *complete* when the marker is there and every listed file exists with its size (cheap: a `stat` per file;
  pruning and the choice of checkpoints use it);
- *intact* when, besides, every listed file has its checksum. Every rank of a resuming job checks its share of
  the files (balanced by size), so each byte is read once, and all ranks agree on the outcome; export and
  reshard check every file they read.
Markers written before checksums existed (sizes only) are accepted with a warning: their content cannot be
checked.

Which checkpoint a run continues from: the newest complete and intact one in its `checkpoints/`. `latest` is a
hint kept for people and tools (a missing, unreadable or stale one is reported, never followed); a damaged
checkpoint is named with the file and moved aside to `step_N.damaged` (kept for inspection, never pruned or
exported), and the next newest is tried.
"""
from __future__ import annotations

import json
import logging
import os
import re
import shutil
import zlib
from pathlib import Path

import torch.distributed as dist

from pretrain.core.config import UsageError
from pretrain.core.files import write_atomic

log = logging.getLogger(__name__)

COMPLETE = "complete.json"
LATEST = "latest"
DAMAGED_SUFFIX = ".damaged"
_TAG = re.compile(r"^step_(\d+)$")
_CHUNK = 4 << 20  # large reads: the checksum, not the syscalls, sets the rate


def tag_for(step: int) -> str:
    return f"step_{step}"


def step_of(name: str) -> int | None:
    """N of a `step_N` folder name, else None."""
    m = _TAG.match(name)
    return int(m.group(1)) if m else None


# ----------------------------------------------------------------------------------------------------------------
# Files
# ----------------------------------------------------------------------------------------------------------------
def crc32_of(file: Path) -> str:
    """zlib's crc32 of the file's bytes, as 8 hex digits."""
    crc, chunk = 0, bytearray(_CHUNK)  # one buffer for every read: host memory holds one chunk, not two
    with file.open("rb", buffering=0) as f:
        while size := f.readinto(chunk):
            crc = zlib.crc32(memoryview(chunk)[:size], crc)
    return f"{crc:08x}"


def describe(folder: Path, files: list[Path]) -> dict[str, dict]:
    """{name relative to `folder`: {"bytes", "crc32"}} of `files`, as complete.json lists them."""
    return {str(f.relative_to(folder)): {"bytes": f.stat().st_size, "crc32": crc32_of(f)} for f in files}


def mismatched(folder: Path, files: dict[str, dict], names: list[str] | None = None) -> list[str]:
    """"NAME (checksum mismatch)" for each of `names` (default: every listed file) whose crc32 is not the listed one."""
    return [f"{name} (checksum mismatch)" for name in (files if names is None else names)
            if crc32_of(folder / name) != files[name]["crc32"]]


def write_marker(folder: Path, files: dict[str, dict]) -> None:
    """Mark `folder` complete: `files` is every file of it with its size and checksum."""
    write_atomic(folder / COMPLETE, json.dumps({"files": files}, indent=1))


def _listed(folder: Path) -> dict[str, dict] | None:
    """The marker's files, {name: {"bytes", "crc32"}} (no "crc32" in an old marker); None without a marker."""
    try:
        files = json.loads((folder / COMPLETE).read_text())["files"]
    except (OSError, ValueError, KeyError, TypeError):
        return None
    return {name: entry if isinstance(entry, dict) else {"bytes": entry} for name, entry in files.items()}


# ----------------------------------------------------------------------------------------------------------------
# Complete and intact
# ----------------------------------------------------------------------------------------------------------------
def missing_parts(path: Path) -> list[str]:
    """What keeps `path` from being a complete checkpoint ([] when complete)."""
    if not path.is_dir():
        return [f"{path} does not exist"]
    files = _listed(path)
    if files is None:
        return [f"{COMPLETE} (the save was interrupted or the folder is not a checkpoint)"]
    problems = []
    for name, entry in files.items():
        file = path / name
        if not file.is_file():
            problems.append(f"{name} (missing)")
        elif file.stat().st_size != entry["bytes"]:
            problems.append(f"{name} ({file.stat().st_size} of {entry['bytes']} bytes)")
    return problems


def _shown(problems: list[str]) -> str:
    return ", ".join(problems[:3]) + (f" and {len(problems) - 3} more" if len(problems) > 3 else "")


def check_complete(path: Path) -> None:
    """A one-line refusal naming what is missing, for resume and export."""
    problems = missing_parts(path)
    if problems:
        raise UsageError(f"checkpoint {path} is incomplete: {_shown(problems)}")


def complete_steps(root: Path) -> list[int]:
    """Steps of the complete checkpoints under `root`, ascending."""
    if not root.is_dir():
        return []
    steps = sorted(s for p in root.iterdir() if (s := step_of(p.name)) is not None)
    return [s for s in steps if not missing_parts(root / tag_for(s))]


def _share(files: dict[str, dict], rank: int, world: int) -> list[str]:
    """This rank's files to check: the largest first, each to the least loaded rank (the same on every rank)."""
    load, mine = [0] * world, []
    for name in sorted(files, key=lambda n: (-files[n]["bytes"], n)):
        r = load.index(min(load))
        load[r] += files[name]["bytes"]
        if r == rank:
            mine.append(name)
    return mine


def damaged_parts(path: Path, rank: int = 0, world: int = 1) -> list[str]:
    """The files of the complete checkpoint `path` whose checksum does not match ([] when intact). With
    `world` > 1 every rank of the default process group calls it, checks its share, and gets every rank's
    findings."""
    files = _listed(path)
    assert files is not None, f"{path} is not complete"
    if any("crc32" not in entry for entry in files.values()):
        log.warning("%s lists no checksums (written before they were recorded): its content is not checked",
                    path / COMPLETE)
        return []
    mine = mismatched(path, files, _share(files, rank, world))
    if world == 1:
        return sorted(mine)  # the share is ordered by size; messages name files in name order
    everyone: list[list[str]] = [[] for _ in range(world)]
    dist.all_gather_object(everyone, mine)
    return sorted(p for found in everyone for p in found)


def check_intact(path: Path, rank: int = 0, world: int = 1) -> None:
    """A one-line refusal naming the damaged files, for a checkpoint the user chose (export, resume=PATH)."""
    check_complete(path)
    problems = damaged_parts(path, rank, world)
    if problems:
        raise UsageError(f"checkpoint {path} is damaged: {_shown(problems)}; its content is not what was saved")


# ----------------------------------------------------------------------------------------------------------------
# The checkpoint to continue from
# ----------------------------------------------------------------------------------------------------------------
def _latest_hint(root: Path) -> str | None:
    """What `latest` says, for the messages: "names step_N", "is unreadable (why)"; None when there is none."""
    latest = root / LATEST
    if not latest.exists() and not latest.is_symlink():
        return None
    try:
        return f"names {latest.read_text(encoding='utf-8').strip()}"
    except (OSError, UnicodeDecodeError) as e:  # a folder, non-UTF-8 bytes, a dangling link
        return f"is unreadable ({type(e).__name__})"


def newest_intact(root: Path, rank: int = 0, world: int = 1) -> Path | None:
    """The newest complete, intact checkpoint under `root` (None when there is none). Damaged ones on the way are
    named in a warning and moved aside (rank 0) to `step_N.damaged`; `latest` is only compared, never followed.
    Every rank of the default process group calls it when `world` > 1."""
    hint = _latest_hint(root)
    for step in reversed(complete_steps(root)):
        path = root / tag_for(step)
        problems = damaged_parts(path, rank, world)
        if not problems:
            if hint != f"names {path.name}":
                log.warning("%s %s: resuming from %s, the newest complete intact checkpoint (latest is a hint)",
                            root / LATEST, hint or "is missing", path.name)
            return path
        log.warning("checkpoint %s (step %d) is damaged: %s; moved to %s%s, trying the one before it", path, step,
                    _shown(problems), path.name, DAMAGED_SUFFIX)
        if rank == 0:
            aside = path.with_name(path.name + DAMAGED_SUFFIX)
            shutil.rmtree(aside, ignore_errors=True)  # an older damaged copy of the same step
            path.rename(aside)
        if world > 1:
            dist.barrier()
    if hint is not None:
        raise UsageError(f"{root / LATEST} {hint}, but no complete intact checkpoint is in {root} (a missing, "
                         "incomplete or damaged one is never resumed); the run cannot continue: start a new run.dir")
    return None


# the run's inputs as a checkpoint records them (inputs.json, the loader's data state): shard names and sizes
def describe_shards(shards: list[str] | tuple[str, ...]) -> tuple[tuple[str, int | None], ...]:
    """(name, size) of each shard as a checkpoint records it: a moved shard folder is the same data; a URL's size is
    unknown, so its name alone."""
    return tuple((s.rsplit("/", 1)[-1], os.path.getsize(s) if os.path.isfile(s) else None) for s in shards)


def shard_change(then: list[tuple], now: list[tuple]) -> str:
    """The difference of two shard lists (`describe_shards`) in a few words: what went, what came, what changed size,
    else the order."""
    sizes_then, sizes_now = dict(then), dict(now)

    def few(names: list[str]) -> str:
        return ", ".join(names[:3]) + (f" and {len(names) - 3} more" if len(names) > 3 else "")

    parts = [f"{len(then)} shards in the checkpoint, {len(now)} now"]
    if gone := [n for n, _ in then if n not in sizes_now]:
        parts.append(f"not listed now: {few(gone)}")
    if new := [n for n, _ in now if n not in sizes_then]:
        parts.append(f"new: {few(new)}")
    if resized := [n for n, size in now if n in sizes_then and sizes_then[n] != size]:
        parts.append(f"another size: {few(resized)}")
    if len(parts) == 1:
        parts.append("the same shards in another order")
    return "; ".join(parts)
