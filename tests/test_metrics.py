"""The metrics logger: metrics.jsonl and TensorBoard event files read back, no-op off rank 0, resume trims; the\nCPU matmul rate against torch's benchmark timer; the GPU peak table per exact model and precision."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from pretrain.runtime.metrics import MetricsLogger, gpu_peak_flops, measured_matmul_flops


def read_tensorboard(run_dir: Path) -> dict[str, list[tuple[int, float]]]:
    """{tag: [(step, value), ...]} from every event file under run_dir/tensorboard."""
    acc = EventAccumulator(str(run_dir / "tensorboard"))
    acc.Reload()
    return {tag: [(e.step, e.value) for e in acc.Scalars(tag)] for tag in acc.Tags()["scalars"]}


def read_metrics(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def test_jsonl_and_tensorboard_hold_the_same_scalars(tmp_path):
    logger = MetricsLogger(tmp_path, enabled=True)
    logger.write(1, {"loss": 2.5, "lr": 1e-3})
    logger.write(2, {"loss": 2.25, "lr": 2e-3, "eval_loss": 2.75})
    logger.close()
    assert read_metrics(tmp_path) == [
        {"step": 1, "loss": 2.5, "lr": 1e-3}, {"step": 2, "loss": 2.25, "lr": 2e-3, "eval_loss": 2.75}
    ]
    scalars = read_tensorboard(tmp_path)
    assert scalars["loss"] == [(1, 2.5), (2, 2.25)]
    assert scalars["eval_loss"] == [(2, 2.75)]


def test_resume_drops_records_of_steps_after_the_checkpoint(tmp_path):
    logger = MetricsLogger(tmp_path, enabled=True)
    for step in (1, 2, 3):
        logger.write(step, {"loss": float(step)})
    logger.close()
    logger = MetricsLogger(tmp_path, enabled=True, start_step=2)  # the run died after logging step 3
    logger.write(3, {"loss": 30.0})
    logger.close()
    assert [(r["step"], r["loss"]) for r in read_metrics(tmp_path)] == [(1, 1.0), (2, 2.0), (3, 30.0)]
    assert read_tensorboard(tmp_path)["loss"] == [(1, 1.0), (2, 2.0), (3, 30.0)]


def test_disabled_logger_writes_nothing(tmp_path):
    logger = MetricsLogger(tmp_path / "run", enabled=False)
    logger.write(1, {"loss": 1.0})
    logger.close()
    assert not (tmp_path / "run").exists()


def test_measured_matmul_rate_is_the_fastest_product(monkeypatch):
    # 2 n^3 FLOPs over the fastest of the timed products, not the burst: a product descheduled on a busy machine
    # (here the 3 s one) must not lower the figure. The clock is the test's, so no wall-clock bound is asserted
    import pretrain.runtime.metrics as metrics

    durations = iter([0.5, 3.0, 0.25, 0.4])
    ticks = []

    def clock() -> float:  # start and end of each product: the end is the start plus its duration
        ticks.append(ticks[-1] + next(durations) if len(ticks) % 2 else 0.0)
        return ticks[-1]

    monkeypatch.setattr(metrics.time, "perf_counter", clock)
    assert measured_matmul_flops(n=64, repeats=4) == 2 * 64**3 / 0.25
    assert len(ticks) == 8


@pytest.mark.parametrize("name, precision, flops", [
    ("NVIDIA H100 80GB HBM3", "bf16", 989e12),  # SXM
    ("NVIDIA H100 PCIe", "bf16", 756e12),
    ("NVIDIA H100 NVL", "fp16", 835e12),
    ("NVIDIA H100 80GB HBM3", "fp32", 495e12),  # TF32
    ("NVIDIA H200", "bf16", 989e12),
    ("NVIDIA B200", "bf16", 2.25e15),
    ("NVIDIA GB200", "bf16", 2.5e15),
    ("NVIDIA A100-SXM4-80GB", "bf16", 312e12),
    ("NVIDIA A100 80GB PCIe", "fp32", 156e12),
    ("NVIDIA A10", "bf16", 125e12),
    ("NVIDIA L4", "bf16", 121e12),
    ("NVIDIA L40S", "bf16", 362e12),
    ("Some Future GPU", "bf16", 0.0),
])
def test_gpu_peak_is_the_data_sheet_figure_of_the_exact_model_and_precision(name, precision, flops):
    assert gpu_peak_flops(name, precision) == flops
