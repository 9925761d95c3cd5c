"""Fine-tuning of exported weights on a GLUE/SuperGLUE task, text to text:
`python -m launch.run --nproc-per-node N -m pretrain.finetune --config configs/finetune/TASK.yaml init=OUT data.dir=DIR
run.dir=RUN [section.key=value ...]` (or `srun python -m pretrain.finetune ...`).

The job skeleton of pretraining (`pretrain.runtime.jobs.run_job`: TP, the DeepSpeed engine, checkpoints with resume
and re-sharding, the one loop with preemption, exit 75 and auto-resume, `train.exit_after`) with fine-tuning's
parts: the model at this job's TP from the export's full weights, Synthesizer layers and mixture weights included
(`task.freeze_mixture` keeps the mixture fixed), or with `from_scratch=true` at a random initialisation (run.seed)
of the same model, the reference that shows what pretraining is worth; inputs longer than a synthesizer's
`model.max_length` are truncated to it. Evaluation (`pretrain.transfer.evaluation`) runs every `eval.every` steps
and at the end, writing `RUN/results.json`, `RUN/results.md` and test-set predictions under `RUN/submission/`.
"""
from __future__ import annotations

if __name__ == "__main__":  # answer --help before the heavy imports below (torch, DeepSpeed, megatron: seconds)
    from pretrain.runtime.preemption import watch_preemption
    watch_preemption()  # and record a preemption signal from now on: the job exits 75 at its first agreed check
    from pretrain.core.cli import exit_on_help
    exit_on_help("FinetuneConfig", prog="pretrain.finetune")

import dataclasses
import sys
from pathlib import Path

import torch
import yaml

from pretrain.core.config import ModelConfig, UsageError, parse_args, to_yaml
from pretrain.core.finetune_config import FinetuneConfig
from pretrain.data.task_examples import ExampleStream, check_examples, tokenize
from pretrain.distributed.parallel import ParallelDims
from pretrain.model import build_model, with_vocab
from pretrain.model.pretrained import export_config, foreign_tokenizer
from pretrain.runtime.checkpoint import Progress, RunInputs
from pretrain.runtime.faults import EXIT_OK, run_with_exit_codes
from pretrain.runtime.jobs import Job, init_job, resolve_precision, run_job
from pretrain.runtime.preemption import watch_preemption
from pretrain.runtime.schedule import with_finetune_lr
from pretrain.tasks import Example, Task, get_task
from pretrain.transfer.evaluation import TaskEvaluation, check_evaluation_files, input_limit
from tokenizer.spm import Tokenizer


class Finetuning(Job):
    """The export's model at this job's TP (its full weights, or a random draw with from_scratch), optionally with
    frozen mixture weights; the task's training file, tokenized once, streamed by DP rank; the task's metrics."""

    cfg: FinetuneConfig

    def __init__(self, cfg: FinetuneConfig, model_cfg: ModelConfig, task: Task, examples: list[Example],
                 tokenizer: Tokenizer) -> None:
        super().__init__(cfg, model_cfg, RunInputs.of(cfg.data.tokenizer, task_file=Path(cfg.data.dir) / task.train))
        self.task, self.examples, self.tokenizer = task, examples, tokenizer
        self.weights = "" if cfg.from_scratch else cfg.init  # from_scratch: the model as initialised (run.seed)
        self.strict_weights = True
        self.max_input_length = input_limit(model_cfg, cfg.task.max_input_length)

    def build_model(self, dims: ParallelDims) -> torch.nn.Module:
        """The export's model; `task.freeze_mixture`: its mixture weights (`attn.mix`) are not trained."""
        train = self.cfg.train
        model = build_model(self.model_cfg, activation_checkpointing=train.activation_checkpointing,
                            compile=train.compile, device=dims.device)
        for name, param in model.named_parameters():
            if self.cfg.task.freeze_mixture and name.endswith(".attn.mix"):
                param.requires_grad_(False)
        return model

    def build_data(self, dims: ParallelDims) -> ExampleStream:
        return ExampleStream(tokenize(self.examples, self.tokenizer, self.max_input_length),
                             self.cfg.train.micro_batch, dims.dp_rank, dims.dp, self.cfg.run.seed)

    def build_evaluator(self, engine, dims: ParallelDims) -> TaskEvaluation:
        return TaskEvaluation(engine.module, self.tokenizer, self.task, self.cfg, self.max_input_length,
                              Path(self.cfg.run.dir), dims.rank)

    def checkpoint_config(self) -> str:
        """The config and the model section: pretrain.export reads fine-tuned runs."""
        return to_yaml(self.cfg) + yaml.safe_dump({"model": dataclasses.asdict(self.model_cfg)}, sort_keys=False)

    def start_line(self, progress: Progress, accumulation: int, dims: ParallelDims) -> str:
        train = self.cfg.train
        return (f"fine-tuning {self.task.name} on {len(self.examples)} examples: steps {progress.step} -> "
                f"{train.steps}, global batch {train.global_batch} = micro {train.micro_batch} x accumulation "
                f"{accumulation} x DP {dims.dp}, peak lr {train.lr:.3g}")


