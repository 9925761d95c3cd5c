"""The job skeleton: what every job (pretraining, fine-tuning) does around its own parts. A command calls `init_job`,
resolves and checks its config (pretrain.core.config.JobConfig's sections are the skeleton's) and reads its inputs,
then calls `run_job` with a `Job`: its model and where the weights
come from, its data, its evaluation (torchtitan's shape: the components are built once, the checkpoint manager
loads them, one loop runs them). Also here: logging with a rank prefix, the precision/device rule, and the
run-folder lock agreed by all ranks. Entry points import these, not each other.
"""
from __future__ import annotations

import abc
import logging
import warnings
from pathlib import Path
from typing import Iterator, Protocol

import torch
import torch.distributed as dist
import yaml
from deepspeed import DeepSpeedEngine

from pretrain.core.config import JobConfig, ModelConfig, UsageError, save_config, to_yaml
from pretrain.core.deepspeed_config import num_accumulation_steps
from pretrain.distributed.parallel import ParallelDims, init_distributed
from pretrain.model import check_model, universal_checkpoint_info
from pretrain.model.pretrained import LoadReport, load_weights
from pretrain.runtime.checkpoint import CheckpointManager, DataStateful, Progress, ResumePlan, RunInputs
from pretrain.runtime.engine import build_engine, master_values, set_master_weights
from pretrain.runtime.faults import stop_if_preempted
from pretrain.runtime.loop import (
    Components,
    Evaluator,
    Meter,
    mixture_metrics,
    run_loop,
    synthesizer_pictures,
    to_device,
)
from pretrain.runtime.metrics import MetricsLogger, peak_flops
from pretrain.runtime.profiling import Profiler, build_profiler
from pretrain.runtime.resume import plan_resume
from pretrain.runtime.run_lock import RunLock

log = logging.getLogger(__name__)


def init_logging(rank: int) -> None:
    """A rank prefix on every line; info from rank 0, warnings and errors from every rank."""
    logging.basicConfig(
        level=logging.INFO if rank == 0 else logging.WARNING,
        format=f"%(asctime)s [rank {rank}] %(levelname)s %(name)s: %(message)s",
        force=True,
    )
    logging.getLogger("DeepSpeed").setLevel(logging.WARNING)  # its per-step chatter; our progress lines suffice


def resolve_precision(precision: str, device: torch.device) -> str:
    """`auto`: bf16 on CUDA, fp32 elsewhere; any other value as given."""
    if precision == "auto":
        return "bf16" if device.type == "cuda" else "fp32"
    return precision


def check_precision(precision: str, backend: str, device: torch.device) -> None:
    """bf16/fp16 on a CPU is almost always a job that meant to run on GPUs and did not get them: refused unless
    the config asks for the CPU explicitly (parallel.backend=gloo)."""
    if precision in ("bf16", "fp16") and device.type != "cuda" and backend != "gloo":
        raise UsageError(f"precision {precision} without CUDA: this job found no GPU (did the job request GPUs?); "
                         "use precision=fp32, or set parallel.backend=gloo to train in "
                         f"{precision} on the CPU on purpose")


def acquire_run_lock(run_dir: Path, dims: ParallelDims) -> RunLock:
    """Rank 0 takes `run.dir/lock`; every rank learns the outcome, so all of them stop on a refusal."""
    lock = RunLock(run_dir)
    refusal = ""
    if dims.rank == 0:
        try:
            lock.acquire()
        except UsageError as e:
            refusal = str(e)
    outcome = [refusal]
    dist.broadcast_object_list(outcome, src=0)
    if outcome[0]:
        raise UsageError(outcome[0])
    return lock


