"""The shard format and where shards come from: naming, the per-document sample codec, the index, shard specs.

A shard is a webdataset tar: one sample per document, `KEY.u16` (or `.u32` for vocabularies over 65,536 ids)
holding the token ids as little-endian integers without EOS, and `KEY.url` the source url. Next to the shards,
`index.json` lists documents and tokens per shard and the bad input skipped while preparing them.

A shard spec (`data.train` / `data.valid`) is a directory, a glob, a brace pattern
(`shard-{000000..001023}.tar`) or webdataset URLs (`pipe:CMD`, `http(s)://...`, brace patterns allowed).
"""
from __future__ import annotations

import glob as globlib
import json
import logging
import os
import urllib.request
from pathlib import Path
from typing import IO, Iterator

import braceexpand
import numpy as np
from webdataset.gopen import gopen
from webdataset.tariterators import group_by_keys, tar_file_expander

log = logging.getLogger(__name__)

INDEX = "index.json"
_URL_SCHEMES = ("pipe:", "http://", "https://", "file:")


def shard_name(index: int) -> str:
    return f"shard-{index:06d}.tar"


def token_suffix(num_ids: int) -> str:
    return "u16" if num_ids <= 1 << 16 else "u32"


def encode_sample(key: str, ids: list[int], url: str, suffix: str) -> dict:
    dtype = "<u2" if suffix == "u16" else "<u4"
    return {"__key__": key, suffix: np.asarray(ids, dtype=dtype).tobytes(), "url": url.encode("utf-8")}


def decode_tokens(sample: dict) -> np.ndarray:
    """Token ids of one sample as int32 (what the chunker concatenates)."""
    if "u16" in sample:
        return np.frombuffer(sample["u16"], dtype="<u2").astype(np.int32)
    if "u32" in sample:
        return np.frombuffer(sample["u32"], dtype="<u4").astype(np.int32)
    raise ValueError(f"sample {sample.get('__key__')} has no token member (.u16/.u32)")


def expand_shards(spec: str) -> list[str]:
    """Shard paths or URLs of a spec, in a fixed order; matching nothing is a one-line ValueError."""
    spec = spec.strip()
    if not spec:
        raise ValueError("no shards given: set data.train / data.valid to a directory, glob, brace pattern or URL")
    if spec.startswith(_URL_SCHEMES):
        return list(braceexpand.braceexpand(spec))
    if os.path.isdir(spec):
        found = sorted(str(p) for p in Path(spec).glob("*.tar"))
    elif "{" in spec:
        found = [p for p in braceexpand.braceexpand(spec) if os.path.exists(p)]
        missing = sum(1 for p in braceexpand.braceexpand(spec) if not os.path.exists(p))
        if missing and found:
            raise ValueError(f"{missing} shards of {spec!r} do not exist; prepare them or narrow the pattern")
    else:
        found = sorted(globlib.glob(spec))
    if not found:
        raise ValueError(f"no shards match {spec!r}; prepare them with `python -m pretrain.data.prepare`")
    return found


def open_shard(url: str) -> IO[bytes]:
    """A byte stream of one shard: local path, http(s) (Python's own client, no curl needed), or `pipe:`."""
    if url.startswith(("http://", "https://")):
        return urllib.request.urlopen(url, timeout=60)
    return gopen(url, "rb")


def read_samples(url: str, on_error) -> Iterator[dict]:
    """Samples of one shard in order. A damaged member or truncated tar calls `on_error(exn)` and ends or skips."""
    try:
        stream = open_shard(url)
    except Exception as exn:  # unreachable URL, missing file, failing pipe: the shard is skipped
        on_error(exn)
        return

    def handler(exn: Exception) -> bool:
        on_error(exn)
        return False  # a tar stream cannot resynchronise after damage: end this shard

    with stream:
        files = tar_file_expander([{"url": url, "stream": stream}], handler=handler)
        yield from group_by_keys(files, handler=handler)


# ---------------------------------------------------------------------------------------------------------
# The index
# ---------------------------------------------------------------------------------------------------------
def write_json(path: Path, data: dict) -> None:
    tmp = path.with_name(path.name + f".tmp{os.getpid()}")
    tmp.write_text(json.dumps(data, indent=1, sort_keys=True))
    tmp.replace(path)


def read_index(spec: str) -> dict | None:
    """index.json beside the shards of a spec: a local folder or an http(s) base URL (None when absent)."""
    if spec.startswith(("http://", "https://")):
        try:
            with urllib.request.urlopen(spec.rsplit("/", 1)[0] + "/" + INDEX, timeout=60) as f:
                return json.loads(f.read())
        except (OSError, ValueError):
            return None
    if spec.startswith(_URL_SCHEMES):
        return None
    folder = Path(spec) if os.path.isdir(spec) else Path(spec).parent
    path = folder / INDEX
    return json.loads(path.read_text()) if path.is_file() else None
