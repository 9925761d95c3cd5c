"""RMSNorm, the gated GELU and the cores of vanilla self-attention and of cross-attention as autograd functions with
hand-written backward passes, for eager CPU training: the same functions as `F.rms_norm`, `gelu_tanh(gate) * linear`
and `softmax(Q K^T + additive) V` (checked in float64 by tests/test_fast_paths.py, forward and every gradient) in fewer
passes over memory.

Why: on a CPU every elementwise op is a pass over memory, and autograd differentiates the plain forms op by op:
`F.rms_norm` is decomposed on the CPU (pow, mean, add, rsqrt, mul, mul, each with its backward, and it keeps
the normalised x as well), `F.gelu(approximate="tanh")` spends most of its time in `tanh`, and the gradient of
the fused `wi` output is two halves glued by a `cat`. Measured at one encoder layer's shapes on one thread
(T5-small, batch 4 x 512, fp32, least of 60-100 interleaved runs on the loaded 2-core machine): RMSNorm
forward + backward 7.7-8.4 -> 4.5-5.2 ms; the gated GELU forward 9.7-10.0 -> 7.6-8.3 ms (its backward: the
class's docstring).

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
    (autograd's decomposition also keeps the normalised x: one activation less per norm). The backward makes one
    full-size product, g x, and takes both of its reductions as matrix-vector products (the weight's gradient
    weighted by rstd, the row dot products with w): [4, 512, 512], one thread, least of 40: 8.4 -> 3.4 ms against
    the form that built xhat = x rstd and g xhat and summed the columns (in a train step, 42 norms: 126-139 ->
    93-98 ms)."""

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
        gx = (grad * x).reshape(-1, d)  # [rows, d]: the one full-size product both gradients read
        # grad_weight = sum over rows of g xhat = (g x)^T rstd, a matrix-vector product (no xhat, no column sum)
        grad_weight = torch.mv(gx.t(), rstd.view(-1)) if ctx.needs_input_grad[1] else None
        # dx = rstd (g w - xhat mean(g w xhat)) = rstd g w - x rstd^3 ((g x) @ w) / d
        coef = (gx @ weight).view(rstd.shape).mul_(rstd * rstd * rstd).div_(-d)  # [..., 1]
        grad_x = torch.mul(grad, weight).mul_(rstd).addcmul_(x, coef)
        return grad_x, grad_weight, None


class GatedGeluFunction(torch.autograd.Function):
    """gelu_tanh(gate) * linear for h = [gate | linear] (the fused `wi` output, [..., 2 f]) -> [..., f].

    gelu_tanh(x) = x/2 (1 + tanh(u)) = x sigmoid(2u), u = sqrt(2/pi) (x + 0.044715 x^3): the same function
    through `sigmoid` in four passes (the gate half of [4, 512, 2 x 1024], one thread, least of 40, 2-core Intel
    Xeon: 6.8 ms; ATen's one-pass `F.gelu(approximate="tanh")` 7.5 ms, the five-pass form before 8.5 ms). Saves h
    and gelu_tanh(gate); the backward writes both halves of the gradient straight into one [..., 2 f] tensor (no
    `cat`), the gate's through ATen's fused `gelu_backward` (backward at [4, 512, 2 x 1024], one thread: 20.9 ->
    14.1 ms)."""

    @staticmethod
    def forward(ctx, h: torch.Tensor) -> torch.Tensor:
        gate, linear = h.chunk(2, dim=-1)  # [..., f] views
        # 2u = (c + c kappa x^2) x, c = 2 sqrt(2/pi): the polynomial in one pass (addcmul onto a 0-d tensor)
        c = gate.new_tensor(2.0 * _SQRT_2_OVER_PI)
        s = torch.addcmul(c, gate, gate, value=2.0 * _SQRT_2_OVER_PI * _KAPPA).mul_(gate).sigmoid_()
        act = s.mul_(gate)  # gelu_tanh(gate), in place of s
        ctx.save_for_backward(h, act)
        return torch.mul(act, linear)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        h, act = ctx.saved_tensors
        gate, linear = h.chunk(2, dim=-1)
        grad_h = torch.empty_like(h)
        grad_gate, grad_linear = grad_h.chunk(2, dim=-1)
        torch.mul(act, grad, out=grad_linear)  # d/d linear = gelu(gate) g
        # d/d gate = gelu'(gate) linear g: ATen's fused gelu_backward, in place on linear g (one pass where the
        # slope spelled out in elementwise ops took five)
        torch.mul(grad, linear, out=grad_gate)
        torch.ops.aten.gelu_backward.grad_input(grad_gate, gate, approximate="tanh", grad_input=grad_gate)
        return grad_h


