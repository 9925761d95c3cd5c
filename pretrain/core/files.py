"""Writes a reader never sees half done: write to a temporary name, fsync, rename over the target, fsync the
folder. The one place of that step; checkpoints' markers, `latest`, config.yaml and results files use it. And what
storage says when it refuses a write (a full disk, a quota), in one line naming the errno and the file: the jobs'
exit codes (pretrain.runtime.faults) and the tools (pretrain.data.prepare) read it here."""
from __future__ import annotations

import contextlib
import errno
import os
from pathlib import Path
from typing import Iterator


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


# what storage says when it cannot take a write (none of them is a bug, none comes from a read), and when it will
# take it again
STORAGE_ERRNOS = {errno.ENOSPC: "there is space again", errno.EDQUOT: "the quota allows it",
                  errno.EFBIG: "the file-size limit (ulimit -f) allows it",
                  errno.EROFS: "the filesystem is writable again"}


def chain(e: BaseException | None) -> Iterator[BaseException]:
    """`e` and the errors it came from (its cause, else its context), the last raised first."""
    seen: set[int] = set()
    while e is not None and id(e) not in seen:
        seen.add(id(e))
        yield e
        e = e.__cause__ or e.__context__


@contextlib.contextmanager
def writing(path: Path | str) -> Iterator[None]:
    """OSErrors raised inside name `path` where they name no file: a failed write() or flush() names none, and
    torch.save into a file raises its own errors over the write's (`OSError` <- `RuntimeError` <- `OSError`)."""
    try:
        yield
    except Exception as e:
        for error in chain(e):
            if isinstance(error, OSError) and error.filename is None:
                error.filename = str(path)
        raise


def storage_failure(e: BaseException) -> OSError | None:
    """The first-raised OSError with a `STORAGE_ERRNOS` errno among `e` and the errors it came from, else None."""
    found = [x for x in chain(e) if isinstance(x, OSError) and x.errno in STORAGE_ERRNOS]
    return found[-1] if found else None


def describe_storage_failure(e: OSError) -> str:
    """`no space left on device (ENOSPC): PATH`."""
    where = f": {e.filename}" if e.filename else ""
    return f"{os.strerror(e.errno).lower()} ({errno.errorcode[e.errno]}){where}"
