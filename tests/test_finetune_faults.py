"""Fine-tuning's faults before its first step: a dev split without examples (fine-tuning and `pretrain.evaluate`), a
`data.tokenizer` other than the export's, and the shipped configs' learning rate, which must follow the measured
width rule (a fixed 1e-4 left the tiny model at chance). Each once went through silently."""
from __future__ import annotations

import dataclasses
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from sentencepiece import sentencepiece_model_pb2

from pretrain.core.config import Config, UsageError, load_config
from pretrain.core.finetune_config import FinetuneConfig
from pretrain.model import build_local_model
from pretrain.model.pretrained import foreign_tokenizer
from pretrain.runtime.schedule import FINETUNE_LR_AT_WIDTH_64, with_finetune_lr
from pretrain.transfer.exporting import write_export
from tokenizer.spm import Tokenizer

REPO = Path(__file__).resolve().parents[1]
TINY = load_config(Config, "configs/tiny.yaml")
SENTENCES = ["a charming and often affecting journey", "uneasy mishmash of styles and genres", "it is good",
             "the film is long, loud and not very funny at all", "a triumph"]


def _sst2(root: Path, train: int, dev: int) -> Path:
    """An SST-2 folder in the official layout: `train` and `dev` labelled rows, five test rows."""
    folder = root / "SST-2"
    folder.mkdir(parents=True)
    rows = lambda n: "".join(f"{SENTENCES[i % 5]}\t{i % 2}\n" for i in range(n))
    (folder / "train.tsv").write_text("sentence\tlabel\n" + rows(train))
    (folder / "dev.tsv").write_text("sentence\tlabel\n" + rows(dev))
    (folder / "test.tsv").write_text("index\tsentence\n" + "".join(f"{i}\t{s}\n" for i, s in enumerate(SENTENCES)))
    return folder


def _export(tmp_path: Path, tokenizer: str) -> Path:
    torch.manual_seed(0)
    return write_export(build_local_model(TINY.model), Path(tokenizer), tmp_path / "export")


def _start(*args: str) -> subprocess.Popen:
    """`python -m ARGS` started now (the commands of a test run side by side: each spends its time importing)."""
    return subprocess.Popen([sys.executable, "-m", *args], cwd=REPO, env=dict(os.environ, OMP_NUM_THREADS="1"),
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def _one_line(job: subprocess.Popen) -> str:
    """The job's only error line, after checking it exited 2 with no traceback."""
    _, stderr = job.communicate()
    errors = [line for line in stderr.splitlines() if "error:" in line or "Traceback" in line]
    assert job.returncode == 2 and len(errors) == 1, stderr[-3000:]
    return errors[0]


def test_an_empty_dev_split_is_one_line_before_training_or_evaluation(tmp_path, tokenizer_model):
    # before: fine-tuning trained to train.steps and wrote {"accuracy": NaN}, exit 0; pretrain.evaluate the same
    export, data = _export(tmp_path, tokenizer_model), _sst2(tmp_path, train=20, dev=0)
    jobs = [_start("pretrain.finetune", "--config", "configs/finetune/sst2.yaml", f"init={export}",
                   f"data.dir={data}", f"run.dir={tmp_path / 'run'}", "train.steps=2"),
            _start("pretrain.evaluate", "--export", str(export), "--task", "sst2", "--data", str(data),
                   "--output", str(tmp_path / "evaluated"))]
    reason = (f"task sst2: {data / 'dev.tsv'} holds no examples, so nothing can be scored on it; give the task's "
              "validation file with its examples")
    assert _one_line(jobs[0]) == f"pretrain.finetune: error: {reason}"
    assert _one_line(jobs[1]) == f"python -m pretrain.evaluate: error: {reason}"
    assert not (tmp_path / "run").exists() and not (tmp_path / "evaluated").exists()  # refused before any work


def _with_two_pieces_swapped(tokenizer: str, out: Path) -> Path:
    """A valid tokenizer with the same number of ids whose ids 10 and 11 mean each other's piece: an export's
    weights load into its model without a shape error."""
    proto = sentencepiece_model_pb2.ModelProto()
    proto.ParseFromString(Path(tokenizer).read_bytes())
    a, b = proto.pieces[10], proto.pieces[11]
    a.piece, b.piece = b.piece, a.piece
    out.write_bytes(proto.SerializeToString())
    return out


def test_finetuning_with_another_tokenizer_than_the_exports_is_one_line(tmp_path, tokenizer_model):
    # before: accepted, trained and shipped in the run's checkpoints (pretraining's init= refuses the same)
    export, data = _export(tmp_path, tokenizer_model), _sst2(tmp_path, train=20, dev=5)
    other = _with_two_pieces_swapped(tokenizer_model, tmp_path / "other.model")
    assert Tokenizer(other).num_ids == Tokenizer(tokenizer_model).num_ids
    job = _start("pretrain.finetune", "--config", "configs/finetune/sst2.yaml", f"init={export}", f"data.dir={data}",
                 f"run.dir={tmp_path / 'run'}", f"data.tokenizer={other}", "train.steps=2")
    copy = shutil.copyfile(export / "spiece.model", tmp_path / "copy.model")
    assert foreign_tokenizer(export, copy) is None  # the same tokenizer at another path is the export's
    assert _one_line(job) == (f"pretrain.finetune: error: data.tokenizer ({other}) is not {export / 'spiece.model'}, "
                              "the tokenizer the export was trained with: its token ids would mean other pieces; "
                              "leave data.tokenizer empty (the export's own)")
    assert not (tmp_path / "run").exists()



def test_a_global_batch_that_does_not_split_is_one_line_in_finetuning(tmp_path, tokenizer_model):
    # before: a ValueError traceback from runtime/engine.py and exit 1, where pretraining gave one line and exit 2
    export, data = _export(tmp_path, tokenizer_model), _sst2(tmp_path, train=20, dev=5)
    job = _start("pretrain.finetune", "--config", "configs/finetune/sst2.yaml", f"init={export}", f"data.dir={data}",
                 f"run.dir={tmp_path / 'run'}", "train.micro_batch=4", "train.global_batch=6", "train.steps=2")
    assert _one_line(job) == ("pretrain.finetune: error: train.global_batch (6) must equal train.micro_batch (4) x "
                              "gradient accumulation x data-parallel size (1), i.e. a multiple of 4 x 1 = 4; use 4 or 8")
    assert not (tmp_path / "run").exists()


def test_an_export_that_tp_does_not_split_is_one_line_before_the_lock(tmp_path, tokenizer_model):
    # before: a ValueError traceback from the model's build inside the run lock (exit 1), where pretraining's
    # planner gave the same rule in one line
    torch.manual_seed(0)
    model_cfg = dataclasses.replace(TINY.model, num_heads=3)  # d_ff 128 splits over TP 2; 3 heads do not
    export = write_export(build_local_model(model_cfg), Path(tokenizer_model), tmp_path / "export")
    data = _sst2(tmp_path, train=20, dev=5)
    done = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                           "-m", "pretrain.finetune", "--config", "configs/finetune/sst2.yaml", f"init={export}",
                           f"data.dir={data}", f"run.dir={tmp_path / 'run'}", "parallel.tensor=2",
                           "train.micro_batch=4", "train.global_batch=8", "train.steps=2"],
                          cwd=REPO, env=dict(os.environ, OMP_NUM_THREADS="1"), capture_output=True, text=True)
    expected = "pretrain.finetune: error: model.num_heads (3) must be a multiple of parallel.tensor (2)"
    lines = [line for line in done.stderr.splitlines()
             if "pretrain.finetune: error" in line or ("Error" in line and "ChildFailedError" not in line)]
    assert lines in ([expected], [expected] * 2), done.stderr[-3000:]  # torchrun may end a rank before it prints
    assert "exitcode  : 2" in done.stderr and not (tmp_path / "run").exists()


