"""The SuperGLUE tasks (Wang et al. 2019) as read from the official download's JSONL files, in T5's text-to-text
form.

Files are `train.jsonl`, `val.jsonl` and `test.jsonl` in each task folder; labels are JSON booleans (BoolQ, WiC,
WSC, MultiRC as 0/1), strings (CB, RTE) or 0/1 (COPA). Submissions follow the jiant/SuperGLUE convention
(`{"idx": 0, "label": "true"}` per line). ReCoRD (span extraction over entities) is not implemented.
"""
from __future__ import annotations

from typing import Iterator

from pretrain.tasks.task import Record, Split, Task

BOOL = (False, True)
BOOL_WORDS = ("False", "True")


def _split(name: str, submission: str) -> tuple[Split, ...]:
    return (Split(name, "val.jsonl", "test.jsonl", submission),)


def _wsc(r: Record) -> str:
    target = r["target"]
    return f"text: {r['text']} span1: {target['span1_text']} span2: {target['span2_text']}"


def _multirc_options(record: Record, where: str) -> Iterator[Record]:
    """One record per (question, answer option): MultiRC is scored per option (F1a) and per question (EM)."""
    passage = record["passage"]
    for q in passage["questions"]:
        for a in q["answers"]:
            option = {
                "idx": (record["idx"], q["idx"], a["idx"]),
                "_group": (record["idx"], q["idx"]),
                "paragraph": passage["text"],
                "question": q["question"],
                "answer": a["text"],
            }
            if "label" in a:
                option["label"] = a["label"]
            yield option


SUPERGLUE_TASKS = (
    Task(
        name="boolq", prefix="boolq", benchmark="superglue", folder="BoolQ",
        fields=("passage", "question"), label_field="label", raw_labels=BOOL,
        label_words=BOOL_WORDS, metrics=("accuracy",),
        convert=lambda r: f"passage: {r['passage']} question: {r['question']}",
        train="train.jsonl", index_field="idx", splits=_split("boolq", "BoolQ.jsonl"),
        submit_labels=("false", "true"),
    ),
    Task(
        name="cb", prefix="cb", benchmark="superglue", folder="CB",
        fields=("premise", "hypothesis"), label_field="label",
        raw_labels=("entailment", "contradiction", "neutral"),
        label_words=("entailment", "contradiction", "neutral"), metrics=("f1_macro", "accuracy"),
        convert=lambda r: f"hypothesis: {r['hypothesis']} premise: {r['premise']}",
        train="train.jsonl", index_field="idx", splits=_split("cb", "CB.jsonl"),
    ),
    Task(
        name="copa", prefix="copa", benchmark="superglue", folder="COPA",
        fields=("premise", "choice1", "choice2", "question"), label_field="label", raw_labels=(0, 1),
        label_words=("choice1", "choice2"), metrics=("accuracy",),
        convert=lambda r: (
            f"choice1: {r['choice1']} choice2: {r['choice2']} premise: {r['premise']} question: {r['question']}"
        ),
        train="train.jsonl", index_field="idx", splits=_split("copa", "COPA.jsonl"),
    ),
    Task(
        name="multirc", prefix="multirc", benchmark="superglue", folder="MultiRC",
        fields=("question", "answer", "paragraph"), label_field="label", raw_labels=(0, 1),
        label_words=BOOL_WORDS, metrics=("f1a", "exact_match"),
        convert=lambda r: f"question: {r['question']} answer: {r['answer']} paragraph: {r['paragraph']}",
        train="train.jsonl", index_field="idx", splits=_split("multirc", "MultiRC.jsonl"),
        explode=_multirc_options,
    ),
    Task(
        name="rte_superglue", prefix="rte", benchmark="superglue", folder="RTE",
        fields=("premise", "hypothesis"), label_field="label",
        raw_labels=("entailment", "not_entailment"),
        label_words=("entailment", "not_entailment"), metrics=("accuracy",),
        convert=lambda r: f"hypothesis: {r['hypothesis']} premise: {r['premise']}",
        train="train.jsonl", index_field="idx", splits=_split("rte_superglue", "RTE.jsonl"),
    ),
    Task(
        name="wic", prefix="wic", benchmark="superglue", folder="WiC",
        fields=("sentence1", "sentence2", "word"), label_field="label", raw_labels=BOOL,
        label_words=BOOL_WORDS, metrics=("accuracy",),
        convert=lambda r: f"sentence1: {r['sentence1']} sentence2: {r['sentence2']} word: {r['word']}",
        train="train.jsonl", index_field="idx", splits=_split("wic", "WiC.jsonl"),
        submit_labels=("false", "true"),
    ),
    Task(
        name="wsc", prefix="wsc", benchmark="superglue", folder="WSC",
        fields=("text", "target"), label_field="label", raw_labels=BOOL,
        label_words=BOOL_WORDS, metrics=("accuracy",), convert=_wsc,
        train="train.jsonl", index_field="idx", splits=_split("wsc", "WSC.jsonl"),
        submit_labels=("False", "True"),
    ),
)
