"""The shard format and where shards come from: naming, the document-pack codec, the index, shard specs.

A shard is a webdataset tar of *packs*, each holding up to `PACK_TOKENS` tokens of consecutive documents
(format 2; format 1 had two tar members per document, and parsing them cost more than the rest of the loader):

    KEY.u16          the pack's token ids, documents concatenated without EOS, little-endian
                     (`KEY.u32` for vocabularies over 65,536 ids)
    KEY.lengths.u32  tokens per document, little-endian uint32: the document boundaries
    KEY.json         {"documents", "tokens", "crc32" (of the lengths bytes then the token bytes), "urls"}

A tar has no checksum on member data, so the crc32 is what reveals a garbled pack. Next to the shards,
`index.json` lists documents and tokens per shard, the format version and the bad input skipped while
preparing them.

A shard spec (`data.train` / `data.valid`) is a directory, a glob, a brace pattern
(`shard-{000000..001023}.tar`) or webdataset URLs (`pipe:CMD`, `http(s)://...`, brace patterns allowed).
"""
from __future__ import annotations

import glob as globlib
import itertools
import json
import logging
import os
import signal
import zlib
from pathlib import Path
from typing import IO, Iterator

import braceexpand
import numpy as np
from webdataset.gopen import Pipe, gopen
from webdataset.tariterators import group_by_keys, tar_file_expander

from pretrain.core.config import UsageError
from pretrain.core.redact import redact
from pretrain.data.remote import Retry, open_http

log = logging.getLogger(__name__)

INDEX = "index.json"
FORMAT_VERSION = 2  # in index.json and each sidecar; the loader refuses shards of another version
PACK_TOKENS = 1 << 19  # ~1 MB of u16 per pack: few tar members per shard, and resume re-reads at most one pack
SHARD_TOKENS = 1 << 27  # ~256 MB of u16 per shard: an input file of more is cut into several (C4's files: 1-2 each)
_URL_SCHEMES = ("pipe:", "http://", "https://", "file:")
_LENGTHS = "lengths.u32"


def shard_name(index: int) -> str:
    """The first shard of input file `index`: also the name of the file's sidecar (.json)."""
    return f"shard-{index:06d}.tar"


def part_name(first: Path, part: int) -> str:
    """Shard `part` of the input file whose first shard is `first`: `shard-NNNNNN.tar`, then `shard-NNNNNN-PPPP.tar`."""
    return first.name if part == 0 else f"{first.stem}-{part:04d}.tar"


def token_suffix(num_ids: int) -> str:
    return "u16" if num_ids <= 1 << 16 else "u32"


def encode_pack(key: str, docs: list[list[int]], urls: list[str], suffix: str) -> dict:
    """One webdataset sample holding the documents `docs` (token ids without EOS) and their urls."""
    lengths = np.fromiter((len(d) for d in docs), dtype="<u4", count=len(docs))
    tokens = np.fromiter(itertools.chain.from_iterable(docs), dtype="<u2" if suffix == "u16" else "<u4",
                         count=int(lengths.sum()))
    length_bytes, token_bytes = lengths.tobytes(), tokens.tobytes()
    meta = {"documents": len(docs), "tokens": len(tokens), "urls": urls,
            "crc32": zlib.crc32(token_bytes, zlib.crc32(length_bytes))}
    return {"__key__": key, suffix: token_bytes, _LENGTHS: length_bytes, "json": json.dumps(meta).encode()}


def num_pack_documents(sample: dict) -> int:
    """Documents in a pack, read from its lengths member alone (skipping a pack needs no decoding)."""
    return len(sample.get(_LENGTHS, b"")) // 4


def decode_pack(sample: dict) -> tuple[np.ndarray, np.ndarray]:
    """(token ids [tokens] as stored, tokens per document [documents] int64) of a pack, verified by its crc32.

    A missing member or a checksum mismatch (a garbled or pre-format-2 shard) raises ValueError.
    """
    suffix = "u16" if "u16" in sample else "u32"
    if suffix not in sample or _LENGTHS not in sample or "json" not in sample:
        raise ValueError(f"sample {sample.get('__key__')} is not a format-{FORMAT_VERSION} document pack (members "
                         f"{sorted(k for k in sample if not k.startswith('__'))}); re-prepare the shards with "
                         "`python -m pretrain.data.prepare`")
    token_bytes, length_bytes = sample[suffix], sample[_LENGTHS]
    meta = json.loads(sample["json"])
    if zlib.crc32(token_bytes, zlib.crc32(length_bytes)) != meta.get("crc32"):
        raise ValueError(f"pack {sample['__key__']} fails its crc32 check: the shard is garbled")
    tokens = np.frombuffer(token_bytes, dtype="<u2" if suffix == "u16" else "<u4")
    return tokens, np.frombuffer(length_bytes, dtype="<u4").astype(np.int64)


