"""The whole model's training forward + backward on the CPU with the attention form `build_model(sdpa=None)` picks
(pretrain/model/attention.py: SDPA's math path for some layers with a trained mask, `cpu_math_wins`) against
materialised logits everywhere (`sdpa=False`): the least time of --reps interleaved steps after one warm-up, per mixer.
docs/model.md ("Fused attention") has the figures.

    OMP_NUM_THREADS=1 .venv/bin/python -m bench.attention_model [--config configs/small.yaml] [--inputs 512]
        [--targets 114] [--batch 2] [--reps 3] [--mixers dense dense+vanilla ...]
"""
from __future__ import annotations

import argparse
import dataclasses
import time

import torch

from pretrain.core.config import Config, load_config
from pretrain.distributed.parallel import init_single_process
from pretrain.model import build_model


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m bench.attention_model", description=__doc__.splitlines()[0])
    parser.add_argument("--config", default="configs/small.yaml")
    parser.add_argument("--inputs", type=int, default=512)
    parser.add_argument("--targets", type=int, default=114)
    parser.add_argument("--batch", type=int, default=2)
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--mixers", nargs="+", default=["dense", "dense+vanilla", "factorized_random+vanilla",
                                                         "random+vanilla"])
    args = parser.parse_args(argv)
    init_single_process()
    cfg = dataclasses.replace(load_config(Config, args.config).model, vocab_size=32128)
    print(f"{args.config} model, CPU fp32, {torch.get_num_threads()} threads, batch {args.batch}, {args.inputs} inputs /"
          f" {args.targets} targets: fwd + bwd, sdpa=None (the rule) vs sdpa=False (materialised)", flush=True)
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(2, cfg.vocab_size, (args.batch, args.inputs), generator=g)
    targets = torch.randint(2, cfg.vocab_size, (args.batch, args.targets), generator=g)
    for spec in args.mixers:
        spec_cfg = dataclasses.replace(cfg, encoder_attention=spec, decoder_attention=spec)
        models = {}
        for form in (None, False):
            torch.manual_seed(0)
            models[form] = build_model(spec_cfg, sdpa=form).train()
        times: dict = {form: [] for form in models}
        for rep in range(args.reps + 1):  # interleaved: the machine's load changes both forms alike
            for form, model in models.items():
                start = time.perf_counter()
                model(ids, decoder_input_ids=targets, labels=targets).loss.backward()
                model.zero_grad(set_to_none=True)
                if rep:
                    times[form].append(time.perf_counter() - start)
        rule, materialised = min(times[None]), min(times[False])
        print(f"{spec}: rule {rule:.3f} s, materialised {materialised:.3f} s, ratio {rule / materialised:.2f}",
              flush=True)
        del models


if __name__ == "__main__":
    main()
