"""One call of `F.scaled_dot_product_attention` with its kernel named explicitly (`torch.nn.attention.sdpa_kernel`).

The kernel is chosen from what the layer is (device, dtype, whether a mask is passed, whether it is trained, attention
dropout, the head dimension), never from the tensors' `requires_grad`: megatron's recompute runs the forward without
gradients and the recompute with them, and torch's own choice would differ between the two (on an H200 cuDNN for the
no-grad forward of a layer whose mask is trained, the memory-efficient kernel for its recompute; on the CPU the flash
kernel, then the math path), so the dropout masks and the gradients would not belong to the forward.

Kernels, measured on torch 2.13 (docs/model.md, "Fused attention"): on the CPU the flash kernel takes no dropout, no
mask that needs a gradient and wants V's head dimension equal to Q's (V is padded); on CUDA flash takes no mask and
wants fp16/bf16 and equal head dimensions of at most 256 (both padded to a multiple of 8); the memory-efficient
kernel takes a mask with a gradient and any float dtype but fp64; everything else runs the math path.
"""
from __future__ import annotations

import contextlib

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

_HALF = (torch.float16, torch.bfloat16)
_META_AS = ["cpu"]  # the device whose kernels a model on the meta device takes: the planner's trace of a job


@contextlib.contextmanager
def meta_as(device: str):
    """Within it, attention on meta tensors takes `device`'s kernels and their padded head dimensions (the planner
    traces a CUDA job so: measured on an H200, Dense's and Factorized Random's cores then save what the kernel saves)."""
    _META_AS.append(device)
    try:
        yield
    finally:
        _META_AS.pop()


def device_kind(device: torch.device) -> str:
    """The device whose kernels a tensor on `device` takes (meta: see meta_as)."""
    return _META_AS[-1] if device.type == "meta" else device.type


def sdpa_backend(device: torch.device, dtype: torch.dtype, masked: bool, mask_grad: bool, p: float,
                 head_dim: int) -> SDPBackend:
    """The one kernel for a layer: `masked` an attn_mask is passed, `mask_grad` it is trained (see the module
    docstring); `head_dim` the larger of Q's and V's."""
    kind = device_kind(device)
    if kind == "cpu":
        return SDPBackend.FLASH_ATTENTION if not mask_grad and p == 0 else SDPBackend.MATH
    if kind != "cuda" or dtype == torch.float64:
        return SDPBackend.MATH
    if not masked and dtype in _HALF and _round8(head_dim) <= 256:
        return SDPBackend.FLASH_ATTENTION
    return SDPBackend.EFFICIENT_ATTENTION


def _round8(n: int) -> int:
    return -(-n // 8) * 8


def _pad(t: torch.Tensor, dim: int) -> torch.Tensor:
    """t [..., d] with zero columns up to `dim` (a no-op at d = dim): zero columns add nothing to Q' K'^T and
    give output columns that are cut off."""
    return t if t.shape[-1] == dim else F.pad(t, (0, dim - t.shape[-1]))


def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None, causal: bool, p: float,
           backend: SDPBackend) -> torch.Tensor:
    """softmax(q k^T + mask (+ causal)) v with scale 1 through `backend`; q, k [b, h, n|m, dq], v [b, h, m, dv] ->
    [b, h, n, dv]. Q and K, or V, get zero columns where the kernel wants one head dimension."""
    dv = v.shape[-1]
    if mask is not None and not torch.is_grad_enabled():
        # no graph is built, but the CPU flash kernel refuses any mask that requires grad (a bias made with
        # gradients, applied in an evaluation): detaching it changes nothing else
        mask = mask.detach()
    if backend != SDPBackend.MATH:
        dim = max(q.shape[-1], dv)
        dim = _round8(dim) if device_kind(q.device) == "cuda" else dim
        q, k, v = _pad(q, dim), _pad(k, dim), _pad(v, dim)
    with sdpa_kernel([backend]):
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=p, is_causal=causal, scale=1.0)
    return out if out.shape[-1] == dv else out[..., :dv]
