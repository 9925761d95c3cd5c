"""Downstream tasks in text-to-text form: GLUE and SuperGLUE from their official files, their metrics and
their submission files; plus the study's span probe (pretrain.tasks.pair). `get_task(name)` is the registry;
names are those of results.json ("sst2", "boolq", "pair")."""
from __future__ import annotations

from pretrain.core.config import UsageError
from pretrain.tasks.glue import GLUE_TASKS
from pretrain.tasks.pair import PAIR_TASK
from pretrain.tasks.superglue import SUPERGLUE_TASKS
from pretrain.tasks.task import Example, Split, Task, TaskFileError

TASKS: dict[str, Task] = {t.name: t for t in GLUE_TASKS + SUPERGLUE_TASKS + (PAIR_TASK,)}


def get_task(name: str) -> Task:
    if name not in TASKS:
        raise UsageError(f"unknown task '{name}'; choose one of {', '.join(TASKS)}")
    return TASKS[name]


__all__ = ["TASKS", "Example", "Split", "Task", "TaskFileError", "get_task"]
