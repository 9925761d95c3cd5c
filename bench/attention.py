"""Time and peak memory of self-attention's core (pretrain/model/attention.py: logits, mixture, softmax, @ V; forward
+ backward) in its fused form (`_fused`: one `F.scaled_dot_product_attention` call, the kernel named by
pretrain/model/sdpa.py) against its materialised form (`_mixed`: [b, heads, n, m] logits and an fp32 softmax), per
mixer and length N (= n = m = model.max_length), with T5's relative bias (trained: a mask with a gradient) and
without (`position_bias: none`), measured in one run; rows are printed as they finish. docs/model.md ("Fused
attention") has the table.

    OMP_NUM_THREADS=1 .venv/bin/python -m bench.attention [--lengths 512 1024 2048 4096] [--batch 2] [--heads 8]
        [--mixers dense dense+vanilla ...] [--reps 2 --warmup 1] [--device cuda --dtype bf16]

Peak memory is what the step adds to what its inputs hold: on the CPU the resident set's peak (VmHWM, restarted
before each step), on CUDA torch's allocator peak. The projections (Q, K, V, output) are outside the core and the
same in both forms. `chosen` is the form the layer takes for training on that device (attention.py: the fused one where
it has one and, on the CPU, its mask needs no gradient or its math path measured faster: `cpu_math_wins`); `kernel`
the SDPA kernel its fused form names (pretrain/model/sdpa.py). Layers without a mixer of Q' K'^T form have no fused form (`-`).
`planned` is the planner's figure for each form's step (pretrain/planning/memory.py `core_bytes`: the tensors it
counts as the core's activations on this device, traced on meta, plus the gradients the step leaves), to read beside
the measured peak.

On CUDA, after those rows, `vanilla (flex)` rows time FlexAttention (`torch.nn.attention.flex_attention`, compiled)
with T5's bias computed inside the kernel from its trained [heads, buckets] table (score_mod; no [b, heads, n, m]
bias or bias gradient), in the fused columns, against the materialised core of the same inputs; compare them with
the `vanilla` rows' fused form (the memory-efficient kernel with the bias as a trained mask). On the CPU torch 2.13
has no FlexAttention backward (NotImplementedError), so there are no such rows. A failed flex row prints its error.
"""
from __future__ import annotations

import argparse
import ctypes
import gc
import time
from pathlib import Path

import torch
from megatron.core import ModelParallelConfig

from pretrain.core.config import ModelConfig
from pretrain.distributed.parallel import init_single_process
from pretrain.model import sdpa
from pretrain.model.attention import RelativePositionBias, SelfAttention
from pretrain.model.mixers import parse_mixers
from pretrain.planning.memory import core_bytes

MIXERS = ["vanilla", "dense", "factorized_random", "dense+vanilla", "factorized_random+vanilla", "random+vanilla",
          "random", "factorized_dense"]
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


def _status(key: str) -> int:
    line = next(l for l in Path("/proc/self/status").read_text().splitlines() if l.startswith(key + ":"))
    return int(line.split()[1]) * 1024  # kB


def _exact_cpu_peaks() -> None:
    """Every allocation from 64 KiB on its own mapping, returned at free (glibc's mallopt M_MMAP_THRESHOLD, which
    also stops glibc raising that threshold after frees): the resident set then follows the live tensors, where
    heap reuse would hide a step's buffers."""
    ctypes.CDLL("libc.so.6").mallopt(-3, 64 * 1024)  # -3: M_MMAP_THRESHOLD


def _peak_reset(device: torch.device) -> int:
    """Start a peak measurement; returns the baseline bytes."""
    gc.collect()
    if device.type == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        return torch.cuda.memory_allocated()
    Path("/proc/self/clear_refs").write_text("5")  # VmHWM restarts from the resident set
    return _status("VmRSS")


def _peak(device: torch.device) -> int:
    if device.type == "cuda":
        torch.cuda.synchronize()
        return torch.cuda.max_memory_allocated()
    return _status("VmHWM")


def _recording_kernels() -> list[str]:
    """The names of the kernels the fused form asks for, in call order."""
    names: list[str] = []
    named = sdpa.sdpa_kernel
    sdpa.sdpa_kernel = lambda backends: names.append(backends[0].name.lower()) or named(backends)
    return names


def core_forward(attn: SelfAttention, form: str, inputs: dict) -> torch.Tensor:
    """The layer's core in `form` (fused / materialised)."""
    x, q, k, v, additive = (inputs[key] for key in ("x", "q", "k", "v", "additive"))
    n = x.shape[1]
    if form == "fused":
        return attn._fused(x, q, k, v, additive, None, 0, n, 0.0, mask_grad=attn._mask_grad(additive, None))
    return attn._mixed(x, q, k, v, additive, None, 0, n, 0.0)


def core_step(attn: SelfAttention, form: str, inputs: dict, grad: torch.Tensor) -> None:
    """One forward + backward of the layer's core in `form` (fused / materialised)."""
    attn.zero_grad(set_to_none=True)
    for t in inputs.values():
        if isinstance(t, torch.Tensor):
            t.grad = None
    core_forward(attn, form, inputs).backward(grad)


