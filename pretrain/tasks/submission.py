"""Test-set predictions in the benchmarks' submission formats.

GLUE (gluebenchmark.com): one `TASK.tsv` per task with the header `index\tprediction` and the label as the
official files write it ("entailment", "1", or the STS-B score). SuperGLUE (super.gluebenchmark.com): one
`TASK.jsonl` per task with `{"idx": ..., "label": ...}` per line; MultiRC nests answers under questions under
passages.
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Sequence

from pretrain.tasks.task import Example, Split, Task


def submission_label(task: Task, prediction: int | float) -> object:
    """A prediction as the submission server wants it; an invalid generated answer (-1) becomes class 0."""
    if task.regression:
        return round(min(max(float(prediction), 0.0), 5.0), 3)
    labels = task.submit_labels or task.raw_labels
    return labels[max(int(prediction), 0)]


def submission_name(split: Split, predicted: int, total: int) -> str:
    """The file's name: the server's (`SST-2.tsv`) for the whole test file; a prediction of its first examples
    only (an evaluation `limit`) is named as such (`SST-2.partial-10-of-1821.tsv`): no server takes it."""
    if predicted >= total:
        return split.submission
    stem, dot, suffix = split.submission.partition(".")
    return f"{stem}.partial-{predicted}-of-{total}{dot}{suffix}"


def write_submission(task: Task, split: Split, examples: Sequence[Example], predictions: Sequence, out_dir: Path,
                     total: int | None = None) -> Path:
    """`total`: the test file's examples, when `examples` may be its first ones only."""
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / submission_name(split, len(examples), len(examples) if total is None else total)
    labels = [submission_label(task, p) for p in predictions]
    if task.benchmark in ("glue", "probe"):  # the probe: GLUE's layout
        lines = ["index\tprediction"] + [f"{e.idx}\t{label}" for e, label in zip(examples, labels)]
    elif task.name == "multirc":
        lines = _multirc_lines(examples, labels)
    else:
        lines = [json.dumps({"idx": e.idx, "label": label}) for e, label in zip(examples, labels)]
    path.write_text("\n".join(lines) + "\n")
    return path


def _multirc_lines(examples: Sequence[Example], labels: Sequence) -> list[str]:
    passages: dict = {}
    for e, label in zip(examples, labels):
        p, q, a = e.idx
        questions = passages.setdefault(p, {})
        questions.setdefault(q, []).append({"idx": a, "label": label})
    return [
        json.dumps({"idx": p, "passage": {"questions": [{"idx": q, "answers": ans} for q, ans in qs.items()]}})
        for p, qs in passages.items()
    ]
