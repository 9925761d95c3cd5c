"""User mistakes are one line and exit 2; everything else keeps its traceback (exit 1), including a ValueError
raised inside a library. Each mistake below once ended in a traceback or, worse, silently."""
from __future__ import annotations

import gzip
import json

import pytest

from pretrain.config import Config, ConfigError, TrainConfig, UsageError, load_config, to_yaml
from pretrain.data.prepare import prepare
from pretrain.faults import EXIT_FAILED, EXIT_USAGE, run_with_exit_codes
from pretrain.loop import check_train_config
from tokenizer.spm import Tokenizer


def test_only_usage_errors_are_one_line(capsys):
    def mistake():
        raise UsageError("train.steps (-3) must be >= 1")

    def bug():
        raise ValueError("math domain error")  # e.g. from inside torch or DeepSpeed: a bug, not a user mistake

    assert run_with_exit_codes(mistake, "pretrain.train") == EXIT_USAGE
    assert capsys.readouterr().err == "pretrain.train: error: train.steps (-3) must be >= 1\n"
    assert run_with_exit_codes(bug, "pretrain.train") == EXIT_FAILED
    err = capsys.readouterr().err
    assert err.count("Traceback (most recent call last)") == 1 and "ValueError: math domain error" in err


@pytest.mark.parametrize("key, value", [("steps", -3), ("steps", 0), ("exit_after", -1), ("max_skipped_steps", -1)])
def test_loop_settings_out_of_range_are_refused(key, value):
    with pytest.raises(UsageError, match=rf"train.{key} \({value}\) must be >= "):
        check_train_config(TrainConfig(**{key: value}), log_every=1)
    with pytest.raises(UsageError, match=r"log.every \(0\) must be >= 1"):
        check_train_config(TrainConfig(), log_every=0)


def test_a_config_that_is_not_utf8(tmp_path):
    path = tmp_path / "model.bin"
    path.write_bytes(b"\x80\x81\xfe binary")
    with pytest.raises(ConfigError, match=r"model.bin is not UTF-8 text \(invalid start byte at byte 0\)"):
        load_config(Config, path)


def test_a_tokenizer_file_that_is_not_sentencepiece(tmp_path):
    path = tmp_path / "spiece.model"
    path.write_text("not a model")
    with pytest.raises(UsageError, match=r"spiece.model is not a SentencePiece model \(.*\); point data.tokenizer"):
        Tokenizer(path)


def test_a_c4_file_that_is_not_gzip(tmp_path, tokenizer_model):
    plain = tmp_path / "c4-train.00000-of-00001.json.gz"
    plain.write_text(json.dumps({"text": "not compressed"}) + "\n")
    with pytest.raises(UsageError, match=r"is not a gzip file of JSON lines"):
        prepare([str(plain)], tmp_path / "shards", tokenizer_model, workers=1)
    assert not (tmp_path / "shards" / "index.json").exists()  # no index claiming a complete, empty data set
    good = tmp_path / "good.json.gz"
    with gzip.open(good, "wt") as f:
        f.write(json.dumps({"text": "a real document"}) + "\n")
    assert prepare([str(good)], tmp_path / "ok", tokenizer_model, workers=1)["documents"] == 1


def test_credentials_in_shard_urls_do_not_reach_the_saved_config():
    cfg = load_config(Config, None, ["data.train=https://alice:s3cret@data.example/c4/shard-{0..7}.tar?token=t0ken"])
    saved = to_yaml(cfg)
    assert "s3cret" not in saved and "t0ken" not in saved and "alice" not in saved
    assert "data.example/c4/shard-{0..7}.tar" in saved  # the rest of the address stays readable


def test_half_precision_without_a_gpu_needs_an_explicit_cpu_backend():
    import torch

    from pretrain.jobs import check_precision

    cpu = torch.device("cpu")
    with pytest.raises(UsageError, match=r"precision bf16 without CUDA: this job found no GPU .*parallel.backend=gloo"):
        check_precision("bf16", "auto", cpu)
    check_precision("bf16", "gloo", cpu)  # asked for on purpose
    check_precision("fp32", "auto", cpu)