def planned(attn: SelfAttention, meta: SelfAttention, form: str, inputs: dict, device: torch.device) -> int:
    """The planner's bytes for a core_step just run (`planned` column): what pretrain/planning/memory.py counts for the
    core on this device (saved for the backward, the CUDA mask gradient's transient; traced on meta) plus the
    gradients the step leaves (the inputs' and the parameters', which a model frees or keeps elsewhere); `meta` the
    same layer built on the meta device."""
    on_meta = {key: t.detach().to("meta").requires_grad_(t.requires_grad) if isinstance(t, torch.Tensor) else t
               for key, t in inputs.items()}
    saved, transient = core_bytes(lambda: core_forward(meta, form, on_meta), device.type,
                                  exclude=[*meta.parameters(), *(t for t in on_meta.values() if t is not None)])
    tensors = [*attn.parameters(), *(t for t in inputs.values() if isinstance(t, torch.Tensor))]
    return saved + transient + sum(t.grad.numel() * t.grad.element_size() for t in tensors if t.grad is not None)


def measure(attn: SelfAttention, form: str, inputs: dict, grad: torch.Tensor) -> tuple[float, int]:
    """(seconds, peak bytes above the inputs) of one core_step."""
    device = grad.device
    base = _peak_reset(device)
    start = time.perf_counter()
    core_step(attn, form, inputs, grad)
    if device.type == "cuda":
        torch.cuda.synchronize()
    return time.perf_counter() - start, max(0, _peak(device) - base)


def flex_core(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, table: torch.Tensor, buckets: torch.Tensor):
    """softmax(q k^T + table[h, buckets[i, j]]) v with scale 1 (T5's bias read inside the kernel); table [heads,
    num_buckets] (trained), buckets [n, m] (long)."""
    from torch.nn.attention.flex_attention import flex_attention

    def score_mod(score, b, h, i, j):
        return score + table[h, buckets[i, j]].to(score.dtype)

    global _FLEX
    if _FLEX is None:
        _FLEX = torch.compile(flex_attention, dynamic=False)
    # blocks small enough for the kernel's shared memory: inductor's defaults for this score_mod asked an H200 for
    # 245,760 bytes of its 232,448 ("No valid triton configs", torch 2.11)
    return _FLEX(q, k, v, score_mod=score_mod, scale=1.0, kernel_options=FLEX_BLOCKS)


FLEX_BLOCKS = {"BLOCK_M": 64, "BLOCK_N": 64, "BLOCK_M1": 32, "BLOCK_N1": 64, "BLOCK_M2": 64, "BLOCK_N2": 32}


_FLEX = None


def flex_rows(cfg_of, lengths: list[int], batch: int, reps: int, warmup: int, device, dtype) -> None:
    """The `vanilla (flex)` rows (module docstring): materialised vs FlexAttention with the bias from its table."""
    for n in lengths:
        cfg = cfg_of(n)
        torch.manual_seed(0)
        attn = SelfAttention(cfg, ("vanilla",), ModelParallelConfig(use_cpu_initialization=True), 0, 1)
        attn = attn.to(device, dtype).train()
        bias = RelativePositionBias(cfg, True, 0, 1).to(device, dtype)
        pos = torch.arange(n, device=device)
        buckets = bias._bucket(pos[None, :] - pos[:, None])  # [n, n]: key - query, as RelativePositionBias.forward
        inputs = _inputs(attn, cfg, batch, False, device, dtype)
        grad = torch.randn(batch, attn.heads, n, cfg.d_kv, device=device, dtype=dtype)
        q, k, v = inputs["q"], inputs["k"], inputs["v"]

        def step(form: str) -> None:
            for t in (q, k, v, bias.weight):
                t.grad = None
            if form == "flex":
                out = flex_core(q, k, v, bias.weight, buckets)
            else:
                out = attn._mixed(inputs["x"], q, k, v, bias(n, n), None, 0, n, 0.0)
            out.backward(grad)

        def timed(form: str) -> tuple[float, int]:
            base = _peak_reset(device)
            start = time.perf_counter()
            step(form)
            torch.cuda.synchronize()
            return time.perf_counter() - start, max(0, _peak(device) - base)

        try:
            for form in ("materialised", "flex") * warmup:
                step(form)
            runs = {"materialised": [], "flex": []}
            for _ in range(reps):
                for form in runs:
                    runs[form].append(timed(form))
        except Exception as e:  # noqa: BLE001 - the row says why; the rows before it stand
            print(f"| vanilla (flex) | {n} | yes | failed: {type(e).__name__}: {str(e).splitlines()[0][:200]} |",
                  flush=True)
            return
        (mt, mm), (ft, fm) = ((min(t for t, _ in r), max(m for _, m in r)) for r in runs.values())
        print(f"| vanilla (flex) | {n} | yes | {mt:.3f} | {mm / 2**20:.0f} | {ft:.3f} | {fm / 2**20:.0f} | "
              f"{ft / mt:.2f} | {fm / max(mm, 1):.2f} | - | flex_attention |", flush=True)


