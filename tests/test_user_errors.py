"""User mistakes are one line and exit 2; everything else keeps its traceback (exit 1), including a ValueError
raised inside a library. Each mistake below once ended in a traceback or, worse, silently."""
from __future__ import annotations

import gzip
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from pretrain.core.config import Config, ConfigError, UsageError, load_config, to_yaml
from pretrain.data.prepare import prepare
from pretrain.runtime.faults import EXIT_FAILED, EXIT_USAGE, run_with_exit_codes
from pretrain.runtime.run_lock import RunLock
from tokenizer.spm import Tokenizer

REPO = Path(__file__).resolve().parents[1]


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


def _unwritable(tmp_path: Path) -> Path:
    """A run.dir this process may not create: below a read-only folder, or for root (who writes anywhere) in sysfs."""
    if os.geteuid() == 0:
        return Path("/sys/run")
    (tmp_path / "read-only").mkdir(mode=0o500)
    return tmp_path / "read-only" / "run"


@pytest.mark.parametrize("case", ["a file", "below a file", "not permitted"])
def test_a_run_dir_that_cannot_be_created_is_one_line(tmp_path, case):
    (tmp_path / "notes.txt").write_text("not a folder")
    run_dir, why = {"a file": (tmp_path / "notes.txt", f"({tmp_path / 'notes.txt'} is a file)"),
                    "below a file": (tmp_path / "notes.txt" / "run", f"({tmp_path / 'notes.txt'} is a file)"),
                    "not permitted": (_unwritable(tmp_path), "(Permission denied: " if os.geteuid() else
                                      "(Operation not permitted: /sys/run)")}[case]
    with pytest.raises(UsageError) as e:
        RunLock(run_dir).acquire()  # the job's first write to run.dir; acquire_run_lock tells every rank
    assert str(e.value).startswith(f"run.dir {run_dir} cannot be created or written {why}")
    assert str(e.value).endswith("; choose another run.dir")


def test_a_vocabulary_far_above_the_tokenizer_is_one_line_before_allocating():
    # before: model.vocab_size=100000000 with a 2,100-id tokenizer allocated 25.6 GB (a traceback, or an OOM kill);
    # with_vocab runs before the model is built in both jobs (below the tokenizer: test_faults.py)
    from pretrain.core.config import ModelConfig
    from pretrain.model import with_vocab

    assert with_vocab(ModelConfig(vocab_size=32128), 32100).vocab_size == 32128  # T5's padded rows
    assert with_vocab(ModelConfig(vocab_size=4200), 2100).vocab_size == 4200
    with pytest.raises(UsageError) as e:
        with_vocab(ModelConfig(vocab_size=100_000_000), 2100)
    assert str(e.value) == ("model.vocab_size (100000000) is more than 2 x the tokenizer's 2100 ids: the rows beyond "
                            "them are never trained; set it to 0 (the tokenizer's, padded by the model itself) or at "
                            "most 4200")


def test_finetuning_without_training_examples_is_one_line_under_torchrun(tmp_path):
    (tmp_path / "SST-2").mkdir()
    (tmp_path / "SST-2" / "train.tsv").write_text("sentence\tlabel\n")  # the header, no example
    done = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                           "-m", "pretrain.finetune", "--config", "configs/finetune/sst2.yaml", "init=unused",
                           f"data.dir={tmp_path / 'SST-2'}", f"run.dir={tmp_path / 'run'}"],
                          cwd=REPO, env=dict(os.environ, OMP_NUM_THREADS="1"), capture_output=True, text=True)
    expected = (f"pretrain.finetune: error: task sst2: {tmp_path / 'SST-2' / 'train.tsv'} gives 0 training examples, "
                "fewer than one micro batch on every DP rank: train.micro_batch (16) x DP (2) = 32; add examples or "
                "lower train.micro_batch")
    # our lines and any exception's (torchrun's own report of the exit codes aside)
    lines = [line for line in done.stderr.splitlines()
             if "pretrain.finetune: error" in line or ("Error" in line and "ChildFailedError" not in line)]
    # every rank refuses alike, each in one whole line (torchrun may end a rank before it prints its own)
    assert lines in ([expected], [expected] * 2), done.stderr[-3000:]
    assert "exitcode  : 2" in done.stderr and not (tmp_path / "run").exists()


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

    from pretrain.runtime.jobs import check_precision

    cpu = torch.device("cpu")
    with pytest.raises(UsageError, match=r"precision bf16 without CUDA: this job found no GPU .*parallel.backend=gloo"):
        check_precision("bf16", "auto", cpu)
    check_precision("bf16", "gloo", cpu)  # asked for on purpose
    check_precision("fp32", "auto", cpu)
