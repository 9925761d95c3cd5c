# The start of every slurm/*.sbatch job (sourced): into the repository the job was submitted from (or
# PRETRAIN_REPO), the site's settings and environment (site.sh), and the layout of multi-process steps.
cd "${PRETRAIN_REPO:-$SLURM_SUBMIT_DIR}"
source slurm/site.sh
site_setup

# For `srun "${STEP_LAYOUT[@]}" python -m ...`, one task per process: NPROC_PER_NODE processes on each node
# (default: the node's GPUs, 1 on CPU-only nodes), the node's CPUs split between them, and the rendezvous
# every task reads through launch/env.py (first host of the job; a port from the job id, stable on requeue).
gpus=${SLURM_GPUS_ON_NODE:-$(nvidia-smi -L 2>/dev/null | grep -c '^GPU' || true)}
NPROC=${NPROC_PER_NODE:-$(( gpus > 0 ? gpus : 1 ))}
STEP_LAYOUT=(--ntasks=$(( SLURM_JOB_NUM_NODES * NPROC )) --ntasks-per-node="$NPROC")
if [ $(( SLURM_CPUS_ON_NODE / NPROC )) -ge 1 ]; then
  STEP_LAYOUT+=(--cpus-per-task=$(( SLURM_CPUS_ON_NODE / NPROC )))
else
  STEP_LAYOUT+=(--overcommit)  # more processes than allocated CPUs, e.g. several gloo ranks per core
fi
MASTER_ADDR=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)
export MASTER_ADDR
export MASTER_PORT=$(( 20000 + SLURM_JOB_ID % 10000 ))
