"""Pretraining: `python -m launch.run --nproc-per-node N -m pretrain.train --config FILE [section.key=value ...]`
(torchrun with the jobs' exit codes; or `srun python -m pretrain.train ...`). `train` is the setup, top to bottom:
process groups, checks, the run lock, tokenizer, checkpoint to resume, model (random, or from `init=` weights) and
DeepSpeed engine, data (train stream and the fixed validation slice, both opened now), restore; then the shared
loop (`pretrain.runtime.loop.run_loop`). Exit codes are in pretrain.runtime.faults.
"""
from __future__ import annotations

if __name__ == "__main__":  # answer --help before the heavy imports below (torch, DeepSpeed, megatron: seconds)
    from pretrain.runtime.preemption import watch_preemption
    watch_preemption()  # and record a preemption signal from now on: the job exits 75 at its first agreed check
    from pretrain.core.cli import exit_on_help
    exit_on_help("Config", prog="pretrain.train")

import dataclasses
import json
import logging
import sys
from pathlib import Path

import torch
import yaml

from pretrain.core.files import write_atomic
from pretrain.runtime.checkpoint import CheckpointManager, Progress, RunInputs, find_resume, prepare_resume
from pretrain.core.config import Config, parse_args, save_config, to_yaml
from pretrain.data.loader import build_eval_loader, build_train_loader
from pretrain.data.shards import expand_shards
from pretrain.runtime.engine import build_engine, load_master_weights
from pretrain.runtime.faults import run_with_exit_codes, stop_if_preempted
from pretrain.runtime.preemption import watch_preemption
from pretrain.runtime.jobs import acquire_run_lock, check_precision, init_logging
from pretrain.runtime.loop import Meter, mixture_metrics, run_loop, synthesizer_pictures, to_device
from pretrain.runtime.metrics import MetricsLogger, peak_flops
from pretrain.runtime.profiling import build_profiler
from pretrain.runtime.validation import ValidationLoss, sum_over_dp
from pretrain.model import build_model, universal_checkpoint_info, with_vocab
from pretrain.model.flops import flops_per_sequence
from pretrain.model.pretrained import check_init_folder, load_weights
from pretrain.distributed.parallel import ParallelDims, init_distributed
from pretrain.planning.planner import check_job, check_memory, with_layout
from tokenizer.spm import Tokenizer

log = logging.getLogger("pretrain.train")


def start_from_init(model: torch.nn.Module, cfg: Config, dims: ParallelDims, run_dir: Path) -> None:
    """`init=`'s weights into the freshly built model: what fits is loaded, the rest keeps its draw from the run's
    seed; the lists go to the log and to run.dir/init.json."""
    report = load_weights(model, cfg.init, resize_vocab=cfg.init_resize_vocab)
    log.info("init %s: %d tensors loaded, %d fresh (%s), %d of the folder unused", cfg.init, len(report.loaded),
             len(report.fresh), ", ".join(report.fresh) or "none", len(report.unused))
    if dims.rank == 0:
        write_atomic(run_dir / "init.json", json.dumps(dataclasses.asdict(report), indent=1) + "\n")