def init_job(cfg: JobConfig) -> ParallelDims:
    """Process groups (TP x DP, seeded from run.seed), rank-prefixed logging, a signal during the imports or the
    rendezvous (every rank stops here), and the precision as the job will resolve it, checked against the device."""
    dims = init_distributed(cfg.parallel, cfg.run.seed)
    init_logging(dims.rank)
    if dims.device.type != "cuda":  # advice on CUDA streams, from every TP rank's first backward: nothing to act on
        warnings.filterwarnings("ignore", message="When using async grad allreduce it is recommended to set the "
                                "environment variable CUDA_DEVICE_MAX_CONNECTIONS", category=UserWarning)
    stop_if_preempted(dims.device)
    check_precision(resolve_precision(cfg.precision, dims.device), cfg.parallel.backend, dims.device)
    return dims


class Data(DataStateful, Protocol):
    """A job's training data: this DP rank's endless micro batches, its position saved with each checkpoint."""

    def __iter__(self) -> Iterator[dict[str, torch.Tensor]]: ...

    def close(self) -> None: ...


class Job(abc.ABC):
    """What one job brings to the skeleton (`run_job`): its model and where the weights come from, its data, its
    evaluation. `cfg` is the job's config, resolved (auto values made concrete); the skeleton reads its shared
    sections (JobConfig: run, parallel, zero, precision, train, checkpoint, log, profile). `inputs`: what a resume
    must have been made from. `weights`: a folder whose weights start the model (and the optimizer's master copy)
    unless the run resumes ("": none); the skeleton reads it, once (`start_model`)."""

    weights: str = ""
    resize_vocab: bool = False  # `weights` holds another vocabulary (pretraining's init_resize_vocab)
    strict_weights: bool = False  # every parameter must come from `weights` (an export of this very model)
    flops_per_step: float = 0.0  # model FLOPs of one step; > 0: MFU is reported

    def __init__(self, cfg: JobConfig, model_cfg: ModelConfig, inputs: RunInputs) -> None:
        self.cfg, self.model_cfg, self.inputs = cfg, model_cfg, inputs

    @abc.abstractmethod
    def build_model(self, dims: ParallelDims) -> torch.nn.Module:
        """This rank's TP shard on its device, as initialised from run.seed (the skeleton loads the weights)."""

    def weights_loaded(self, report: LoadReport, dims: ParallelDims) -> None:
        """What the job does with the report of its `weights` loaded (every rank calls)."""

    @abc.abstractmethod
    def build_data(self, dims: ParallelDims) -> Data:
        """This DP rank's training stream, and every file the job evaluates on read now (a bad one fails here)."""

    @abc.abstractmethod
    def build_evaluator(self, engine, dims: ParallelDims) -> Evaluator | None: ...

    @abc.abstractmethod
    def start_line(self, progress: Progress, accumulation: int, dims: ParallelDims) -> str:
        """The log line before the first step: what trains, from which step, at which batch split."""

    def extra_metrics(self, dims: ParallelDims) -> dict[str, float]:
        """Scalars of the job's own beside the mixture weights on every metrics line (every rank calls)."""
        return {}

    def checkpoint_config(self) -> str:
        """The config.yaml a checkpoint keeps (pretrain.export reads the model and tokenizer from it)."""
        return to_yaml(self.cfg)


