"""Who am I in the job: rank, world size, local rank and rendezvous address, from torchrun's or SLURM's
environment; and the tie of a rank to torchrun's agent (`init_launcher_death_signal`).

torchrun (also `srun torchrun`, one task per node) sets RANK/WORLD_SIZE/LOCAL_RANK/MASTER_ADDR/MASTER_PORT
itself. Under `srun python -m ...` (one task per GPU or CPU slot) only SLURM's variables exist; the master
is the first host of the job's node list and the port is derived from the job id, so concurrent jobs on a
shared node do not collide.
"""
from __future__ import annotations

import os
import random
import signal
import socket
import subprocess
from dataclasses import dataclass
from typing import Mapping

from pretrain.core.signals import die_with_parent


@dataclass(frozen=True)
class DistEnv:
    rank: int
    world_size: int
    local_rank: int
    local_world_size: int
    master_addr: str
    master_port: int
    source: str  # "torchrun", "slurm" or "single"


def _first_host(nodelist: str) -> str:
    """First host of a SLURM node list (`node[1-2],gpu7` -> `node1`), via scontrol when available."""
    try:
        out = subprocess.run(
            ["scontrol", "show", "hostnames", nodelist], capture_output=True, text=True, check=True
        ).stdout.split()
        if out:
            return out[0]
    except (OSError, subprocess.CalledProcessError):
        pass
    head = nodelist.split(",")[0]
    if "[" in head:
        prefix, rest = head.split("[", 1)
        first = rest.rstrip("]").split(",")[0].split("-")[0]
        return prefix + first
    return head


def slurm_port(job_id: str) -> int:
    """A rendezvous port in [20000, 30000) derived from the job id."""
    return 20000 + int(job_id) % 10000


def tasks_per_node(spec: str) -> list[int]:
    """Expand SLURM's compressed task counts: `2(x3),1` -> [2, 2, 2, 1]."""
    counts: list[int] = []
    for part in spec.split(","):
        num, _, rep = part.partition("(x")
        counts += [int(num)] * (int(rep.rstrip(")")) if rep else 1)
    return counts


def distributed_env(environ: Mapping[str, str] | None = None) -> DistEnv:
    """The process's place in the job. torchrun's variables win (also under `srun torchrun`); SLURM's count
    only inside a job step (SLURM_STEP_ID): the batch shell has SLURM_PROCID=0 and the job's SLURM_NTASKS
    too, and a process started there is alone."""
    env = os.environ if environ is None else environ
    if "RANK" in env and "WORLD_SIZE" in env:
        return DistEnv(
            rank=int(env["RANK"]),
            world_size=int(env["WORLD_SIZE"]),
            local_rank=int(env.get("LOCAL_RANK", 0)),
            local_world_size=int(env.get("LOCAL_WORLD_SIZE", env["WORLD_SIZE"])),
            master_addr=env.get("MASTER_ADDR", "127.0.0.1"),
            master_port=int(env.get("MASTER_PORT", 29500)),
            source="torchrun",
        )
    if "SLURM_STEP_ID" in env and "SLURM_PROCID" in env and "SLURM_NTASKS" in env:
        nodelist = env.get("SLURM_STEP_NODELIST") or env.get("SLURM_JOB_NODELIST", "127.0.0.1")
        # srun sets the step's layout in SLURM_STEP_TASKS_PER_NODE (and SLURM_TASKS_PER_NODE), e.g. "2(x2)"
        per_node = tasks_per_node(env.get("SLURM_STEP_TASKS_PER_NODE") or env.get("SLURM_TASKS_PER_NODE", "1"))
        return DistEnv(
            rank=int(env["SLURM_PROCID"]),
            world_size=int(env["SLURM_NTASKS"]),
            local_rank=int(env.get("SLURM_LOCALID", 0)),
            local_world_size=per_node[min(int(env.get("SLURM_NODEID", 0)), len(per_node) - 1)],
            master_addr=env.get("MASTER_ADDR") or _first_host(nodelist),
            master_port=int(env.get("MASTER_PORT") or slurm_port(env.get("SLURM_JOB_ID", "0"))),
            source="slurm",
        )
    # a lone process needs no agreed port: a free one, so two such jobs on one machine do not collide
    return DistEnv(0, 1, 0, 1, "127.0.0.1", int(env.get("MASTER_PORT") or free_port()), "single")


# where free_port picks: below SLURM jobs' 20000-29999 (slurm/job.sh) and the tests' 30000-32767
# (tests/distributed.py), far below Linux's ephemeral ports (32768-60999 by default)
RENDEZVOUS_PORTS = range(10000, 20000)


def free_port() -> int:
    """A port free now, for a rendezvous its caller binds next: a random one of RENDEZVOUS_PORTS that binds now.
    Not the kernel's pick (bind to port 0): that is an ephemeral port, which the kernel can hand out again, to
    another process's outgoing connection, before the job binds it (a study cell's rank 0 once failed with
    EADDRINUSE beside a full test suite). Random from the OS (`SystemRandom`), not `random`, which jobs seed:
    concurrent cells with the same seed would pick the same port."""
    pick = random.SystemRandom()
    for _ in range(100):
        port = pick.choice(RENDEZVOUS_PORTS)
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:  # in use, or in TIME_WAIT from a job that just ended
                continue
            return port
    raise RuntimeError(f"no free port found in 100 tries of ports {RENDEZVOUS_PORTS.start}-{RENDEZVOUS_PORTS.stop - 1}")


# Megatron's setting for tensor parallelism: TP's communication kernels run in the order they are issued with the
# compute that consumes them. CUDA reads it when a process creates its CUDA context, so the launchers put it in the
# job's environment (launch.local, slurm/site.sh); pretrain.distributed.parallel sets it too, for launches that did not.
CUDA_CONNECTIONS = ("CUDA_DEVICE_MAX_CONNECTIONS", "1")

# What NCCL's watchdog does with a collective that timed out (or failed): 3, torch's own default, takes the
# process down at once (std::abort: SIGABRT, exit 134, no Python `finally`) without first aborting the NCCL
# communicators, which can itself hang; 1, what torchrun's agent sets when the variable is unset, aborts them
# first. Never 2 (abort the communicators, let Python go on): the CUDA stream's results are then unknown, and a
# rank could go on to save a checkpoint of them. The launchers set 3 (launch.run, slurm/site.sh), so srun and
# torchrun jobs end alike; docs/training.md has what a user sees.
NCCL_ERROR_HANDLING = ("TORCH_NCCL_ASYNC_ERROR_HANDLING", "3")


def export_torch_env(d: DistEnv) -> None:
    """Set the variables torch.distributed's env:// rendezvous reads (a no-op under torchrun)."""
    os.environ.update(
        RANK=str(d.rank),
        WORLD_SIZE=str(d.world_size),
        LOCAL_RANK=str(d.local_rank),
        LOCAL_WORLD_SIZE=str(d.local_world_size),
        MASTER_ADDR=d.master_addr,
        MASTER_PORT=str(d.master_port),
    )


def init_launcher_death_signal() -> None:
    """Under torchrun's agent (torchrun, launch.run): SIGTERM to this rank when the agent dies, however it dies.
    A launcher killed by SIGKILL (the OOM killer, a node agent) forwards nothing, and its ranks would train on as
    orphans holding the run lock; the jobs take SIGTERM as preemption (checkpoint, exit). Linux only (prctl);
    elsewhere, and under srun, whose step daemon ends its tasks itself, nothing is done."""
    if "TORCHELASTIC_RUN_ID" in os.environ:
        die_with_parent(signal.SIGTERM)
