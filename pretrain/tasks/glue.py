"""The GLUE tasks (Wang et al. 2018) as read from the official download's TSV files, in T5's text-to-text form.

Column names are those of the official headers (CoLA's train/dev files have none; their four columns are
named here). Inputs follow T5's `glue` preprocessor: the task prefix, then each feature as "name: text" in sorted
feature order, so MNLI reads "mnli hypothesis: ... premise: ...".
"""
from __future__ import annotations

from pretrain.tasks.task import Split, Task

BINARY = ("0", "1")
ENTAIL = ("entailment", "not_entailment")


def _split(name: str, submission: str) -> tuple[Split, ...]:
    return (Split(name, "dev.tsv", "test.tsv", submission),)


GLUE_TASKS = (
    Task(
        name="cola", prefix="cola", benchmark="glue", folder="CoLA",
        fields=("sentence",), label_field="label", raw_labels=BINARY,
        label_words=("unacceptable", "acceptable"), metrics=("matthews_corr",),
        convert=lambda r: f"sentence: {r['sentence']}",
        header=("source", "label", "original_label", "sentence"),
        splits=_split("cola", "CoLA.tsv"),
    ),
    Task(
        name="sst2", prefix="sst2", benchmark="glue", folder="SST-2",
        fields=("sentence",), label_field="label", raw_labels=BINARY,
        label_words=("negative", "positive"), metrics=("accuracy",),
        convert=lambda r: f"sentence: {r['sentence']}",
        splits=_split("sst2", "SST-2.tsv"),
    ),
    Task(
        name="mrpc", prefix="mrpc", benchmark="glue", folder="MRPC",
        fields=("#1 String", "#2 String"), label_field="Quality", raw_labels=BINARY,
        label_words=("not_equivalent", "equivalent"), metrics=("f1", "accuracy"),
        convert=lambda r: f"sentence1: {r['#1 String']} sentence2: {r['#2 String']}",
        splits=_split("mrpc", "MRPC.tsv"),
    ),
    Task(
        name="stsb", prefix="stsb", benchmark="glue", folder="STS-B",
        fields=("sentence1", "sentence2"), label_field="score", raw_labels=(),
        # T5 casts STS-B as 26 classes: the scores 0.0, 0.2, ..., 5.0 written with one decimal
        label_words=tuple(f"{i / 5:.1f}" for i in range(26)), metrics=("pearson", "spearman"),
        convert=lambda r: f"sentence1: {r['sentence1']} sentence2: {r['sentence2']}",
        regression=True, splits=_split("stsb", "STS-B.tsv"),
    ),
    Task(
        name="qqp", prefix="qqp", benchmark="glue", folder="QQP",
        fields=("question1", "question2"), label_field="is_duplicate", raw_labels=BINARY,
        label_words=("not_duplicate", "duplicate"), metrics=("f1", "accuracy"),
        convert=lambda r: f"question1: {r['question1']} question2: {r['question2']}",
        index_field="id", splits=_split("qqp", "QQP.tsv"),
    ),
    Task(
        name="mnli", prefix="mnli", benchmark="glue", folder="MNLI",
        fields=("sentence1", "sentence2"), label_field="gold_label",
        raw_labels=("entailment", "neutral", "contradiction"),
        label_words=("entailment", "neutral", "contradiction"), metrics=("accuracy",),
        convert=lambda r: f"hypothesis: {r['sentence2']} premise: {r['sentence1']}",
        splits=(
            Split("mnli_matched", "dev_matched.tsv", "test_matched.tsv", "MNLI-m.tsv"),
            Split("mnli_mismatched", "dev_mismatched.tsv", "test_mismatched.tsv", "MNLI-mm.tsv"),
        ),
    ),
    Task(
        name="qnli", prefix="qnli", benchmark="glue", folder="QNLI",
        fields=("question", "sentence"), label_field="label", raw_labels=ENTAIL,
        label_words=ENTAIL, metrics=("accuracy",),
        convert=lambda r: f"question: {r['question']} sentence: {r['sentence']}",
        splits=_split("qnli", "QNLI.tsv"),
    ),
    Task(
        name="rte", prefix="rte", benchmark="glue", folder="RTE",
        fields=("sentence1", "sentence2"), label_field="label", raw_labels=ENTAIL,
        label_words=ENTAIL, metrics=("accuracy",),
        convert=lambda r: f"sentence1: {r['sentence1']} sentence2: {r['sentence2']}",
        splits=_split("rte", "RTE.tsv"),
    ),
    Task(
        name="wnli", prefix="wnli", benchmark="glue", folder="WNLI",
        fields=("sentence1", "sentence2"), label_field="label", raw_labels=BINARY,
        label_words=("not_entailment", "entailment"), metrics=("accuracy",),
        convert=lambda r: f"sentence1: {r['sentence1']} sentence2: {r['sentence2']}",
        splits=_split("wnli", "WNLI.tsv"),
    ),
)