class VanillaAttentionFunction(torch.autograd.Function):
    """softmax(Q K^T + additive) V with Q, K, V read in place from the fused projection [b, n, heads * 3 * d_kv]
    (rows ordered [head, (q, k, v), d_kv], as attention._split_heads reads them) and the output written straight
    into [b, n, heads * d_kv], the output projection's input; the backward writes dQ, dK, dV straight into one
    gradient of the fused projection. `additive` [b|1, heads|1, n, n] or None: bias and masks, summed back to
    its shape for its gradient.

    Why: the plain form copies Q, K and V to contiguous [b, heads, n, d_kv] tensors, the output back to
    [b, n, heads * d_kv], and in the backward stacks the three gradients into the projection's layout
    (`clone` and `stack`: ~80 ms of a 7 s one-thread T5-small step). A GEMM reads and writes a matrix whose rows
    are strided (leading dimension heads * 3 * d_kv) as fast as a contiguous one, so the batched GEMMs here run
    once per example over the heads, on strided views, and nothing is copied. The softmax and its backward run
    in place on the [b, heads, n, n] logits and their gradient."""

    @staticmethod
    def forward(ctx, qkv: torch.Tensor, additive: torch.Tensor | None, heads: int, d_kv: int) -> torch.Tensor:
        q, k, v = head_views(qkv, heads, 3, d_kv)  # [b, heads, n, d_kv] strided views
        out, probs = _attend(q, k, v, additive)
        ctx.save_for_backward(qkv, probs)
        ctx.heads, ctx.d_kv = heads, d_kv
        ctx.additive_shape = None if additive is None else additive.shape
        return out

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        qkv, probs = ctx.saved_tensors
        grad_qkv = torch.empty_like(qkv)
        dlogits = _attend_backward(head_views(qkv, ctx.heads, 3, ctx.d_kv), probs, grad,
                                   head_views(grad_qkv, ctx.heads, 3, ctx.d_kv))
        grad_additive = dlogits.sum_to_size(ctx.additive_shape) if ctx.needs_input_grad[1] else None
        return grad_qkv, grad_additive, None, None


class CrossAttentionFunction(torch.autograd.Function):
    """softmax(Q K^T + mask) V for decoder queries [b, n, heads * d_kv] against the encoder output's fused K|V
    projection [b, m, heads * 2 * d_kv] (rows [head, (k, v), d_kv]), read in place as VanillaAttentionFunction
    reads its Q, K, V; the backward writes dK, dV straight into one gradient of the K|V projection. `mask`
    [b, 1, 1|n, m] additive or None (no gradient).

    Why: the plain form splits K and V out of the fused projection (a `stack` of their gradients in the backward)
    and runs SDPA's fused CPU kernel, whose backward is the slow part at these shapes. T5-small's cross-attention
    at batch 4, 114 queries x 512 keys, 6 heads of 64, fp32, one thread (fwd + bwd, thread CPU time, least of 20
    interleaved runs, 2-core Intel Xeon): 16.3 ms -> 13.6 ms a layer."""

    @staticmethod
    def forward(ctx, q_proj: torch.Tensor, kv_proj: torch.Tensor, mask: torch.Tensor | None, heads: int,
                d_kv: int) -> torch.Tensor:
        out, probs = _attend(*_cross_views(q_proj, kv_proj, heads, d_kv), mask)
        ctx.save_for_backward(q_proj, kv_proj, probs)
        ctx.heads, ctx.d_kv = heads, d_kv
        return out

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        q_proj, kv_proj, probs = ctx.saved_tensors
        grad_q, grad_kv = torch.empty_like(q_proj), torch.empty_like(kv_proj)
        _attend_backward(_cross_views(q_proj, kv_proj, ctx.heads, ctx.d_kv), probs, grad,
                         _cross_views(grad_q, grad_kv, ctx.heads, ctx.d_kv))
        return grad_q, grad_kv, None, None, None


