# Site settings: the one file to edit for a cluster (partition, account, GPUs, modules, network).
#
# Sourced twice: by pipeline.sh (or by you: `source slurm/site.sh && sbatch ...`) before submitting, where the
# SBATCH_* variables below act as sbatch options (the command line still wins over them, and they win over
# the scripts' #SBATCH lines); and by every slurm/*.sbatch script at the start of the job, which then calls
# site_setup for the job's software environment. Every value can also be set in the environment beforehand.

# --- submission: empty means "not set", i.e. the cluster's default -----------------------------------------
SITE_PARTITION=${SITE_PARTITION:-}        # e.g. gpu
SITE_ACCOUNT=${SITE_ACCOUNT:-}            # e.g. project1234
SITE_QOS=${SITE_QOS:-}
SITE_GPUS_PER_NODE=${SITE_GPUS_PER_NODE-8}  # GPUs per node of the GPU jobs (pretrain, finetune); 0: CPU-only cluster
SITE_TIME=${SITE_TIME:-}                  # time limit per job run, e.g. 24:00:00 (a requeued run starts afresh)

if [ -n "$SITE_PARTITION" ]; then export SBATCH_PARTITION=$SITE_PARTITION; fi
if [ -n "$SITE_ACCOUNT" ]; then export SBATCH_ACCOUNT=$SITE_ACCOUNT; fi
if [ -n "$SITE_QOS" ]; then export SBATCH_QOS=$SITE_QOS; fi
# pretrain.sbatch and finetune.sbatch ask for 8 GPUs per node (#SBATCH --gpus-per-node=8), pipeline.sh for
# SITE_GPUS_PER_NODE; the CPU jobs (tokenizer, data, export, reshard) for none. A CPU-only site asks for none
# everywhere; elsewhere a bare `sbatch` of a GPU job with another count takes --gpus-per-node N.
if [ "${SITE_GPUS_PER_NODE:-0}" -eq 0 ]; then export SBATCH_GPUS_PER_NODE=0; fi
if [ -n "$SITE_TIME" ]; then export SBATCH_TIMELIMIT=$SITE_TIME; fi

# --- the job's environment ---------------------------------------------------------------------------------
PYTHON=${PYTHON:-$PWD/.venv/bin/python}   # the interpreter with requirements.txt installed
MAX_RESTARTS=${MAX_RESTARTS:-20}          # pretrain.sbatch stops requeueing itself after this many restarts
PREPARE_TASKS=${PREPARE_TASKS:-32}        # pipeline.sh: most array tasks for data preparation

site_setup() {
  # Modules and network settings of the site, run at the start of each job. NCCL picks interfaces and
  # InfiniBand devices itself on most clusters; set them here when it does not, e.g.
  # `export NCCL_SOCKET_IFNAME=ib0` or `export NCCL_IB_HCA=mlx5`; `module load cuda/12.4` likewise.
  export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}   # one thread per process: ranks share the node's cores
  export PYTHONUNBUFFERED=1                      # log lines reach the job's output file as they happen
  # Megatron's setting for tensor parallelism (pretrain/distributed/env.py, CUDA_CONNECTIONS): CUDA reads it when a process
  # creates its CUDA context, so it belongs in the job's environment, before any process starts
  export CUDA_DEVICE_MAX_CONNECTIONS=${CUDA_DEVICE_MAX_CONNECTIONS:-1}
  # a timed-out NCCL collective ends its rank at once (SIGABRT), as under launch.run (pretrain/distributed/env.py,
  # NCCL_ERROR_HANDLING); job.sh reports that as a crash, never as a preemption
  export TORCH_NCCL_ASYNC_ERROR_HANDLING=${TORCH_NCCL_ASYNC_ERROR_HANDLING:-3}
}
