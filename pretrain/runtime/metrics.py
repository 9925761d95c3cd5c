"""The metrics logger: one JSON object per logged step in `run.dir/metrics.jsonl` and the same scalars in
TensorBoard event files under `run.dir/tensorboard/` (with a tokens-seen axis, images and text), optionally
mirrored to Weights & Biases (`log.wandb`). Only global rank 0 writes; elsewhere it is a no-op.

Also the figures a progress line needs that are not losses: the device's peak FLOP/s for model FLOPs
utilisation (configured, a table on GPUs, or a measured matmul rate on CPU) and peak memory.
"""
from __future__ import annotations

import hashlib
import html
import json
import logging
import math
import re
import resource
import time
from pathlib import Path

import numpy as np
import torch

from pretrain.core.files import writing

log = logging.getLogger(__name__)

# dense bf16 peak FLOP/s per device (vendor data sheets, without sparsity)
# Dense peak FLOP/s per device (vendor data sheets, without sparsity): (bf16/fp16, fp32 as TF32 tensor-core
# matmuls, which the trainer enables). Matched against torch.cuda.get_device_name in this order, the first
# pattern found wins, so the PCIe and NVL parts are listed before the SXM names they contain.
_GPU_PEAK_FLOPS: tuple[tuple[str, float, float], ...] = (
    (r"GB200", 2.5e15, 1.25e15),
    (r"B200", 2.25e15, 1.1e15),
    (r"H200 NVL", 835e12, 418e12),
    (r"H200", 989e12, 495e12),  # SXM
    (r"H100 PCIe", 756e12, 378e12),
    (r"H100 NVL", 835e12, 418e12),
    (r"H100", 989e12, 495e12),  # SXM ("NVIDIA H100 80GB HBM3")
    (r"H800 PCIe", 756e12, 378e12),
    (r"H800", 989e12, 495e12),
    (r"A100", 312e12, 156e12),  # SXM and PCIe alike
    (r"A800", 312e12, 156e12),
    (r"L40S", 362e12, 183e12),
    (r"L40\b", 181e12, 90.5e12),
    (r"L4\b", 121e12, 60e12),
    (r"A10G", 70e12, 35e12),
    (r"A10\b", 125e12, 62.5e12),
    (r"V100", 125e12, 15.7e12),  # fp16 only: no bf16, no TF32
)


def _step_of(line: str) -> int | None:
    """The step of a metrics.jsonl line; None for a line that is no record (cut by a kill, or damaged)."""
    try:
        return int(json.loads(line)["step"])
    except (ValueError, KeyError, TypeError):
        return None


class MetricsLogger:
    """`write(step, scalars)` appends to metrics.jsonl and TensorBoard; resuming drops records after `start_step`,
    and lines that are no record, each named in a warning (`lacks(step)` then says whether a step's line is there).

    `write_images(step, {tag: HWC uint8})` and `write_text(tag, text)` go to TensorBoard (and W&B). With
    `wandb=PROJECT` every call is mirrored to a W&B run named after the run folder (resumed, not duplicated,
    when the job restarts); WANDB_MODE=offline keeps it on disk under run.dir/wandb.
    """

    def __init__(self, run_dir: str | Path, enabled: bool, start_step: int = 0, wandb: str = "",
                 config: dict | None = None) -> None:
        self.enabled = enabled
        self._wandb = None
        self._steps: set[int] = set()  # the steps whose lines were kept
        if not enabled:
            return
        from torch.utils.tensorboard import SummaryWriter  # imported where used: rank 0 only

        run_dir = Path(run_dir)
        run_dir.mkdir(parents=True, exist_ok=True)
        self.path = run_dir / "metrics.jsonl"
        if self.path.exists():
            self._keep_until(start_step)
        self._file = self.path.open("a")
        # purge_step hides the same stale steps from TensorBoard
        self._tb = SummaryWriter(str(run_dir / "tensorboard"), purge_step=start_step + 1 if start_step else None)
        if wandb:
            self._wandb = _start_wandb(wandb, run_dir, config or {})

    def _keep_until(self, start_step: int) -> None:
        """Drop the lines of steps after the resumed checkpoint (computed by a run that died: they are redone now)
        and, with a warning naming each, the lines that are no record."""
        lines = self.path.read_text().splitlines()
        kept = []
        for number, line in enumerate(lines, 1):
            step = _step_of(line)
            if step is None and line.strip():
                log.warning("%s line %d of %d is no metrics record (cut by a kill, or damaged); dropped: %.80r",
                            self.path, number, len(lines), line)
            elif step is not None and step <= start_step:
                kept.append(line)
                self._steps.add(step)
        self.path.write_text("".join(line + "\n" for line in kept))

    def lacks(self, step: int) -> bool:
        """Whether metrics.jsonl holds no line of `step` (on rank 0, the writer; False elsewhere)."""
        return self.enabled and step not in self._steps

    def write(self, step: int, scalars: dict[str, float], tokens_seen: int | None = None) -> None:
        """One metrics line; with `tokens_seen`, the same scalars also under `by_tokens/` with tokens as the x axis."""
        if not self.enabled:
            return
        extra = {} if tokens_seen is None else {"tokens_seen": tokens_seen}
        with writing(self.path):  # a full disk is then one line naming the file (faults.run_with_exit_codes)
            self._file.write(json.dumps({"step": step, **scalars, **extra}) + "\n")
            self._file.flush()
        self._steps.add(step)
        for key, value in scalars.items():
            self._tb.add_scalar(key, value, step)
            if tokens_seen is not None:
                self._tb.add_scalar(f"by_tokens/{key}", value, tokens_seen)
        self._tb.flush()
        if self._wandb is not None:
            self._wandb.log({**scalars, **extra}, step=step)

    def write_images(self, step: int, images: dict[str, np.ndarray]) -> None:
        """Images [height, width, 3] uint8 (e.g. `pretrain.runtime.pictures.synthesizer_images(model)`) at `step`."""
        if not self.enabled:
            return
        for tag, image in images.items():
            self._tb.add_image(tag, image, step, dataformats="HWC")
        self._tb.flush()
        if self._wandb is not None:
            import wandb as wandb_lib

            self._wandb.log({tag: wandb_lib.Image(image) for tag, image in images.items()}, step=step)

    def write_text(self, tag: str, text: str, step: int = 0) -> None:
        """Text shown verbatim (e.g. the resolved config: `write_text("config", to_yaml(cfg))`)."""
        if not self.enabled:
            return
        # TensorBoard renders text as markdown: indenting by four spaces keeps YAML a code block
        self._tb.add_text(tag, "".join("    " + line + "\n" for line in text.splitlines()), step)
        self._tb.flush()
        if self._wandb is not None:
            import wandb as wandb_lib

            self._wandb.log({tag: wandb_lib.Html(f"<pre>{html.escape(text)}</pre>")}, step=step)

    def close(self) -> None:
        if self.enabled:
            self._file.close()
            self._tb.close()
            if self._wandb is not None:
                import wandb as wandb_lib

                self._wandb.finish()
                wandb_lib.teardown()  # finish() returns before the W&B service has flushed the run to disk


