"""Documents in input files: the formats `tokenizer.train` and `pretrain.data.prepare` read, and C4's layout.

Formats, from each file's name or `--format` for all of them:
- `jsonl` (`.jsonl`, `.jsonl.gz`, `.json.gz`): JSON lines, one object per document with its text in
  `--text-field` (default `text`). C4 is this format: gzip JSON lines with `text`, `timestamp`, `url`, named
  like allenai/c4 (`train_name`, `write_documents`: what `pretrain.data.fetch` writes);
- `text` (`.txt`, `.txt.gz`): UTF-8, one document per line or per blank-line-separated block
  (`--text-documents line|block`);
- `parquet` (`.parquet`): the string column `--text-field`, read one record batch at a time.
A name ending in `.gz` is gunzipped. A `url` field or column, where present, goes with each document.

Reading never stops on a bad record and never passes one silently: each kind of damage is counted in a
`Counter` the caller reports (`BAD_KINDS`). A file that cannot be read at all (not gzip, not Parquet, no such
column, no record holding the text field) is a one-line UsageError naming it.
"""
from __future__ import annotations

import argparse
import glob as globlib
import gzip
import itertools
import json
import logging
import zlib
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable, Iterator, NamedTuple

from pretrain.core.config import UsageError

log = logging.getLogger(__name__)

FORMATS = ("jsonl", "text", "parquet")
TEXT_DOCUMENTS = ("line", "block")
_EXTENSIONS = {".jsonl": "jsonl", ".jsonl.gz": "jsonl", ".json.gz": "jsonl", ".txt": "text", ".txt.gz": "text",
               ".parquet": "parquet"}
BAD_KINDS = (
    "invalid_json",       # a line that is not JSON
    "non_utf8",           # a JSON line, text line or text block that is not UTF-8
    "missing_text",       # a record without the text field (absent, null, or not a JSON object)
    "non_string_text",    # the text field holds a number, a list, ...
    "empty_text",         # zero-length or whitespace-only text (prepare adds documents that encode to no token)
    "lone_surrogate",     # "\ud800" is valid JSON but not Unicode text: no tool can encode it as UTF-8
    "damaged_row_group",  # a Parquet row group that fails to read (the file's other row groups are read)
    "truncated_gzip",     # the rest of a gzip file after damage
)
PARQUET_BATCH = 1024  # rows per record batch: memory stays bounded whatever a file's row-group size


class Document(NamedTuple):
    text: str
    url: str


@dataclass(frozen=True)
class InputLayout:
    """Where the documents are in the input files (the flags of `add_layout_arguments`)."""

    format: str | None = None  # one of FORMATS; None: from each file's name
    text_field: str = "text"  # JSON field or Parquet column holding a document's text
    text_documents: str = "line"  # plain text: a document per "line" or per blank-line-separated "block"

    def __post_init__(self) -> None:
        if self.format not in (None, *FORMATS):
            raise UsageError(f"input format {self.format!r} is not one of {', '.join(FORMATS)}")
        if not self.text_field:
            raise UsageError("--text-field is empty; name the JSON field or Parquet column that holds the text")
        if self.text_documents not in TEXT_DOCUMENTS:
            raise UsageError(f"--text-documents {self.text_documents!r} is not one of {', '.join(TEXT_DOCUMENTS)}")


def add_layout_arguments(p: argparse.ArgumentParser) -> None:
    """The input-format flags both tools take."""
    g = p.add_argument_group("input format")
    g.add_argument("--format", choices=FORMATS,
                   help="format of every input file (default: from each name: " + ", ".join(
                       f"{ext} {fmt}" for ext, fmt in _EXTENSIONS.items()) + ")")
    g.add_argument("--text-field", default="text", help="JSON field / Parquet column holding the text (default text)")
    g.add_argument("--text-documents", choices=TEXT_DOCUMENTS, default="line",
                   help="plain text: one document per line (default) or per block of lines between blank lines")


def layout_from_args(args: argparse.Namespace) -> InputLayout:
    return InputLayout(args.format, args.text_field, args.text_documents)


def format_of(path: str | Path, layout: InputLayout) -> str:
    """The format `path` is read in: `layout.format`, else the one its name ends with."""
    if layout.format:
        return layout.format
    name = Path(path).name.lower()
    for ext, fmt in _EXTENSIONS.items():
        if name.endswith(ext):
            return fmt
    raise UsageError(f"{path}: no input format ends this name ({', '.join(_EXTENSIONS)}); pass --format "
                     f"{'|'.join(FORMATS)}")


def expand_glob(pattern: str, layout: InputLayout = InputLayout()) -> list[str]:
    """Sorted files matching `pattern`, each of a known format; matching nothing is a one-line UsageError."""
    files = sorted(globlib.glob(pattern, recursive=True))
    if not files:
        raise UsageError(f"no files match {pattern!r}; pass a glob such as 'DIR/c4-train.*.json.gz' (quoted)")
    for f in files:
        format_of(f, layout)
    return files


def read_documents(path: str | Path, bad: Counter, layout: InputLayout = InputLayout()) -> Iterator[Document]:
    """Documents of one file in order; damaged records (and a truncated gzip tail) are skipped and counted in `bad`."""
    path = Path(path)
    fmt = format_of(path, layout)
    if fmt == "parquet":
        yield from _parquet_documents(path, layout.text_field, bad)
    elif fmt == "jsonl":
        yield from _json_documents(path, _raw_lines(path, "JSON lines", bad), layout.text_field, bad)
    elif layout.text_documents == "line":
        for line in _raw_lines(path, "text", bad):
            doc = _checked(_decoded(line, bad), "", bad)
            if doc:
                yield doc
    else:
        yield from _text_blocks(_raw_lines(path, "text", bad), bad)


