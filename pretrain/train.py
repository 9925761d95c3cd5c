"""The pretraining loop: `torchrun --nproc-per-node N -m pretrain.train --config FILE [section.key=value ...]`
(or `srun python -m pretrain.train ...`). `main` reads top to bottom: process groups, tokenizer, checkpoint
to resume, model and DeepSpeed engine, data, restore, then the loop (train step, metrics, evaluation,
checkpoint, signals). Exit codes are listed in pretrain.faults.
"""
from __future__ import annotations

import logging
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator

import deepspeed
import torch
import torch.distributed as dist
from deepspeed.runtime.utils import get_global_norm_of_tensors
from megatron.core import parallel_state

from pretrain.checkpoint import CheckpointManager, TrainerState, find_resume, prepare_resume
from pretrain.config import Config, parse_args, save_config, to_yaml
from pretrain.data.loader import build_eval_loader, build_train_loader
from pretrain.data.shards import expand_shards
from pretrain.data.span_corruption import input_and_target_lengths
from pretrain.engine import build_deepspeed_config, build_engine
from pretrain.faults import EXIT_OK, EXIT_PREEMPTED, PreemptionFlag, SkipBudget, any_rank_true, run_with_exit_codes
from pretrain.metrics import MetricsLogger, peak_flops, peak_memory_bytes
from pretrain.model import build_model, universal_checkpoint_info, vocab_parallel_argmax
from pretrain.model.flops import flops_per_sequence
from pretrain.schedule import lr_factor
from pretrain.parallel import ParallelDims, check_parallel, init_distributed
from tokenizer.spm import Tokenizer

log = logging.getLogger("pretrain.train")


def init_logging(rank: int) -> None:
    """A rank prefix on every line; info from rank 0, warnings and errors from every rank."""
    logging.basicConfig(
        level=logging.INFO if rank == 0 else logging.WARNING,
        format=f"%(asctime)s [rank {rank}] %(levelname)s %(name)s: %(message)s",
        force=True,
    )
    logging.getLogger("DeepSpeed").setLevel(logging.WARNING)  # its per-step chatter; our progress lines suffice


