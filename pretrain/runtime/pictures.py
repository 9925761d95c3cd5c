"""Pictures of a model's learned attention for TensorBoard and the study: the input-independent synthesizer matrices
(each mixer with a `Mixer.matrix`: Random, Fixed Random, Factorized Random as R1 R2^T) per layer and head as
labelled heatmaps with a colour bar, the mixture weights per layer and head as labelled bars (matplotlib figures
rendered to arrays), and attention maps on an input."""
from __future__ import annotations

import re
from typing import Mapping

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


def matrix_figure(tag: str, r: torch.Tensor):
    """A matplotlib Figure of one layer's learned synthesizer logits [heads, N, N]: a heatmap per head (labelled,
    query rows x key columns), one colour scale for the layer, and its colour bar."""
    from matplotlib.figure import Figure

    heads, lo, hi = r.shape[0], float(r.min()), float(r.max())
    cols = min(heads, 4)
    rows = -(-heads // cols)
    fig = Figure(figsize=(2.4 * cols + 0.8, 2.4 * rows + 0.5), dpi=80, layout="constrained")
    axes = fig.subplots(rows, cols, squeeze=False)
    for h, ax in enumerate(axes.flat):
        if h >= heads:
            ax.set_axis_off()
            continue
        shown = ax.imshow(r[h].cpu().numpy(), cmap="viridis", vmin=lo, vmax=hi, interpolation="nearest")
        ax.set_title(f"head {h}", fontsize=9)
        if h // cols == rows - 1:
            ax.set_xlabel("key position", fontsize=8)
        if h % cols == 0:
            ax.set_ylabel("query position", fontsize=8)
        ax.tick_params(labelsize=7)
    fig.colorbar(shown, ax=axes, shrink=0.8, label="logit")
    fig.suptitle(f"{tag}: learned logits per head", fontsize=10)
    return fig


def mixture_figure(tag: str, grid: np.ndarray):
    """A matplotlib Figure of one mixer's softmax weight per layer and head ([layers, heads], 0..1): grouped bars,
    one group per head and one bar per layer."""
    from matplotlib.figure import Figure

    layers, heads = grid.shape
    fig = Figure(figsize=(max(4.0, 0.5 * heads * layers + 1.5), 3.0), dpi=80, layout="constrained")
    ax = fig.subplots()
    width = 0.8 / layers
    for layer in range(layers):
        ax.bar(np.arange(heads) + (layer - (layers - 1) / 2) * width, grid[layer], width, label=f"layer {layer}")
    ax.set_xticks(np.arange(heads), [f"head {h}" for h in range(heads)], fontsize=8)
    ax.set_ylim(0, 1)
    ax.set_ylabel("mixture weight")
    ax.legend(fontsize=7, ncols=min(layers, 4))
    ax.set_title(f"{tag}: softmax weight of this mixer", fontsize=10)
    return fig


def rendered(fig) -> np.ndarray:
    """A Figure as an HWC uint8 RGB image (Agg, no display)."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg

    canvas = FigureCanvasAgg(fig)
    canvas.draw()
    return np.asarray(canvas.buffer_rgba())[..., :3].copy()


def synthesizer_figures(model) -> dict[str, object]:
    """{tag: Figure} of this rank's learned synthesizer matrices (`synthesizer/<layer>/<mixer>`) and each mixer's
    mixture weights (`mixture_heads/<stack>/<mixer>`). Call on every rank (per-head mixture weights are gathered
    over TP); ZeRO-3 needs the parameters gathered."""
    matrices = synthesizer_matrices(model.state_dict())
    figures = {f"synthesizer/{tag}": matrix_figure(tag, r) for tag, r in matrices.items()}
    for tag, grid in mixture_grids(model).items():
        figures[f"mixture_heads/{tag}"] = mixture_figure(tag, grid)
    return figures


def synthesizer_images(model) -> dict[str, np.ndarray]:
    """TensorBoard images ({tag: HWC uint8}) of `synthesizer_figures`."""
    return {tag: rendered(fig) for tag, fig in synthesizer_figures(model).items()}


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