def _checked(text: object, url: str, bad: Counter) -> Document | None:
    """The document if `text` is real text, else None with its kind counted (a None text, by the caller)."""
    if text is None:
        return None
    if not isinstance(text, str):
        bad["non_string_text"] += 1
        return None
    if not text or text.isspace():
        bad["empty_text"] += 1
        return None
    if not text.isascii():  # ASCII holds no surrogate: the common case costs no encode
        try:
            text.encode("utf-8")
        except UnicodeEncodeError:
            bad["lone_surrogate"] += 1
            return None
    return Document(text, url)


def _decoded(raw: bytes, bad: Counter) -> str | None:
    try:
        return raw.decode("utf-8").rstrip("\r\n")
    except UnicodeDecodeError:
        bad["non_utf8"] += 1
        return None


def _raw_lines(path: Path, what: str, bad: Counter) -> Iterator[bytes]:
    """Lines of a file as bytes, gunzipped for `.gz`; damage partway through a gzip file ends it, counted."""
    if not path.name.endswith(".gz"):
        with open(path, "rb") as f:
            yield from f
        return
    started = False
    try:
        with gzip.open(path, "rb") as f:
            for line in f:
                started = True
                yield line
    except (EOFError, gzip.BadGzipFile, zlib.error, OSError) as e:
        if not started:  # not damage partway through: the file is not gzip (or not readable) at all
            raise UsageError(f"{path} is not a gzip file of {what} ({e}); a name ending in .gz must be gzip "
                             "(C4 files are *.json.gz)") from None
        # the documents before the damage were yielded; the rest of the file is unreadable
        bad["truncated_gzip"] += 1
        log.warning("%s: stopped reading at damaged gzip data (%s)", path, e)


def _json_documents(path: Path, lines: Iterable[bytes], field: str, bad: Counter) -> Iterator[Document]:
    found, first_without = 0, None
    for line in lines:
        if not line.strip():
            continue
        try:
            record = json.loads(line.decode("utf-8"))
        except UnicodeDecodeError:
            bad["non_utf8"] += 1
            continue
        except json.JSONDecodeError:
            bad["invalid_json"] += 1
            continue
        text = record.get(field) if isinstance(record, dict) else None
        if text is None:
            bad["missing_text"] += 1
            first_without = record if first_without is None else first_without
            continue
        url = record.get("url")
        doc = _checked(text, url if isinstance(url, str) else "", bad)
        if doc:
            found += 1
            yield doc
    if not found and first_without is not None:  # a wrong --text-field, not a few damaged records
        has = f"fields {', '.join(sorted(first_without))}" if isinstance(first_without, dict) else \
            f"a JSON {type(first_without).__name__}"
        raise UsageError(f"{path}: no record has the text field {field!r} (the first has {has}); pass "
                         "--text-field NAME")


def _text_blocks(lines: Iterable[bytes], bad: Counter) -> Iterator[Document]:
    block: list[bytes] = []
    for line in itertools.chain(lines, [b""]):  # the empty line ends the last block
        if line.strip():
            block.append(line)
            continue
        if block:
            doc = _checked(_decoded(b"".join(block), bad), "", bad)
            block = []
            if doc:
                yield doc


def _parquet_documents(path: Path, field: str, bad: Counter) -> Iterator[Document]:
    import pyarrow as pa  # ~1 s to import: only Parquet input pays it
    import pyarrow.parquet as pq

    try:
        # a row group written with page checksums is verified; most writers add none, and then a damaged
        # page is seen only when it fails to decode
        pf = pq.ParquetFile(path, page_checksum_verification=True)
    except (pa.ArrowException, OSError) as e:
        raise UsageError(f"{path} is not a readable Parquet file ({str(e).splitlines()[0]})") from None
    schema = pf.schema_arrow
    if field not in schema.names:
        raise UsageError(f"{path} has no column {field!r} (columns: {', '.join(schema.names)}); pass --text-field NAME")
    kind = schema.field(field).type
    if not (pa.types.is_string(kind) or pa.types.is_large_string(kind) or pa.types.is_string_view(kind)):
        raise UsageError(f"column {field!r} of {path} holds {kind}, not text; pass --text-field NAME of a string "
                         "column")
    columns = [field] + (["url"] if field != "url" and "url" in schema.names else [])
    for group in range(pf.num_row_groups):
        try:
            for batch in pf.iter_batches(PARQUET_BATCH, row_groups=[group], columns=columns, use_threads=False):
                texts = batch.column(0).to_pylist()
                urls = batch.column(1).to_pylist() if len(columns) > 1 else itertools.repeat("")
                if batch.column(0).null_count:
                    bad["missing_text"] += batch.column(0).null_count
                for text, url in zip(texts, urls):
                    doc = _checked(text, url if isinstance(url, str) else "", bad)
                    if doc:
                        yield doc
        except (pa.ArrowException, OSError, UnicodeDecodeError) as e:
            bad["damaged_row_group"] += 1
            log.warning("%s: row group %d of %d is damaged (%s); its rest is skipped", path, group,
                        pf.num_row_groups, str(e).splitlines()[0])


def train_name(index: int, count: int) -> str:
    return f"c4-train.{index:05d}-of-{count:05d}.json.gz"


def validation_name(index: int, count: int) -> str:
    return f"c4-validation.{index:05d}-of-{count:05d}.json.gz"


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
