"""Forward + backward time of each SDPA kernel that runs a call without a trained mask (flash, cuDNN, memory-efficient;
CUDA only), at the project's shapes: pretrain/model/sdpa.py names flash for such calls in bf16, where torch's own
order (cuDNN > 9.15 on an H200) would take cuDNN. Ratios are against flash, measured in the same run.

    python -m bench.sdpa_kernels [--shapes 32x12x512x64 8x12x2048x64] [--reps 20]
"""
from __future__ import annotations

import argparse

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

KERNELS = (SDPBackend.FLASH_ATTENTION, SDPBackend.CUDNN_ATTENTION, SDPBackend.EFFICIENT_ATTENTION)


def timed(q, k, v, causal: bool, backend: SDPBackend, reps: int) -> float:
    """Median milliseconds of one forward + backward through `backend`."""
    grad = torch.randn_like(q)
    times = []
    for i in range(reps + 3):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        with sdpa_kernel([backend]):
            out = F.scaled_dot_product_attention(q, k, v, is_causal=causal, scale=1.0)
        out.backward(grad)
        end.record()
        end.synchronize()
        if i >= 3:
            times.append(start.elapsed_time(end))
    return sorted(times)[len(times) // 2]


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m bench.sdpa_kernels", description=__doc__.splitlines()[0])
    parser.add_argument("--shapes", nargs="+", default=["32x12x512x64", "32x12x114x64", "8x12x2048x64"],
                        help="batch x heads x length x head dim")
    parser.add_argument("--reps", type=int, default=20)
    args = parser.parse_args(argv)
    print(f"torch {torch.__version__}, cuDNN {torch.backends.cudnn.version()}, {torch.cuda.get_device_name()}, bf16; "
          "ms per forward + backward (median), ratio to flash")
    print("| shape | causal | " + " | ".join(k.name.lower() for k in KERNELS) + " |\n|---|---|---|---|---|")
    for shape in args.shapes:
        b, h, n, d = (int(x) for x in shape.split("x"))
        q, k, v = (torch.randn(b, h, n, d, device="cuda", dtype=torch.bfloat16, requires_grad=True) for _ in range(3))
        for causal in (False, True):
            ms = {}
            for backend in KERNELS:
                try:
                    ms[backend] = timed(q, k, v, causal, backend, args.reps)
                except RuntimeError as e:  # a kernel that refuses the call: the row says so
                    ms[backend] = f"refused: {str(e).splitlines()[0][:60]}"
            flash = ms[KERNELS[0]] if isinstance(ms[KERNELS[0]], float) else float("nan")
            cells = [f"{t:.3f} ({t / flash:.2f}x)" if isinstance(t, float) else t for t in ms.values()]
            print(f"| {shape} | {causal} | " + " | ".join(cells) + " |", flush=True)


if __name__ == "__main__":
    main()
