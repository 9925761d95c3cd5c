"""Throughput of the trainer's own step (`pretrain.runtime.loop.train_step`: DeepSpeed forward, backward, the step's
DP all-reduce and skip check, clipping, AdamW) for attention variants, per GPU: median step time and its spread,
tokens/s, model TFLOP/s (pretrain.model.flops), MFU against the device peak, peak memory, and beside it the
planner's figure for the same job (pretrain/planning/memory.py, less its CUDA reserve, which torch's allocator peak
does not see; on the CPU the peak resident set also holds the interpreter and libraries).

    .venv/bin/python -m bench.throughput                          # CPU, configs/tiny.yaml, fp32 (the CI smoke test)
    torchrun --nproc-per-node 8 -m bench.throughput --config configs/base.yaml --precision bf16 --micro-batch 32

Under torchrun every rank runs the same step (DP = world / TP, global batch = micro x DP, one micro batch per
step); times are rank 0's (the step's all-reduce keeps ranks in step), memory the largest rank's. Each variant
gets a fresh model and engine; the previous one is freed first and the peak-memory counter reset (on CPU the
peak resident set, reset through /proc/self/clear_refs). 5 warm-up steps (allocator, kernels, compilation)
are not timed; each measured step ends with a device synchronize. Random token ids, unpadded like span-corrupted
batches (the data pipeline is benchmarked in bench/data.py). The peak is `log.peak_flops` if set, a data-sheet
figure on known GPUs, or this CPU's measured matmul rate. `--sdpa both` times every variant with a fused attention
form (vanilla, dense, factorized_random and their mixtures) through it and through materialised logits; rank 0
prints each row as it finishes; `--out FILE` also writes the table as markdown.
"""
from __future__ import annotations

import argparse
import dataclasses
import gc
import itertools
import os
import socket
import statistics
import time
from pathlib import Path

import torch
import torch.distributed as dist

from pretrain.core.config import Config, load_config
from pretrain.data.span_corruption import input_and_target_lengths
from pretrain.distributed.parallel import destroy_distributed, init_distributed
from pretrain.model import MIXERS, build_model
from pretrain.model.attention import SelfAttention
from pretrain.model.flops import flops_per_sequence
from pretrain.planning.memory import CUDA_RESERVE_BYTES, estimate_memory
from pretrain.runtime.engine import build_engine
from pretrain.runtime.loop import install_skip_guard, to_device, train_step
from pretrain.runtime.metrics import peak_flops

# every mixer of the registry, then the mixtures the size configs train (configs/tiny.yaml's, configs/long.yaml's;
# tests/test_bench.py holds this to the configs)
VARIANTS = (*MIXERS, "random+vanilla", "dense+vanilla")
SDPA = {"auto": [None], "on": [True], "off": [False], "both": [True, False]}


