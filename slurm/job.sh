# The start of every slurm/*.sbatch job (sourced): into the repository the job was submitted from (or
# PRETRAIN_REPO), the site's settings and environment (site.sh), and the layout of multi-process steps.
cd "${PRETRAIN_REPO:-$SLURM_SUBMIT_DIR}"
source slurm/site.sh
site_setup

# For `srun "${STEP_LAYOUT[@]}" python -m ...`, one task per process: NPROC_PER_NODE processes on each node
# (default: the node's GPUs, 1 on CPU-only nodes), the node's CPUs split between them, and the rendezvous
# every task reads through pretrain/distributed/env.py (first host of the job; a port from the job id, stable on requeue).
gpus=${SLURM_GPUS_ON_NODE:-$(nvidia-smi -L 2>/dev/null | grep -c '^GPU' || true)}
NPROC=${NPROC_PER_NODE:-$(( gpus > 0 ? gpus : 1 ))}
# --kill-on-bad-exit: a task that dies ends the step's other tasks at once, rather than leaving them to find out
# through a collective's timeout (the trainer's own handling ends them too; this is the scheduler's backstop)
STEP_LAYOUT=(--ntasks=$(( SLURM_JOB_NUM_NODES * NPROC )) --ntasks-per-node="$NPROC" --kill-on-bad-exit=1)
if [ $(( SLURM_CPUS_ON_NODE / NPROC )) -ge 1 ]; then
  STEP_LAYOUT+=(--cpus-per-task=$(( SLURM_CPUS_ON_NODE / NPROC )))
else
  STEP_LAYOUT+=(--overcommit)  # more processes than allocated CPUs, e.g. several gloo ranks per core
fi
# GPU steps (pretraining, fine-tuning) call this first: without the GPUs the site promises they would train in
# bf16 on the CPU, silently; a job submitted without `source slurm/site.sh` (no --gpus-per-node) lands here
require_gpus() {
  if [ "${SITE_GPUS_PER_NODE:-0}" -gt 0 ] && [ "$gpus" -eq 0 ]; then
    echo "$1: no GPU in this job, but slurm/site.sh says SITE_GPUS_PER_NODE=$SITE_GPUS_PER_NODE: submit after" \
      "'source slurm/site.sh' (or with --gpus-per-node), or set SITE_GPUS_PER_NODE=0 for a CPU-only cluster" >&2
    exit 2
  fi
}
MASTER_ADDR=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)
export MASTER_ADDR
export MASTER_PORT=$(( 20000 + SLURM_JOB_ID % 10000 ))

# `run_requeueable MODULE ARGS...`: the job's srun step of `python -m MODULE ARGS`, requeued on preemption.
# SLURM sends USR1 to this shell <seconds> before the time limit (--signal=B:USR1@...); the trap forwards it to the
# step, whose job saves a checkpoint and exits with its "preempted" code; the job is then requeued (up to
# MAX_RESTARTS restarts). `scontrol requeue` and scheduler preemption send TERM to the tasks directly; they
# checkpoint the same way and SLURM requeues the job itself. Returns the step's exit code.
EXIT_RESTARTS=4  # distinct from the jobs' codes (pretrain/runtime/faults.py: 0, 1, 2, 3, 75)
# read, not imported: importing pretrain.runtime.faults would load torch and megatron for one number
EXIT_PREEMPTED=$(sed -n 's/^EXIT_PREEMPTED = \([0-9]*\).*/\1/p' pretrain/runtime/faults.py)
source slurm/step_exit.sh
run_requeueable() {
  local module=$1 restarts=${SLURM_RESTART_COUNT:-0} signalled="" step reader rc
  shift
  if [ "$restarts" -gt "$MAX_RESTARTS" ]; then
    echo "$module: job $SLURM_JOB_ID restarted $restarts times (MAX_RESTARTS=$MAX_RESTARTS); giving up" >&2
    return $EXIT_RESTARTS
  fi
  echo "$module: job $SLURM_JOB_ID run $restarts on $SLURM_JOB_NUM_NODES nodes x $NPROC processes, master $MASTER_ADDR:$MASTER_PORT"
  # USR1: the time limit is near, we requeue. TERM: SLURM is requeueing or cancelling the job and signals the
  # tasks itself; USR1 is forwarded anyway in case only this shell got it (srun relays USR1 to every task as
  # is, but turns a TERM into SIGKILL)
  trap 'signalled=USR1; kill -s USR1 "$step" 2>/dev/null' USR1
  trap 'signalled=TERM; kill -s USR1 "$step" 2>/dev/null' TERM
  # srun's stderr (its own line per ended task, and the tasks' stderr) passes through a reader that keeps srun's
  # lines for step_exit_code; the reader ignores the signals SLURM sends the batch step
  local tmp
  tmp=$(mktemp -d)
  mkfifo "$tmp/stderr"
  (trap '' TERM USR1 INT
   while IFS= read -r line || [ -n "$line" ]; do
     printf '%s\n' "$line" >&2
     if [[ $line == "srun: error: "* ]]; then printf '%s\n' "$line" >> "$tmp/srun"; fi
   done < "$tmp/stderr") &
  reader=$!
  srun "${STEP_LAYOUT[@]}" "$PYTHON" -m "$module" "$@" 2> "$tmp/stderr" &
  step=$!
  # `wait` returns early when a trapped signal arrives: wait until the step is gone, then ask bash for its
  # status, which it keeps for finished background jobs
  wait "$step"
  while kill -0 "$step" 2>/dev/null; do wait "$step"; done
  wait "$step"; rc=$?
  while kill -0 "$reader" 2>/dev/null; do wait "$reader"; done
  touch "$tmp/srun"
  # a task's own 75 is the preemption, also when --kill-on-bad-exit then killed the others (srun: 137), and so is
  # a task killed by the USR1 forwarded above while it started; a crashed task (SIGABRT, SIGSEGV...) never is
  # (slurm/step_exit.sh)
  rc=$(step_exit_code "$rc" "$tmp/srun" "$module" "${signalled:+User defined signal 1}")  # the USR1 forwarded
  rm -rf "$tmp"
  if [ "$rc" -eq "$EXIT_PREEMPTED" ] && [ "$signalled" != TERM ]; then
    if [ "$restarts" -lt "$MAX_RESTARTS" ]; then
      echo "$module: checkpoint saved, requeueing job $SLURM_JOB_ID (restart $(( restarts + 1 )))"
      scontrol requeue "$SLURM_JOB_ID"
    else
      echo "$module: checkpoint saved; MAX_RESTARTS=$MAX_RESTARTS reached, not requeueing" >&2
    fi
  fi
  echo "$module: exited with $rc"
  return "$rc"
}
