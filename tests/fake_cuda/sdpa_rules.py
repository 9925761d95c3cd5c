"""Torch's rules for which kernel `F.scaled_dot_product_attention` runs on an H200 (sm 9.0), transcribed from torch 2.13's
`aten/src/ATen/native/transformers/cuda/sdp_utils.cpp` and `sdp_utils_cpp.h` (`select_sdp_backend` and the
`can_use_*` filters, dense inputs), for the calls tests/fake_cuda/rehearsal.py records: fake tensors run SDPA as its
math decomposition and never reach torch's choice (`_fused_sdp_choice` needs a device), so the choice is computed here
from each call's shapes, strides, dtypes, mask and gradients.

A call is a dict: q, k, v (shapes), dtype, last_stride_1 (q, k, v and mask), mask (None or {shape, dtype, grad}), dropout,
causal, grad (q, k or v requires grad with grad mode on), named (the kernel pretrain/model/sdpa.py names).
"""
from __future__ import annotations

KERNELS = ("CUDNN_ATTENTION", "FLASH_ATTENTION", "EFFICIENT_ATTENTION", "MATH")
HALF = ("torch.float16", "torch.bfloat16")


def priority(cudnn_version: int) -> tuple[str, ...]:
    """`priority_order`: cuDNN first on sm 9.0 where the runtime cuDNN is newer than 9.15.0 (check_prefer_cudnn_attention),
    else flash, memory-efficient, math, cuDNN (the context's default order)."""
    if cudnn_version > 91500:
        return KERNELS
    return ("FLASH_ATTENTION", "EFFICIENT_ATTENTION", "MATH", "CUDNN_ATTENTION")


def refusal(kernel: str, call: dict, cudnn_version: int) -> str | None:
    """Why `kernel` does not run `call` on an H200 (None: it does)."""
    q, k, v, mask = call["q"], call["k"], call["v"], call["mask"]
    dq, dv = q[-1], v[-1]
    if kernel == "MATH":
        return None
    if not (len(q) == len(k) == len(v) == 4):
        return "q, k, v must be 4-D"
    if not call["last_stride_1"]:
        return "q, k, v and the mask need stride 1 in their last dimension"
    if not (q[0] == k[0] == v[0] and q[1] == k[1] == v[1]):
        return "q, k, v need one batch size and one number of heads"
    if q[2] == 0 or k[2] == 0:
        return "empty sequence"
    if mask is not None and mask["dtype"] not in ("torch.bool", call["dtype"]):
        return f"a float mask must have the queries' dtype ({mask['dtype']} beside {call['dtype']})"  # the kernels check it
    if kernel == "FLASH_ATTENTION":
        if mask is not None:
            return "flash takes no attn_mask"
        if not (dq == k[-1] == dv and dq <= 256):
            return f"flash wants one head dimension <= 256 (q {dq}, v {dv})"
        if call["causal"] and q[2] != k[2]:
            return "flash's is_causal wants as many queries as keys"
        if call["dtype"] not in HALF:
            return f"flash takes fp16/bf16, not {call['dtype']}"
        return None
    if kernel == "EFFICIENT_ATTENTION":
        # minimum_gemm_alignment on sm 8.0+: 128 bits of the dtype (8 halves, 4 floats); fp64 is not among its dtypes
        align = 8 if call["dtype"] in HALF else 4
        if not (dq == k[-1] and dq % align == 0 and dv % align == 0):
            return f"memory-efficient wants q, k of one head dimension and q, v head dimensions divisible by {align}"
        if call["dtype"] not in (*HALF, "torch.float32"):
            return f"memory-efficient takes fp16/bf16/fp32, not {call['dtype']}"
        return None
    # cuDNN
    if call["dtype"] not in HALF:
        return f"cuDNN takes fp16/bf16, not {call['dtype']}"
    if mask is not None:
        if mask["grad"]:
            return "cuDNN takes no mask that requires grad (check_attn_mask_shape)"
        b, h, n, m = mask["shape"] if len(mask["shape"]) == 4 else (1, 1, *mask["shape"])
        if n not in (1, q[2]) or m not in (1, k[2]) or b not in (1, q[0]) or h not in (1, q[1]):
            return "cuDNN wants a mask broadcastable as [b|1, heads|1, n|1, m|1]"
    if call["dropout"] * 16 != int(call["dropout"] * 16):
        return "cuDNN's dropout comes in steps of 1/16"
    limit = 256 if cudnn_version > 92200 else 128
    if not (dq <= limit and dv <= limit and dq % 8 == 0 and dv % 8 == 0):
        return f"cuDNN wants head dimensions <= {limit} divisible by 8 (q {dq}, v {dv})"
    if k[2] == 1:
        return "cuDNN takes no single key"
    if call["grad"] and limit == 256 and not (max(dq, dv) <= 128 or (dq, dv) in ((192, 128), (256, 256))):
        return "cuDNN's backward on sm 9.0 takes head dimensions <= 128, (192, 128) or (256, 256)"
    return None


def torch_choice(call: dict, cudnn_version: int) -> str:
    """The kernel torch would take for `call` on an H200 with every kernel enabled (`select_sdp_backend`)."""
    return next(kernel for kernel in priority(cudnn_version) if refusal(kernel, call, cudnn_version) is None)