def train(cfg: Config) -> int:
    # 1. Process groups (TP x DP) and seeds -------------------------------------------------------------------
    dims = init_distributed(cfg.parallel, cfg.run.seed)
    init_logging(dims.rank)
    check_parallel(cfg.model, dims.tp, dims.world)
    # every engine option (batch split, ZeRO stage, precision, optimizer, schedule) is checked before allocation
    accumulation = build_deepspeed_config(cfg.train, cfg.zero, cfg.precision, dims.dp)["gradient_accumulation_steps"]
    if cfg.log.every < 1:
        raise ValueError(f"log.every ({cfg.log.every}) must be >= 1: the steps between metrics lines")
    run_dir = Path(cfg.run.dir)

    # 2. Tokenizer: the vocabulary the model must hold --------------------------------------------------------
    num_ids = Tokenizer(cfg.data.tokenizer).num_ids
    if num_ids > cfg.model.vocab_size:
        raise ValueError(f"model.vocab_size ({cfg.model.vocab_size}) is smaller than the tokenizer's {num_ids} ids")

    # 3. Checkpoint to resume: decided before the engine, which must know whether it loads a universal one ---
    checkpoints = CheckpointManager(cfg.checkpoint, run_dir / "checkpoints", dims)
    resume_path = find_resume(cfg.checkpoint, checkpoints.root)
    plan = prepare_resume(resume_path, cfg.model, dims) if resume_path else None

    # 4. Model (this rank's TP shard, identical full init on every rank) and the DeepSpeed engine ------------
    model = build_model(cfg.model, activation_checkpointing=cfg.train.activation_checkpointing)
    engine = build_engine(model, cfg.train, cfg.zero, cfg.precision, dims.dp, load_universal=bool(plan and plan.universal))
    # the padded vocabulary rows take part in the softmax, so a reshard must keep all model.vocab_size rows
    universal_info = universal_checkpoint_info(model, cfg.model.vocab_size)

    # 5. Data: this DP rank's stream of span-corrupted micro batches ------------------------------------------
    loader = build_train_loader(cfg.data, seed=cfg.run.seed, dp_rank=dims.dp_rank, dp_size=dims.dp,
                                micro_batch=cfg.train.micro_batch)
    if cfg.eval.every and cfg.data.valid:
        expand_shards(cfg.data.valid)  # a wrong validation path fails now, not at the first evaluation hours later

    # 6. Restore: engine (weights, optimizer, LR schedule), RNG, data position, counters ----------------------
    state = TrainerState(step=0, tokens_seen=0, skipped_steps=0, tp=dims.tp, dp=dims.dp)
    if plan:
        loader_state = checkpoints.load(engine, plan)
        if loader_state is not None:
            loader.load_state_dict(loader_state)
        state = TrainerState(plan.state.step, plan.state.tokens_seen, plan.state.skipped_steps, dims.tp, dims.dp)
        log.info("resumed from %s at step %d", plan.path, state.step)
    if dims.rank == 0:
        save_config(cfg, run_dir / "config.yaml")
    metrics = MetricsLogger(run_dir, enabled=dims.rank == 0, start_step=state.step)

    # 7. The loop -----------------------------------------------------------------------------------------------
    input_length, target_length = cfg.data.input_length, input_and_target_lengths(
        cfg.data.input_length, cfg.data.noise_density, cfg.data.mean_noise_span_length)[1]
    tokens_per_step = cfg.train.global_batch * (input_length + target_length)
    # model FLOPs utilisation: achieved model FLOP/s over the peak of all devices of the job
    flops_per_step = cfg.train.global_batch * flops_per_sequence(cfg.model, input_length, target_length)
    job_peak = peak_flops(cfg.log.peak_flops, dims.device) * dims.world
    preemption = PreemptionFlag()
    budget = SkipBudget(cfg.train.max_skipped_steps, state.skipped_steps)
    batches = _to_device(iter(loader), dims.device)
    steps_this_run, window, window_start = 0, [], time.perf_counter()
    log.info("training steps %d -> %d: global batch %d = micro %d x accumulation %d x DP %d, %d tokens/step",
             state.step, cfg.train.steps, cfg.train.global_batch, cfg.train.micro_batch, accumulation, dims.dp,
             tokens_per_step)
    while state.step < cfg.train.steps:
        result = train_step(engine, batches, accumulation, dims)
        if result.non_finite:
            budget.skip(state.step + 1)
        if result.loss is None:  # nothing was applied: the same step number is tried again with the next batches
            state = TrainerState(state.step, state.tokens_seen + tokens_per_step, budget.skipped, dims.tp, dims.dp)
            continue
        state = TrainerState(state.step + 1, state.tokens_seen + tokens_per_step, budget.skipped, dims.tp, dims.dp)
        steps_this_run += 1
        window.append(result)
        record: dict[str, float] = {}
        if state.step % cfg.log.every == 0 or state.step == cfg.train.steps:
            elapsed = time.perf_counter() - window_start
            record = step_metrics(engine, window, elapsed, tokens_per_step, flops_per_step, job_peak, dims,
                                  cfg.train.global_batch, cfg.zero.stage)
            record["lr"] = cfg.train.lr * lr_factor(cfg.train, state.step - 1)  # the lr this step used
            record["skipped_steps"] = budget.skipped
            log.info("step %d/%d  loss %.4f  lr %.3g  grad_norm %.3f  %.0f tokens/s  MFU %.1f%%", state.step,
                     cfg.train.steps, record["loss"], record["lr"], record["grad_norm"], record["tokens_per_s"],
                     100 * record["mfu"])
            window, window_start = [], time.perf_counter()
        if cfg.eval.every and state.step % cfg.eval.every == 0 and cfg.data.valid:
            record.update(evaluate(engine, cfg, dims))
            log.info("step %d  eval_loss %.4f  eval_accuracy %.4f", state.step, record["eval_loss"],
                     record["eval_accuracy"])
        if record:
            metrics.write(state.step, record)
        preempted = preemption.agreed(dims.device)
        done = state.step == cfg.train.steps or steps_this_run == cfg.train.exit_after
        periodic = cfg.checkpoint.every and state.step % cfg.checkpoint.every == 0
        if preempted or done or periodic:
            checkpoints.save(engine, state, loader.state_dict(), to_yaml(cfg), universal_info)
        if preempted:
            log.warning("preempted by signal %s at step %d: checkpoint saved, exiting %d", preemption.received,
                        state.step, EXIT_PREEMPTED)
            metrics.close()
            return EXIT_PREEMPTED
        if done:
            break
    metrics.close()
    log.info("stopped at step %d of %d", state.step, cfg.train.steps)
    return EXIT_OK


def _to_device(batches: Iterator[dict], device: torch.device) -> Iterator[dict[str, torch.Tensor]]:
    for batch in batches:
        yield {k: v.to(device, non_blocking=True) for k, v in batch.items()}


@dataclass(frozen=True)
class StepResult:
    loss: float | None  # mean over micro batches and DP; None if nothing was applied
    grad_norm: float  # global norm before clipping (over DP and TP)
    non_finite: bool  # some micro batch had a NaN/inf loss on some rank


