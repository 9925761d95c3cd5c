#!/usr/bin/env bash
# The Synthesizer study on SLURM, from the repository root:
#
#   slurm/study.sh --config configs/study/FILE.yaml [section.key=value ...]
#
# Submits four jobs, each `python -m pretrain.study` with the same config and overrides (see its docstring):
#   data        fetch text, tokenizer, shards, the polarity set and the pair probe (a no-op unless data.fetch)
#   pretrain    an array, task i pretrains cell i (variant x seed), after `data` succeeded
#   downstream  an array, task i exports and fine-tunes cell i (from the export and from scratch) once
#               pretraining task i succeeded (aftercorr); a failed pretraining cancels only its own downstream task
#   report      results.csv, results.md, figures/ once every downstream task ended in any state (afterany),
#               so a failed cell is a row of the report and the others are there
# The pretrain and downstream tasks are one node each with slurm/site.sh's SITE_GPUS_PER_NODE GPUs (set
# study.processes to that count: its jobs run through torchrun on the node; `python -m pretrain.study_plan`
# checks that every variant fits). Prints one `STEP JOBID` line per job; logs go to STUDY_DIR/logs. The study
# resumes like the local one:
# submitting again skips finished cells and resumes unfinished runs from their checkpoints.
# The jobs run this script with `--job STAGE` (sbatch copies it; the repository is SLURM_SUBMIT_DIR or PRETRAIN_REPO).
set -euo pipefail

if [ "${1:-}" = --job ]; then  # inside a job
  stage=$2; shift 2
  source "${PRETRAIN_REPO:-$SLURM_SUBMIT_DIR}/slurm/job.sh"
  case $stage in
    pretrain|downstream) exec "$PYTHON" -m pretrain.study "$@" --stage "$stage" --cell "$SLURM_ARRAY_TASK_ID" ;;
    *) exec "$PYTHON" -m pretrain.study "$@" --stage "$stage" ;;
  esac
fi

source slurm/site.sh
if [ "${1:-}" != --config ] || [ $# -lt 2 ]; then
  echo "usage: slurm/study.sh --config FILE [section.key=value ...]" >&2; exit 2
fi
# the cell count and study folder; a bad config is refused here, before anything is submitted
out=$("$PYTHON" -m pretrain.study "$@" --cells)
read -r cells dir <<< "$out"
mkdir -p "$dir/logs"

submit() {  # submit STEP [sbatch options]: prints `STEP JOBID`, sets $job
  local step=$1; shift
  job=$(sbatch --parsable --kill-on-invalid-dep=yes --job-name="study-$step" --nodes=1 --ntasks=1 \
    --output="$dir/logs/%x-%j.out" "$@" slurm/study.sh --job "$step" "${study_args[@]}" | cut -d';' -f1)
  echo "$step $job"
}
study_args=("$@")
submit data
array=(--array=0-$(( cells - 1 )) --output="$dir/logs/%x-%A_%a.out")  # the later --output wins
array+=(--gpus-per-node="$SITE_GPUS_PER_NODE")  # 0 on a CPU-only site, as slurm/pipeline.sh asks
submit pretrain "${array[@]}" --dependency=afterok:"$job"
submit downstream "${array[@]}" --dependency=aftercorr:"$job"
submit report --dependency=afterany:"$job"
