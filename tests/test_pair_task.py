"""The span probe (pretrain.tasks.pair_data -> task `pair`): built from the real held-out validation text, its
labels are checked by an independent test of the text, its splits are balanced, disjoint and reproducible, every
input fits the model; and a short fine-tuning on it, from an export and from scratch (finetune from_scratch)."""
from __future__ import annotations

import gzip
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from pretrain.core.config import Config, load_config
from pretrain.model import build_local_model
from pretrain.tasks import get_task
from pretrain.tasks.pair import pair_input
from pretrain.tasks.pair_data import PairSpec, build_pair_task
from pretrain.transfer.exporting import write_export
from tokenizer.spm import Tokenizer

REPO = Path(__file__).resolve().parents[1]
TINY = load_config(Config, "configs/tiny.yaml")


def _rows(path: Path) -> list[list[str]]:
    return [line.split("\t") for line in path.read_text(encoding="utf-8").splitlines()[1:]]


@pytest.fixture(scope="module")
def pair_dir(tmp_path_factory, c4_dir: Path, tokenizer_model: str) -> Path:
    return build_pair_task([str(c4_dir / "c4-validation.00000-of-00001.json.gz")],
                           tmp_path_factory.mktemp("pair") / "PAIR", PairSpec(), tokenizer_model)


def test_labels_are_true_balanced_and_splits_disjoint(pair_dir: Path, c4_dir: Path, tokenizer_model: str) -> None:
    validation = [json.loads(line)["text"] for line in gzip.open(c4_dir / "c4-validation.00000-of-00001.json.gz", "rt")]
    held_out = " ".join(" ".join(t.split()) for t in validation)
    tok = Tokenizer(tokenizer_model)
    firsts = {}
    for split in ("train", "dev"):
        rows = _rows(pair_dir / f"{split}.tsv")
        assert len(rows) >= (2000 if split == "train" else 300), split
        labels = [int(y) for _, _, y in rows]
        assert labels.count(1) == labels.count(0), split  # balanced
        for a, b, y in rows:
            # the label, checked on the text itself: sentence2 occurs as whole words inside sentence1 or not
            assert (f" {b} " in f" {a} ") == (y == "1"), (a, b, y)
            assert len(b.split()) == 4 and a in held_out  # sentence1 is held-out validation text
        inputs = [pair_input(a, b) for a, b, _ in rows]
        assert max(len(ids) for ids in tok.encode_batch(inputs)) + 1 <= 64  # never truncated (+ EOS)
        firsts[split] = {a for a, _, _ in rows}
    test = _rows(pair_dir / "test.tsv")
    assert [int(i) for i, _, _ in test] == list(range(len(test))) and len(test) >= 300
    firsts["test"] = {a for _, a, _ in test}
    assert not firsts["train"] & firsts["dev"] and not firsts["train"] & firsts["test"] and not firsts["dev"] & firsts["test"]
    # the task reads the files: "pair sentence1: ... sentence2: ..." -> "yes" / "no"
    examples = get_task("pair").read(pair_dir, "dev.tsv", labelled=True)
    assert examples[0].inputs.startswith("pair sentence1: ") and {e.target for e in examples} == {"yes", "no"}


def test_the_same_seed_builds_the_same_files(pair_dir: Path, c4_dir: Path, tokenizer_model: str, tmp_path: Path) -> None:
    source = [str(c4_dir / "c4-validation.00000-of-00001.json.gz")]
    again = build_pair_task(source, tmp_path / "again", PairSpec(), tokenizer_model)
    other = build_pair_task(source, tmp_path / "other", PairSpec(seed=1), tokenizer_model)
    for name in ("train.tsv", "dev.tsv", "test.tsv"):
        assert (again / name).read_bytes() == (pair_dir / name).read_bytes()
        assert (other / name).read_bytes() != (pair_dir / name).read_bytes()


def _finetune(init: Path, pair_dir: Path, run: Path, *extra: str) -> dict:
    cmd = [sys.executable, "-m", "pretrain.finetune", "--config", "configs/finetune/pair.yaml", f"init={init}",
           f"data.dir={pair_dir}", f"run.dir={run}", "train.steps=3", "train.micro_batch=8", "train.global_batch=8",
           "log.every=1", "eval.method=rank", "eval.limit=24", "eval.submission=false", *extra]
    done = subprocess.run(cmd, cwd=REPO, env=dict(os.environ, OMP_NUM_THREADS="1"), capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-3000:]
    losses = [json.loads(line)["loss"] for line in (run / "metrics.jsonl").read_text().splitlines() if '"loss"' in line]
    return {"results": json.loads((run / "results.json").read_text()), "losses": losses}


def test_finetuning_on_pairs_from_the_export_and_from_scratch(pair_dir: Path, tokenizer_model: str, tmp_path: Path) -> None:
    exports = []
    for seed in (0, 1):  # two exports of the same model config with different weights
        torch.manual_seed(seed)
        exports.append(write_export(build_local_model(TINY.model), Path(tokenizer_model), tmp_path / f"export{seed}"))
    pretrained = _finetune(exports[0], pair_dir, tmp_path / "pretrained")
    scratch = [_finetune(e, pair_dir, tmp_path / f"scratch{i}", "from_scratch=true") for i, e in enumerate(exports)]
    scores = pretrained["results"]["pair"]
    assert set(scores) == {"accuracy_rank", "examples", "examples_in_file"} and len(pretrained["losses"]) == 3
    # the scores say what they cover: eval.limit=24 of the dev file's rows
    assert (scores["examples"], scores["examples_in_file"]) == (24, len(_rows(pair_dir / "dev.tsv")))
    # from scratch, the export gives the model config and tokenizer but not the weights: both runs are the same
    assert scratch[0] == scratch[1]
    assert scratch[0]["losses"][0] != pretrained["losses"][0]
