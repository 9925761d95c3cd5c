"""What a fine-tuning score is worth: the majority-class baseline (every validation example given the validation
set's most frequent label) and chance (a uniform guess over the label words), in the task's own metrics, printed
beside every result (results.md). STS-B, a regression, has neither."""
from __future__ import annotations

from typing import Sequence

from pretrain.tasks.metrics import score
from pretrain.tasks.task import Example, Task

# the expected score of a uniform guess over k classes, where it has a closed form
_CHANCE = {"accuracy": lambda k: 1 / k, "matthews_corr": lambda k: 0.0}


def baselines(task: Task, examples: Sequence[Example]) -> dict[str, dict[str, float]]:
    """{"majority class (positive)": {metric: score}, "chance (2 classes)": {metric: score}} on `examples`."""
    if task.regression or not examples:
        return {}
    k = len(task.label_words)
    labels = [e.label for e in examples]
    majority = max(range(k), key=labels.count)  # a tie: the first class id
    out = {f"majority class ({task.label_words[majority]})": score(task, [majority] * len(examples), examples)}
    chance = {m: _CHANCE[m](k) for m in task.metrics if m in _CHANCE}
    if chance:
        out[f"chance ({k} classes)"] = chance
    return out
