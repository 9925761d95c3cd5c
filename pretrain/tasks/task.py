"""What a downstream task is: its official files, its text-to-text form (T5's task prefix and label words) and
its metrics; plus the strict readers of the official TSV (GLUE) and JSONL (SuperGLUE) files.

A task turns one record of its official file into an `Example`: `inputs` such as
"sst2 sentence: a gorgeous film" and `target` such as "positive" (T5, Raffel et al. 2020, appendix D). Labels are
class ids into `label_words`, or floats for STS-B. A wrong or missing file, column or field raises `TaskFileError`
with one line naming the file (and line) and what was expected.
"""
from __future__ import annotations

import csv
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Iterator

from pretrain.core.config import UsageError

# The GLUE TSVs are not quoted ('"' is literal text), and some sentences are long.
csv.field_size_limit(1 << 24)


class TaskFileError(UsageError):
    """A task file that is missing or not in the official format; the message is one line."""


@dataclass(frozen=True)
class Example:
    idx: object  # the official index (MultiRC: (passage, question, answer)), written back in submissions
    inputs: str
    target: str  # the label word(s); "" for an unlabelled test example
    label: int | float | None  # class id into Task.label_words (float for regression); None on test
    group: int | str | None = None  # MultiRC: the question an answer option belongs to


@dataclass(frozen=True)
class Split:
    """One evaluation: a labelled validation file and its unlabelled test file."""

    name: str  # the key in results.json: "sst2", "mnli_matched", ...
    validation: str  # file name inside the task folder
    test: str
    submission: str  # the benchmark's submission file name: "SST-2.tsv", "BoolQ.jsonl"


Record = dict  # one row (by column name) or one JSON object
Convert = Callable[[Record], str]  # record -> the input text after the task prefix


@dataclass(frozen=True)
class Task:
    name: str  # the registry key: "sst2", "boolq", "rte_superglue"
    prefix: str  # T5's task prefix at the start of every input: "sst2", "rte"
    benchmark: str  # "glue", "superglue", or "probe" (made here, in GLUE's layout: pretrain.tasks.pair)
    folder: str  # the task folder in the official download: "SST-2", "BoolQ"
    fields: tuple[str, ...]  # columns / JSON fields every file must have (the label is checked apart)
    label_field: str  # the column / field holding the label in train and validation files
    raw_labels: tuple  # label values as the official files write them, in class-id order
    label_words: tuple[str, ...]  # T5's target words, in class-id order
    metrics: tuple[str, ...]  # metric names in pretrain.tasks.metrics.METRICS
    convert: Convert
    train: str = "train.tsv"
    splits: tuple[Split, ...] = ()
    regression: bool = False  # STS-B: the label is a float, label_words are its 0.2-spaced values
    header: tuple[str, ...] | None = None  # column names of header-less train/dev files (CoLA)
    index_field: str = "index"
    submit_labels: tuple | None = None  # labels as the submission server wants them (default: raw_labels)
    # MultiRC: one passage record -> one record per answer option (question and answer flattened in)
    explode: Callable[[Record, str], Iterator[Record]] | None = field(default=None)

    def label_to_id(self, raw: object, where: str) -> int | float:
        if self.regression:
            try:
                score = float(raw)
            except (TypeError, ValueError):
                raise TaskFileError(f"{where}: label {raw!r} is not a number") from None
            low, high = float(self.label_words[0]), float(self.label_words[-1])  # STS-B: 0.0 ... 5.0
            if not low <= score <= high:  # also NaN
                raise TaskFileError(f"{where}: label {raw!r} is outside the task's scores, {low:g} to {high:g}")
            return score
        for i, value in enumerate(self.raw_labels):
            if raw == value:
                return i
        expected = ", ".join(repr(v) for v in self.raw_labels)
        raise TaskFileError(f"{where}: label {raw!r} is not one of {expected}")

    def target_of(self, label: int | float) -> str:
        if self.regression:
            # T5: round to the nearest 0.2 and write with one decimal ("3.8")
            return f"{round(float(label) * 5) / 5:.1f}"
        return self.label_words[int(label)]

    def read(self, folder: str | Path, file: str, labelled: bool) -> list[Example]:
        """The examples of one official file; test files (`labelled=False`) carry no labels."""
        path = Path(folder) / file
        if not path.is_file():
            raise TaskFileError(f"{path}: file not found; expected the official {self.folder} {file}")
        jsonl = file.endswith(".jsonl")
        records = _read_jsonl(path) if jsonl else _read_tsv(path, self.header if labelled else None)
        needed = self.fields + ((self.label_field,) if labelled else ())
        examples = []
        kind = "fields" if jsonl else "columns"
        for position, (where, record) in enumerate(records):
            try:
                for rec in self.explode(record, where) if self.explode else [record]:
                    missing = [f for f in needed if f not in rec]
                    if missing:
                        raise TaskFileError(f"{where}: expected {kind} {', '.join(needed)}; missing {', '.join(missing)}")
                    examples.append(self._example(rec, where, labelled, position))
            except (KeyError, TypeError) as e:  # a nested field (WSC target, MultiRC passage) is missing
                raise TaskFileError(f"{where}: expected the official {self.folder} {kind}; missing {e}") from None
        return examples

    def _example(self, rec: Record, where: str, labelled: bool, position: int) -> Example:
        inputs = f"{self.prefix} {self.convert(rec)}"
        idx, group = rec.get(self.index_field, position), rec.get("_group")
        if not labelled:
            return Example(idx, inputs, "", None, group)
        label = self.label_to_id(rec[self.label_field], where)
        return Example(idx, inputs, self.target_of(label), label, group)


def _read_tsv(path: Path, header: tuple[str, ...] | None) -> Iterator[tuple[str, Record]]:
    """Rows of a tab-separated file by column name; the first line is the header unless `header` is given."""
    with path.open(newline="", encoding="utf-8") as f:
        rows = csv.reader(f, delimiter="\t", quoting=csv.QUOTE_NONE)
        names = header
        for lineno, row in enumerate(rows, start=1):
            if names is None:
                names = tuple(row)
                continue
            if len(row) != len(names):
                raise TaskFileError(
                    f"{path} line {lineno}: expected {len(names)} tab-separated fields "
                    f"({', '.join(names)}), found {len(row)}"
                )
            yield f"{path} line {lineno}", dict(zip(names, row))
        if names is None:
            raise TaskFileError(f"{path}: empty file; expected a header line")


def _read_jsonl(path: Path) -> Iterator[tuple[str, Record]]:
    with path.open(encoding="utf-8") as f:
        for lineno, line in enumerate(f, start=1):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError as e:
                raise TaskFileError(f"{path} line {lineno}: not a JSON object ({e.msg})") from None
            if not isinstance(record, dict):
                raise TaskFileError(f"{path} line {lineno}: expected a JSON object, found {type(record).__name__}")
            yield f"{path} line {lineno}", record
