#!/usr/bin/env bash
# The one-GPU check, under 8 minutes on one bare H200 with the device kit installed first:
#   bash bench/gpu_check.sh [OUT_DIR]            there, with carry [".kit"] (docs/cluster.md, "The one-GPU check")
#   DRY_RUN=1 bash bench/gpu_check.sh [OUT_DIR]  the same sections on the CPU, tiny (bench/rehearse_gpu_check.sh)
#   SECTIONS="kit attention" bash bench/gpu_check.sh   a partial rerun: only the sections named (default: all)
#
#   0. kit         the kit's wheels (bash bench/device_kit.sh) installed into a temporary folder put on PYTHONPATH
#   1. env         CUDA, bf16 and NCCL sanity (a bf16 GEMM against fp32, a 1-rank NCCL all-reduce), the versions
#                  (torch, CUDA, cuDNN, NCCL)
#      startup     host memory while the trainer's build_model puts CONFIG's model on the GPU (must stay small)
#   2. throughput  bench.throughput at configs/base.yaml, bf16: vanilla, dense, random, factorized_random,
#                  random+vanilla (the trainer's step; median, IQR, tokens/s, TFLOP/s, MFU, peak memory)
#   3. attention   bench.attention: each mixer's attention core, fused (one SDPA call, the kernel it names) against
#                  materialised logits, N 512-4096, with and without T5's bias (time, memory, the planner's figure;
#                  rows as they finish), then FlexAttention with the bias inside the kernel
#   4. cuda_tests  tests/test_cuda.py and the CUDA test of tests/test_async_checkpoint.py with pytest: each fused attention
#                  form on its kernel against the float64 reference (fp32, bf16), torch's kernel choice against the
#                  fake-CUDA tests' rules, recompute with dropout 0.1 replaying the forward, torch.compile vs eager
#   5. pipeline    50-step pretraining of configs/tiny.yaml in bf16 (an asynchronous save at step 25), export,
#                  fine-tuning with evaluation (sst2; selective recompute of random+vanilla with dropout 0.1)
# Every section runs under a time limit (30 + 40 + 40 + 130 + 120 + 120 + 110 s, each killed 5 s after its limit:
# under 10 minutes in all, about 5 measured); a failure is recorded and the next section still runs; the benchmarks print each row as it
# finishes, so a section cut by its limit keeps its rows in its log. OUT_DIR (default $OUT, else
# runs/gpu_check) gets 8 files, as the machine returns at most 8: summary.md (each section's status and time, the
# tables, the tests' results, the fine-tuning scores) and <section>.log for each section.
#
# Offline: the kit (KIT, default .kit) holds the wheels the machine lacks and data/, which the pipeline reads:
# tokenizer/spiece.model, shards/train, shards/valid and polarity/ (SST-2 layout). PYTHON selects the interpreter
# (default python3); DRY_RUN=1 runs on the CPU (gloo, fp32, configs/tiny.yaml, micro batch 4, fewer steps);
# TIME_SCALE=K gives each section K times its limit; CONFIG, PRECISION and MICRO_BATCH change the benchmark
# sections' settings (default configs/base.yaml, bf16, 32).
set -euo pipefail
cd "$(dirname "$0")/.."
OUT_DIR=${1:-${OUT:-runs/gpu_check}}
KIT=$(realpath "${KIT:-.kit}")
DATA=$KIT/data
PY=${PYTHON:-python3}
DRY_RUN=${DRY_RUN:-0}
TIME_SCALE=${TIME_SCALE:-1}  # multiplies every section's limit: a dry run on a small, shared CPU needs more
SECTIONS=${SECTIONS:-kit env startup throughput attention cuda_tests pipeline}
# a dry run takes the same paths with fewer steps: the benchmarks' 5 + 20 and the pipeline's 50 cost minutes on a CPU
if [ "$DRY_RUN" = 1 ]; then
    DEVICE=cpu; BACKEND=gloo; STEPS=(--warmup 1 --steps 2); PIPELINE_STEPS=10
    export PRETRAIN_TEST_DEVICE=cpu  # tests/test_cuda.py's bodies on the CPU
    ATTENTION=(--lengths 64 128 --batch 1 --heads 2 --reps 1)
else
    DEVICE=cuda; BACKEND=nccl; STEPS=(); PIPELINE_STEPS=50
    ATTENTION=(--lengths 512 1024 2048 4096 --batch 8 --heads 12 --reps 3 --dtype bf16)
