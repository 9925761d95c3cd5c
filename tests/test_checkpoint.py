"""Which checkpoint a run resumes from, and the refusal of a resume whose model changed (no processes needed;
saving, loading, `latest` and resharding run in tests/test_train.py)."""
from __future__ import annotations

import dataclasses

import pytest

from pretrain.checkpoint import check_same_model, find_resume
from pretrain.config import CheckpointConfig, ModelConfig


def test_find_resume_auto_none_and_path(tmp_path):
    root = tmp_path / "checkpoints"
    assert find_resume(CheckpointConfig(resume="auto"), root) is None  # a fresh run.dir
    (root / "step_20").mkdir(parents=True)
    (root / "step_20" / "trainer_state.json").write_text("{}")
    (root / "latest").write_text("step_20\n")
    assert find_resume(CheckpointConfig(resume="auto"), root) == root / "step_20"
    assert find_resume(CheckpointConfig(resume="none"), root) is None
    assert find_resume(CheckpointConfig(resume=str(root / "step_20")), tmp_path / "other") == root / "step_20"
    with pytest.raises(ValueError, match=r"checkpoint.resume '.*step_7' is not a checkpoint folder"):
        find_resume(CheckpointConfig(resume=str(root / "step_7")), root)


def test_changed_model_is_refused_naming_every_difference(tmp_path):
    saved = dataclasses.asdict(ModelConfig())
    check_same_model(saved, dataclasses.replace(ModelConfig(), dropout=0.1), tmp_path)  # dropout may change
    changed = dataclasses.replace(ModelConfig(), d_model=256, encoder_attention="random")
    with pytest.raises(ValueError) as e:
        check_same_model(saved, changed, tmp_path)
    assert "model.d_model: 512 in the checkpoint, 256 now" in str(e.value)
    assert "model.encoder_attention: 'vanilla' in the checkpoint, 'random' now" in str(e.value)
