"""bench/attention.py and bench/attention_model.py on the CPU at tiny sizes: one row per mixer, length and bias, the
form each layer takes for CPU training as pretrain/model/attention.py decides it, the kernel its fused form names,
and the whole model's comparison of the two forms."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from bench import attention_model


def _rows(out: str) -> list[list[str]]:
    lines = [line for line in out.splitlines() if line.startswith("| ") and not line.startswith("| mixer")]
    return [[c.strip() for c in line.strip("|").split(" | ")] for line in lines]


def test_attention_table_names_the_form_and_kernel_cpu_training_takes() -> None:
    # its own process: the benchmark sets glibc's mmap threshold for its memory figures, for the rest of the process
    out = subprocess.run([sys.executable, "-m", "bench.attention", "--lengths", "16", "--batch", "1", "--heads", "2",
                          "--d-kv", "8", "--reps", "1", "--mixers", "vanilla", "dense", "factorized_random",
                          "random+vanilla", "random"], cwd=Path(__file__).resolve().parents[1], capture_output=True, text=True,
                         check=True).stdout
    rows = {(r[0], r[2]): r for r in _rows(out)}
    # (mixer, bias) -> (chosen, kernel): flash without a trained mask, the math path with one; dense takes it there
    # (cpu_math_wins), vanilla, factorized_random and random+vanilla (R is trained) materialise; random has no fused form
    expected = {("vanilla", "no"): ("fused", "flash_attention"), ("vanilla", "yes"): ("materialised", "math"),
                ("dense", "no"): ("fused", "flash_attention"), ("dense", "yes"): ("fused", "math"),
                ("factorized_random", "no"): ("fused", "flash_attention"),
                ("factorized_random", "yes"): ("materialised", "math"),
                ("random+vanilla", "no"): ("materialised", "math"), ("random+vanilla", "yes"): ("materialised", "math"),
                ("random", "no"): ("materialised", "-"), ("random", "yes"): ("materialised", "-")}
    assert {key: (r[9], r[10]) for key, r in rows.items()} == expected
    for key, r in rows.items():
        assert r[1] == "16" and float(r[3]) > 0 and (r[5] == "-" if key[0] == "random" else float(r[5]) > 0), r
        planned = r[11].split(" / ")  # the planner's figure per form, in MiB: none for a form the layer has not
        assert planned[0].isdigit() and (planned[1] == "-" if key[0] == "random" else planned[1].isdigit()), r


def test_attention_model_compares_the_rule_with_materialised_logits(capsys: pytest.CaptureFixture) -> None:
    attention_model.main(["--config", "configs/tiny.yaml", "--inputs", "16", "--targets", "4", "--reps", "1",
                          "--mixers", "dense", "random"])
    lines = [line for line in capsys.readouterr().out.splitlines() if line.startswith(("dense:", "random:"))]
    assert len(lines) == 2
    for line in lines:
        rule, materialised, ratio = (float(w) for w in line.replace(",", "").split() if w[0].isdigit())
        assert rule > 0 and materialised > 0 and ratio == pytest.approx(rule / materialised, rel=0.05)
