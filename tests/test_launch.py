"""launch/: the rank/world/rendezvous view from torchrun's and SLURM's variables, and the local launcher."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from launch.local import launcher_argv
from pretrain.distributed.env import DistEnv, distributed_env, slurm_port, tasks_per_node

REPO = Path(__file__).resolve().parents[1]

# Variables as srun sets them in a job step (recorded on the test cluster: -N2 --ntasks-per-node=2).
SRUN_TASK_3 = {
    "SLURM_JOB_ID": "4711", "SLURM_STEP_ID": "0", "SLURM_PROCID": "3", "SLURM_LOCALID": "1",
    "SLURM_NODEID": "1", "SLURM_NTASKS": "4", "SLURM_TASKS_PER_NODE": "2(x2)",
    "SLURM_JOB_NODELIST": "node[1-2]", "SLURM_STEP_NODELIST": "node[1-2]",
}


def test_torchrun_variables() -> None:
    env = {"RANK": "5", "WORLD_SIZE": "8", "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "4",
           "MASTER_ADDR": "gpu17", "MASTER_PORT": "29400"}
    assert distributed_env(env) == DistEnv(5, 8, 1, 4, "gpu17", 29400, "torchrun")


def test_srun_one_task_per_process() -> None:
    d = distributed_env(SRUN_TASK_3)
    assert d == DistEnv(3, 4, 1, 2, "node1", 20000 + 4711 % 10000, "slurm")


def test_srun_torchrun_prefers_torchrun_variables() -> None:
    """`srun torchrun`: one SLURM task per node, torchrun's workers carry both sets; torchrun's describe them."""
    env = {**SRUN_TASK_3, "SLURM_PROCID": "1", "SLURM_NTASKS": "2", "SLURM_TASKS_PER_NODE": "1(x2)",
           "RANK": "6", "WORLD_SIZE": "8", "LOCAL_RANK": "2", "LOCAL_WORLD_SIZE": "4",
           "MASTER_ADDR": "node1", "MASTER_PORT": "29500"}
    assert distributed_env(env) == DistEnv(6, 8, 2, 4, "node1", 29500, "torchrun")


def test_batch_shell_is_a_single_process() -> None:
    """The batch script has SLURM_PROCID=0 and the job's SLURM_NTASKS but no step: not a rank of the job."""
    env = {k: v for k, v in SRUN_TASK_3.items() if k != "SLURM_STEP_ID"}
    assert distributed_env(env).source == "single"
    assert distributed_env(env).world_size == 1


@pytest.mark.parametrize("spec, counts", [("4", [4]), ("2(x2)", [2, 2]), ("2(x3),1", [2, 2, 2, 1]),
                                          ("1,3(x2)", [1, 3, 3])])
def test_tasks_per_node(spec: str, counts: list[int]) -> None:
    assert tasks_per_node(spec) == counts


def test_uneven_nodes_local_world_size() -> None:
    """`-n 5` on 2 nodes: 3 tasks on the first, 2 on the second; each task sees its own node's count."""
    env = {**SRUN_TASK_3, "SLURM_NTASKS": "5", "SLURM_TASKS_PER_NODE": "3,2", "SLURM_PROCID": "4"}
    assert distributed_env(env).local_world_size == 2
    assert distributed_env({**env, "SLURM_NODEID": "0", "SLURM_PROCID": "0"}).local_world_size == 3


def test_master_from_node_list_and_port_from_job() -> None:
    env = {**SRUN_TASK_3, "SLURM_STEP_NODELIST": "gpu[007-009,012]", "SLURM_JOB_ID": "123456"}
    d = distributed_env(env)
    assert (d.master_addr, d.master_port) == ("gpu007", 23456)
    assert slurm_port("123456") != slurm_port("123457")
    assert distributed_env({**env, "MASTER_ADDR": "10.0.0.1", "MASTER_PORT": "4000"}).master_addr == "10.0.0.1"


def test_local_launcher_runs_a_two_process_group(tmp_path: Path) -> None:
    subprocess.run([sys.executable, "-m", "launch.local", "--nproc-per-node", "2", "--module",
                    "tests.launch_probe", str(tmp_path)], cwd=REPO, check=True, capture_output=True)
    records = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]
    for r, rec in enumerate(records):
        assert (rec["rank"], rec["world_size"], rec["local_rank"], rec["source"]) == (r, 2, r, "torchrun")
        assert rec["gathered"] == [0, 1]
        assert rec["cuda_connections"] == "1"  # in the job's environment, before any CUDA context
        assert rec["nccl_error_handling"] == "3"  # as under srun (slurm/site.sh), not torchrun's 1


def test_local_launcher_passes_the_module_arguments_through() -> None:
    argv = launcher_argv(2, "pretrain.train", ["--config", "configs/tiny.yaml", "train.steps=3"])
    assert argv[-5:] == ["-m", "pretrain.train", "--config", "configs/tiny.yaml", "train.steps=3"]


def test_local_launcher_rejects_zero_processes() -> None:
    out = subprocess.run([sys.executable, "-m", "launch.local", "--nproc-per-node", "0"], cwd=REPO,
                         capture_output=True, text=True)
    assert out.returncode == 2
    assert "--nproc-per-node 0 must be at least 1" in out.stderr.strip().splitlines()[-1]


def test_launch_run_refuses_a_rank_count_below_one_in_one_line() -> None:
    # before: torchrun's bare AssertionError traceback (0, -1), exit 1
    jobs = {n: subprocess.Popen([sys.executable, "-m", "launch.run", "--nproc-per-node", n, "-m", "pretrain.train"],
                                cwd=REPO, stderr=subprocess.PIPE, text=True) for n in ("0", "-1")}
    for n, job in jobs.items():
        _, stderr = job.communicate()
        assert job.returncode == 2 and stderr.splitlines() == [
            f"launch.run: error: --nproc-per-node {n} must be a number of ranks on this node, at least 1, or gpu, "
            "cpu or auto"], stderr


def test_free_port_is_outside_the_kernels_ephemeral_range_and_unseeded() -> None:
    # the kernel's own pick (bind to port 0) is an ephemeral port, which it may hand to another process's outgoing
    # connection before the job binds it: a study cell's rank 0 failed with EADDRINUSE beside a full suite. A pick
    # from `random`, which the jobs seed, would give concurrent cells of one seed the same port
    import random
    import socket

    from pretrain.distributed.env import RENDEZVOUS_PORTS, free_port

    low, _ = map(int, Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split())
    picks = []
    for _ in range(5):
        random.seed(0)
        picks.append(free_port())
    assert all(port in RENDEZVOUS_PORTS and port < low for port in picks) and len(set(picks)) > 1, picks
    with socket.socket() as s:
        s.bind(("127.0.0.1", picks[-1]))  # free when picked
