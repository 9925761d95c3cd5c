"""The metrics logger: metrics.jsonl and TensorBoard event files read back, no-op off rank 0, resume trims."""
from __future__ import annotations

import json
from pathlib import Path

from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from pretrain.metrics import MetricsLogger, measured_matmul_flops


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


def test_measured_matmul_rate_is_plausible():
    assert 1e8 < measured_matmul_flops(n=128, repeats=2) < 1e14  # between 0.1 GFLOP/s and 100 TFLOP/s
