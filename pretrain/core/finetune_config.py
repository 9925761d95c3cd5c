"""Fine-tuning's configuration (`pretrain.finetune`): its own sections (task, data, eval) and the schema that adds
them to the sections every job shares (pretrain.core.config.JobConfig: run, parallel, zero, precision, train,
checkpoint, log, profile). Loaded by the same `load_config` / `parse_args`; `--help` reads the field comments here
too.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from pretrain.core.config import PRECISIONS, JobConfig, check_at_least, check_choice, check_fraction

METHODS = ("generate", "rank", "both")  # evaluation methods (pretrain.transfer.evaluation)


@dataclass(frozen=True)
class TaskConfig:
    name: str = "sst2"  # a task of pretrain.tasks; also its key in results.json
    max_input_length: int = 128  # tokens including EOS; longer inputs are truncated
    dropout: float = 0.1  # replaces the export's model.dropout (T5 fine-tunes with 0.1)
    freeze_mixture: bool = False  # keep the pretrained mixture weights (attn.mix) fixed
    train_examples: int = 0  # use only the first N training examples (0: all)

    def __post_init__(self) -> None:
        check_at_least("task", self, {"max_input_length": 2, "train_examples": 0})  # inputs: a token and EOS
        check_fraction("task", self, ("dropout",))


@dataclass(frozen=True)
class FinetuneDataConfig:
    dir: str = ""  # the task's folder in the official layout (glue_data/SST-2), or the folder above it (glue_data)
    tokenizer: str = ""  # empty: the `init` export's spiece.model; another file must be that same tokenizer


@dataclass(frozen=True)
class FinetuneEvalConfig:
    every: int = 0  # steps between evaluations (0: only at the end)
    method: str = "both"  # generate (greedy, cached), rank (classification over label words) or both
    batch: int = 32  # examples per forward pass
    limit: int = 0  # evaluate only the first N examples of each file (0: all)
    submission: bool = True  # write test-set predictions in the benchmark's format at the end

    def __post_init__(self) -> None:
        check_at_least("eval", self, {"every": 0, "batch": 1, "limit": 0})
        check_choice("eval.method", self.method, METHODS)


@dataclass(frozen=True)
class FinetuneConfig(JobConfig):
    precision: str = "auto"  # auto (bf16 on CUDA, fp32 on CPU), fp32, bf16 or fp16
    init: str = ""  # export folder to start from (python -m pretrain.export)
    from_scratch: bool = False  # a random initialisation of init's model (its config and tokenizer, not its weights)
    task: TaskConfig = field(default_factory=TaskConfig)
    data: FinetuneDataConfig = field(default_factory=FinetuneDataConfig)
    eval: FinetuneEvalConfig = field(default_factory=FinetuneEvalConfig)

    def __post_init__(self) -> None:
        check_choice("precision", self.precision, ("auto", *PRECISIONS))