def _cross_views(q_proj: torch.Tensor, kv_proj: torch.Tensor, heads: int, d_kv: int) -> tuple[torch.Tensor, ...]:
    """(q, k, v) [b, heads, n|m, d_kv] views of the query projection and the fused K|V projection."""
    return (*head_views(q_proj, heads, 1, d_kv), *head_views(kv_proj, heads, 2, d_kv))


def _attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
            additive: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """q [b, heads, n, d_kv], k, v [b, heads, m, d_kv] (strided views) -> (output [b, n, heads * d_kv],
    probabilities [b, heads, n, m]); one batched GEMM per example over the heads, softmax in place."""
    b, heads, n, d_kv = q.shape
    probs = q.new_empty(b, heads, n, k.shape[2])
    for i in range(b):
        torch.bmm(q[i], k[i].transpose(-1, -2), out=probs[i])  # [heads, n, m]
    if additive is not None:
        probs.add_(additive)  # as HF's `scores += position_bias`
    torch.softmax(probs, dim=-1, out=probs)  # in place: each row is read before it is written
    out = q.new_empty(b, n, heads, d_kv)
    for i in range(b):
        torch.bmm(probs[i], v[i], out=out[i].transpose(0, 1))  # [heads, n, d_kv] into [n, heads, d_kv]
    return out.view(b, n, heads * d_kv), probs


def _attend_backward(qkv: tuple[torch.Tensor, ...], probs: torch.Tensor, grad: torch.Tensor,
                     grads: tuple[torch.Tensor, ...]) -> torch.Tensor:
    """Writes dQ, dK, dV into the views `grads` (shaped as q, k, v = `qkv`); returns the logits' gradient."""
    q, k, v = qkv
    dq, dk, dv = grads
    b, heads, n, d_kv = q.shape
    grad = grad.reshape(b, n, heads, d_kv).transpose(1, 2)  # [b, heads, n, d_kv] view
    dlogits = torch.empty_like(probs)  # [b, heads, n, m]
    scratch = q.new_empty(heads, d_kv, k.shape[2]) if n >= _TRANSPOSED_FROM else None
    for i in range(b):
        torch.bmm(grad[i], v[i].transpose(-1, -2), out=dlogits[i])  # d probs = dO V^T
        _transposed_product(probs[i], grad[i], dv[i], scratch)  # dV = P^T dO
    # in place: each row's dot product is taken before the row is written
    torch._softmax_backward_data(dlogits, probs, -1, probs.dtype, grad_input=dlogits)
    for i in range(b):
        torch.bmm(dlogits[i], k[i], out=dq[i])  # dQ = dS K
        _transposed_product(dlogits[i], q[i], dk[i], scratch)  # dK = dS^T Q
    return dlogits


# From this many queries on, dK and dV are computed transposed. MKL's batched GEMM is slow for a^T b with a long
# shared dimension (the queries) into [keys, d_kv]; (b^T a)^T into a contiguous [d_kv, keys] scratch, then one
# copy, is faster: dK at 6 heads x 512 x 512 x 64, 4 examples, one thread 20.0 -> 13.5 ms, dV 18.9 -> 13.0 ms;
# the crossover is between 192 (2.2 vs 2.6 ms) and 256 (5.2 vs 4.7 ms); below it the direct form wins.
_TRANSPOSED_FROM = 256


def _transposed_product(a: torch.Tensor, b: torch.Tensor, out: torch.Tensor, scratch: torch.Tensor | None) -> None:
    """out = a^T b for a [heads, n, m], b [heads, n, d] into the (strided) view out [heads, m, d]; through
    `scratch` [heads, d, m] as (b^T a)^T where given."""
    if scratch is None:
        torch.bmm(a.transpose(-1, -2), b, out=out)
    else:
        out.copy_(torch.bmm(b.transpose(-1, -2), a, out=scratch).transpose(-1, -2))


def head_views(fused: torch.Tensor, heads: int, parts: int, d_kv: int) -> tuple[torch.Tensor, ...]:
    """[b, n, heads * parts * d_kv] (rows ordered [head, part, d_kv]) -> `parts` views [b, heads, n, d_kv]."""
    b, n, _ = fused.shape
    return tuple(t.transpose(1, 2) for t in fused.view(b, n, heads, parts, d_kv).unbind(3))
