"""The study's span probe as a task: "pair sentence1: ... sentence2: ..." -> "yes" when sentence2 is a span cut
from sentence1, "no" when it was cut from another sentence. A probe made from held-out real text by
`python -m pretrain.tasks.pair_data` (in GLUE's TSV layout), not a benchmark."""
from __future__ import annotations

from pretrain.tasks.task import Split, Task

PAIR_TASK = Task(
    name="pair", prefix="pair", benchmark="probe", folder="PAIR",
    fields=("sentence1", "sentence2"), label_field="label", raw_labels=("0", "1"),
    label_words=("no", "yes"), metrics=("accuracy",),
    convert=lambda r: f"sentence1: {r['sentence1']} sentence2: {r['sentence2']}",
    splits=(Split("pair", "dev.tsv", "test.tsv", "PAIR.tsv"),),
)


def pair_input(sentence1: str, sentence2: str) -> str:
    """The task's model input for one pair, as Task.read writes it."""
    return f"{PAIR_TASK.prefix} {PAIR_TASK.convert({'sentence1': sentence1, 'sentence2': sentence2})}"
