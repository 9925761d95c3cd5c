"""Throughput of the real training step (DeepSpeed engine: forward, backward, clipping, AdamW) for every
attention variant: tokens/s and model FLOPs utilisation (pretrain.model.flops against the device peak).

    .venv/bin/python -m bench.throughput                      # tiny CPU mode (configs/tiny.yaml, fp32): CI
    python -m bench.throughput --config configs/base.yaml --precision bf16 --micro-batch 32   # on a GPU

One process, random token ids (the data pipeline is benchmarked in bench/data.py). The peak is
`log.peak_flops` if set, a data-sheet figure on known GPUs, or this CPU's measured matmul rate.
"""
from __future__ import annotations

import argparse
import dataclasses
import time

import torch

from pretrain.config import Config, load_config
from pretrain.data.span_corruption import input_and_target_lengths
from pretrain.engine import build_engine
from pretrain.metrics import peak_flops
from pretrain.model import build_model
from pretrain.model.flops import flops_per_sequence
from pretrain.parallel import destroy_distributed, init_distributed

VARIANTS = ("vanilla", "dense", "random", "fixed_random", "factorized_dense", "factorized_random",
            "random+vanilla", "dense+vanilla")


def _batch(micro_batch: int, input_length: int, target_length: int, vocab: int, device) -> dict:
    g = torch.Generator().manual_seed(0)
    ids = lambda n: torch.randint(2, vocab, (micro_batch, n), generator=g).to(device)  # noqa: E731
    return {"input_ids": ids(input_length), "attention_mask": torch.ones(micro_batch, input_length, dtype=torch.long,
            device=device), "decoder_input_ids": ids(target_length), "labels": ids(target_length)}


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", default="configs/tiny.yaml")
    parser.add_argument("--precision", default=None, help="fp32, bf16 or fp16 (default: the config's)")
    parser.add_argument("--micro-batch", type=int, default=None)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--variants", nargs="+", default=list(VARIANTS))
    args = parser.parse_args()
    cfg = load_config(Config, args.config)
    precision = args.precision or cfg.precision
    micro = args.micro_batch or cfg.train.micro_batch
    train = dataclasses.replace(cfg.train, micro_batch=micro, global_batch=micro)
    dims = init_distributed(cfg.parallel, cfg.run.seed)
    input_length = cfg.data.input_length
    target_length = input_and_target_lengths(input_length, cfg.data.noise_density, cfg.data.mean_noise_span_length)[1]
    peak = peak_flops(cfg.log.peak_flops, dims.device)
    device_name = torch.cuda.get_device_name(dims.device) if dims.device.type == "cuda" else "CPU"
    print(f"{args.config}: {device_name}, {precision}, micro batch {micro}, inputs {input_length} / targets "
          f"{target_length}, peak {peak / 1e12:.3g} TFLOP/s")
    print(f"{'variant':>18} {'ms/step':>9} {'tokens/s':>10} {'MFU':>7}")
    batch = _batch(micro, input_length, target_length, min(cfg.model.vocab_size, 32000), dims.device)
    for variant in args.variants:
        model_cfg = dataclasses.replace(cfg.model, encoder_attention=variant, decoder_attention=variant)
        engine = build_engine(build_model(model_cfg, cfg.train.activation_checkpointing), train, cfg.zero, precision,
                              dims.dp)
        for step in range(args.steps + 1):
            if step == 1:  # the first step warms up allocators and kernels
                _sync(dims.device)
                start = time.perf_counter()
            engine.backward(engine(**batch).loss)
            engine.step()
        _sync(dims.device)
        step_s = (time.perf_counter() - start) / args.steps
        flops = micro * flops_per_sequence(model_cfg, input_length, target_length)
        print(f"{variant:>18} {step_s * 1e3:9.1f} {micro * (input_length + target_length) / step_s:10.0f} "
              f"{flops / step_s / peak:7.1%}")
        del engine
    destroy_distributed()


if __name__ == "__main__":
    main()
