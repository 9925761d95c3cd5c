"""The input formats on real text (the fixture's C4 validation file rewritten into each), and each kind of
damaged record: counted and skipped, or, for a file that cannot be read at all, refused in one line naming it."""
from __future__ import annotations

import gzip
from collections import Counter
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from bench.documents import block_text, write_formats
from pretrain.core.config import UsageError
from pretrain.data.documents import BAD_KINDS, Document, InputLayout, expand_glob, read_documents


def real_documents(c4_dir: Path) -> list[Document]:
    return list(read_documents(c4_dir / "c4-validation.00000-of-00001.json.gz", Counter()))


def expected(name: str, docs: list[Document]) -> list[Document]:
    """What `write_formats`'s file `name` reads back: plain text holds no urls, and its own layout of lines."""
    if name == "text lines":
        return [Document(d.text.replace("\n", " "), "") for d in docs]
    if name == "text blocks":
        return [Document(block_text(d.text), "") for d in docs]
    return docs


def test_every_format_reads_the_real_documents_back(c4_dir, tmp_path):
    docs = real_documents(c4_dir)
    assert len(docs) > 100 and sum("\n\n" in d.text for d in docs) > 50  # multi-paragraph documents
    for name, (path, layout) in write_formats(docs, tmp_path, row_group_size=25).items():
        bad = Counter()
        assert list(read_documents(path, bad, layout)) == expected(name, docs), name
        assert not bad, name


def test_damaged_json_records_are_counted_by_kind(tmp_path):
    lines = [
        b'{"body": "A first real document.", "url": "u1"}',
        b"{not json",
        b'{"body": "caf\xe9 bytes"}',                     # Latin-1, not UTF-8
        b'{"url": "no body"}', b'{"body": null}', b'["a list"]',  # no text field
        b'{"body": 42}', b'{"body": ["a", "list"]}',      # not a string
        b'{"body": ""}', b'{"body": " \\n\\t "}',           # empty, whitespace only
        b'{"body": "half a pair \\ud800 of surrogates"}',   # valid JSON, not Unicode text
        b"",                                                # a blank line is no record
        b'{"body": "A last real document.", "url": 7}',    # a url that is not a string is dropped
    ]
    path = tmp_path / "mixed.jsonl"
    path.write_bytes(b"\n".join(lines) + b"\n")
    bad = Counter()
    docs = list(read_documents(path, bad, InputLayout(text_field="body")))
    assert docs == [Document("A first real document.", "u1"), Document("A last real document.", "")]
    assert bad == {"invalid_json": 1, "non_utf8": 1, "missing_text": 3, "non_string_text": 2, "empty_text": 2,
                   "lone_surrogate": 1}
    assert set(bad) <= set(BAD_KINDS)


def test_a_wrong_text_field_is_one_line_naming_the_fields(c4_dir):
    with pytest.raises(UsageError, match=r"c4-validation.00000-of-00001.json.gz: no record has the text field 'body' "
                                         r"\(the first has fields text, timestamp, url\); pass --text-field NAME"):
        list(read_documents(c4_dir / "c4-validation.00000-of-00001.json.gz", Counter(), InputLayout(text_field="body")))


def test_damaged_plain_text_is_counted(tmp_path):
    path = tmp_path / "t.txt"
    path.write_bytes(b"first line\n\n   \ncaf\xe9 line\nlast line\n")
    bad = Counter()
    assert [d.text for d in read_documents(path, bad)] == ["first line", "last line"]
    assert bad == {"empty_text": 2, "non_utf8": 1}  # one document per line: the blank ones are empty documents
    bad = Counter()
    blocks = list(read_documents(path, bad, InputLayout(text_documents="block")))
    assert [d.text for d in blocks] == ["first line"] and bad == {"non_utf8": 1}  # the block of the bad line
    whole = gzip.compress(b"a line of text\n" * 5000)
    (tmp_path / "cut.txt.gz").write_bytes(whole[: len(whole) // 2])
    bad = Counter()
    assert 0 < len(list(read_documents(tmp_path / "cut.txt.gz", bad))) < 5000 and bad == {"truncated_gzip": 1}


def _overwrite(path: Path, offset: int, data: bytes) -> None:
    with open(path, "r+b") as f:
        f.seek(offset)
        f.write(data)


def test_a_damaged_parquet_row_group_is_skipped_and_counted(c4_dir, tmp_path):
    docs = real_documents(c4_dir)[:100]
    layout = InputLayout(text_field="body")
    texts = [d.text for d in docs]
    texts[3], texts[4] = None, " "  # a null and a blank text in row group 0
    for checksums in (False, True):
        path = tmp_path / f"checksums-{checksums}.parquet"
        # with checksums, uncompressed: 4 letters changed inside row group 2's text decode fine and are seen by
        # the page's crc alone; without, a garbled page header (what most files, written without checksums, show)
        pq.write_table(pa.table({"body": texts}), path, row_group_size=25, write_page_checksum=checksums,
                       compression="none" if checksums else "snappy", use_dictionary=not checksums)
        column = pq.ParquetFile(path).metadata.row_group(2).column(0)
        start = column.dictionary_page_offset or column.data_page_offset
        if checksums:
            _overwrite(path, start + column.total_compressed_size // 2, b"XXXX")
        else:
            _overwrite(path, start, b"\xff" * 16)
        bad = Counter()
        read = [d.text for d in read_documents(path, bad, layout)]
        assert read == [t for t in texts[:50] + texts[75:] if t and t.strip()], checksums
        assert bad == {"missing_text": 1, "empty_text": 1, "damaged_row_group": 1}, checksums


def test_parquet_files_that_cannot_be_read_are_one_line(tmp_path):
    path = tmp_path / "docs.parquet"
    pq.write_table(pa.table({"body": ["some text"] * 10, "n": list(range(10))}), path)
    with pytest.raises(UsageError, match=r"docs.parquet has no column 'text' \(columns: body, n\); pass --text-field"):
        list(read_documents(path, Counter()))
    with pytest.raises(UsageError, match=r"column 'n' of .*docs.parquet holds int64, not text; pass --text-field"):
        list(read_documents(path, Counter(), InputLayout(text_field="n")))
    cut = tmp_path / "cut.parquet"
    cut.write_bytes(path.read_bytes()[:-20])  # the footer is gone: nothing of the file can be found
    with pytest.raises(UsageError, match=r"cut.parquet is not a readable Parquet file \("):
        list(read_documents(cut, Counter(), InputLayout(text_field="body")))


def test_format_from_the_name_or_the_flag(tmp_path):
    path = tmp_path / "corpus.data"
    path.write_text('{"text": "one document"}\n')
    with pytest.raises(UsageError, match=r"corpus.data: no input format ends this name .*; pass --format "
                                         r"jsonl\|text\|parquet"):
        expand_glob(str(tmp_path / "*"))
    layout = InputLayout(format="jsonl")
    assert expand_glob(str(tmp_path / "*"), layout) == [str(path)]
    assert [d.text for d in read_documents(path, Counter(), layout)] == ["one document"]
    assert [d.text for d in read_documents(path, Counter(), InputLayout(format="text"))] == ['{"text": "one document"}']
