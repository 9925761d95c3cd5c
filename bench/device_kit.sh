#!/usr/bin/env bash
# The device kit of bench/gpu_check.sh, made here with PyPI: bash bench/device_kit.sh [KIT_DIR]   (default .kit)
#
# The one-GPU check machine runs Python 3.12 with torch 2.11 and no network, and lacks the project's GPU-path
# packages (docs/cluster.md, "The one-GPU check"). KIT_DIR (git-ignored; it travels as the run's `carry`) gets:
#   wheels/  one cp312 manylinux x86_64 wheel of each package that machine lacks: the pins of requirements.txt
#            and what their Requires-Dist need beyond the machine's own packages (KIT_DEPS below). PyPI has only
#            deepspeed's sdist: it is built here into a pure-Python wheel (DS_BUILD_OPS=0: ops build on first use).
#   data/    what the check's pipeline section reads, made by the project's own commands from the test fixture
#            text (pretrain.data.fetch): tokenizer/spiece.model (1000 pieces + 100 sentinels), shards/train,
#            shards/valid, polarity/ (SST-2 layout).
# Then it prints the kit's size, which must stay well under the 64 MiB a run may carry with the working tree.
# A rerun rebuilds the wheels (pip's cache makes that quick) and reuses the data. PYTHON (default
# .venv/bin/python) runs pip and the project's commands.
set -euo pipefail
cd "$(dirname "$0")/.."
KIT=${1:-.kit}
PY=${PYTHON:-.venv/bin/python}
MAX_MIB=48  # of the 64 MiB a run carries: the rest is the working tree (about 2 MiB) and headroom

# the Requires-Dist of deepspeed (einops, hjson, pydantic) and pydantic's own, in the versions the project's venv
# resolves; the machine already has torch, numpy, packaging, psutil, py-cpuinfo, msgpack, ninja, tqdm and pyyaml.
# typing-extensions travels because pydantic needs >= 4.16 and the machine's version is not known.
# omegaconf 2.4 vendors its antlr4 runtime: no antlr4-python3-runtime.
KIT_DEPS=(einops==0.8.2 hjson==3.1.0 pydantic==2.14.4 pydantic-core==2.50.5 annotated-types==0.8.0
          typing-inspection==0.4.5 typing-extensions==4.16.0)
pin() { grep -i -m1 "^$1==" requirements.txt; }  # requirements.txt owns the project's pins
PINNED=("$(pin megatron-core)" "$(pin webdataset)" "$(pin braceexpand)" "$(pin omegaconf)")
DEEPSPEED=$(pin deepspeed)

wheels() {
    local out=$1
    "$PY" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
        --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
        -d "$out" "${PINNED[@]}" "${KIT_DEPS[@]}"
    DS_BUILD_OPS=0 "$PY" -m pip wheel -q --no-deps --no-binary deepspeed -w "$out" "$DEEPSPEED"
    # one version of each, as pip --no-deps installs whatever it is given
    local names
    names=$(ls "$out" | cut -d- -f1 | sort)
    [ "$(uniq -d <<<"$names")" = "" ] || { echo "device_kit: two versions of one package in $out" >&2; exit 1; }
}

data() {
    local out=$1 text
    text=$(mktemp -d)
    "$PY" -m pretrain.data.fetch --output "$text" --train-files 2
    "$PY" -m tokenizer.train --input "$text/c4-train.*.json.gz" --output "$out/tokenizer" --vocab-size 1000 \
        --max-bytes 1000000
    "$PY" -m pretrain.data.prepare --input "$text/c4-train.*.json.gz" --output "$out/shards/train" \
        --tokenizer "$out/tokenizer/spiece.model" --workers 2
    "$PY" -m pretrain.data.prepare --input "$text/c4-validation.*.json.gz" --output "$out/shards/valid" \
        --tokenizer "$out/tokenizer/spiece.model" --workers 1
    "$PY" -m pretrain.tasks.polarity --output "$out/polarity"
    rm -rf "$text"
}

mkdir -p "$KIT"
rm -rf "$KIT/wheels.tmp"
wheels "$KIT/wheels.tmp"
rm -rf "$KIT/wheels"
mv "$KIT/wheels.tmp" "$KIT/wheels"
if [ ! -e "$KIT/data/polarity/test.tsv" ]; then  # the last thing data() writes: the folder is whole
    rm -rf "$KIT/data.tmp"
    data "$KIT/data.tmp"
    rm -rf "$KIT/data"
    mv "$KIT/data.tmp" "$KIT/data"
fi
ls "$KIT/wheels"
kib=$(du -sk "$KIT" | cut -f1)
echo "device kit: $KIT, $((kib / 1024)) MiB ($(ls "$KIT/wheels" | wc -l) wheels + data); carry it: [\"$KIT\"]"
[ "$kib" -le $((MAX_MIB * 1024)) ] || { echo "device_kit: $KIT exceeds $MAX_MIB MiB" >&2; exit 1; }
