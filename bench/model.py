"""`python -m bench.model`: CPU fp32 speed of the model at T5-v1.1-small width and N = 512.

Prints, all measured in this one run (absolute numbers vary between machines; ratios are the figures):
- the machine's fp32 matmul rate (2048^3 GEMM, all threads);
- forward + backward time of one self-attention layer for each mixer, as a ratio to our vanilla layer
  (batch x 512 x 512, 6 heads of 64, relative bias as in the model), for an unpadded batch (pretraining
  after span corruption) and for a batch with one padded example;
- a full train step (forward, backward, fused AdamW) of our vanilla model against HuggingFace's
  `T5ForConditionalGeneration` with the same weights, config and batch (inputs 512, targets 114), steps
  interleaved so load changes hit both alike; and our step's model GFLOP/s (pretrain.model.flops) as a
  fraction of the matmul rate;
- the same step ratio with flush-to-zero on for both models (`torch.set_flush_denormal(True)`, one thread:
  the flag sets only the calling thread's FPU mode), the fair comparison on CPUs where subnormal floats
  take a slow path (HF's LM-head gradient makes many; ours floors them, see pretrain/model/loss.py);
- beside each step ratio, the ratio of user CPU seconds: the models' own work without the kernel's (on some
  machines HF's step spends a second faulting in fresh pages for its large temporaries, ours almost none);
- last, on one line, the figure of issue 31: the worse (larger) of the two step ratios, with the load average
  (1 min) before and after each step measurement: the machine may be shared, and only ratios within a run
  compare.
`--step-only` skips the matmul and attention sections; `--profile` adds the per-op CPU time of one step, ours
against HF's, forward / backward / optimizer (bench/op_profile.py).
Targets: our step / HF step <= 0.85 (aim 0.8); random, factorized_random <= 0.7 x vanilla; step > 40% of matmul.
"""
from __future__ import annotations

import argparse
import contextlib
import functools
import os
import resource
import statistics
import time

import torch
from megatron.core import ModelParallelConfig
from transformers import T5ForConditionalGeneration

from bench.op_profile import op_times, print_op_table
from pretrain.core.config import ModelConfig
from pretrain.distributed.parallel import init_single_process
from pretrain.model import build_local_model, full_state_dict
from pretrain.model.attention import RelativePositionBias, SelfAttention
from pretrain.model.flops import flops_per_sequence
from pretrain.model.hf_convert import hf_config, to_hf_state_dict
from pretrain.model.mixers import MIXERS, parse_mixers

SMALL = ModelConfig(vocab_size=32128)  # T5 v1.1 small: d_model 512, d_ff 1024, 6 x 64 heads, 8 + 8 layers, N 512


def _seconds(fn) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def _cpu_name() -> str:
    with open("/proc/cpuinfo") as f:
        return next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), "unknown CPU")


def matmul_gflops(reps: int) -> float:
    a, b = torch.randn(2048, 2048), torch.randn(2048, 2048)
    a @ b
    best = min(_seconds(lambda: a @ b) for _ in range(reps))
    return 2 * 2048**3 / best / 1e9


def attention_times(batch: int, reps: int, padded: bool) -> dict[str, float]:
    """Median fwd+bwd seconds per mixer; the layer gets what the stack passes it: the learned relative bias,
    plus (`padded`) a per-example padding mask added once per stack, making the bias [batch, heads, n, n]."""
    init_single_process()
    mp_config = ModelParallelConfig(use_cpu_initialization=True)
    n = SMALL.max_length
    x = torch.randn(batch, n, SMALL.d_model, requires_grad=True)
    relative_bias = RelativePositionBias(SMALL, True, 0, 1)
    mask = torch.zeros(batch, 1, 1, n)
    mask[0, ..., n - 8 :] = torch.finfo(torch.float32).min
    layers = {name: SelfAttention(SMALL, parse_mixers(name), mp_config, 0, 1) for name in MIXERS}

    def step(layer: SelfAttention) -> None:
        bias = relative_bias(n, n)  # [1, heads, n, n]
        layer(x, bias + mask if padded else bias, None).sum().backward()

    times: dict[str, list[float]] = {name: [] for name in MIXERS}
    for rep in range(reps + 1):  # round-robin, first round is warm-up
        for name, layer in layers.items():
            t = _seconds(lambda: step(layer))
            if rep:
                times[name].append(t)
    return {name: statistics.median(t) for name, t in times.items()}


def train_step_times(batch: int, reps: int, flush_denormal: bool = False) -> tuple[tuple[float, float], ...]:
    """Median seconds per step, wall and user CPU: ((ours, HF) wall, (ours, HF) user CPU); `flush_denormal`: one
    thread with subnormals flushed to zero. User CPU leaves out the kernel's time (page faults: on some machines
    HF's step spends a second a step faulting in fresh pages for its large temporaries, ours almost none)."""
    with _threads(flush_denormal):
        step_ours, step_hf = _train_steps(batch)
        wall, user = ([], []), ([], [])
        for rep in range(reps + 1):
            for i, step in enumerate((step_ours, step_hf)):  # interleaved: a load change hits both alike
                cpu, start = resource.getrusage(resource.RUSAGE_SELF).ru_utime, time.perf_counter()
                step()
                if rep:  # the first round is warm-up
                    wall[i].append(time.perf_counter() - start)
                    user[i].append(resource.getrusage(resource.RUSAGE_SELF).ru_utime - cpu)
    return tuple(tuple(statistics.median(t) for t in pair) for pair in (wall, user))


def profile_step(batch: int, reps: int, shapes: bool = False) -> None:
    """Per-op CPU time of a step, ours against HF's, with flush-to-zero on one thread (bench/op_profile.py);
    `shapes`: the GEMMs per operand shapes and strides."""
    with _threads(flush_denormal=True):
        steps = dict(zip(("ours", "HF"), _train_steps(batch)))
        print_op_table(op_times(steps, reps, shapes))


