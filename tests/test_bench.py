"""bench.throughput's CPU mode as a smoke test: 2 real processes under torchrun (DP 2) on configs/tiny.yaml,
the trainer's step for two variants, both attention paths of the one with vanilla; the table has its columns and sane numbers.
Its default variants: every registered mixer and the mixtures the size configs train."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from pretrain.model import MIXERS
from tests.registry import shipped_mixtures

REPO = Path(__file__).resolve().parent.parent


def test_throughput_table_under_torchrun(tmp_path):
    out = tmp_path / "throughput.md"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
           "-m", "bench.throughput", "--config", "configs/tiny.yaml", "--warmup", "1", "--steps", "3",
           "--variants", "random+vanilla", "random", "--sdpa", "both", "--out", str(out)]
    done = subprocess.run(cmd, cwd=REPO, env=dict(os.environ, OMP_NUM_THREADS="1"), capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-3000:]
    header, _, *table = out.read_text().splitlines()
    assert "DP 2 x TP 1, micro batch 4 (global 8)" in header and "1 warm-up + 3 measured steps" in header
    rows = [[c.strip() for c in line.strip("|").split("|")] for line in table]
    assert rows[0] == ["variant", "ms/step (median)", "IQR ms", "tokens/s/process", "TFLOP/s/process", "MFU",
                       "peak GiB", "planned GiB"]
    variants = [r[0] for r in rows[2:]]
    # random has no vanilla mixer: timed once
    assert variants == ["random+vanilla (sdpa)", "random+vanilla (materialised)", "random"]
    for name, ms, iqr, tokens, tflops, mfu, memory, planned in rows[2:]:
        low, high = (float(x) for x in iqr.split("-"))
        assert 0 < low <= float(ms) <= high, name
        # tokens per step and process: micro batch 4 x (64 inputs + 14 targets)
        assert abs(float(tokens) * float(ms) / 1e3 - 4 * 78) < 0.02 * 4 * 78, name
        assert float(tflops) > 0 and 0 < float(mfu.rstrip("%")) < 100 and float(memory) > 0.05, name
        assert float(planned) > 0, name  # the planner's figure for the job (its CPU peak holds the interpreter too)
    assert done.stdout.count("| random+vanilla (sdpa) |") == 1  # printed by rank 0 only


def test_the_default_variants_are_the_registry_and_the_size_configs_mixtures():
    from bench.throughput import VARIANTS

    assert set(VARIANTS) == {*MIXERS, *shipped_mixtures("*.yaml")} and len(VARIANTS) == len(set(VARIANTS))
