"""RMSNorm and the gated GELU as autograd functions with hand-written backward passes, for eager CPU training:
the same functions as `F.rms_norm` and `gelu_tanh(gate) * linear` (checked in float64 by tests/test_fast_paths.py,
forward and every gradient) in fewer passes over memory.

Why: on a CPU every elementwise op is a pass over memory, and autograd differentiates the plain forms op by op:
`F.rms_norm` is decomposed on the CPU (pow, mean, add, rsqrt, mul, mul, each with its backward, and it keeps
the normalised x as well), `F.gelu(approximate="tanh")` spends most of its time in `tanh`, and the gradient of
the fused `wi` output is two halves glued by a `cat`. Measured at one encoder layer's shapes on one thread
(T5-small, batch 4 x 512, fp32, least of 60-100 interleaved runs on the loaded 2-core machine): RMSNorm
forward + backward 7.7-8.4 -> 4.5-5.2 ms; the gated GELU forward 9.7-10.0 -> 7.6-8.3 ms, its backward the same
(12.9 vs 13.1 ms).

`use_cpu_autograd(x)` says where they are used: fp32/fp64 tensors on the CPU outside torch.compile. On CUDA
`F.rms_norm` and `F.gelu` are fused kernels already; under torch.compile inductor fuses the plain chains.
"""
from __future__ import annotations

import math

import torch

_SQRT_2_OVER_PI = math.sqrt(2.0 / math.pi)
_KAPPA = 0.044715  # gelu_tanh(x) = x/2 (1 + tanh(sqrt(2/pi) (x + 0.044715 x^3)))


def use_cpu_autograd(x: torch.Tensor) -> bool:
    """True where the hand-written functions are the faster form: eager, CPU, fp32 or fp64."""
    return x.device.type == "cpu" and x.dtype in (torch.float32, torch.float64) and not torch.compiler.is_compiling()


class RMSNormFunction(torch.autograd.Function):
    """y = x * rsqrt(mean(x^2) + eps) * w over the last dimension (`F.rms_norm`); saves x and rstd [..., 1]
    (autograd's decomposition also keeps the normalised x: one activation less per norm)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        d = x.shape[-1]
        # mean of squares as one fused reduction (||x||^2 / d) instead of pow + mean
        rstd = torch.linalg.vector_norm(x, dim=-1, keepdim=True).square_().div_(d).add_(eps).rsqrt_()  # [..., 1]
        ctx.save_for_backward(x, weight, rstd)
        return torch.mul(x, rstd).mul_(weight)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        x, weight, rstd = ctx.saved_tensors
        d = x.shape[-1]
        xhat = x * rstd  # [..., d]
        gx = grad * xhat  # [..., d]: grad_weight's terms, and (times w) those of the row dot product
        grad_weight = gx.reshape(-1, d).sum(0) if ctx.needs_input_grad[1] else None
        # dx = rstd (g w - xhat mean(g w xhat)); mean(g w xhat) = (gx @ w) / d, a matrix-vector product
        dot = (gx.reshape(-1, d) @ weight).div_(d).view(*x.shape[:-1], 1)  # [..., 1]
        grad_x = torch.addcmul(grad * weight, xhat, dot, value=-1.0).mul_(rstd)
        return grad_x, grad_weight, None


class GatedGeluFunction(torch.autograd.Function):
    """gelu_tanh(gate) * linear for h = [gate | linear] (the fused `wi` output, [..., 2 f]) -> [..., f].

    gelu_tanh(x) = x/2 (1 + tanh(u)) = x sigmoid(2u), u = sqrt(2/pi) (x + 0.044715 x^3): the same function
    through `sigmoid` (2.0 ms for [4, 512, 1024] here) instead of `tanh` (8.4 ms). Saves h and s = sigmoid(2u);
    the backward writes both halves of the gradient straight into one [..., 2 f] tensor (no `cat`)."""

    @staticmethod
    def forward(ctx, h: torch.Tensor) -> torch.Tensor:
        gate, linear = h.chunk(2, dim=-1)  # [..., f] views
        s = torch.addcmul(gate, gate * gate, gate, value=_KAPPA).mul_(2.0 * _SQRT_2_OVER_PI).sigmoid_()
        ctx.save_for_backward(h, s)
        return torch.mul(gate, s).mul_(linear)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        h, s = ctx.saved_tensors
        gate, linear = h.chunk(2, dim=-1)
        grad_h = torch.empty_like(h)
        grad_gate, grad_linear = grad_h.chunk(2, dim=-1)
        torch.mul(gate, s, out=grad_linear).mul_(grad)  # d/d linear = gelu(gate) g
        # d gelu/dx = s + s (1 - s) 2x u'(x), 2x u'(x) = sqrt(2/pi) (2x + 6 * 0.044715 x^3)
        two_x_du = torch.addcmul(gate * (2.0 * _SQRT_2_OVER_PI), gate * gate, gate,
                                 value=6.0 * _KAPPA * _SQRT_2_OVER_PI)
        slope = torch.addcmul(s, two_x_du, torch.addcmul(s, s, s, value=-1.0))
        torch.mul(grad, linear, out=grad_gate).mul_(slope)
        return grad_h
