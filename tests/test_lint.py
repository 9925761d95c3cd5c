"""The tree passes ruff as ruff.toml sets it (pyflakes and sorted imports): a finding fails the test with ruff's own
lines, each naming the file, the line and the rule; `ruff check --fix` repairs the import order."""
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_ruff_finds_nothing():
    result = subprocess.run([sys.executable, "-m", "ruff", "check", "--no-cache", "--output-format", "concise", "."],
                            cwd=ROOT, capture_output=True, text=True)
    assert result.returncode == 0, result.stdout + result.stderr
