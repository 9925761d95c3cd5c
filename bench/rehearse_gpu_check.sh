#!/usr/bin/env bash
# The CPU rehearsal of the one-GPU check: bash bench/rehearse_gpu_check.sh [TEST_FILE ...]
#
# Builds (once) a venv shaped like the GPU machine's Python: Python 3.12 (pyenv's, else python3.12 on PATH;
# REHEARSAL_PYTHON overrides), torch 2.11.0 from PyPI (the CUDA build with its nvidia-* wheels, about 5 GB: it runs
# on the CPU) and the machine's other packages (docs/cluster.md), none of the kit's. Then runs
# `DRY_RUN=1 bash bench/gpu_check.sh`, which installs the kit (.kit, from bash bench/device_kit.sh) as on the machine,
# and checks that every section passed and that the output folder holds at most 8 files, two folders deep at most.
# TEST_FILEs then run with pytest in the same environment (torch 2.11 + the kit), e.g. tests/test_model.py.
# VENV (default ~/.cache/synthesizer-pretrain/gpu-rehearsal-venv) and OUT (default /tmp/gpu-rehearsal) move them.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${VENV:-$HOME/.cache/synthesizer-pretrain/gpu-rehearsal-venv}
OUT=${OUT:-/tmp/gpu-rehearsal}
TORCH=torch==2.11.0
# the GPU machine's own packages that the project or the kit's wheels import (versions as read there)
MACHINE=(numpy==2.5.2 sentencepiece==0.2.2 transformers==5.17.0 safetensors==0.8.0 tensorboard matplotlib tqdm
         pyyaml psutil py-cpuinfo ninja msgpack packaging pytest)
KIT_MODULES=(deepspeed megatron omegaconf webdataset braceexpand hjson pydantic pydantic_core annotated_types
             typing_inspection einops)

if [ ! -x "$VENV/bin/python" ]; then
    base=${REHEARSAL_PYTHON:-$(pyenv prefix 3.12 2>/dev/null || true)}
    base=${base:+$base/bin/python}
    base=${base:-python3.12}
    "$base" -m venv "$VENV.tmp"
    "$VENV.tmp/bin/python" -m pip install -q "$TORCH" "${MACHINE[@]}"
    mv "$VENV.tmp" "$VENV"
fi
# the machine lacks every package of the kit: a dependency of the packages above must not bring one in
"$VENV/bin/python" - "${KIT_MODULES[@]}" <<'EOF'
import importlib.util, sys
found = [m for m in sys.argv[1:] if importlib.util.find_spec(m)]
assert not found, f"the rehearsal venv has {found}, which the GPU machine lacks: remove them"
EOF

rm -rf "$OUT"
t0=$(date +%s)
DRY_RUN=1 PYTHON="$VENV/bin/python" bash bench/gpu_check.sh "$OUT"
echo "rehearsal: gpu_check.sh dry run took $(($(date +%s) - t0)) s"
failed=$(grep -cE '^\| [a-z]+ \| (FAILED|TIMEOUT)' "$OUT/summary.md" || true)
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