fi
CONFIG=${CONFIG:-$([ "$DRY_RUN" = 1 ] && echo configs/tiny.yaml || echo configs/base.yaml)}
PRECISION=${PRECISION:-$([ "$DRY_RUN" = 1 ] && echo fp32 || echo bf16)}
MICRO_BATCH=${MICRO_BATCH:-$([ "$DRY_RUN" = 1 ] && echo 4 || echo 32)}
mkdir -p "$OUT_DIR"
SUMMARY="$OUT_DIR/summary.md"
WORK=$(mktemp -d)  # the tables, the status lines and the pipeline's runs: into summary.md, not OUT_DIR
SITE=$WORK/site
export PYTHONUNBUFFERED=1
START=$(date +%s)
: >"$WORK/status.txt"

# section NAME LIMIT_S COMMAND...: run it with its output in NAME.log; record ok / FAILED (exit) / TIMEOUT
section() {
    local name=$1 limit=$(($2 * TIME_SCALE)) t0 rc=0
    shift 2
    if [[ " $SECTIONS " != *" $name "* ]]; then echo "| $name | skipped | 0 s |" >>"$WORK/status.txt"; return; fi
    t0=$(date +%s)
    echo "== $name (limit ${limit}s)"
    timeout --kill-after=5 "$limit" "$@" >"$OUT_DIR/$name.log" 2>&1 || rc=$?
    local status="ok"
    if [ "$rc" -eq 124 ] || [ "$rc" -eq 137 ]; then status="TIMEOUT"; elif [ "$rc" -ne 0 ]; then status="FAILED (exit $rc)"; fi
    echo "| $name | $status | $(($(date +%s) - t0)) s |" | tee -a "$WORK/status.txt"
    if [ "$status" != "ok" ]; then tail -n 15 "$OUT_DIR/$name.log" | sed 's/^/    /'; fi
}