def _batch(micro_batch: int, input_length: int, target_length: int, vocab: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    ids = lambda n: torch.randint(2, vocab, (micro_batch, n), generator=g)  # noqa: E731
    labels = ids(target_length)
    decoder_input_ids = torch.cat([torch.zeros(micro_batch, 1, dtype=torch.long), labels[:, :-1]], dim=1)
    return {"input_ids": ids(input_length), "decoder_input_ids": decoder_input_ids, "labels": labels}


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _reset_peak_memory(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
        _HELD[0] = torch.cuda.memory_allocated(device)
        return
    try:  # "5" resets the peak resident set (VmHWM) of this process (Linux >= 4.0)
        Path("/proc/self/clear_refs").write_text("5")
    except OSError:
        pass  # then the column is the process's peak so far


_HELD = [0]  # bytes allocated on the GPU when the variant started


def _peak_memory(device: torch.device) -> float:
    """Peak bytes of this variant, the largest over ranks: allocated on GPU above what was allocated when it started
    (an H200 run held 4-15 GiB more at each later variant: DeepSpeed engines outlive `del` and gc), resident set on
    CPU."""
    if device.type == "cuda":
        peak = float(torch.cuda.max_memory_allocated(device) - _HELD[0])
    else:
        status = Path("/proc/self/status").read_text()
        peak = float(next(line.split()[1] for line in status.splitlines() if line.startswith("VmHWM"))) * 1024
    t = torch.tensor(peak, dtype=torch.float64, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return t.item()


def _fused_form(model: torch.nn.Module) -> bool:
    """Whether a self-attention layer of `model` has a fused form (a mixer with a Q' K'^T form, attention.py)."""
    return any(layer.dot for layer in model.modules() if isinstance(layer, SelfAttention))


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="bench.throughput", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", default="configs/tiny.yaml")
    parser.add_argument("--precision", default=None, help="fp32, bf16 or fp16 (default: the config's)")
    parser.add_argument("--micro-batch", type=int, default=None, help="sequences per GPU (default: the config's)")
    parser.add_argument("--warmup", type=int, default=5, help="untimed steps per variant")
    parser.add_argument("--steps", type=int, default=20, help="measured steps per variant")
    parser.add_argument("--variants", nargs="+", default=list(VARIANTS))
    parser.add_argument("--sdpa", choices=sorted(SDPA), default="auto",
                        help="fused attention: auto (as the trainer), on, off (materialised logits), both")
    parser.add_argument("--activation-checkpointing", default=None, help="none, full or selective (default: config)")
    parser.add_argument("--compile", action="store_true", help="torch.compile each layer (train.compile)")
    parser.add_argument("--out", default=None, help="also write the table to this markdown file (rank 0)")
    args = parser.parse_args(argv)
    if args.steps < 1 or args.warmup < 0:
        parser.error("--steps must be >= 1 and --warmup >= 0")
    cfg = load_config(Config, args.config)
    precision = args.precision or cfg.precision
    micro = args.micro_batch or cfg.train.micro_batch
    checkpointing = args.activation_checkpointing or cfg.train.activation_checkpointing
    if "WORLD_SIZE" not in os.environ and "SLURM_PROCID" not in os.environ:
        # run without a launcher: a 1-process group on a free port (torchrun's default 29500 may be taken)
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dims = init_distributed(cfg.parallel, cfg.run.seed)
    train = dataclasses.replace(cfg.train, micro_batch=micro, global_batch=micro * dims.dp)
    input_length = cfg.data.input_length
    target_length = input_and_target_lengths(input_length, cfg.data.noise_density, cfg.data.mean_noise_span_length)[1]
    vocab = cfg.model.vocab_size or 32100  # 0 means the tokenizer's: T5's 32000 pieces + 100 sentinels
    peak = peak_flops(cfg.log.peak_flops, dims.device)
    device_name = torch.cuda.get_device_name(dims.device) if dims.device.type == "cuda" else "CPU"
    header = (f"{args.config}: {device_name}, {precision}, DP {dims.dp} x TP {dims.tp}, micro batch {micro} "
              f"(global {micro * dims.dp}), inputs {input_length} / targets {target_length}, activation "
              f"checkpointing {checkpointing}, compile {args.compile}, {args.warmup} warm-up + {args.steps} "
              f"measured steps, peak {peak / 1e12:.3g} TFLOP/s per device")
    per = "GPU" if dims.device.type == "cuda" else "process"
    columns = ("variant", "ms/step (median)", "IQR ms", f"tokens/s/{per}", f"TFLOP/s/{per}", "MFU", "peak GiB",
               "planned GiB")
    rows = []
    line = lambda cells: "| " + " | ".join(cells) + " |"  # noqa: E731
    if dims.rank == 0:  # the rows as they finish: a run cut short by a time limit keeps the rows done
        print(header, line(columns), line(("---",) * len(columns)), sep="\n", flush=True)
    batch = _batch(micro, input_length, target_length, min(vocab, 32000))
    fused = {}  # variant -> whether its model has a fused form, known once built (sdpa on comes first)
    for variant, sdpa in itertools.product(args.variants, SDPA[args.sdpa]):
        if sdpa is False and not fused.get(variant, True) and args.sdpa == "both":
            continue  # the same layer as with sdpa on
        model_cfg = dataclasses.replace(cfg.model, encoder_attention=variant, decoder_attention=variant,
                                        vocab_size=vocab)
        job = dataclasses.replace(cfg, model=model_cfg, precision=precision,
                                  train=dataclasses.replace(train, activation_checkpointing=checkpointing))
        planned = estimate_memory(job, dims.tp, dims.dp, micro, target_length, dims.device.type).total
        planned -= CUDA_RESERVE_BYTES if dims.device.type == "cuda" else 0  # not torch's allocations
        gc.collect()
        if dims.device.type == "cuda":
            torch.cuda.empty_cache()
        _reset_peak_memory(dims.device)
        model = build_model(model_cfg, checkpointing, args.compile, sdpa, device=dims.device)  # as the trainer
        fused[variant] = _fused_form(model)
        engine = build_engine(model, train, cfg.zero, precision, dims.dp)
        install_skip_guard(engine)
        batches = to_device(itertools.repeat(batch), dims.device)
        times = []
        for step in range(args.warmup + args.steps):
            _sync(dims.device)
            start = time.perf_counter()
            train_step(engine, batches, 1, dims)
            _sync(dims.device)
            if step >= args.warmup:
                times.append(time.perf_counter() - start)
        memory = _peak_memory(dims.device)
        median = statistics.median(times)
        q1, _, q3 = statistics.quantiles(times, n=4) if len(times) > 1 else (median, median, median)
        flops = micro * flops_per_sequence(model_cfg, input_length, target_length)
        label = variant if sdpa is None or not fused[variant] else f"{variant} ({'sdpa' if sdpa else 'materialised'})"
        rows.append((label, f"{median * 1e3:.1f}", f"{q1 * 1e3:.1f}-{q3 * 1e3:.1f}",
                     f"{micro * (input_length + target_length) / median:.0f}", f"{flops / median / 1e12:.3g}",
                     f"{flops / median / peak:.1%}" if peak else "n/a", f"{memory / 2**30:.2f}",
                     f"{planned / 2**30:.2f}"))
        if dims.rank == 0:
            print(line(rows[-1]), flush=True)
            if _HELD[0] > 2**30:
                print(f"  ({_HELD[0] / 2**30:.1f} GiB were still allocated when {variant} started, outside its peak)",
                      flush=True)
        del engine, model, batches
    table = "\n".join(line(r) for r in [columns, ("---",) * len(columns), *rows])
    if dims.rank == 0 and args.out:
        Path(args.out).write_text(f"{header}\n\n{table}\n")
    destroy_distributed()


if __name__ == "__main__":
    main()
