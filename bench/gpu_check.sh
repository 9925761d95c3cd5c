#!/usr/bin/env bash
# The one-GPU check, under 9 minutes on one H200: bash bench/gpu_check.sh [OUT_DIR] [DATA_DIR]
#
#   1. env         CUDA, bf16 and NCCL sanity (a bf16 GEMM against fp32, a 1-rank NCCL all-reduce)
#      startup     host memory while the trainer's build_model puts CONFIG's model on the GPU (must stay small)
#   2. throughput  bench.throughput at configs/base.yaml, bf16: vanilla, dense, random, factorized_random,
#                  random+vanilla (the trainer's step; median, IQR, tokens/s, TFLOP/s, MFU, peak memory)
#   3. sdpa        vanilla and random+vanilla attention through SDPA against materialised logits (time, memory)
#   4. pipeline    50-step pretraining of configs/tiny.yaml in bf16, export, fine-tuning with evaluation (sst2)
# Every section runs under a time limit (45 + 45 + 180 + 120 + 120 s: under 9 minutes in all); a failure is recorded
# and the next section still runs. The summary
# (OUT_DIR/summary.md; OUT_DIR defaults to $OUT, else runs/gpu_check) lists each section's status and time and
# holds the tables; each section's full output is in OUT_DIR/<section>.log.
#
# Offline: the pipeline reads DATA_DIR (default runs/demo), the folders `python -m pretrain.demo` leaves:
# tokenizer/spiece.model, shards/train, shards/valid and polarity/ (SST-2 layout). Make them on a machine with
# network and copy that folder along; the other sections need no data. Needs the project's Python packages
# (requirements); PYTHON selects the interpreter (default python3). CONFIG, PRECISION and MICRO_BATCH change the
# benchmark sections' settings (default configs/base.yaml, bf16, 32), e.g. for a dry run of the script on a CPU:
#   PYTHON=.venv/bin/python CONFIG=configs/tiny.yaml PRECISION=fp32 MICRO_BATCH=4 bash bench/gpu_check.sh out
set -euo pipefail
cd "$(dirname "$0")/.."
OUT_DIR=${1:-${OUT:-runs/gpu_check}}
DATA=${2:-runs/demo}
PY=${PYTHON:-python3}
CONFIG=${CONFIG:-configs/base.yaml}
PRECISION=${PRECISION:-bf16}
MICRO_BATCH=${MICRO_BATCH:-32}
mkdir -p "$OUT_DIR"
SUMMARY="$OUT_DIR/summary.md"
WORK=$(mktemp -d)
export PYTHONUNBUFFERED=1
START=$(date +%s)
: >"$OUT_DIR/status.txt"

# section NAME LIMIT_S COMMAND...: run it with its output in NAME.log; record ok / FAILED (exit) / TIMEOUT
section() {
    local name=$1 limit=$2 t0 rc=0
    shift 2
    t0=$(date +%s)
    echo "== $name (limit ${limit}s)"
    timeout --kill-after=10 "$limit" "$@" >"$OUT_DIR/$name.log" 2>&1 || rc=$?
    local status="ok"
    if [ "$rc" -eq 124 ] || [ "$rc" -eq 137 ]; then status="TIMEOUT"; elif [ "$rc" -ne 0 ]; then status="FAILED (exit $rc)"; fi
    echo "| $name | $status | $(($(date +%s) - t0)) s |" | tee -a "$OUT_DIR/status.txt"
    if [ "$status" != "ok" ]; then tail -n 15 "$OUT_DIR/$name.log" | sed 's/^/    /'; fi
}

env_check() {
    set -euo pipefail
    nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader || echo "nvidia-smi missing"
    "$PY" - <<'EOF'
import os, socket
import torch
import torch.distributed as dist

assert torch.cuda.is_available(), "CUDA not available to torch"
print(f"torch {torch.__version__}, CUDA {torch.version.cuda}, {torch.cuda.get_device_name()}, "
      f"NCCL {'.'.join(map(str, torch.cuda.nccl.version()))}, bf16 {torch.cuda.is_bf16_supported()}")
assert torch.cuda.is_bf16_supported(), "no bf16 on this GPU"
g = torch.Generator(device="cuda").manual_seed(0)
a, b = (torch.randn(4096, 4096, device="cuda", generator=g) for _ in range(2))
err = ((a.bfloat16() @ b.bfloat16()).float() - a @ b).norm() / (a @ b).norm()
print(f"bf16 GEMM relative error vs fp32: {err:.2e}")
assert err < 1e-2, "bf16 GEMM far from fp32"
with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
dist.init_process_group("nccl", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)
t = torch.arange(4.0, device="cuda")
dist.all_reduce(t)
torch.cuda.synchronize()
assert t.tolist() == [0.0, 1.0, 2.0, 3.0], t
dist.destroy_process_group()
print("NCCL all-reduce ok")
import deepspeed, megatron.core  # noqa: E401,F401  the project's GPU stack imports
print(f"deepspeed {deepspeed.__version__}")
EOF
}