@contextlib.contextmanager
def _threads(flush_denormal: bool):
    """`flush_denormal`: one thread with subnormals flushed to zero for the block; as shipped otherwise."""
    threads = torch.get_num_threads()
    if flush_denormal:
        torch.set_num_threads(1)
        torch.set_flush_denormal(True)
    try:
        yield
    finally:
        torch.set_flush_denormal(False)
        torch.set_num_threads(threads)


def _train_steps(batch: int):
    """(step of ours, step of HF): forward, backward and fused AdamW of the two models on the same weights."""
    torch.manual_seed(0)
    ours = build_local_model(SMALL).train()
    hf = T5ForConditionalGeneration(hf_config(SMALL)).train()
    hf.lm_head.weight = torch.nn.Parameter(torch.empty_like(hf.lm_head.weight))  # v1.1: untied
    hf.load_state_dict(to_hf_state_dict(full_state_dict(ours), SMALL))
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(2, 32000, (batch, 512), generator=g)
    mask = torch.ones_like(ids)
    labels = torch.randint(2, 32000, (batch, 114), generator=g)
    dec = torch.cat([torch.zeros(batch, 1, dtype=torch.long), labels[:, :-1]], dim=1)
    # fused: one pass per tensor; the default single-tensor loop on CPU is 6x slower and would be a third of the
    # step under load, the same for both models, hiding the models' own difference
    opt_ours, opt_hf = torch.optim.AdamW(ours.parameters(), fused=True), torch.optim.AdamW(hf.parameters(), fused=True)

    def step(forward, optimizer, mark=lambda phase: None) -> None:  # mark: bench/op_profile.py's phases
        mark("fwd")
        loss = forward()
        mark("bwd")
        loss.backward()
        mark("opt")
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    # ours unpadded: no mask, as the pretraining collator sends it; HF's own default takes the all-ones mask
    forward_ours = lambda: ours(ids, None, dec, labels).loss  # noqa: E731
    forward_hf = lambda: hf(input_ids=ids, attention_mask=mask, decoder_input_ids=dec, labels=labels).loss  # noqa: E731
    return functools.partial(step, forward_ours, opt_ours), functools.partial(step, forward_hf, opt_hf)


def _load() -> float:
    return os.getloadavg()[0]


def main() -> None:
    parser = argparse.ArgumentParser(prog="bench.model", description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, default=4, help="sequences per step (inputs 512, targets 114)")
    parser.add_argument("--reps", type=int, default=3, help="measured repetitions (median); one warm-up extra")
    parser.add_argument("--step-only", action="store_true", help="only the train-step ratios (no matmul, attention)")
    parser.add_argument("--profile", action="store_true", help="also the per-op CPU time of a step, ours vs HF")
    parser.add_argument("--gemm-shapes", action="store_true", help="with --profile: GEMMs per operand shapes, strides")
    args = parser.parse_args()
    threads = torch.get_num_threads()
    print(f"{_cpu_name()}, torch {torch.__version__}, {threads} threads, fp32, batch {args.batch}")
    if not args.step_only:
        rate = matmul_gflops(5)
        print(f"matmul 2048^3: {rate:.1f} GFLOP/s")

        attn = attention_times(args.batch, args.reps, padded=False)
        padded = attention_times(args.batch, args.reps, padded=True)
        print(f"\nself-attention layer fwd+bwd, batch {args.batch} x 512, T5-small width; unpadded batch "
              f"(pretraining) and with one padded example")
        print(f"{'mixer':<20}{'ms':>10}{'x vanilla':>12}{'padded ms':>12}{'x vanilla':>12}")
        for name, t in attn.items():
            print(f"{name:<20}{t * 1e3:>10.1f}{t / attn['vanilla']:>12.2f}"
                  f"{padded[name] * 1e3:>12.1f}{padded[name] / padded['vanilla']:>12.2f}")

    print(f"\ntrain step (fwd+bwd+fused AdamW), T5-v1.1-small vanilla, batch {args.batch} x 512/114")
    ratios = {}
    for label, flush in ((f"as shipped, {threads} threads", False), ("flush-to-zero on, 1 thread", True)):
        before = _load()
        (ours, hf), (cpu_ours, cpu_hf) = train_step_times(args.batch, args.reps, flush_denormal=flush)
        ratios[label] = ours / hf
        print(f"{label}: ours {ours:.2f} s, HuggingFace {hf:.2f} s, ratio ours/HF {ours / hf:.2f}; user CPU "
              f"{cpu_ours:.2f} / {cpu_hf:.2f} s = {cpu_ours / cpu_hf:.2f} (load average {before:.1f} -> {_load():.1f})")
        if not flush and not args.step_only:
            flops = flops_per_sequence(SMALL, 512, 114) * args.batch
            print(f"ours {flops / ours / 1e9:.1f} model GFLOP/s = {flops / ours / 1e9 / rate:.0%} of measured matmul "
                  f"rate (HF {flops / hf / 1e9 / rate:.0%})")
    if args.profile:
        print("\nper-op CPU time of one step (flush-to-zero, 1 thread; min over the repetitions), ms")
        profile_step(args.batch, args.reps, args.gemm_shapes)
    worse = max(ratios, key=ratios.get)
    print(f"\nstep ratio ours/HF (issue 31: the worse of as shipped and flush-to-zero 1 thread): "
          f"{ratios[worse]:.2f} ({worse}; " + ", ".join(f"{k} {v:.2f}" for k, v in ratios.items()) + ")")


if __name__ == "__main__":
    main()