def resolve(cfg: FinetuneConfig, dims: ParallelDims) -> tuple[FinetuneConfig, ModelConfig, Task, list[Example]]:
    """The config as the job runs it, from the one loaded: the precision (auto: the device's), data.dir (a benchmark
    root: the task's folder in it, so one data.dir serves a whole array job), train.lr (auto: by the export's width)
    and data.tokenizer (empty: the export's); the model's config (the export's, with task.dropout and the
    tokenizer's ids); the task and its training examples. Every file is read and checked here: the task's files
    first, then the export's (its checksums)."""
    if not isinstance(cfg.train.micro_batch, int):
        raise UsageError(f"train.micro_batch '{cfg.train.micro_batch}': fine-tuning takes a number (auto is the "
                         "pretraining planner's)")
    if not cfg.init:
        raise UsageError("init is empty; pass init=EXPORT_DIR (made by python -m pretrain.export)")
    task = get_task(cfg.task.name)
    data_dir = str(Path(cfg.data.dir) / task.folder) if (Path(cfg.data.dir) / task.folder).is_dir() else cfg.data.dir
    examples = task.read(data_dir, task.train, labelled=True)
    examples = examples[: cfg.task.train_examples] if cfg.task.train_examples else examples
    check_examples(len(examples), Path(data_dir) / task.train, cfg.task, cfg.train.micro_batch, dims.dp)
    check_evaluation_files(task, data_dir, cfg.eval.submission)
    if cfg.data.tokenizer and (own := foreign_tokenizer(Path(cfg.init), Tokenizer(cfg.data.tokenizer).path)):
        raise UsageError(f"data.tokenizer ({cfg.data.tokenizer}) is not {own}, the tokenizer the export was trained "
                         "with: its token ids would mean other pieces; leave data.tokenizer empty (the export's own)")
    model_cfg = dataclasses.replace(export_config(cfg.init), dropout=cfg.task.dropout)
    spiece = cfg.data.tokenizer or str(Path(cfg.init) / "spiece.model")
    cfg = dataclasses.replace(cfg, precision=resolve_precision(cfg.precision, dims.device),
                              train=with_finetune_lr(cfg.train, model_cfg.d_model),
                              data=dataclasses.replace(cfg.data, dir=data_dir, tokenizer=spiece))
    # the export's token rows; padding is per TP
    return cfg, with_vocab(model_cfg, Tokenizer(spiece).num_ids), task, examples


def finetune(cfg: FinetuneConfig) -> int:
    # Process groups, checks; the config resolved: the task and its files, the export's config and tokenizer read now
    dims = init_job(cfg)
    cfg, model_cfg, task, examples = resolve(cfg, dims)
    code = run_job(Finetuning(cfg, model_cfg, task, examples, Tokenizer(cfg.data.tokenizer)), dims)
    run_dir = Path(cfg.run.dir)
    if code == EXIT_OK and dims.rank == 0 and (run_dir / "results.md").is_file():
        print((run_dir / "results.md").read_text(), end="")
    return code


def main(argv: list[str] | None = None) -> int:
    watch_preemption()  # (again: the prelude above does it before the imports when run as `python -m`)
    cfg = parse_args(FinetuneConfig, argv, prog="pretrain.finetune")
    return run_with_exit_codes(lambda: finetune(cfg), "pretrain.finetune")


if __name__ == "__main__":
    sys.exit(main())
