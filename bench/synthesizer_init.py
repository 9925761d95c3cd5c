"""The standard deviation of each mixer's initial logits under both `model.synthesizer_init` options, measured on
the real modules: the first encoder layer of a one-layer model of the config's widths (N = model.max_length), fed
inputs of unit RMS (what the attention's RMSNorm gives it at the start). docs/model.md ("Initial scale") quotes the
table; tests/test_model.py checks it against the closed forms there.

    .venv/bin/python -m bench.synthesizer_init [--config configs/small.yaml] [section.key=value ...]
"""
from __future__ import annotations

import argparse
import dataclasses

import torch

from pretrain.core.config import SYNTHESIZER_INIT, Config, ModelConfig, load_config
from pretrain.model import MIXERS, build_local_model


@torch.no_grad()
def initial_logit_std(cfg: ModelConfig, mixer: str, seed: int = 0, batch: int = 2) -> float:
    """Std of `mixer`'s per-head logits [b, heads, N, N] in encoder layer 0 of a fresh model of `cfg`'s widths."""
    small = dataclasses.replace(cfg, vocab_size=128, num_layers=1, num_decoder_layers=1, encoder_attention=mixer,
                                decoder_attention="vanilla")
    torch.manual_seed(seed)
    attn = build_local_model(small).encoder.layers[0].attn
    n = cfg.max_length
    x = torch.randn(batch, n, cfg.d_model)  # unit RMS per token, as RMSNorm's output at initialisation
    if mixer == "vanilla":
        q, k, _ = attn.qkv(x).view(batch, n, attn.heads, 3, attn.d_kv).permute(3, 0, 2, 1, 4)
        return float((q @ k.transpose(-1, -2)).std())
    return float(attn.synth[mixer](x, 0, n).std())


def table(cfg: ModelConfig) -> dict[str, dict[str, float]]:
    """{mixer: {synthesizer_init: std}} (vanilla's logits do not depend on the option)."""
    return {m: {init: initial_logit_std(dataclasses.replace(cfg, synthesizer_init=init), m) for init in SYNTHESIZER_INIT}
            for m in MIXERS}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m bench.synthesizer_init", description=__doc__.splitlines()[0])
    parser.add_argument("--config", default="configs/small.yaml")
    args, overrides = parser.parse_known_args(argv)
    cfg = load_config(Config, args.config, overrides).model
    print(f"initial logit std, {args.config}: d_model {cfg.d_model}, {cfg.num_heads} heads of {cfg.d_kv}, "
          f"N = {cfg.max_length}, k = {cfg.factorized_k}")
    print("| mixer | " + " | ".join(SYNTHESIZER_INIT) + " |\n" + "|---" * (len(SYNTHESIZER_INIT) + 1) + "|")
    for mixer, stds in table(cfg).items():
        print(f"| {mixer} | " + " | ".join(f"{stds[init]:.4g}" for init in SYNTHESIZER_INIT) + " |")


if __name__ == "__main__":
    main()