startup_check() {
    set -euo pipefail
    "$PY" - "$CONFIG" <<'EOF'
import resource, sys
import torch
from pretrain.config import Config, load_config
from pretrain.model import build_model, with_vocab
from pretrain.parallel import init_single_process

device = "cuda" if torch.cuda.is_available() else "cpu"  # cpu: the script's dry run
torch.empty(1, device=device)  # the CUDA context first: its host memory is not the model's
init_single_process()
cfg = load_config(Config, sys.argv[1], []).model
cfg = with_vocab(cfg, cfg.vocab_size or 32100)  # 0: the T5 tokenizer's ids
before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # peak so far, bytes
model = build_model(cfg, device=device)
grew = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 - before
size = sum(p.numel() * p.element_size() for p in model.parameters())
print(f"built {sys.argv[1]} on {device}: {size / 2**30:.2f} GiB of fp32 weights; peak host memory grew "
      f"{grew / 2**30:.2f} GiB ({grew / size:.0%} of the model)")
assert device == "cpu" or grew < 0.25 * size, "the build went through the host"
EOF
}

pipeline() {
    set -euo pipefail
    for need in tokenizer/spiece.model shards/train shards/valid polarity; do
        [ -e "$DATA/$need" ] || { echo "missing $DATA/$need: run python -m pretrain.demo on a machine with network and copy $DATA"; return 2; }
    done
    "$PY" -m torch.distributed.run --standalone --nproc-per-node 1 -m pretrain.train --config configs/tiny.yaml \
        "run.dir=$WORK/pretrain" "data.train=$DATA/shards/train" "data.valid=$DATA/shards/valid" \
        "data.tokenizer=$DATA/tokenizer/spiece.model" "precision=$PRECISION" train.steps=50 train.global_batch=4 \
        checkpoint.every=0 eval.every=50 log.every=10
    "$PY" -m pretrain.export --run "$WORK/pretrain" --output "$WORK/export"
    "$PY" -m torch.distributed.run --standalone --nproc-per-node 1 -m pretrain.finetune \
        --config configs/finetune/polarity.yaml "init=$WORK/export" "data.dir=$DATA/polarity" \
        "run.dir=$WORK/finetune" "precision=$PRECISION" train.steps=50 train.global_batch=32
    cp "$WORK/finetune/results.md" "$OUT_DIR/finetune_results.md"
}

# the sections run in child processes under `timeout`: they see these functions and variables
export -f env_check startup_check pipeline
export PY DATA WORK OUT_DIR PRECISION CONFIG
section env 45 bash -c env_check
section startup 45 bash -c startup_check
BENCH=(-m bench.throughput --config "$CONFIG" --precision "$PRECISION" --micro-batch "$MICRO_BATCH")
section throughput 180 "$PY" "${BENCH[@]}" --variants vanilla dense random factorized_random random+vanilla \
    --out "$OUT_DIR/throughput.md"
section sdpa 120 "$PY" "${BENCH[@]}" --variants vanilla random+vanilla --sdpa both --out "$OUT_DIR/sdpa.md"
section pipeline 120 bash -c pipeline

{
    echo "# GPU check, $(date -u +%Y-%m-%dT%H:%MZ), $(($(date +%s) - START)) s, commit $(git rev-parse --short HEAD 2>/dev/null || echo '?')"
    echo
    echo "| section | status | time |"
    echo "|---|---|---|"
    cat "$OUT_DIR/status.txt"
    echo
    grep -E "^torch |bf16 GEMM|NCCL all-reduce|deepspeed " "$OUT_DIR/env.log" || true
    grep -E "^built " "$OUT_DIR/startup.log" || true
    for part in throughput sdpa; do
        echo
        echo "## $part"
        cat "$OUT_DIR/$part.md" 2>/dev/null || echo "(no table: see $part.log)"
    done
    echo
    echo "## pipeline (50 pretraining steps, export, fine-tuning + evaluation)"
    grep -E "step 50/50|eval_loss" "$OUT_DIR/pipeline.log" | tail -n 3 || true
    cat "$OUT_DIR/finetune_results.md" 2>/dev/null || echo "(no results: see pipeline.log)"
} >"$SUMMARY"
rm -rf "$WORK"
cat "$SUMMARY"
