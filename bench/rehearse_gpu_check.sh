#!/usr/bin/env bash
# The CPU rehearsal of the one-GPU check: bash bench/rehearse_gpu_check.sh [TEST_FILE ...]
#
# Builds (once) a venv shaped like the GPU machine's Python: Python 3.12 (pyenv's, else python3.12 on PATH;
# REHEARSAL_PYTHON overrides), torch 2.11.0 from PyPI (the CUDA build with its nvidia-* wheels, about 5 GB: it runs
# on the CPU) and the machine's other packages (docs/cluster.md), none of the kit's. Then runs
# `DRY_RUN=1 bash bench/gpu_check.sh`, which installs the kit (.kit, from bash bench/device_kit.sh) as on the machine,
# and checks that every section passed and that the output folder holds at most 8 files, two folders deep at most.
# TEST_FILEs then run with pytest in the same environment (torch 2.11 + the kit), e.g. tests/test_model.py.
# VENV (default ~/.cache/synthesizer-pretrain/gpu-rehearsal-venv) and OUT (default /tmp/gpu-rehearsal) move them;
# TIME_SCALE (default 10) multiplies the check's time limits.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${VENV:-$HOME/.cache/synthesizer-pretrain/gpu-rehearsal-venv}
OUT=${OUT:-/tmp/gpu-rehearsal}
TORCH=torch==2.11.0
# the GPU machine's own packages that the project or the kit's wheels import (versions as read there)
MACHINE=(numpy==2.5.2 sentencepiece==0.2.2 transformers==5.17.0 safetensors==0.8.0 tensorboard matplotlib tqdm
         pyyaml psutil py-cpuinfo ninja msgpack packaging pytest)

if [ ! -x "$VENV/bin/python" ]; then
    base=${REHEARSAL_PYTHON:-$(pyenv prefix 3.12 2>/dev/null || true)}
    base=${base:+$base/bin/python}
    base=${base:-python3.12}
    "$base" -m venv "$VENV.tmp"
    "$VENV.tmp/bin/python" -m pip install -q "$TORCH" "${MACHINE[@]}"
    mv "$VENV.tmp" "$VENV"
fi
# the machine lacks the kit's packages (typing-extensions aside: torch needs it; the kit's overrides it), so the
# ones the packages above brought in go
[ -d .kit/wheels ] || { echo "rehearsal: no .kit/wheels: run bash bench/device_kit.sh first"; exit 2; }
kit=$(ls .kit/wheels | cut -d- -f1 | grep -v '^typing_extensions$')
"$VENV/bin/python" -m pip uninstall -q -y $kit 2>&1 | grep -v "not installed" || true

rm -rf "$OUT"
t0=$(date +%s)
# TIME_SCALE: the limits are the H200's; the 2-core test machine, shared, is many times slower at importing
DRY_RUN=1 TIME_SCALE=${TIME_SCALE:-10} PYTHON="$VENV/bin/python" bash bench/gpu_check.sh "$OUT"
echo "rehearsal: gpu_check.sh dry run took $(($(date +%s) - t0)) s"
failed=$(grep -cE '^\| [a-z_]+ \| (FAILED|TIMEOUT)' "$OUT/summary.md" || true)
files=$(find "$OUT" -type f | wc -l)
deep=$(find "$OUT" -mindepth 3 | wc -l)
echo "rehearsal: $failed failed sections, $files files in $OUT, $deep entries deeper than two folders"
[ "$failed" -eq 0 ] && [ "$files" -le 8 ] && [ "$deep" -eq 0 ] || { echo "rehearsal: FAILED"; exit 1; }

if [ $# -gt 0 ]; then  # the project's tests on the machine's torch, with the kit installed the same way
    site=$(mktemp -d)
    "$VENV/bin/python" -m pip install -q --no-index --no-deps --no-compile --target "$site" .kit/wheels/*.whl
    PYTHONPATH="$site" OMP_NUM_THREADS=1 "$VENV/bin/python" -m pytest -q -p no:cacheprovider "$@"
    rm -rf "$site"
fi
echo "rehearsal: ok"
