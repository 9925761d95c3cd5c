"""Pictures of a model's learned attention for TensorBoard and the study: the input-independent synthesizer matrices
(each mixer with a `Mixer.matrix`: Random, Fixed Random, Factorized Random as R1 R2^T) per layer and head,
the mixture weights per layer and head, and attention maps on an input, as arrays (no plotting library)."""
from __future__ import annotations

import re
from typing import Mapping, Sequence

import numpy as np
import torch

from pretrain.model.mixers import MIXERS

# a synthesizer's own parameter, by our names (encoder.layers.0.attn.synth.random.r) and the export's
# (encoder.block.0.layer.0.SelfAttention.synth.random.r)
_SYNTH = re.compile(r"^(encoder|decoder)\.(?:layers|block)\.(\d+)\..*synth\.(\w+)\.(\w+)$")


def synthesizer_matrices(state: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """{"encoder.layers.0/random": [heads, N, N]} for every input-independent synthesizer in `state`."""
    params: dict[tuple[str, int, str], dict[str, torch.Tensor]] = {}
    for name, t in state.items():
        m = _SYNTH.match(name)
        if m and m[3] in MIXERS and MIXERS[m[3]].matrix is not None:
            params.setdefault((m[1], int(m[2]), m[3]), {})[m[4]] = t.detach().float()
    found = sorted(params.items(), key=lambda f: (f[0][0] != "encoder", *f[0][1:]))  # encoder first, by layer
    return {f"{stack}.layers.{layer}/{mixer}": MIXERS[mixer].matrix(p) for (stack, layer, mixer), p in found}


def mixture_grids(model) -> dict[str, np.ndarray]:
    """{"encoder/random": [layers, heads]}: each mixer's softmax weight per layer and head (a per-layer
    weight is the same for every head). Per-head weights are gathered over TP: call on every TP rank."""
    weights = model.mixture_weights()  # {"encoder.layers.3": [k] or [heads, k]}
    heads = model.config.num_heads
    grids: dict[str, list[np.ndarray]] = {}
    for layer, w in weights.items():
        stack = layer.split(".")[0]
        w = w.float().cpu()
        w = w.expand(heads, -1) if w.dim() == 1 else w  # [heads, k]
        for i, mixer in enumerate(model.mixers[stack]):
            grids.setdefault(f"{stack}/{mixer}", []).append(w[:, i].numpy())
    return {tag: np.stack(rows) for tag, rows in grids.items()}


def heatmap(matrix: np.ndarray, vmin: float | None = None, vmax: float | None = None) -> np.ndarray:
    """A 2-D array as an HWC uint8 RGB image (viridis, min..max of the array unless given)."""
    from matplotlib import colormaps

    matrix = np.asarray(matrix, dtype=np.float64)
    lo = matrix.min() if vmin is None else vmin
    hi = matrix.max() if vmax is None else vmax
    scaled = (matrix - lo) / (hi - lo) if hi > lo else np.zeros_like(matrix)
    return (colormaps["viridis"](np.clip(scaled, 0, 1))[..., :3] * 255).astype(np.uint8)  # [H, W, 3]


def _tile(images: Sequence[np.ndarray], gap: int = 2) -> np.ndarray:
    """Images of one height side by side with a white gap (one tile per head)."""
    h = images[0].shape[0]
    spacer = np.full((h, gap, 3), 255, dtype=np.uint8)
    parts = [p for img in images for p in (img, spacer)][:-1]
    return np.concatenate(parts, axis=1)


def synthesizer_images(model) -> dict[str, np.ndarray]:
    """TensorBoard images ({tag: HWC uint8}) of this rank's learned random matrices (heads side by side, one
    colour scale per layer) and of each mixer's mixture weights as a layer x head grid (scale 0..1).
    Call on every rank (per-head mixture weights are gathered over TP); ZeRO-3 needs the parameters gathered."""
    images = {}
    for tag, r in synthesizer_matrices(model.state_dict()).items():
        lo, hi = float(r.min()), float(r.max())
        images[f"synthesizer/{tag}"] = _tile([heatmap(h.cpu().numpy(), lo, hi) for h in r])
    for tag, grid in mixture_grids(model).items():
        # a few pixels per cell: a 2 x 4 grid would be invisible at one pixel each
        images[f"mixture_heads/{tag}"] = np.kron(heatmap(grid, 0.0, 1.0), np.ones((16, 16, 1), dtype=np.uint8))
    return images


@torch.no_grad()
def attention_maps(model, input_ids: torch.Tensor) -> dict[str, torch.Tensor]:
    """The first encoder layer's self-attention on one unpadded sequence: {mixer: [heads, n, n]} for each
    mixer alone (softmax of its logits + position bias) and "mixed" (the probabilities the layer uses).

    The layer's input, position bias and mask are captured with a forward hook; the logits are recomputed
    from the layer's own projections (Q/K for vanilla, the synthesizer modules otherwise)."""
    attn = model.encoder.layers[0].attn
    captured = {}

    def hook(module, args, kwargs, output):
        captured["x"], captured["bias"] = args[0], args[1]
        captured["vanilla_bias"] = args[4] if len(args) > 4 else kwargs.get("vanilla_bias")
        captured["out"] = output

    handle = attn.register_forward_hook(hook, with_kwargs=True)
    try:
        model.encode(input_ids, torch.ones_like(input_ids))
    finally:
        handle.remove()
    # [1, n, d]; [1, heads, n, n] or None (no padding: the bias after mixing only); [1, heads, n, n] or None
    x, additive, vanilla_bias = captured["x"], captured["bias"], captured["vanilla_bias"]
    additive = 0 if additive is None else additive  # position_bias: none (or vanilla without a mixture)
    b, n, _ = x.shape
    logits = {}
    for name in attn.mixers:
        if name == "vanilla":
            qkv = attn.qkv(x).view(b, n, attn.heads, 3, attn.d_kv).permute(3, 0, 2, 1, 4)
            logits[name] = qkv[0] @ qkv[1].transpose(-1, -2)  # [1, heads, n, n]; T5 folds the scale into Q
            if vanilla_bias is not None:  # position_bias: vanilla, in a mixture
                logits[name] = logits[name] + vanilla_bias
        else:
            logits[name] = attn.synth[name](x, 0, n).expand(b, -1, -1, -1)
    if len(attn.mixers) > 1:
        alpha = attn.mixture_weights()  # [k] or [heads, k]
        mixed = sum(logits[m] * (alpha[i] if alpha.dim() == 1 else alpha[:, i, None, None])
                    for i, m in enumerate(attn.mixers))
    else:
        mixed = logits[attn.mixers[0]]
    maps = {name: torch.softmax(s + additive, dim=-1)[0] for name, s in logits.items()}
    maps["mixed"] = torch.softmax(mixed + additive, dim=-1)[0]
    return maps
