"""The planner's activation terms against one real training forward + backward of the same model, per variant: what
autograd saves for the backward (counted the planner's way, saved_tensors_hooks over storages, parameters left out),
split by region (attention cores, the rest of the layers, outside the layers), what is live after the forward, and the
peak of forward + backward above the model's own memory. pretrain/planning/memory.py traces the same forward on the
meta device; a gap in `saved` is a tensor the trace does not see, a gap in `peak` only a backward transient.

    .venv/bin/python -m bench.activation_memory --config configs/base.yaml --micro-batch 32 --device cuda \
        --variants vanilla factorized_random random+vanilla
"""
from __future__ import annotations

import argparse
import dataclasses
import gc

import torch

from pretrain.core.config import Config, load_config
from pretrain.data.span_corruption import input_and_target_lengths
from pretrain.distributed.parallel import init_single_process
from pretrain.model import build_model
from pretrain.planning.memory import _DTYPES, trace_activations

MiB = 2**20


def _tagged(fn, region: list[str]):
    def core(*args, **kwargs):
        region.append("attention")
        try:
            return fn(*args, **kwargs)
        finally:
            region.pop()
    return core


def measured(model: torch.nn.Module, b: int, n: int, m: int, vocab: int, device: torch.device) -> dict[str, int]:
    """Bytes saved for the backward (by region), live after the forward, and the forward + backward's peak, each
    above what the model held before."""
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    seen: dict[int, tuple[int, str]] = {}
    region = ["rest"]
    hooks = []
    for block in [*model.encoder.layers, *model.decoder.layers]:
        hooks.append(block.register_forward_pre_hook(lambda *a: region.append("layers")))
        hooks.append(block.register_forward_hook(lambda *a: [region.pop(), None][1]))
        for name in ("_fused", "_mixed"):  # the attention core, as the planner's trace tags it
            if hasattr(block.attn, name):
                setattr(block.attn, name, _tagged(getattr(block.attn, name), region))

    def pack(t: torch.Tensor) -> torch.Tensor:
        ptr = t.untyped_storage().data_ptr()
        if ptr not in params and ptr not in seen:
            seen[ptr] = (t.untyped_storage().nbytes(), region[-1])
        return t

    g = torch.Generator(device=device).manual_seed(0)
    ids = torch.randint(2, vocab, (b, n), device=device, generator=g)
    labels = torch.randint(2, vocab, (b, m), device=device, generator=g)
    dec = torch.cat([torch.zeros_like(labels[:, :1]), labels[:, :-1]], dim=1)
    gc.collect()
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    sync()
    before = torch.cuda.memory_allocated() if device.type == "cuda" else 0
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats()
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = model(input_ids=ids, decoder_input_ids=dec, labels=labels)
    sync()
    live = torch.cuda.memory_allocated() - before if device.type == "cuda" else 0
    out.loss.backward()
    sync()
    peak = torch.cuda.max_memory_allocated() - before if device.type == "cuda" else 0
    for h in hooks:
        h.remove()
    by = {r: sum(size for size, where in seen.values() if where == r) for r in ("attention", "layers", "rest")}
    return {**by, "saved": sum(by.values()), "live": live, "peak": peak}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m bench.activation_memory", description=__doc__.splitlines()[0])
    parser.add_argument("--config", default="configs/tiny.yaml")
    parser.add_argument("--micro-batch", type=int, default=None)
    parser.add_argument("--precision", default="bf16")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--variants", nargs="+", default=["vanilla", "factorized_random", "random+vanilla"])
    args = parser.parse_args(argv)
    cfg = load_config(Config, args.config)
    micro = args.micro_batch or cfg.train.micro_batch
    n = cfg.data.input_length
    m = input_and_target_lengths(n, cfg.data.noise_density, cfg.data.mean_noise_span_length)[1]
    vocab = cfg.model.vocab_size or 32100
    device = torch.device(args.device)
    init_single_process()
    print(f"{args.config}, {args.precision}, micro batch {micro}, inputs {n} / targets {m}, {device}: MiB saved for the "
          f"backward (attention cores / rest of the layers / outside them), live after the forward, peak of forward + "
          f"backward; planned = pretrain/planning/memory.py's trace", flush=True)
    print("| variant | attention planned / measured | layers planned / measured | outside planned / measured | "
          "saved planned / measured | live | peak | planned backward transient |\n|---|---|---|---|---|---|---|---|",
          flush=True)
    for variant in args.variants:
        model_cfg = dataclasses.replace(cfg.model, encoder_attention=variant, decoder_attention=variant,
                                        vocab_size=vocab)
        job = dataclasses.replace(cfg, model=model_cfg, precision=args.precision)
        trace = trace_activations(job, 1, micro, m, device.type)
        planned_layers = sum(trace.blocks)
        planned = {"attention": trace.core, "layers": planned_layers - trace.core, "rest": trace.rest + trace.logits}
        torch.manual_seed(0)
        model = build_model(model_cfg, device=device)  # the path the trainer takes
        model = model.to(_DTYPES[args.precision]).train()
        got = measured(model, micro, n, m, min(vocab, 32000), device)
        cells = [f"{planned[r] / MiB:.0f} / {got[r] / MiB:.0f}" for r in ("attention", "layers", "rest")]
        cells.append(f"{sum(planned.values()) / MiB:.0f} / {got['saved'] / MiB:.0f}")
        cells += [f"{got['live'] / MiB:.0f}", f"{got['peak'] / MiB:.0f}", f"{trace.attention_backward / MiB:.0f}"]
        print(f"| {variant} | " + " | ".join(cells) + " |", flush=True)
        del model
        gc.collect()
        if device.type == "cuda":
            torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
