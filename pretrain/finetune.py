"""Fine-tuning of exported weights on a GLUE/SuperGLUE task, text to text:
`torchrun --nproc-per-node N -m pretrain.finetune --config configs/finetune/TASK.yaml init=OUT data.dir=DIR
run.dir=RUN [section.key=value ...]` (or `srun python -m pretrain.finetune ...`).

The same machinery as pretraining: process groups and TP (`pretrain.parallel`), the DeepSpeed engine
(`pretrain.engine`: ZeRO, bf16, clipping, LR schedule), checkpoints with resume and re-sharding
(`pretrain.checkpoint`), the train step and metrics (`pretrain.train`, `pretrain.metrics`: metrics.jsonl and
TensorBoard). The model is built at this job's TP from the export's full weights, Synthesizer layers and
mixture weights included (`task.freeze_mixture` keeps the mixture fixed). Evaluation (`pretrain.evaluate`)
runs every `eval.every` steps and at the end, writing `RUN/results.json`, `RUN/results.md` and test-set
predictions under `RUN/submission/`.
"""
from __future__ import annotations

import dataclasses
import logging
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterator

import torch
import yaml

from pretrain.checkpoint import CheckpointManager, TrainerState, find_resume, prepare_resume
from pretrain.config import (CheckpointConfig, LogConfig, ModelConfig, ParallelConfig, RunConfig,
                             TrainConfig, ZeroConfig, parse_args, save_config, to_yaml)
from pretrain.engine import build_engine, num_accumulation_steps
from pretrain.evaluate import METHODS, evaluate_task, write_results
from pretrain.export import read_export
from pretrain.faults import EXIT_OK, SkipBudget, run_with_exit_codes
from pretrain.metrics import MetricsLogger
from pretrain.model import IGNORE_INDEX, T5Model, build_model, load_full_state_dict, universal_checkpoint_info
from pretrain.parallel import VOCAB_MULTIPLE, init_distributed, padded_vocab_size
from pretrain.tasks import Example, TaskFileError, get_task
from pretrain.train import init_logging, mixture_metrics, train_step
from tokenizer.spm import Tokenizer

log = logging.getLogger("pretrain.finetune")


@dataclass(frozen=True)
class TaskConfig:
    name: str = "sst2"  # a task of pretrain.tasks; also its key in results.json
    max_input_length: int = 128  # tokens including EOS; longer inputs are truncated
    dropout: float = 0.1  # replaces the export's model.dropout (T5 fine-tunes with 0.1)
    freeze_mixture: bool = False  # keep the pretrained mixture weights (attn.mix) fixed
    train_examples: int = 0  # use only the first N training examples (0: all)


@dataclass(frozen=True)
class FinetuneDataConfig:
    dir: str = ""  # the task's folder in the official layout (glue_data/SST-2), or the folder above it (glue_data)
    tokenizer: str = ""  # spiece.model; empty: the one in the `init` export


@dataclass(frozen=True)
class FinetuneEvalConfig:
    every: int = 0  # steps between evaluations (0: only at the end)
    method: str = "both"  # generate (greedy, cached), rank (classification over label words) or both
    batch: int = 32  # examples per forward pass
    limit: int = 0  # evaluate only the first N examples of each file (0: all)
    submission: bool = True  # write test-set predictions in the benchmark's format at the end


