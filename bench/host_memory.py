"""Peak host memory (resident set) of the start-ups that read a whole model, against the model's fp32 bytes, each
in a fresh process and counted from the resident set after its imports:
- fine-tuning's start-up: an export into the model built on the rank's device (`pretrain.runtime.jobs.start_model`
  reads it one tensor at a time through `pretrain.model.pretrained.load_weights`), next to building that model
  alone: on the CPU the model itself is host memory, so what loading costs is the difference;
- export: a training checkpoint into an export folder (`pretrain.transfer.exporting.export`).

    OMP_NUM_THREADS=1 .venv/bin/python -m bench.host_memory --tokenizer SPIECE [--d-model 1024 --d-ff 2816
        --layers 12] [--run RUN]

The model is configs/tiny.yaml's with the sizes given; `--run RUN` also exports RUN's newest checkpoint.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def _status(key: str) -> int:
    line = next(l for l in Path("/proc/self/status").read_text().splitlines() if l.startswith(key + ":"))
    return int(line.split()[1]) * 1024  # kB


def _measure(what: str, source: str, output: str) -> dict[str, int]:
    """In this (fresh) process: the resident set after imports, the peak after them, and the model's bytes."""
    from pretrain.distributed.parallel import init_single_process
    from pretrain.model import build_model
    from pretrain.model.pretrained import export_config, load_weights
    from pretrain.transfer.exporting import export

    init_single_process()
    # TorchDynamo: imported on first use by torch's meta-tensor decompositions (the load plan's shape checks) and
    # by every optimizer's constructor; code, not model data (pretrain/__init__.py keeps it out of the imports)
    import torch._dynamo  # noqa: F401
    if what == "export":  # what the export imports as it runs: DeepSpeed's checkpoint readers, HF's tokenizer
        import deepspeed.runtime.fp16.loss_scaler  # noqa: F401
        import deepspeed.runtime.zero.config  # noqa: F401
        import deepspeed.utils.tensor_fragment  # noqa: F401
        import deepspeed.utils.zero_to_fp32  # noqa: F401
        from transformers import T5Tokenizer  # noqa: F401
    Path("/proc/self/clear_refs").write_text("5")  # the peak (VmHWM) restarts from the resident set now
    imports = _status("VmRSS")
    if what in ("build", "finetune"):
        cfg = export_config(source)
        model = build_model(cfg)
        if what == "finetune":
            load_weights(model, source, strict=True)
        model_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    else:
        out = export(source, output)
        model_bytes = sum(f.stat().st_size for f in out.glob("*.safetensors"))  # fp32, one copy of each tensor
    return {"imports": imports, "peak": _status("VmHWM"), "model": model_bytes}


def measure(what: str, source: str | Path, output: str | Path = "") -> dict[str, int]:
    """`_measure` in a fresh Python process (peak resident sets are per process). glibc's malloc gets a fixed mmap
    threshold: with its default, which moves as blocks are freed, whether a freed tensor's pages go back to the
    system or stay in the heap (and in the resident set) varies from run to run, +-15 MB on a 40 MB model; fixed,
    every block above 64 KiB is its own mapping, so the resident set follows the live tensors."""
    env = {**os.environ, "MALLOC_MMAP_THRESHOLD_": "65536"}
    done = subprocess.run([sys.executable, "-m", "bench.host_memory", "--measure", what, "--source", str(source),
                           "--output", str(output)], cwd=REPO, capture_output=True, text=True, env=env)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.splitlines()[-1])


def _line(what: str, m: dict[str, int]) -> str:
    gib = 2**30
    return (f"{what}: model {m['model'] / gib:.2f} GiB, peak RSS {m['peak'] / gib:.2f} GiB "
            f"({m['imports'] / gib:.2f} of it imports), above imports {(m['peak'] - m['imports']) / m['model']:.2f}x the model")


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m bench.host_memory", description=__doc__.splitlines()[0])
    parser.add_argument("--tokenizer", help="spiece.model of 1100 ids (tiny.yaml's vocabulary), e.g. the tests' one")
    parser.add_argument("--d-model", type=int, default=1024)
    parser.add_argument("--d-ff", type=int, default=2816)
    parser.add_argument("--layers", type=int, default=12, help="encoder and decoder layers each")
    parser.add_argument("--run", default="", help="a run folder whose newest checkpoint to export as well")
    parser.add_argument("--measure", choices=("build", "finetune", "export"), help=argparse.SUPPRESS)
    parser.add_argument("--source", help=argparse.SUPPRESS)
    parser.add_argument("--output", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.measure:
        print(json.dumps(_measure(args.measure, args.source, args.output)))
        return
    import torch

    from pretrain.core.config import Config, load_config
    from pretrain.model import build_local_model
    from pretrain.transfer.exporting import write_export

    tiny = load_config(Config, REPO / "configs" / "tiny.yaml")
    cfg = dataclasses.replace(tiny.model, d_model=args.d_model, d_ff=args.d_ff, num_heads=args.d_model // 64, d_kv=64,
                              num_layers=args.layers, num_decoder_layers=args.layers)
    with tempfile.TemporaryDirectory() as tmp:
        torch.manual_seed(0)
        out = write_export(build_local_model(cfg), Path(args.tokenizer), Path(tmp) / "export")
        print(_line("the model built alone (random init)", measure("build", out)))
        print(_line("fine-tuning start-up (built, then the export read in)", measure("finetune", out)))
        if args.run:
            print(_line("export", measure("export", args.run, Path(tmp) / "run-export")))


if __name__ == "__main__":
    main()