def pack_urls(sample: dict) -> list[str]:
    return json.loads(sample["json"])["urls"]


def expand_shards(spec: str) -> list[str]:
    """Shard paths or URLs of a spec, in a fixed order; matching nothing is a one-line ValueError."""
    spec = spec.strip()
    if not spec:
        raise UsageError("no shards given: set data.train / data.valid to a directory, glob, brace pattern or URL")
    if spec.startswith(_URL_SCHEMES):
        return list(braceexpand.braceexpand(spec))
    if os.path.isdir(spec):
        found = sorted(str(p) for p in Path(spec).glob("*.tar"))
    elif "{" in spec:
        found = [p for p in braceexpand.braceexpand(spec) if os.path.exists(p)]
        missing = sum(1 for p in braceexpand.braceexpand(spec) if not os.path.exists(p))
        if missing and found:
            raise UsageError(f"{missing} shards of {spec!r} do not exist; prepare them or narrow the pattern")
    else:
        found = sorted(globlib.glob(spec))
    if not found:
        raise UsageError(f"no shards match {spec!r}; prepare them with `python -m pretrain.data.prepare`")
    return found


def open_shard(url: str, retry: Retry | None) -> IO[bytes]:
    """A byte stream of one shard: local path, http(s) (Python's own client, no curl needed; `retry` says how
    patient it is), or `pipe:`."""
    if url.startswith(("http://", "https://")):
        assert retry is not None, "an http(s) shard needs a Retry (data.http_timeout_s, data.http_retries)"
        return open_http(url, retry)  # retries transient failures; credentials stay out of messages
    return gopen(url, "rb")


# a `pipe:` command ended by SIGPIPE: the reader stopped early (a damaged tar, the loader shutting down), no failure
# (141: the shell reports it; a command the shell exec'd ends by the signal itself)
_STOPPED_EARLY = (128 + signal.SIGPIPE, -signal.SIGPIPE)


def _check_command(url: str, stream: IO[bytes]) -> None:
    """A `pipe:` command that failed is the user's to fix, not a damaged shard: a UsageError naming the command
    and its exit status (webdataset's own error is a tuple of Popen's arguments, raised in the middle of a read)."""
    status = stream.status if isinstance(stream, Pipe) else None
    if status in (None, 0, *_STOPPED_EARLY):
        return
    if status < 0:
        how = f"was killed by {signal.Signals(-status).name}"
    else:
        how = f"exited with status {status}" + {127: " (command not found)", 126: " (not executable)"}.get(status, "")
    raise UsageError(f"the command of shard {redact(url)!r} {how}; it must write the shard's tar to stdout: run "
                     f"`{redact(url[len('pipe:'):])}` in a shell to see why, then fix data.train / data.valid")


def read_packs(url: str, on_error, retry: Retry | None = None) -> Iterator[dict]:
    """Packs (raw samples) of one shard in order; a damaged member or truncated tar calls `on_error(exn)`;
    a failing `pipe:` command is a UsageError (`_check_command`)."""
    try:
        stream = open_shard(url, retry)
    except Exception as exn:  # unreachable URL, missing file: the shard is skipped
        on_error(exn)
        return

    def handler(exn: Exception) -> bool:
        _check_command(url, stream)
        on_error(exn)
        return False  # a tar stream cannot resynchronise after damage: end this shard

    try:
        with stream:
            files = tar_file_expander([{"url": url, "stream": stream}], handler=handler)
            yield from group_by_keys(files, handler=handler)
    except OSError:  # webdataset's Pipe checks the command's status when it closes
        _check_command(url, stream)
        if not (isinstance(stream, Pipe) and stream.status in _STOPPED_EARLY):
            raise


# ---------------------------------------------------------------------------------------------------------
# The index
# ---------------------------------------------------------------------------------------------------------
def write_json(path: Path, data: dict) -> None:
    tmp = path.with_name(path.name + f".tmp{os.getpid()}")
    tmp.write_text(json.dumps(data, indent=1, sort_keys=True))
    tmp.replace(path)


def read_index(spec: str, retry: Retry) -> dict | None:
    """index.json beside the shards of a spec: a local folder or an http(s) base URL (None when absent)."""
    if spec.startswith(("http://", "https://")):
        try:
            with open_http(spec.rsplit("/", 1)[0] + "/" + INDEX, retry) as f:
                return json.loads(f.read())
        except (OSError, ValueError):
            return None
    if spec.startswith(_URL_SCHEMES):
        return None
    folder = Path(spec) if os.path.isdir(spec) else Path(spec).parent
    path = folder / INDEX
    return json.loads(path.read_text()) if path.is_file() else None
