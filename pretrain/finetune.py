"""Fine-tuning of exported weights on a GLUE/SuperGLUE task, text to text:
`python -m launch.run --nproc-per-node N -m pretrain.finetune --config configs/finetune/TASK.yaml init=OUT data.dir=DIR
run.dir=RUN [section.key=value ...]` (or `srun python -m pretrain.finetune ...`).

The same machinery as pretraining: process groups and TP (`pretrain.distributed.parallel`), the DeepSpeed engine
(`pretrain.runtime.engine`: ZeRO, bf16, clipping, LR schedule), checkpoints with resume and re-sharding
(`pretrain.runtime.checkpoint`), and the one loop (`pretrain.runtime.loop`: steps, skipped steps, metrics, evaluation,
checkpoints, preemption with exit 75 and auto-resume, `train.exit_after`). The model is built at this job's TP
from the export's full weights, Synthesizer layers and mixture weights included (`task.freeze_mixture` keeps
the mixture fixed), or with `from_scratch=true` at a random initialisation (run.seed) of the same model, the
reference that shows what pretraining is worth; inputs longer than a synthesizer's `model.max_length` are truncated to it. Evaluation (`pretrain.evaluate`)
runs every `eval.every` steps and at the end, writing `RUN/results.json`, `RUN/results.md` and test-set
predictions under `RUN/submission/`.
"""
from __future__ import annotations

if __name__ == "__main__":  # answer --help before the heavy imports below (torch, DeepSpeed, megatron: seconds)
    from pretrain.runtime.preemption import watch_preemption
    watch_preemption()  # and record a preemption signal from now on: the job exits 75 at its first agreed check
    from pretrain.core.cli import exit_on_help
    exit_on_help("FinetuneConfig", prog="pretrain.finetune")

import dataclasses
import logging
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterator

import torch
import yaml

from pretrain.runtime.checkpoint import CheckpointManager, Progress, RunInputs, find_resume, prepare_resume
from pretrain.core.config import (CheckpointConfig, ConfigError, LogConfig, ModelConfig, ParallelConfig, ProfileConfig,
                             RunConfig, TrainConfig, UsageError, ZeroConfig, check_at_least, parse_args, save_config,
                             to_yaml)
from pretrain.runtime.engine import build_engine, load_master_weights, num_accumulation_steps
from pretrain.transfer.evaluation import METHODS, check_evaluation_files, evaluate_task, input_limit, write_results
from pretrain.runtime.faults import EXIT_OK, run_with_exit_codes, stop_if_preempted
from pretrain.runtime.preemption import watch_preemption
from pretrain.runtime.jobs import acquire_run_lock, check_precision, init_logging, resolve_precision
from pretrain.runtime.loop import Meter, mixture_metrics, run_loop, synthesizer_pictures, to_device
from pretrain.runtime.metrics import MetricsLogger
from pretrain.runtime.profiling import build_profiler
from pretrain.model import IGNORE_INDEX, T5Model, build_model, universal_checkpoint_info, with_vocab
from pretrain.model.pretrained import export_config, foreign_tokenizer, load_weights
from pretrain.runtime.schedule import with_finetune_lr
from pretrain.distributed.parallel import init_distributed
from pretrain.tasks import Example, get_task
from tokenizer.spm import Tokenizer

log = logging.getLogger("pretrain.finetune")


@dataclass(frozen=True)
class TaskConfig:
    name: str = "sst2"  # a task of pretrain.tasks; also its key in results.json
    max_input_length: int = 128  # tokens including EOS; longer inputs are truncated
    dropout: float = 0.1  # replaces the export's model.dropout (T5 fine-tunes with 0.1)
    freeze_mixture: bool = False  # keep the pretrained mixture weights (attn.mix) fixed
    train_examples: int = 0  # use only the first N training examples (0: all)

    def __post_init__(self) -> None:
        check_at_least("task", self, {"max_input_length": 2, "train_examples": 0})  # inputs: a token and EOS


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
        check_at_least("eval", self, {"batch": 1})
        if self.method not in METHODS:
            raise ConfigError(f"eval.method '{self.method}' is not one of {', '.join(METHODS)}")