def train_step(engine, batches: Iterator[dict], accumulation: int, dims: ParallelDims) -> StepResult:
    """One optimizer step over `accumulation` micro batches.

    Every micro batch's loss is checked on all ranks before its backward. A non-finite loss in the first
    micro batch skips the step: no backward, no update, no moment change, the step's batches are consumed
    (loss None). One after some micro batches were backpropagated is dropped instead: its backward is of a
    zero loss, which keeps the engine's accumulation aligned, and the step applies the others.
    """
    losses, non_finite, grad_norm = [], False, None
    for micro in range(accumulation):
        batch = next(batches)
        if non_finite and not losses:
            continue
        loss = engine(**batch).loss
        if any_rank_true(not bool(torch.isfinite(loss)), dims.device):
            non_finite = True
            if not losses:
                continue
            loss = loss.nan_to_num(0.0, 0.0, 0.0) * 0.0
        else:
            losses.append(loss.detach())
        engine.backward(loss)
        if micro == accumulation - 1 and _engine_keeps_no_grad_norm(engine):
            grad_norm = get_global_norm_of_tensors(
                [p.grad for p in engine.module.parameters() if p.grad is not None], mpu=engine.mpu)
        engine.step()
    if not losses:
        return StepResult(None, 0.0, non_finite)
    mean = torch.stack(losses).mean()
    dist.all_reduce(mean, group=parallel_state.get_data_parallel_group())
    grad_norm = engine.get_global_grad_norm() if grad_norm is None else grad_norm
    return StepResult(mean.item() / dims.dp, float(grad_norm), non_finite)


def _engine_keeps_no_grad_norm(engine) -> bool:
    # DeepSpeed records the global grad norm in its ZeRO, bf16 and fp16 optimizers, not for plain fp32 ZeRO 0
    return engine.zero_optimization_stage() == 0 and not (engine.bfloat16_enabled() or engine.fp16_enabled())


def step_metrics(engine, window: list[StepResult], elapsed: float, tokens_per_step: int, flops_per_step: float,
                 job_peak: float, dims: ParallelDims, global_batch: int, zero_stage: int) -> dict[str, float]:
    steps_per_s = len(window) / elapsed
    record = {
        "loss": sum(r.loss for r in window) / len(window),
        "grad_norm": window[-1].grad_norm,
        "tokens_per_s": tokens_per_step * steps_per_s,
        "samples_per_s": global_batch * steps_per_s,
        "mfu": flops_per_step * steps_per_s / job_peak if job_peak else 0.0,
        "memory_gb": peak_memory_bytes(dims.device) / 2**30,
    }
    record.update(mixture_metrics(engine.module, zero_stage))
    return record


def mixture_metrics(model, zero_stage: int) -> dict[str, float]:
    """`mixture/<layer>/<mixer>`: how much each layer trusts each attention mixer (softmax weights)."""
    params = [p for name, p in model.named_parameters() if ".mix" in name]
    with deepspeed.zero.GatheredParameters(params, enabled=zero_stage == 3):  # ZeRO-3 holds only shards
        weights = model.mixture_weights()
    out = {}
    for layer, w in weights.items():
        mixers = model.mixers[layer.split(".")[0]]
        per_mixer = w if w.dim() == 1 else w.mean(dim=0)  # per-head weights: the mean over heads
        out.update({f"mixture/{layer}/{name}": float(v) for name, v in zip(mixers, per_mixer)})
    return out


@torch.no_grad()
def evaluate(engine, cfg: Config, dims: ParallelDims) -> dict[str, Any]:
    """Loss and token accuracy on a fixed slice of the validation shards (the same batches every time)."""
    loader = build_eval_loader(cfg.data, dp_rank=dims.dp_rank, dp_size=dims.dp, micro_batch=cfg.train.micro_batch,
                               num_batches=cfg.eval.batches)
    engine.eval()
    sums = torch.zeros(3, dtype=torch.float64, device=dims.device)  # loss x tokens, correct, tokens
    for batch in _to_device(iter(loader), dims.device):
        out = engine(**batch)
        valid = batch["labels"] != -100
        correct = ((vocab_parallel_argmax(out.logits) == batch["labels"]) & valid).sum()
        sums += torch.stack([out.loss.double() * out.num_tokens, correct.double(), out.num_tokens.double()])
    engine.train()
    dist.all_reduce(sums, group=parallel_state.get_data_parallel_group())
    return {"eval_loss": (sums[0] / sums[2]).item(), "eval_accuracy": (sums[1] / sums[2]).item()}


def main(argv: list[str] | None = None) -> int:
    cfg = parse_args(Config, argv, prog="pretrain.train")
    return run_with_exit_codes(lambda: train(cfg), "pretrain.train")


if __name__ == "__main__":
    sys.exit(main())
