"""Tensor-parallel building blocks of the model: per-head parameters sharded over TP and megatron's linear layers
returning their output alone (megatron's return (output, bias); the model adds its biases in the layer)."""
from __future__ import annotations

import torch
from megatron.core.tensor_parallel import (
    ColumnParallelLinear,
    RowParallelLinear,
    reduce_from_tensor_model_parallel_region,
    set_tensor_model_parallel_attributes,
)
from torch import nn


def head_parameter(full: torch.Tensor, tp_rank: int, tp: int, requires_grad: bool = True) -> nn.Parameter:
    """This rank's heads of a full per-head tensor [heads, ...], marked tensor-parallel along dim 0."""
    param = nn.Parameter(full.chunk(tp, dim=0)[tp_rank].clone(), requires_grad=requires_grad)
    set_tensor_model_parallel_attributes(param, True, 0, 1)
    return param


class ColumnLinear(ColumnParallelLinear):
    """megatron's ColumnParallelLinear (output split over TP along its last dimension, gathered only with
    gather_output), returning the output alone: its bias, if any, is added inside (skip_bias_add is never set)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out, _ = super().forward(x)  # fwd: identity into the TP region, bwd: all-reduce of the input gradient
        return out


class RowLinear(RowParallelLinear):
    """megatron's RowParallelLinear (input split over TP along its last dimension, output all-reduced), bias-free,
    returning the output alone. megatron's own forward hands the matmul `tp_group=None`, which megatron answers
    with a DeprecationWarning through warnings.warn at every call on rank 0: a torch.compile graph break at each
    output projection. Here the matmul gets the layer's group; the computation is the same."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self._forward_impl(input=x, weight=self.weight, bias=None,
                                 gradient_accumulation_fusion=self.gradient_accumulation_fusion,
                                 allreduce_dgrad=False, sequence_parallel=False, tp_group=self.tp_group,
                                 grad_output_buffer=None)
        return reduce_from_tensor_model_parallel_region(out, group=self.tp_group)  # fwd: all-reduce over TP