@dataclass(frozen=True)
class FinetuneConfig:
    init: str = ""  # export folder to start from (python -m pretrain.export)
    from_scratch: bool = False  # a random initialisation of init's model (its config and tokenizer, not its weights)
    run: RunConfig = field(default_factory=RunConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    zero: ZeroConfig = field(default_factory=ZeroConfig)
    precision: str = "auto"  # auto (bf16 on CUDA, fp32 on CPU), fp32, bf16 or fp16
    task: TaskConfig = field(default_factory=TaskConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    data: FinetuneDataConfig = field(default_factory=FinetuneDataConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    log: LogConfig = field(default_factory=LogConfig)
    eval: FinetuneEvalConfig = field(default_factory=FinetuneEvalConfig)
    profile: ProfileConfig = field(default_factory=ProfileConfig)


def check_examples(num_examples: int, file: Path, task: TaskConfig, micro_batch: int, dp: int) -> None:
    """Every DP rank's first micro batch must be full: fewer examples is a user's mistake, refused in one line
    (identical on every rank) before the lock or the export is touched."""
    if num_examples < micro_batch * dp:
        kept = f" (task.train_examples={task.train_examples})" if task.train_examples else ""
        raise UsageError(f"task {task.name}: {file}{kept} gives {num_examples} training examples, fewer than one micro "
                         f"batch on every DP rank: train.micro_batch ({micro_batch}) x DP ({dp}) = {micro_batch * dp}; "
                         "add examples or lower train.micro_batch")


class ExampleStream:
    """Endless micro batches of this DP rank: each epoch a permutation seeded by (seed, epoch), cut into
    global batches of micro x DP examples, of which DP rank r takes the r-th micro slice. Resumable on any layout
    of the same global batch: the position is counted in examples."""

    def __init__(self, rows: list[tuple[list[int], list[int]]], micro: int, dp_rank: int, dp: int, seed: int):
        assert len(rows) >= micro * dp, "check_examples refuses a training set smaller than one micro batch x DP"
        self.rows, self.micro, self.dp_rank, self.dp, self.seed = rows, micro, dp_rank, dp, seed
        self.epoch, self.position = 0, 0  # position: global micro-batch slices consumed in this epoch

    def state_dict(self) -> dict:
        return {"epoch": self.epoch, "examples": self.position * self.micro * self.dp}

    def load_state_dict(self, state: dict) -> None:
        """`{"ranks": [...]}`: every saved DP rank holds the same global position (examples of this epoch)."""
        saved = state["ranks"][0]
        self.epoch, self.position = saved["epoch"], saved["examples"] // (self.micro * self.dp)

    def __iter__(self) -> Iterator[dict[str, torch.Tensor]]:
        per_slice = self.micro * self.dp
        while True:
            order = torch.randperm(len(self.rows), generator=torch.Generator().manual_seed(self.seed + self.epoch))
            while (self.position + 1) * per_slice <= len(self.rows):
                start = self.position * per_slice + self.dp_rank * self.micro
                self.position += 1
                yield collate([self.rows[i] for i in order[start : start + self.micro].tolist()])
            self.epoch, self.position = self.epoch + 1, 0


def collate(rows: list[tuple[list[int], list[int]]]) -> dict[str, torch.Tensor]:
    """Inputs padded with 0; labels padded with IGNORE_INDEX; decoder inputs = labels shifted right from 0."""
    n, m = max(len(i) for i, _ in rows), max(len(t) for _, t in rows)
    input_ids = torch.zeros(len(rows), n, dtype=torch.long)
    labels = torch.full((len(rows), m), IGNORE_INDEX, dtype=torch.long)
    for k, (i, t) in enumerate(rows):
        input_ids[k, : len(i)] = torch.tensor(i)
        labels[k, : len(t)] = torch.tensor(t)
    decoder_input_ids = torch.cat([torch.zeros(len(rows), 1, dtype=torch.long), labels[:, :-1].clamp(min=0)], dim=1)
    return {"input_ids": input_ids, "attention_mask": (input_ids != 0).long(), "decoder_input_ids": decoder_input_ids,
            "labels": labels}


def tokenize(examples: list[Example], tokenizer: Tokenizer, max_input_length: int) -> list[tuple[list[int], list[int]]]:
    inputs = tokenizer.encode_batch([e.inputs for e in examples])
    targets = tokenizer.encode_batch([e.target for e in examples])
    eos = tokenizer.eos_id
    return [(i[: max_input_length - 1] + [eos], t + [eos]) for i, t in zip(inputs, targets)]


def build_from_export(model_cfg: ModelConfig, folder: str | Path, freeze_mixture: bool,
                      activation_checkpointing: str | bool = "none", compile: bool = False,
                      device: torch.device | str = "cpu", weights: bool = True) -> T5Model:
    """This rank's TP shard of the exported model on `device` (every TP size), read one parameter at a time
    (pretrain.model.pretrained): the host never holds the model. weights=False: the model as initialised
    (from run.seed), for the from-scratch reference."""
    model = build_model(model_cfg, activation_checkpointing=activation_checkpointing, compile=compile, device=device)
    if weights:
        load_weights(model, folder, strict=True)
    if freeze_mixture:
        for name, param in model.named_parameters():
            if name.endswith(".attn.mix"):
                param.requires_grad_(False)
    return model


class TaskEvaluation:
    """The task's official metrics on its validation files every `eval.every` steps and at the end (then also the
    test-set predictions); writes `results.json` / `results.md` (rank 0) and returns `eval/<split>/<metric>`."""

    def __init__(self, model: T5Model, tokenizer: Tokenizer, task, cfg: FinetuneConfig, max_input_length: int,
                 run_dir: Path, rank: int) -> None:
        self.model, self.tokenizer, self.task, self.cfg = model, tokenizer, task, cfg
        self.max_input_length, self.run_dir, self.rank = max_input_length, run_dir, rank

    def due(self, step: int, final: bool) -> bool:
        return final or bool(self.cfg.eval.every and step % self.cfg.eval.every == 0)

    def __call__(self, step: int, final: bool) -> dict[str, float]:
        submission = self.run_dir / "submission" if final and self.cfg.eval.submission else None
        device = next(self.model.parameters()).device
        results = evaluate_task(self.model, self.tokenizer, self.task, self.cfg.data.dir, self.cfg.eval.method,
                                self.cfg.eval.batch, self.max_input_length, self.cfg.eval.limit, submission,
                                between_batches=lambda: stop_if_preempted(device, "during evaluation"))
        record = {f"eval/{split}/{k}": v for split, scores in results.items() for k, v in scores.items()}
        if self.rank == 0:
            write_results(self.run_dir, results)
            log.info("step %d  %s", step, "  ".join(f"{k} {v:.4f}" for k, v in record.items()))
        return record


def finetune(cfg: FinetuneConfig) -> int:
    # 1. Process groups, checks, the task and its files (all read now), the exported weights ----------------------
    dims = init_distributed(cfg.parallel, cfg.run.seed)
    init_logging(dims.rank)
    stop_if_preempted(dims.device)  # a signal during the imports or the rendezvous: every rank stops here
    cfg = dataclasses.replace(cfg, precision=resolve_precision(cfg.precision, dims.device))
    check_precision(cfg.precision, cfg.parallel.backend, dims.device)
    if not isinstance(cfg.train.micro_batch, int):
        raise UsageError(f"train.micro_batch '{cfg.train.micro_batch}': fine-tuning takes a number (auto is the "
                         "pretraining planner's)")
    if not cfg.init:
        raise UsageError("init is empty; pass init=EXPORT_DIR (made by python -m pretrain.export)")
    task = get_task(cfg.task.name)
    if (Path(cfg.data.dir) / task.folder).is_dir():  # a benchmark root: one data.dir for a whole array job
        cfg = dataclasses.replace(cfg, data=dataclasses.replace(cfg.data, dir=str(Path(cfg.data.dir) / task.folder)))
    examples = task.read(cfg.data.dir, task.train, labelled=True)
    examples = examples[: cfg.task.train_examples] if cfg.task.train_examples else examples
    check_examples(len(examples), Path(cfg.data.dir) / task.train, cfg.task, cfg.train.micro_batch, dims.dp)
    check_evaluation_files(task, cfg.data.dir, cfg.eval.submission)
    if cfg.data.tokenizer and (own := foreign_tokenizer(Path(cfg.init), Tokenizer(cfg.data.tokenizer).path)):
        raise UsageError(f"data.tokenizer ({cfg.data.tokenizer}) is not {own}, the tokenizer the export was trained "
                         "with: its token ids would mean other pieces; leave data.tokenizer empty (the export's own)")
    run_dir = Path(cfg.run.dir)
    profiler = build_profiler(cfg.profile, run_dir, dims)  # None when off; profile.ranks checked against the world
    accumulation = num_accumulation_steps(cfg.train, dims.dp)
    lock = acquire_run_lock(run_dir, dims)
    try:
        model_cfg = dataclasses.replace(export_config(cfg.init), dropout=cfg.task.dropout)
        cfg = dataclasses.replace(cfg, train=with_finetune_lr(cfg.train, model_cfg.d_model))  # lr: auto
        spiece = cfg.data.tokenizer or str(Path(cfg.init) / "spiece.model")
        cfg = dataclasses.replace(cfg, data=dataclasses.replace(cfg.data, tokenizer=spiece))
        tokenizer = Tokenizer(spiece)
        model_cfg = with_vocab(model_cfg, tokenizer.num_ids)  # the export's token rows; padding is per TP
        max_input_length = input_limit(model_cfg, cfg.task.max_input_length)

        # 2. Model at this job's TP from the full weights, optionally with frozen mixture weights, and the engine
        root = run_dir / "checkpoints"
        inputs = RunInputs.of(spiece)
        resume = find_resume(cfg.checkpoint, root, dims.rank, dims.world)
        plan = prepare_resume(resume, model_cfg, inputs, dims, cfg.parallel.timeout_s, precision=cfg.precision,
                              zero_stage=cfg.zero.stage) if resume else None
        model = build_from_export(model_cfg, cfg.init, cfg.task.freeze_mixture, cfg.train.activation_checkpointing,
                                  cfg.train.compile, dims.device, weights=not cfg.from_scratch)
        engine = build_engine(model, cfg.train, cfg.zero, cfg.precision, dims.dp,
                              load_universal=bool(plan and plan.universal))
        if not plan and not cfg.from_scratch:  # a resume restores its own master weights
            load_master_weights(engine, cfg.init)
        stop_if_preempted(dims.device)

        # 3. Data: the task's training file, tokenized once, streamed by DP rank -----------------------------------
        stream = ExampleStream(tokenize(examples, tokenizer, max_input_length), cfg.train.micro_batch,
                               dims.dp_rank, dims.dp, cfg.run.seed)

        # 4. Checkpoints and restore; the checkpoint's config.yaml also names the model and tokenizer, so
        #    pretrain.export reads fine-tuned runs -----------------------------------------------------------------
        progress = Progress()
        config_yaml = to_yaml(cfg) + yaml.safe_dump({"model": dataclasses.asdict(model_cfg)}, sort_keys=False)
        checkpoints = CheckpointManager(cfg.checkpoint, root, dims, engine=engine, progress=progress, data=stream,
                                        inputs=inputs, config_yaml=config_yaml,
                                        universal_info=universal_checkpoint_info(model, model_cfg.vocab_size))
        if plan:
            checkpoints.load(plan)
            log.info("resumed from %s at step %d", plan.path, progress.step)
        if dims.rank == 0:
            save_config(cfg, run_dir / "config.yaml")

        # 5. Metrics, evaluation and the loop ----------------------------------------------------------------------
        meter = Meter(every=cfg.log.every, steps=cfg.train.steps, samples_per_step=cfg.train.global_batch,
                      extra=lambda: mixture_metrics(engine.module, cfg.zero.stage),
                      straggler_factor=cfg.log.straggler_factor)
        evaluator = TaskEvaluation(engine.module, tokenizer, task, cfg, max_input_length, run_dir, dims.rank)
        metrics = MetricsLogger(run_dir, enabled=dims.rank == 0, start_step=progress.step, wandb=cfg.log.wandb,
                                config=yaml.safe_load(to_yaml(cfg)))
        metrics.write_text("config", to_yaml(cfg), step=progress.step)
        log.info("fine-tuning %s on %d examples: steps %d -> %d, global batch %d = micro %d x accumulation %d x DP %d, "
                 "peak lr %.3g", task.name, len(examples), progress.step, cfg.train.steps, cfg.train.global_batch,
                 cfg.train.micro_batch, accumulation, dims.dp, cfg.train.lr)
        try:
            code = run_loop(engine, to_device(stream, dims.device), accumulation, dims, cfg.train, progress, meter,
                            checkpoints, metrics, evaluator,
                            pictures=lambda: synthesizer_pictures(engine.module, cfg.zero.stage),
                            profiler=profiler)
        finally:
            metrics.close()
    finally:
        lock.release()
    if code == EXIT_OK and dims.rank == 0 and (run_dir / "results.md").is_file():
        print((run_dir / "results.md").read_text(), end="")
    return code


def main(argv: list[str] | None = None) -> int:
    watch_preemption()  # (again: the prelude above does it before the imports when run as `python -m`)
    cfg = parse_args(FinetuneConfig, argv, prog="pretrain.finetune")
    return run_with_exit_codes(lambda: finetune(cfg), "pretrain.finetune")

if __name__ == "__main__":
    sys.exit(main())
