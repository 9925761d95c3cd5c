"""Writes a reader never sees half done: write to a temporary name, fsync, rename over the target, fsync the
folder. The one place of that step; checkpoints' markers, `latest`, config.yaml and results files use it."""
from __future__ import annotations

import os
from pathlib import Path


def fsync_path(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_atomic(path: Path, text: str) -> None:
    """Write, fsync, rename over `path`, fsync the folder: readers see the old or the new text, never a part."""
    tmp = path.with_name(path.name + ".tmp")
    with tmp.open("w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    tmp.replace(path)
    fsync_path(path.parent)
