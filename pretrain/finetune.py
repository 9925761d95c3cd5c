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
from pathlib import Path

import yaml

from pretrain.runtime.checkpoint import CheckpointManager, Progress, RunInputs, find_resume, prepare_resume
from pretrain.core.config import UsageError, parse_args, save_config, to_yaml
from pretrain.core.finetune_config import FinetuneConfig
from pretrain.data.task_examples import ExampleStream, check_examples, tokenize
from pretrain.runtime.engine import build_engine, load_master_weights, num_accumulation_steps
from pretrain.transfer.evaluation import TaskEvaluation, check_evaluation_files, input_limit
from pretrain.runtime.faults import EXIT_OK, run_with_exit_codes, stop_if_preempted
from pretrain.runtime.preemption import watch_preemption
from pretrain.runtime.jobs import acquire_run_lock, check_precision, init_logging, resolve_precision
from pretrain.runtime.loop import Meter, mixture_metrics, run_loop, synthesizer_pictures, to_device
from pretrain.runtime.metrics import MetricsLogger
from pretrain.runtime.profiling import build_profiler
from pretrain.model import universal_checkpoint_info, with_vocab
from pretrain.model.pretrained import build_from_export, export_config, foreign_tokenizer
from pretrain.runtime.schedule import with_finetune_lr
from pretrain.distributed.parallel import init_distributed
from pretrain.tasks import get_task
from tokenizer.spm import Tokenizer

log = logging.getLogger("pretrain.finetune")


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