kit_install() {
    set -euo pipefail
    ls "$KIT"/wheels/*.whl >/dev/null || { echo "no wheels in $KIT/wheels: run bash bench/device_kit.sh and carry it"; return 2; }
    "$PY" -m pip install -q --no-index --no-deps --no-compile --target "$SITE" "$KIT"/wheels/*.whl
    ls "$KIT/wheels"
}

env_check() {
    set -euo pipefail
    if [ "$DEVICE" = cuda ]; then nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader; fi
    "$PY" - "$DEVICE" "$BACKEND" "$SITE" <<'EOF'
import socket, sys
import torch
import torch.distributed as dist

device, backend, site = sys.argv[1:]
if device == "cuda":
    assert torch.cuda.is_available(), "CUDA not available to torch"
    print(f"torch {torch.__version__}, CUDA {torch.version.cuda}, cuDNN {torch.backends.cudnn.version()}, "
          f"{torch.cuda.get_device_name()}, NCCL {'.'.join(map(str, torch.cuda.nccl.version()))}, "
          f"bf16 {torch.cuda.is_bf16_supported()}")
    assert torch.cuda.is_bf16_supported(), "no bf16 on this GPU"
else:
    print(f"torch {torch.__version__} on the CPU (dry run)")
n = 4096 if device == "cuda" else 256
g = torch.Generator(device=device).manual_seed(0)
a, b = (torch.randn(n, n, device=device, generator=g) for _ in range(2))
err = ((a.bfloat16() @ b.bfloat16()).float() - a @ b).norm() / (a @ b).norm()
print(f"bf16 GEMM relative error vs fp32: {err:.2e}")
assert err < 1e-2, "bf16 GEMM far from fp32"
with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)
t = torch.arange(4.0, device=device)
dist.all_reduce(t)
assert t.tolist() == [0.0, 1.0, 2.0, 3.0], t
dist.destroy_process_group()
print(f"{backend.upper()} all-reduce ok")
import deepspeed, megatron.core, omegaconf, webdataset, pydantic  # noqa: E401  the project's GPU stack
for mod in (deepspeed, megatron.core, omegaconf, webdataset, pydantic):
    assert mod.__file__.startswith(site), f"{mod.__name__} comes from {mod.__file__}, not the kit"
print(f"kit imports ok: deepspeed {deepspeed.__version__}, megatron-core {megatron.core.__version__}, "
      f"pydantic {pydantic.VERSION}")
EOF
}

startup_check() {
    set -euo pipefail
    "$PY" - "$CONFIG" "$DEVICE" <<'EOF'
import resource, sys
import torch
from pretrain.core.config import Config, load_config
from pretrain.model import build_model, with_vocab
from pretrain.distributed.parallel import init_single_process

config, device = sys.argv[1:]
torch.empty(1, device=device)  # the CUDA context first: its host memory is not the model's
init_single_process()
cfg = load_config(Config, config, []).model
cfg = with_vocab(cfg, cfg.vocab_size or 32100)  # 0: the T5 tokenizer's ids
before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # peak so far, bytes
model = build_model(cfg, device=device)
grew = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 - before
size = sum(p.numel() * p.element_size() for p in model.parameters())
print(f"built {config} on {device}: {size / 2**30:.2f} GiB of fp32 weights; peak host memory grew "
      f"{grew / 2**30:.2f} GiB ({grew / size:.0%} of the model)")
assert device == "cpu" or grew < 0.25 * size, "the build went through the host"
EOF
}

pipeline() {
    set -euo pipefail
    for need in tokenizer/spiece.model shards/train shards/valid polarity; do
        [ -e "$DATA/$need" ] || { echo "missing $DATA/$need: run bash bench/device_kit.sh and carry it"; return 2; }
    done
    "$PY" -m torch.distributed.run --standalone --nproc-per-node 1 -m pretrain.train --config configs/tiny.yaml \
        "run.dir=$WORK/pretrain" "data.train=$DATA/shards/train" "data.valid=$DATA/shards/valid" \
        "data.tokenizer=$DATA/tokenizer/spiece.model" "precision=$PRECISION" "train.steps=$PIPELINE_STEPS" \
        train.global_batch=4 "checkpoint.every=$((PIPELINE_STEPS / 2))" checkpoint.async_save=true \
        "eval.every=$PIPELINE_STEPS" log.every=10  # a background save mid-run: its CUDA copies (side stream, event)
    "$PY" -m pretrain.export --run "$WORK/pretrain" --output "$WORK/export"
    "$PY" -m torch.distributed.run --standalone --nproc-per-node 1 -m pretrain.finetune \
        --config configs/finetune/polarity.yaml "init=$WORK/export" "data.dir=$DATA/polarity" \
        "run.dir=$WORK/finetune" "precision=$PRECISION" "train.steps=$PIPELINE_STEPS" train.global_batch=32 \
        train.activation_checkpointing=selective  # random+vanilla (tiny.yaml), dropout 0.1: recompute replays masks
}

# the sections run in child processes under `timeout`: they see these functions and variables
export -f kit_install env_check startup_check pipeline
export PY KIT DATA WORK SITE DEVICE BACKEND PRECISION CONFIG PIPELINE_STEPS
section kit 30 bash -c kit_install
export PYTHONPATH="$SITE${PYTHONPATH:+:$PYTHONPATH}"  # the kit's packages before the interpreter's own
section env 40 bash -c env_check
section startup 40 bash -c startup_check
BENCH=(-m bench.throughput --config "$CONFIG" --precision "$PRECISION" --micro-batch "$MICRO_BATCH" "${STEPS[@]}")
section throughput 130 "$PY" "${BENCH[@]}" --variants vanilla dense random factorized_random random+vanilla \
    --out "$WORK/throughput.md"
section attention 120 "$PY" -m bench.attention --device "$DEVICE" "${ATTENTION[@]}" --mixers vanilla dense \
    factorized_random dense+vanilla random+vanilla random
section cuda_tests 120 "$PY" -m pytest -v -rsP -p no:cacheprovider tests/test_cuda.py \
    tests/test_async_checkpoint.py::test_cuda_copies_into_pinned_buffers_hold_the_state_as_saved
section pipeline 110 bash -c pipeline

{
    echo "# GPU check$([ "$DRY_RUN" = 1 ] && echo ' (DRY RUN on the CPU)'), $(date -u +%Y-%m-%dT%H:%MZ)," \
        "$(($(date +%s) - START)) s, commit $(git rev-parse --short HEAD 2>/dev/null || echo '?')"
    echo
    echo "| section | status | time |"
    echo "|---|---|---|"
    cat "$WORK/status.txt"
    echo
    grep -E "^torch |bf16 GEMM|all-reduce ok|kit imports" "$OUT_DIR/env.log" || true
    grep -E "^built " "$OUT_DIR/startup.log" || true
    echo
    echo "## throughput"
    cat "$WORK/throughput.md" 2>/dev/null || echo "(no table: see throughput.log)"
    echo
    echo "## attention"
    grep -E "^attention core|^\|" "$OUT_DIR/attention.log" 2>/dev/null || echo "(no table: see attention.log)"
    echo
    echo "## cuda_tests"
    grep -E "(PASSED|FAILED|SKIPPED|ERROR)|torch chooses|relative error| passed| failed" "$OUT_DIR/cuda_tests.log" 2>/dev/null \
        | sed -E 's/^(tests\/[^ ]*) (PASSED|FAILED|SKIPPED|ERROR).*/\2 \1/' || echo "(none: see cuda_tests.log)"
    echo
    echo "## pipeline ($PIPELINE_STEPS pretraining steps, export, fine-tuning + evaluation)"
    grep -E "step $PIPELINE_STEPS/$PIPELINE_STEPS|eval_loss" "$OUT_DIR/pipeline.log" | tail -n 3 || true
    cat "$WORK/finetune/results.md" 2>/dev/null || echo "(no results: see pipeline.log)"
} >"$SUMMARY"
rm -rf "$WORK"
cat "$SUMMARY"