def run_job(job: Job, dims: ParallelDims) -> int:
    """The setup every job shares, top to bottom, then the one loop (pretrain.runtime.loop.run_loop): the batch
    split (a user error is one line), the profiler, the run lock; the checkpoint to resume; the job's model and
    the DeepSpeed engine; its data and evaluator; the checkpoint manager with its Stateful components, restored;
    metrics. Returns the loop's exit code; the lock is released on every path."""
    cfg = job.cfg
    run_dir, root = Path(cfg.run.dir), Path(cfg.run.dir) / "checkpoints"
    check_model(job.model_cfg, dims.tp)  # mixer names, heads and d_ff split over TP: an export's model too
    accumulation = num_accumulation_steps(cfg.train, dims.dp)
    profiler = build_profiler(cfg.profile, run_dir, dims)  # None when off; profile.ranks checked against the world
    lock = acquire_run_lock(run_dir, dims)
    try:
        # 1. Checkpoint to resume: decided before the engine, which must know whether it loads a universal one;
        #    the newest intact one (all ranks share the checksum reads), refused if made with other inputs ---------
        plan = plan_resume(cfg.checkpoint, root, job.model_cfg, job.inputs, dims, cfg.parallel.timeout_s,
                           precision=cfg.precision, zero_stage=cfg.zero.stage, global_batch=cfg.train.global_batch)

        # 2. Model (this rank's TP shard) with the job's weights, and the engine -----------------------------------
        engine = start_model(job, dims, plan)
        model = engine.module
        stop_if_preempted(dims.device)

        # 3. Data and evaluation, opened now; checkpoints (engine, progress, data position, RNG) and restore -------
        data = job.build_data(dims)
        try:
            evaluator = job.build_evaluator(engine, dims)
            progress = Progress()
            # a reshard keeps the token rows and pads them anew for the new TP (padding rows are masked, see t5.py)
            checkpoints = CheckpointManager(cfg.checkpoint, root, dims, engine=engine, progress=progress, data=data,
                                            inputs=job.inputs, config_yaml=job.checkpoint_config(),
                                            universal_info=universal_checkpoint_info(model, job.model_cfg.vocab_size))
            if plan:
                checkpoints.load(plan)
                log.info("resumed from %s at step %d", plan.path, progress.step)
            if dims.rank == 0:
                save_config(cfg, run_dir / "config.yaml")
            return _train(job, dims, engine, data, accumulation, progress, checkpoints, evaluator, profiler)
        finally:
            data.close()
    finally:
        lock.release()


def start_model(job: Job, dims: ParallelDims, plan: ResumePlan | None) -> DeepSpeedEngine:
    """The job's model and the DeepSpeed engine around it. Unless the run resumes (`plan`: its checkpoint has the
    weights), the job's `weights` are read once, into the module, and start the engine's fp32 master copy too: in
    bf16/fp16 from the loaded fp32 values, not from the module it casts (pretrain.runtime.engine.master_values)."""
    cfg = job.cfg
    model = job.build_model(dims)
    masters = {}
    if job.weights and not plan:
        report = load_weights(model, job.weights, strict=job.strict_weights, resize_vocab=job.resize_vocab)
        job.weights_loaded(report, dims)
        masters = master_values(model, report, cfg.precision)
    engine = build_engine(model, cfg.train, cfg.zero, cfg.precision, dims.dp,
                          load_universal=bool(plan and plan.universal))
    set_master_weights(engine, masters)
    return engine


def _train(job: Job, dims: ParallelDims, engine, data: Data, accumulation: int, progress: Progress,
           checkpoints: CheckpointManager, evaluator: Evaluator | None, profiler: Profiler | None) -> int:
    """4. Metrics and the loop."""
    cfg = job.cfg
    meter = Meter(
        every=cfg.log.every, steps=cfg.train.steps, samples_per_step=cfg.train.global_batch,
        # model FLOPs utilisation: achieved model FLOP/s over the peak of all devices of the job
        flops_per_step=job.flops_per_step,
        job_peak_flops=peak_flops(cfg.log.peak_flops, dims.device, cfg.precision) * dims.world
        if job.flops_per_step else 0.0,
        extra=lambda: {**mixture_metrics(engine.module, cfg.zero.stage), **job.extra_metrics(dims)},
        straggler_factor=cfg.log.straggler_factor)
    metrics = MetricsLogger(Path(cfg.run.dir), enabled=dims.rank == 0, start_step=progress.step,
                            wandb=cfg.log.wandb, config=yaml.safe_load(to_yaml(cfg)))
    try:
        metrics.write_text("config", to_yaml(cfg), step=progress.step)
        log.info("%s", job.start_line(progress, accumulation, dims))
        return run_loop(Components(engine, to_device(data, dims.device), accumulation, dims, cfg.train, progress,
                                   meter, checkpoints, metrics, evaluator,
                                   pictures=lambda: synthesizer_pictures(engine.module, cfg.zero.stage),
                                   profiler=profiler))
    finally:
        metrics.close()