@dataclass(frozen=True)
class FinetuneConfig:
    init: str = ""  # export folder to start from (python -m pretrain.export)
    run: RunConfig = field(default_factory=RunConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    zero: ZeroConfig = field(default_factory=ZeroConfig)
    precision: str = "fp32"
    task: TaskConfig = field(default_factory=TaskConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    data: FinetuneDataConfig = field(default_factory=FinetuneDataConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    log: LogConfig = field(default_factory=LogConfig)
    eval: FinetuneEvalConfig = field(default_factory=FinetuneEvalConfig)


class ExampleStream:
    """Endless micro batches of this DP rank: each epoch a permutation seeded by (seed, epoch), cut into
    global batches of micro x DP examples, of which DP rank r takes the r-th micro slice. Resumable."""

    def __init__(self, rows: list[tuple[list[int], list[int]]], micro: int, dp_rank: int, dp: int, seed: int):
        if len(rows) < micro * dp:
            raise ValueError(f"{len(rows)} training examples cannot fill one micro batch of {micro} x DP {dp}")
        self.rows, self.micro, self.dp_rank, self.dp, self.seed = rows, micro, dp_rank, dp, seed
        self.epoch, self.position = 0, 0  # position: global micro-batch slices consumed in this epoch

    def state_dict(self) -> dict:
        return {"epoch": self.epoch, "position": self.position}

    def load_state_dict(self, state: dict) -> None:
        self.epoch, self.position = state["epoch"], state["position"]

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


def fit_vocab(model_cfg: ModelConfig, full_state: dict[str, torch.Tensor], num_ids: int, tp: int
              ) -> tuple[ModelConfig, dict[str, torch.Tensor]]:
    """Re-pad the embedding and LM head rows to a multiple of 128 x TP when this job's TP needs it.

    Rows past the tokenizer's `num_ids` are never looked up nor targets. Dropped rows lose nothing; added LM-head
    rows copy the pad row (id 0, never a target, so trained to a low logit), which keeps them out of the argmax.
    """
    if model_cfg.vocab_size % (VOCAB_MULTIPLE * tp) == 0:
        return model_cfg, full_state
    rows = padded_vocab_size(num_ids, tp)
    state = dict(full_state)
    embed, head = state["embed.weight"], state["lm_head.weight"]  # [V, d]
    if rows <= embed.shape[0]:
        state["embed.weight"], state["lm_head.weight"] = embed[:rows].clone(), head[:rows].clone()
    else:
        extra = rows - embed.shape[0]
        state["embed.weight"] = torch.cat([embed, embed.new_zeros(extra, embed.shape[1])])
        state["lm_head.weight"] = torch.cat([head, head[:1].expand(extra, -1)])
    log.info("vocabulary rows %d -> %d for TP %d", model_cfg.vocab_size, rows, tp)
    return dataclasses.replace(model_cfg, vocab_size=rows), state


def build_from_export(model_cfg: ModelConfig, full_state: dict[str, torch.Tensor], freeze_mixture: bool,
                      activation_checkpointing: bool = False) -> T5Model:
    """This rank's TP shard of the exported model (every TP size: the full weights are sliced here)."""
    model = build_model(model_cfg, activation_checkpointing=activation_checkpointing)
    load_full_state_dict(model, full_state)
    if freeze_mixture:
        for name, param in model.named_parameters():
            if name.endswith(".attn.mix"):
                param.requires_grad_(False)
    return model


def finetune(cfg: FinetuneConfig) -> int:
    # 1. Process groups, the task, the exported weights ------------------------------------------------------
    dims = init_distributed(cfg.parallel, cfg.run.seed)
    init_logging(dims.rank)
    if cfg.eval.method not in METHODS:
        raise ValueError(f"eval.method '{cfg.eval.method}' is not one of {', '.join(METHODS)}")
    # checked here, not when the first evaluation runs after hours of training
    if cfg.eval.batch < 1:
        raise ValueError(f"eval.batch ({cfg.eval.batch}) must be at least 1")
    if cfg.task.max_input_length < 2:
        raise ValueError(f"task.max_input_length ({cfg.task.max_input_length}) must be at least 2 (a token and EOS)")
    if not cfg.init:
        raise ValueError("init is empty; pass init=EXPORT_DIR (made by python -m pretrain.export)")
    task = get_task(cfg.task.name)
    if (Path(cfg.data.dir) / task.folder).is_dir():  # a benchmark root: one data.dir for a whole array job
        cfg = dataclasses.replace(cfg, data=dataclasses.replace(cfg.data, dir=str(Path(cfg.data.dir) / task.folder)))
    model_cfg, full_state = read_export(cfg.init)
    model_cfg = dataclasses.replace(model_cfg, dropout=cfg.task.dropout)
    spiece = cfg.data.tokenizer or str(Path(cfg.init) / "spiece.model")
    cfg = dataclasses.replace(cfg, data=dataclasses.replace(cfg.data, tokenizer=spiece))
    tokenizer = Tokenizer(spiece)
    model_cfg, full_state = fit_vocab(model_cfg, full_state, tokenizer.num_ids, dims.tp)
    run_dir = Path(cfg.run.dir)
    accumulation = num_accumulation_steps(cfg.train, dims.dp)

    # 2. Model at this job's TP from the full weights, optionally with frozen mixture weights, and the engine
    checkpoints = CheckpointManager(cfg.checkpoint, run_dir / "checkpoints", dims)
    resume_path = find_resume(cfg.checkpoint, checkpoints.root)
    plan = prepare_resume(resume_path, model_cfg, dims) if resume_path else None
    model = build_from_export(model_cfg, full_state, cfg.task.freeze_mixture, cfg.train.activation_checkpointing)
    engine = build_engine(model, cfg.train, cfg.zero, cfg.precision, dims.dp, load_universal=bool(plan and plan.universal))
    universal_info = universal_checkpoint_info(model, tokenizer.num_ids)

    # 3. Data: the task's training file, tokenized once, streamed by DP rank -----------------------------------
    examples = task.read(cfg.data.dir, task.train, labelled=True)
    examples = examples[: cfg.task.train_examples] if cfg.task.train_examples else examples
    stream = ExampleStream(tokenize(examples, tokenizer, cfg.task.max_input_length), cfg.train.micro_batch,
                           dims.dp_rank, dims.dp, cfg.run.seed)

    # 4. Restore -----------------------------------------------------------------------------------------------
    state = TrainerState(step=0, tokens_seen=0, skipped_steps=0, tp=dims.tp, dp=dims.dp)
    if plan:
        loader_state = checkpoints.load(engine, plan)
        if loader_state is not None:
            stream.load_state_dict(loader_state)
        state = TrainerState(plan.state.step, 0, plan.state.skipped_steps, dims.tp, dims.dp)
        log.info("resumed from %s at step %d", plan.path, state.step)
    # the checkpoint's config.yaml also names the model and tokenizer, so pretrain.export reads fine-tuned runs
    config_yaml = to_yaml(cfg) + yaml.safe_dump({"model": dataclasses.asdict(model_cfg)}, sort_keys=False)
    if dims.rank == 0:
        save_config(cfg, run_dir / "config.yaml")
    metrics = MetricsLogger(run_dir, enabled=dims.rank == 0, start_step=state.step)

    # 5. The loop ------------------------------------------------------------------------------------------------
    log.info("fine-tuning %s on %d examples: steps %d -> %d, global batch %d = micro %d x accumulation %d x DP %d",
             task.name, len(examples), state.step, cfg.train.steps, cfg.train.global_batch, cfg.train.micro_batch,
             accumulation, dims.dp)
    batches = ({k: v.to(dims.device) for k, v in b.items()} for b in stream)
    window, norms, start = [], [], time.perf_counter()
    budget = SkipBudget(cfg.train.max_skipped_steps, state.skipped_steps)
    while state.step < cfg.train.steps:
        result = train_step(engine, batches, accumulation, dims)
        if result.non_finite:
            budget.skip(state.step + 1)
        if result.loss is None:  # nothing applied: the same step is tried again with the next batches
            continue
        state = TrainerState(state.step + 1, 0, budget.skipped, dims.tp, dims.dp)
        window.append(result.loss)
        norms.append(result.grad_norm)
        record: dict[str, float] = {}
        last = state.step == cfg.train.steps
        if state.step % cfg.log.every == 0 or last:
            record = {"loss": sum(window) / len(window), "lr": engine.get_lr()[0], "grad_norm": norms[-1],
                      "samples_per_s": cfg.train.global_batch * len(window) / (time.perf_counter() - start)}
            record.update(mixture_metrics(engine.module, cfg.zero.stage))
            log.info("step %d/%d  loss %.4f  lr %.3g  %.1f samples/s", state.step, cfg.train.steps, record["loss"],
                     record["lr"], record["samples_per_s"])
            window, norms, start = [], [], time.perf_counter()
        if last or (cfg.eval.every and state.step % cfg.eval.every == 0):
            results = evaluate_task(engine.module, tokenizer, task, cfg.data.dir, cfg.eval.method, cfg.eval.batch,
                                    cfg.task.max_input_length, cfg.eval.limit,
                                    run_dir / "submission" if last and cfg.eval.submission else None)
            record.update({f"eval/{split}/{k}": v for split, scores in results.items() for k, v in scores.items()})
            if dims.rank == 0:
                write_results(run_dir, results)
                log.info("step %d  %s", state.step, "  ".join(f"{k} {v:.4f}" for k, v in record.items() if k.startswith("eval/")))
        if record:
            metrics.write(state.step, record)
        if last or (cfg.checkpoint.every and state.step % cfg.checkpoint.every == 0):
            checkpoints.save(engine, state, stream.state_dict(), config_yaml, universal_info)
    metrics.close()
    if dims.rank == 0 and (run_dir / "results.md").is_file():
        print((run_dir / "results.md").read_text(), end="")
    return EXIT_OK


def main(argv: list[str] | None = None) -> int:
    cfg = parse_args(FinetuneConfig, argv, prog="pretrain.finetune")
    return run_with_exit_codes(lambda: finetune(cfg), "pretrain.finetune", usage_errors=(TaskFileError,))

if __name__ == "__main__":
    sys.exit(main())
