"""Pretraining: `python -m launch.run --nproc-per-node N -m pretrain.train --config FILE [section.key=value ...]`
(torchrun with the jobs' exit codes; or `srun python -m pretrain.train ...`). `train` is the setup, top to bottom:
process groups; the config resolved once (`resolve`: precision, vocabulary from the tokenizer, layout and micro
batch) and checked; then the job skeleton (`pretrain.runtime.jobs.run_job`: the run lock, checkpoint to resume,
model (random, or from `init=` weights, read once) and DeepSpeed engine, data (train stream and the fixed
validation slice, both opened now), restore, the shared loop). Exit codes are in pretrain.runtime.faults.
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

from pretrain.core.config import Config, parse_args
from pretrain.core.files import write_atomic
from pretrain.data.loader import build_eval_loader, build_train_loader
from pretrain.data.shards import expand_shards
from pretrain.distributed.parallel import ParallelDims
from pretrain.model import build_model, with_vocab
from pretrain.model.flops import flops_per_sequence
from pretrain.model.pretrained import LoadReport, check_init_folder
from pretrain.planning.planner import Layout, check_job, check_memory, with_layout
from pretrain.runtime.checkpoint import Progress, RunInputs
from pretrain.runtime.faults import run_with_exit_codes
from pretrain.runtime.jobs import Job, init_job, resolve_precision, run_job
from pretrain.runtime.preemption import watch_preemption
from pretrain.runtime.validation import ValidationLoss, sum_over_dp
from tokenizer.spm import Tokenizer

log = logging.getLogger("pretrain.train")


class Pretraining(Job):
    """A random model, or `init=`'s weights; this DP rank's stream of span-corrupted micro batches; the loss on
    fixed validation slices."""

    cfg: Config

    def __init__(self, cfg: Config, layout: Layout) -> None:
        # the shards as the stream reads them (a mixture's, data.sources, are the loader's to record and check)
        super().__init__(cfg, cfg.model, RunInputs.of(cfg.data.tokenizer,
                                                     expand_shards(cfg.data.train) if cfg.data.train else ()))
        self.layout, self.weights, self.resize_vocab = layout, cfg.init, cfg.init_resize_vocab
        self.flops_per_step = cfg.train.global_batch * flops_per_sequence(cfg.model, layout.input_length,
                                                                          layout.target_length)

    def build_model(self, dims: ParallelDims) -> torch.nn.Module:
        cfg = self.cfg
        return build_model(cfg.model, activation_checkpointing=cfg.train.activation_checkpointing,
                           compile=cfg.train.compile, device=dims.device)

    def weights_loaded(self, report: LoadReport, dims: ParallelDims) -> None:
        """`init`'s weights (unless this run resumes its own checkpoint): what fits is loaded, the rest keeps its
        draw from the run's seed; the lists go to the log and to run.dir/init.json."""
        log.info("init %s: %d tensors loaded, %d fresh (%s), %d of the folder unused", self.cfg.init,
                 len(report.loaded), len(report.fresh), ", ".join(report.fresh) or "none", len(report.unused))
        if dims.rank == 0:
            write_atomic(Path(self.cfg.run.dir) / "init.json", json.dumps(dataclasses.asdict(report), indent=1) + "\n")

    def build_data(self, dims: ParallelDims):
        self.loader = build_train_loader(self.cfg.data, seed=self.cfg.run.seed, dp_rank=dims.dp_rank,
                                         dp_size=dims.dp, micro_batch=self.cfg.train.micro_batch)
        return self.loader

    def build_evaluator(self, engine, dims: ParallelDims) -> ValidationLoss | None:
        """{"": data.valid's slice, NAME: the slice of that source's valid}, read now."""
        cfg = self.cfg
        names = ([""] if cfg.data.valid else []) + [s.name for s in cfg.data.sources if s.valid]
        validation = {name: build_eval_loader(cfg.data, dp_rank=dims.dp_rank, dp_size=dims.dp,
                                              micro_batch=cfg.train.micro_batch, source=name,
                                              num_examples=cfg.eval.batches * cfg.train.global_batch)
                      for name in (names if cfg.eval.every else [])}
        return ValidationLoss(engine, validation, cfg.eval.every, dims,
                              weights={s.name: s.weight for s in cfg.data.sources}) if validation else None

    def extra_metrics(self, dims: ParallelDims) -> dict[str, float]:
        return self.loader.metrics(lambda values: sum_over_dp(values, dims.device))

    def start_line(self, progress: Progress, accumulation: int, dims: ParallelDims) -> str:
        cfg, layout = self.cfg, self.layout
        return (f"training steps {progress.step} -> {cfg.train.steps}: global batch {cfg.train.global_batch} = "
                f"micro {layout.micro_batch} x accumulation {accumulation} x DP {dims.dp}, "
                f"{layout.tokens_per_step} tokens/step")


def resolve(cfg: Config, dims: ParallelDims, gpu_memory: int | None) -> tuple[Config, Layout]:
    """The config as the job runs it, from the one loaded, and its layout: the precision (the device's for auto),
    the model's vocabulary (model.vocab_size 0: the tokenizer's ids) and the micro batch (auto: the largest the
    layout fits in `gpu_memory`), after every check that needs no allocation: the planner's
    (pretrain.planning.planner.check_job: layout, model, batch split, DeepSpeed options)."""
    cfg = dataclasses.replace(cfg, precision=resolve_precision(cfg.precision, dims.device),
                              model=with_vocab(cfg.model, Tokenizer(cfg.data.tokenizer).num_ids))
    layout = check_job(cfg, dims.world, gpu_memory)
    return with_layout(cfg, layout), layout


def train(cfg: Config) -> int:
    # Process groups (TP x DP), seeds; the config resolved and checked (on CUDA, the memory estimate against the
    # device's memory too), and `init`'s folder against it
    dims = init_job(cfg)
    gpu_memory = torch.cuda.get_device_properties(dims.device).total_memory if dims.device.type == "cuda" else None
    cfg, layout = resolve(cfg, dims, gpu_memory)
    if gpu_memory is not None:
        check_memory(cfg, layout, gpu_memory)
    if cfg.init:
        check_init_folder(Path(cfg.init), cfg.model, Path(cfg.data.tokenizer), cfg.init_resize_vocab)
    return run_job(Pretraining(cfg, layout), dims)


def main(argv: list[str] | None = None) -> int:
    watch_preemption()  # (again: the prelude above does it before the imports when run as `python -m`)
    cfg = parse_args(Config, argv, prog="pretrain.train")
    return run_with_exit_codes(lambda: train(cfg), "pretrain.train")


if __name__ == "__main__":
    sys.exit(main())