def _measured_sweep() -> dict[float, float]:
    """docs/transfer.md's table of `bench.finetune_recipe` on the tiny export: {train.lr: mean dev accuracy}."""
    text = (REPO / "docs" / "transfer.md").read_text()
    table = text[text.index("| train.lr | accuracy (per seed)"):].split("\n\n")[0].splitlines()[2:]
    sweep = {}
    for row in table:
        lr, accuracy = (cell.strip() for cell in row.strip("|").split("|")[:2])
        per_seed = [float(a) for a in re.findall(r"[0-9.]+", accuracy)]
        sweep[float(lr)] = sum(per_seed) / len(per_seed)
    return sweep


def test_the_shipped_finetuning_configs_take_the_measured_learning_rate():
    # before: every GLUE/SuperGLUE config fixed AdamW at 1e-4, T5-base's rate, at which the tiny model (d_model 64)
    # learnt nothing (dev accuracy at chance); the configs now take lr auto, the width rule whose constant is the
    # best LR of the recorded sweep at d_model 64
    sweep = _measured_sweep()
    best = max(sweep, key=sweep.get)
    assert FINETUNE_LR_AT_WIDTH_64 == best and sweep[best] - sweep[1e-4] > 0.05, sweep
    configs = sorted(p for p in (REPO / "configs" / "finetune").glob("*.yaml") if not p.name.startswith("_"))
    assert len(configs) == 18
    for path in configs:
        train = load_config(FinetuneConfig, path).train
        assert with_finetune_lr(train, TINY.model.d_model).lr == pytest.approx(best), path.name
        assert with_finetune_lr(train, 768).lr == pytest.approx(best * 64 / 768), path.name  # base's width


def test_lr_auto_is_fine_tunings_and_a_number_otherwise(tmp_path):
    from pretrain.planning.planner import check_job

    with pytest.raises(UsageError, match=re.escape("train.lr auto is fine-tuning's rule (from the export's width); "
                                                   "pretraining takes a number")):
        check_job(load_config(Config, "configs/tiny.yaml", ["train.lr=auto"]), world=1)  # the trainer's and plan's
    with pytest.raises(UsageError, match=re.escape("train.lr 'fast' must be a number > 0 or auto")):
        load_config(FinetuneConfig, "configs/finetune/sst2.yaml", ["train.lr=fast"])
    assert load_config(FinetuneConfig, "configs/finetune/sst2.yaml", ["train.lr=1e-3"]).train.lr == 1e-3
    assert load_config(FinetuneConfig, "configs/finetune/sst2.yaml", ["train.lr=1"]).train.lr == 1.0
    (tmp_path / "run.yaml").write_text("train:\n  lr: 3e-4\n")  # YAML 1.1 reads a number without a dot as text
    assert load_config(FinetuneConfig, tmp_path / "run.yaml").train.lr == 3e-4
