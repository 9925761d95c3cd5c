"""Mesh TensorFlow's initialisers of the synthesizer parameters (`model.synthesizer_init: mesh_tf`), as its
`synthetic_attention` draws them; docs/model.md, "Initial scale"."""
from __future__ import annotations

import math

import torch
from torch import nn

from pretrain.model.init import holds_values


def mesh_tf_glorot(shape: tuple[int, ...], mesh_tf_shape: tuple[int, ...]) -> torch.Tensor:
    """A tensor of `shape` drawn as Mesh TF draws a variable of `mesh_tf_shape` that `mtf.get_variable` gives no
    initializer (R, R1, R2): TF's glorot_uniform, U(-a, a) with a = sqrt(6 / (fan_in + fan_out)), the fans read
    from the variable's layout (TF's `_compute_fans`: the last two dimensions, each times the others' product)."""
    receptive = math.prod(mesh_tf_shape[:-2])
    limit = math.sqrt(6 / ((mesh_tf_shape[-2] + mesh_tf_shape[-1]) * receptive))
    return torch.empty(shape).uniform_(-limit, limit)


def mesh_tf_dense_kernel(shape: tuple[int, ...], fan_in: int) -> torch.Tensor:
    """`mtf.layers.dense`'s default kernel (VarianceScalingInitializer: scale 1, fan_in, normal): TF's truncated
    normal, std sqrt(1 / fan_in) before values beyond two standard deviations are redrawn."""
    std = fan_in**-0.5
    w = torch.empty(shape)
    # trunc_normal_ redraws until no value is out of range, reading each draw on the host: not on fake tensors
    return nn.init.trunc_normal_(w, 0.0, std, -2 * std, 2 * std) if holds_values(w) else w
