#!/usr/bin/env bash
# Submit the whole chain, each step starting only when the one before it succeeded (afterok); a failed step
# cancels every step after it (--kill-on-invalid-dep=yes). Run from the repository root:
#
#   slurm/pipeline.sh --input 'c4/en/c4-train.*.json.gz' --work /scratch/run1 --config configs/base.yaml \
#       [--nodes N] [--vocab-size 32000] [--stages tokenizer,prepare,pretrain,export,finetune] \
#       [--finetune-tasks cola,sst2,... --finetune-data GLUE_DIR] [-- section.key=value ...]
#
# Steps and what they leave in WORK: tokenizer (tokenizer/spiece.model) -> prepare, an array job over the
# input files plus one job that writes the final index (shards/) -> pretrain (run/) -> export (export/) ->
# finetune (only with --finetune-tasks: an array job, one fine-tuning task each, finetune/TASK/). --stages
# runs a subset: the outputs of the skipped earlier steps must already be in WORK. Arguments after `--` go to
# the trainer. Only training shards are prepared: the config's data.valid is used as it is, so pass
# `-- data.valid=SHARDS` (validation shards made with slurm/prepare_data.sbatch) or `-- eval.every=0`.
# Logs go to WORK/logs; for each submitted job one line `STEP JOBID` is printed.
set -euo pipefail
source slurm/site.sh

usage() { echo "usage: slurm/pipeline.sh --input GLOB --work DIR --config FILE [--nodes N] [--vocab-size N]" \
  "[--stages LIST] [--finetune-tasks LIST --finetune-data DIR] [-- overrides]" >&2; exit 2; }
input="" work="" config="" nodes=1 vocab=32000 finetune_tasks="" finetune_data=""
stages=tokenizer,prepare,pretrain,export,finetune
while [ $# -gt 0 ]; do
  case $1 in
    --input) input=$2; shift 2 ;;
    --work) work=$2; shift 2 ;;
    --config) config=$2; shift 2 ;;
    --nodes) nodes=$2; shift 2 ;;
    --vocab-size) vocab=$2; shift 2 ;;
    --stages) stages=$2; shift 2 ;;
    --finetune-tasks) finetune_tasks=$2; shift 2 ;;
    --finetune-data) finetune_data=$2; shift 2 ;;
    --) shift; break ;;
    *) echo "slurm/pipeline.sh: unknown argument '$1'" >&2; usage ;;
  esac
done
for stage in ${stages//,/ }; do
  case $stage in tokenizer|prepare|pretrain|export|finetune) ;;
    *) echo "slurm/pipeline.sh: unknown stage '$stage' in --stages (tokenizer,prepare,pretrain,export,finetune)" >&2
       exit 2 ;;
  esac
done
want() { [[ ",$stages," == *",$1,"* ]]; }
[ -n "$work" ] || usage
if want tokenizer || want prepare; then [ -n "$input" ] || usage; fi
if want pretrain; then [ -n "$config" ] || usage; fi
if [ -n "$finetune_tasks" ]; then [ -n "$finetune_data" ] || usage; fi
work=$(realpath -m "$work")
mkdir -p "$work/logs"
tokenizer=$work/tokenizer/spiece.model

previous=""  # the job the next step waits for
submit() {  # submit STEP SCRIPT [sbatch options] -- [script arguments]; prints `STEP JOBID`
  local step=$1 script=$2; shift 2
  local opts=(--parsable --kill-on-invalid-dep=yes --output="$work/logs/%x-%j.out")
  [ -n "$previous" ] && opts+=(--dependency=afterok:"$previous")
  while [ "$1" != -- ]; do opts+=("$1"); shift; done
  shift
  previous=$(sbatch "${opts[@]}" "$script" "$@" | cut -d';' -f1)
  echo "$step $previous"
}

if want tokenizer; then
  submit tokenizer slurm/train_tokenizer.sbatch -- --input "$input" --output "$work/tokenizer" --vocab-size "$vocab"
fi
if want prepare; then
  num_files=$(compgen -G "$input" | wc -l)
  if [ "$num_files" -eq 0 ]; then echo "slurm/pipeline.sh: no file matches --input '$input'" >&2; exit 2; fi
  tasks=$(( num_files < PREPARE_TASKS ? num_files : PREPARE_TASKS ))
  prepare=(--input "$input" --output "$work/shards" --tokenizer "$tokenizer")
  submit prepare slurm/prepare_data.sbatch --array=0-$(( tasks - 1 )) --output="$work/logs/%x-%A_%a.out" -- "${prepare[@]}"
  submit index slurm/prepare_data.sbatch --job-name=index -- "${prepare[@]}"
fi
if want pretrain; then
  submit pretrain slurm/pretrain.sbatch --nodes="$nodes" --gpus-per-node="$SITE_GPUS_PER_NODE" --output="$work/logs/%x-%j.out" -- --config "$config" \
    data.train="$work/shards" data.tokenizer="$tokenizer" run.dir="$work/run" "$@"
fi
if want export; then
  submit export slurm/export.sbatch -- --run "$work/run" --output "$work/export"
fi
if want finetune && [ -n "$finetune_tasks" ]; then
  IFS=, read -r -a names <<< "$finetune_tasks"
  submit finetune slurm/finetune.sbatch --gpus-per-node="$SITE_GPUS_PER_NODE" --array=0-$(( ${#names[@]} - 1 )) --output="$work/logs/%x-%A_%a.out" -- \
    --tasks "$finetune_tasks" --data "$finetune_data" --init "$work/export" --runs "$work/finetune"
fi