def train(cfg: Config) -> int:
    # 1. Process groups (TP x DP), seeds, and every check that needs no allocation: the planner's own
    #    (pretrain.planning.planner.check_job: layout, model, batch split, DeepSpeed options; on CUDA, the memory estimate
    #    against the device's memory), with the model's vocabulary resolved from the tokenizer first ------------
    dims = init_distributed(cfg.parallel, cfg.run.seed)
    init_logging(dims.rank)
    stop_if_preempted(dims.device)  # a signal during the imports or the rendezvous: every rank stops here
    check_precision(cfg.precision, cfg.parallel.backend, dims.device)
    cfg = dataclasses.replace(cfg, model=with_vocab(cfg.model, Tokenizer(cfg.data.tokenizer).num_ids))
    gpu_memory = torch.cuda.get_device_properties(dims.device).total_memory if dims.device.type == "cuda" else None
    layout = check_job(cfg, dims.world, gpu_memory)
    cfg = with_layout(cfg, layout)  # train.micro_batch: auto -> the number the layout chose
    if gpu_memory is not None:
        check_memory(cfg, layout, gpu_memory)
    if cfg.init:
        check_init_folder(Path(cfg.init), cfg.model, Path(cfg.data.tokenizer), cfg.init_resize_vocab)
    run_dir = Path(cfg.run.dir)
    profiler = build_profiler(cfg.profile, run_dir, dims)  # None when off; profile.ranks checked against the world
    lock = acquire_run_lock(run_dir, dims)
    try:
        # 3. Checkpoint to resume: decided before the engine, which must know whether it loads a universal one;
        #    the newest intact one (all ranks share the checksum reads), refused if made with other inputs --------
        root = run_dir / "checkpoints"
        # the shards as the stream reads them (a mixture's, data.sources, are the loader's to record and check)
        inputs = RunInputs.of(cfg.data.tokenizer, expand_shards(cfg.data.train) if cfg.data.train else ())
        resume = find_resume(cfg.checkpoint, root, dims.rank, dims.world)
        plan = prepare_resume(resume, cfg.model, inputs, dims, cfg.parallel.timeout_s, precision=cfg.precision,
                              zero_stage=cfg.zero.stage) if resume else None

        # 4. Model (this rank's TP shard, identical full init on every rank, built on its device), then `init`'s
        #    weights unless this run resumes its own checkpoint (a requeue continues), and the engine, whose
        #    bf16/fp16 master weights start from init's fp32 values, not from the cast module -------------------
        model = build_model(cfg.model, activation_checkpointing=cfg.train.activation_checkpointing,
                            compile=cfg.train.compile, device=dims.device)
        if cfg.init and not plan:
            start_from_init(model, cfg, dims, run_dir)
        engine = build_engine(model, cfg.train, cfg.zero, cfg.precision, dims.dp,
                              load_universal=bool(plan and plan.universal))
        if cfg.init and not plan:
            load_master_weights(engine, cfg.init, cfg.init_resize_vocab)
        stop_if_preempted(dims.device)

        # 5. Data: this DP rank's stream of span-corrupted micro batches; the validation slice, read now so a bad
        #    file fails before hours of training ------------------------------------------------------------------
        loader = build_train_loader(cfg.data, seed=cfg.run.seed, dp_rank=dims.dp_rank, dp_size=dims.dp,
                                    micro_batch=cfg.train.micro_batch)
        # {"": data.valid's slice, NAME: the slice of that source's valid}
        names = ([""] if cfg.data.valid else []) + [s.name for s in cfg.data.sources if s.valid]
        validation = {name: build_eval_loader(cfg.data, dp_rank=dims.dp_rank, dp_size=dims.dp,
                                              micro_batch=cfg.train.micro_batch, source=name,
                                              num_examples=cfg.eval.batches * cfg.train.global_batch)
                      for name in (names if cfg.eval.every else [])}

        # 6. Checkpoints (engine, progress, data position, RNG) and restore ---------------------------------------
        progress = Progress()
        # a reshard keeps the token rows and pads them anew for the new TP (padding rows are masked, see t5.py)
        checkpoints = CheckpointManager(cfg.checkpoint, root, dims, engine=engine, progress=progress, data=loader,
                                        inputs=inputs, config_yaml=to_yaml(cfg),
                                        universal_info=universal_checkpoint_info(model, cfg.model.vocab_size))
        if plan:
            checkpoints.load(plan)
            log.info("resumed from %s at step %d", plan.path, progress.step)
        if dims.rank == 0:
            save_config(cfg, run_dir / "config.yaml")

        # 7. Metrics and the loop ---------------------------------------------------------------------------------
        meter = Meter(
            every=cfg.log.every, steps=cfg.train.steps, samples_per_step=cfg.train.global_batch,
            # model FLOPs utilisation: achieved model FLOP/s over the peak of all devices of the job
            flops_per_step=cfg.train.global_batch * flops_per_sequence(cfg.model, layout.input_length,
                                                                       layout.target_length),
            job_peak_flops=peak_flops(cfg.log.peak_flops, dims.device, cfg.precision) * dims.world,
            extra=lambda: {**mixture_metrics(engine.module, cfg.zero.stage),
                           **loader.metrics(lambda values: sum_over_dp(values, dims.device))},
            straggler_factor=cfg.log.straggler_factor)
        evaluator = ValidationLoss(engine, validation, cfg.eval.every, dims,
                                   weights={s.name: s.weight for s in cfg.data.sources}) if validation else None
        metrics = MetricsLogger(run_dir, enabled=dims.rank == 0, start_step=progress.step, wandb=cfg.log.wandb,
                                config=yaml.safe_load(to_yaml(cfg)))
        metrics.write_text("config", to_yaml(cfg), step=progress.step)
        log.info("training steps %d -> %d: global batch %d = micro %d x accumulation %d x DP %d, %d tokens/step",
                 progress.step, cfg.train.steps, cfg.train.global_batch, layout.micro_batch, layout.accumulation,
                 dims.dp, layout.tokens_per_step)
        try:
            return run_loop(engine, to_device(loader, dims.device), layout.accumulation, dims, cfg.train, progress,
                            meter, checkpoints, metrics, evaluator,
                            pictures=lambda: synthesizer_pictures(engine.module, cfg.zero.stage),
                            profiler=profiler)
        finally:
            loader.close()
            metrics.close()
    finally:
        lock.release()


def main(argv: list[str] | None = None) -> int:
    watch_preemption()  # (again: the prelude above does it before the imports when run as `python -m`)
    cfg = parse_args(Config, argv, prog="pretrain.train")
    return run_with_exit_codes(lambda: train(cfg), "pretrain.train")


if __name__ == "__main__":
    sys.exit(main())