def _inputs(attn: SelfAttention, cfg: ModelConfig, batch: int, bias: bool, device, dtype) -> dict:
    n, h, dkv = cfg.max_length, attn.heads, cfg.d_kv
    shape = (batch, h, n, dkv)
    leaf = lambda *s: torch.randn(*s, device=device, dtype=dtype).requires_grad_()  # noqa: E731
    additive = None
    if bias:  # T5's bias as the stack passes it: gathered from the [heads, buckets] table, [1, heads, n, n]
        table = RelativePositionBias(cfg, True, 0, 1).to(device, dtype)
        additive = table(n, n).detach().requires_grad_()
    vanilla = "vanilla" in attn.mixers
    return {"x": leaf(batch, n, cfg.d_model), "q": leaf(*shape) if vanilla else None,
            "k": leaf(*shape) if vanilla else None, "v": leaf(*shape), "additive": additive}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m bench.attention", description=__doc__.splitlines()[0])
    parser.add_argument("--lengths", type=int, nargs="+", default=[512, 1024, 2048, 4096])
    parser.add_argument("--mixers", nargs="+", default=MIXERS)
    parser.add_argument("--batch", type=int, default=2)
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--d-kv", type=int, default=64)
    parser.add_argument("--reps", type=int, default=2, help="least time of this many steps of each form, interleaved")
    parser.add_argument("--warmup", type=int, default=1, help="unmeasured steps before them")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", choices=sorted(DTYPES), default="fp32")
    args = parser.parse_args(argv)
    device, dtype = torch.device(args.device), DTYPES[args.dtype]
    if device.type == "cpu":
        _exact_cpu_peaks()
    kernels = _recording_kernels()
    init_single_process()
    print(f"attention core fwd + bwd, {args.device} {args.dtype}, batch {args.batch}, {args.heads} heads of "
          f"{args.d_kv}, {torch.get_num_threads()} threads; ratio = fused / materialised", flush=True)
    print("| mixer | N | bias | materialised s | MiB | fused s | MiB | time ratio | memory ratio | chosen | kernel | "
          "planned MiB (materialised / fused) |\n|---|---|---|---|---|---|---|---|---|---|---|---|", flush=True)
    def cfg_of(n: int) -> ModelConfig:
        return ModelConfig(d_model=args.heads * args.d_kv, d_kv=args.d_kv, num_heads=args.heads, max_length=n,
                           factorized_k=8, mixture_per_head=False)

    for spec in args.mixers:
        for n in args.lengths:
            cfg = cfg_of(n)
            torch.manual_seed(0)
            make = lambda: SelfAttention(cfg, parse_mixers(spec), ModelParallelConfig(use_cpu_initialization=True), 0, 1)  # noqa: E731
            attn = make().to(device, dtype).train()
            with torch.device("meta"):
                meta = make().to(dtype).train()
            for bias in (False, True):
                inputs = _inputs(attn, cfg, args.batch, bias, device, dtype)
                grad = torch.randn(args.batch, attn.heads, n, args.d_kv, device=device, dtype=dtype)
                forms = ("materialised", "fused") if attn.dot else ("materialised",)
                for _ in range(args.warmup):
                    for form in forms:
                        core_step(attn, form, inputs, grad)
                runs = {form: [] for form in forms}
                for _ in range(args.reps):  # interleaved: the machine's load changes both forms alike
                    for form in forms:
                        runs[form].append(measure(attn, form, inputs, grad))
                results = {form: (min(t for t, _ in r), max(m for _, m in r)) for form, r in runs.items()}
                trained = attn._mask_grad(inputs["additive"], None)
                takes = not (trained and attn.cuda_materialises_with_trained_mask) if device.type == "cuda" else \
                    attn.cpu_math_wins or not trained
                chosen = "fused" if attn.dot and takes else "materialised"
                (mt, mm), (ft, fm) = results["materialised"], results.get("fused", (float("nan"), 0))
                cells = [f"{mt:.3f}", f"{mm / 2**20:.0f}"] + (
                    [f"{ft:.3f}", f"{fm / 2**20:.0f}", f"{ft / mt:.2f}", f"{fm / max(mm, 1):.2f}"] if attn.dot else
                    ["-"] * 4)
                kernel = kernels[-1] if attn.dot else "-"
                plan = {}
                for form in forms:  # each form's gradients as its step left them
                    core_step(attn, form, inputs, grad)
                    plan[form] = f"{planned(attn, meta, form, inputs, device) / 2**20:.0f}"
                print(f"| {spec} | {n} | {'yes' if bias else 'no'} | " + " | ".join(cells) + f" | {chosen} | {kernel} | "
                      f"{plan['materialised']} / {plan.get('fused', '-')} |", flush=True)
                del inputs, grad
            del attn
    if device.type == "cuda" and "vanilla" in args.mixers:
        flex_rows(cfg_of, args.lengths, args.batch, args.reps, args.warmup, device, dtype)


if __name__ == "__main__":
    main()