def _start_wandb(project: str, run_dir: Path, config: dict):
    """The W&B run that mirrors the metrics: online where W&B takes it; where it does not (no login, a server that
    refuses or cannot be reached: wandb.init raised a traceback on rank 0 before), offline under run.dir/wandb, with
    a warning. Offline rather than one line and exit 2: the mirror is not worth the job (metrics.jsonl and
    TensorBoard hold every scalar), a requeued job whose login lapsed would otherwise stop at every restart, and
    `wandb sync` uploads the offline run later."""
    import wandb as wandb_lib  # optional dependency, imported only when asked for

    # one id per run folder: a restarted job continues the same W&B run
    run_id = hashlib.sha1(str(run_dir.resolve()).encode()).hexdigest()[:16]
    settings = dict(project=project, name=run_dir.name, id=run_id, resume="allow", dir=str(run_dir), config=config)
    try:
        return wandb_lib.init(**settings)
    except wandb_lib.errors.Error as e:
        reason = (str(e).strip().splitlines() or [type(e).__name__])[0]
        log.warning("log.wandb=%s: W&B did not take the run (%s); logging it offline in %s instead: upload it later "
                    "with `wandb sync %s/offline-run-*` (metrics.jsonl and TensorBoard are complete either way)",
                    project, reason, run_dir / "wandb", run_dir / "wandb")
        return wandb_lib.init(**settings, mode="offline")


def gpu_peak_flops(name: str, precision: str) -> float:
    """Data-sheet dense peak of the GPU called `name` at `precision` (bf16, fp16 or fp32); 0 if unknown."""
    for pattern, half, tf32 in _GPU_PEAK_FLOPS:
        if re.search(pattern, name):
            return tf32 if precision == "fp32" else half
    return 0.0


def peak_flops(configured: float, device: torch.device, precision: str = "bf16") -> float:
    """Peak FLOP/s of one device: `log.peak_flops` if set, the data sheet's for `precision` on GPUs, else a
    measured matmul rate."""
    if configured > 0:
        return configured
    if device.type == "cuda":
        name = torch.cuda.get_device_name(device)
        flops = gpu_peak_flops(name, precision)
        if not flops:
            log.warning("no peak FLOP/s known for %s; set log.peak_flops for model FLOPs utilisation", name)
        return flops
    return measured_matmul_flops()


def measured_matmul_flops(n: int = 512, repeats: int = 8) -> float:
    """fp32 n x n x n matmul rate of this CPU process (its threads), the CPU stand-in for a peak figure: the
    fastest of `repeats` products, since a busy machine deschedules some and never speeds one up (the rate of
    the whole burst, descheduled once on a loaded 2-core machine, once read 1/50 of the peak and an MFU of 132%)."""
    # a private generator: the global stream drives dropout, and a resumed run restores it before this call
    gen = torch.Generator().manual_seed(0)
    a, b = torch.randn(n, n, generator=gen), torch.randn(n, n, generator=gen)
    a @ b  # warm-up: first call allocates and picks the kernel
    fastest = math.inf
    for _ in range(repeats):
        start = time.perf_counter()
        a @ b
        fastest = min(fastest, time.perf_counter() - start)
    return 2 * n**3 / fastest


def peak_memory_bytes(device: torch.device) -> int:
    """Peak allocated device memory on GPU; peak resident set of this process on CPU."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device)
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux reports KiB
