"""A real SLURM cluster for the tests: munged, slurmctld and two slurmd "nodes" (node1, node2) on this host.

Nothing is installed here (CI installs Debian's slurmctld, slurmd, slurm-client and munge). Every daemon
runs in the foreground as a child of the test process, with its state, spool, logs, pid files, munge
socket and ports under one temporary folder, so two test sessions on one machine do not collide. The
node names are added to /etc/hosts if missing (rendezvous resolves the first host of the node list).
Teardown cancels the jobs (running steps outlive slurmd) and stops each daemon by its pid, also when a test
or the start itself fails. Settings follow ../shared/reference/local-slurm.md.
"""
from __future__ import annotations

import contextlib
import os
import random
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterator

import pytest

NODES = ("node1", "node2")
CPUS_PER_NODE = 4  # declared, more than the machine has (SlurmdParameters=config_overrides)
TERMINAL_STATES = {"COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY",
                   "BOOT_FAIL", "DEADLINE", "PREEMPTED"}
HOSTS_FILE = Path("/etc/hosts")


def _port_is_free(port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
        return True


def _free_ports(count: int) -> list[int]:
    """`count` consecutive free ports (slurm.conf takes the nodes' ports as one range)."""
    for base in random.Random(os.getpid()).sample(range(20000, 60000, count), 200):
        if all(_port_is_free(base + i) for i in range(count)):
            return [base + i for i in range(count)]
    raise RuntimeError(f"no {count} consecutive free ports for the SLURM test cluster")


def _slurm_conf(root: Path, ctld_port: int, node_ports: list[int]) -> str:
    host = socket.gethostname()
    return f"""\
ClusterName=testcluster
SlurmctldHost={host}(127.0.0.1)
SlurmctldPort={ctld_port}
SlurmUser=root
AuthType=auth/munge
AuthInfo=socket={root}/munge/munge.socket,cred_expire=10
CredType=cred/munge
StateSaveLocation={root}/state
SlurmdSpoolDir={root}/spool/%n
SlurmctldPidFile={root}/slurmctld.pid
SlurmdPidFile={root}/slurmd-%n.pid
SlurmctldLogFile={root}/log/slurmctld.log
SlurmdLogFile={root}/log/slurmd-%n.log
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/linux
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
SlurmdParameters=config_overrides
SchedulerParameters=sched_interval=2,bf_interval=2
EnforcePartLimits=ALL
DependencyParameters=kill_invalid_depend
JobCompType=jobcomp/filetxt
JobCompLoc={root}/log/jobcomp.txt
MinJobAge=600
JobRequeue=1
ReturnToService=2
MpiDefault=none
MailProg=/bin/true
NodeName=node[1-2] NodeHostname={host} NodeAddr=127.0.0.1 Port=[{node_ports[0]}-{node_ports[1]}] \
CPUs={CPUS_PER_NODE} State=UNKNOWN
PartitionName=debug Nodes=node[1-2] Default=YES MaxTime=INFINITE DefaultTime=15 State=UP
"""


LAUNCHER_VARIABLES = {"RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"}


@dataclass
class SlurmCluster:
    """A running cluster: `env` has SLURM_CONF so the client commands (sbatch, squeue, sacct) reach it."""

    root: Path
    env: dict[str, str]
    procs: list[subprocess.Popen] = field(default_factory=list)

    def run(self, *cmd: str, check: bool = True, cwd: str | Path | None = None,
            extra_env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
        env = {**self.env, **(extra_env or {})}
        out = subprocess.run(list(cmd), capture_output=True, text=True, env=env, cwd=cwd)
        if check and out.returncode != 0:
            raise RuntimeError(f"{' '.join(cmd)} -> {out.returncode}\n{out.stdout}\n{out.stderr}")
        return out

    def sbatch(self, *args: str, cwd: str | Path, extra_env: dict[str, str] | None = None) -> str:
        """Submit and return the job id."""
        return self.run("sbatch", "--parsable", *args, cwd=cwd, extra_env=extra_env).stdout.strip().split(";")[0]

    def jobs(self, job_id: str) -> list[dict[str, str]]:
        """`scontrol show job` as dicts (JobState, ExitCode, Restarts, Reason, StartTime, ...): one per array task."""
        out = self.run("scontrol", "show", "job", "-o", job_id).stdout
        return [dict(kv.split("=", 1) for kv in line.split() if "=" in kv) for line in out.splitlines() if line]

    def job(self, job_id: str) -> dict[str, str]:
        return self.jobs(job_id)[0]

    def wait(self, job_id: str, states: set[str] = TERMINAL_STATES, poll_s: float = 0.5) -> list[dict[str, str]]:
        """Poll until the job (every task of an array) is in one of `states`; MinJobAge keeps it visible."""
        while True:
            info = self.jobs(job_id)
            if all(rec["JobState"] in states for rec in info):
                return info
            time.sleep(poll_s)

    def log(self, name: str) -> str:
        path = self.root / "log" / name
        return path.read_text() if path.exists() else ""


def _add_hosts() -> None:
    """Make node1/node2 resolve to this host. The line stays: test sessions running at the same time share
    /etc/hosts, and removing it under another session's jobs would break their rendezvous."""
    text = HOSTS_FILE.read_text()
    if not all(any(n in line.split() for line in text.splitlines()) for n in NODES):
        HOSTS_FILE.write_text(text.rstrip("\n") + "\n127.0.0.1 " + " ".join(NODES) + "  # tests/slurm_cluster.py\n")


def _start_munge(root: Path) -> list[str]:
    """The munged command line (run as the munge user), with its socket, key copy, seed, pid and log in root/munge."""
    mdir = root / "munge"
    mdir.mkdir(mode=0o755)  # clients need execute permission to reach the socket
    shutil.copy("/etc/munge/munge.key", mdir / "munge.key")
    os.chmod(mdir / "munge.key", 0o400)
    shutil.chown(mdir, "munge", "munge")
    shutil.chown(mdir / "munge.key", "munge", "munge")
    return ["/usr/sbin/munged", "--foreground",
            f"--socket={mdir}/munge.socket", f"--key-file={mdir}/munge.key", f"--pid-file={mdir}/munged.pid",
            f"--seed-file={mdir}/munged.seed", f"--log-file={mdir}/munged.log"]


def _wait_for(what: str, ready, procs: list[subprocess.Popen], root: Path) -> None:
    for _ in range(600):
        if ready():
            return
        dead = [p for p in procs if p.poll() is not None]
        if dead:
            break
        time.sleep(0.1)
    logs = "\n".join(f"--- {p.name}\n{p.read_text()[-2000:]}" for p in sorted((root / "log").glob("*")) + [root / "munge" / "munged.log"] if p.exists())
    raise RuntimeError(f"SLURM test cluster: {what} not ready\n{logs}")


def _stop(cluster: SlurmCluster) -> None:
    """scancel everything (slurmd leaves running steps behind), then TERM each daemon by pid, KILL if stuck."""
    if cluster.procs and cluster.procs[1:] and all(p.poll() is None for p in cluster.procs[:2]):
        cluster.run("scancel", "--full", "--partition=debug", check=False)
        for _ in range(100):
            if not cluster.run("squeue", "-h", "-t", "RUNNING,COMPLETING", check=False).stdout.strip():
                break
            time.sleep(0.2)
    for proc in reversed(cluster.procs):
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


def _check_machine() -> None:
    missing = [t for t in ("munged", "slurmctld", "slurmd", "sbatch") if shutil.which(t) is None]
    if missing:
        raise RuntimeError(f"SLURM test cluster: {', '.join(missing)} not installed; run .ci/run or `apt-get install "
                           "-y --no-install-recommends slurmctld slurmd slurm-client munge`")
    if os.geteuid() != 0:
        raise RuntimeError("SLURM test cluster: needs root (slurmd, munged as user munge, node names in /etc/hosts)")


@contextlib.contextmanager
def start_cluster() -> Iterator[SlurmCluster]:
    _check_machine()
    root = Path(tempfile.mkdtemp(prefix="slurm-test-"))
    os.chmod(root, 0o755)  # munged refuses a socket folder reachable through a group/other-writable path
    for sub in ("state", "spool", "log"):
        (root / sub).mkdir()
    ctld_port, *node_ports = _free_ports(3)
    conf = root / "slurm.conf"
    conf.write_text(_slurm_conf(root, ctld_port, node_ports))
    # jobs must not inherit this process's launcher variables (a test may hold a process group of its own)
    env = {k: v for k, v in os.environ.items() if k not in LAUNCHER_VARIABLES and not k.startswith("SLURM_")}
    # a CPU-only site (slurm/site.sh): GPU jobs ask for no GPU (SBATCH_GPUS_PER_NODE beats their #SBATCH line)
    cpu_site = {"SITE_GPUS_PER_NODE": "0", "SBATCH_GPUS_PER_NODE": "0"}
    cluster = SlurmCluster(root, {**env, "SLURM_CONF": str(conf), **cpu_site})
    _add_hosts()
    logs = open(root / "log" / "daemons.out", "w")
    try:
        def spawn(cmd: list[str], user: str | None = None) -> None:
            cluster.procs.append(subprocess.Popen(cmd, stdout=logs, stderr=subprocess.STDOUT, env=cluster.env,
                                                  user=user, group=user, extra_groups=[] if user else None))

        spawn(_start_munge(root), user="munge")
        _wait_for("munged", lambda: (root / "munge" / "munge.socket").exists(), cluster.procs, root)
        spawn(["/usr/sbin/slurmctld", "-D", "-i", "-f", str(conf)])
        _wait_for("slurmctld", lambda: cluster.run("sinfo", check=False).returncode == 0, cluster.procs, root)
        for node in NODES:
            spawn(["/usr/sbin/slurmd", "-D", "-f", str(conf), "-N", node])

        def idle() -> bool:
            states = cluster.run("sinfo", "-h", "-N", "-o", "%N %t", check=False).stdout.split("\n")
            return sum(s.split()[1:] == ["idle"] for s in states if s.strip()) == len(NODES)

        _wait_for("nodes idle", idle, cluster.procs, root)
        yield cluster
    finally:
        _stop(cluster)
        logs.close()
        shutil.rmtree(root, ignore_errors=True)


@pytest.fixture(scope="session")
def slurm_cluster() -> Iterator[SlurmCluster]:
    with start_cluster() as cluster:
        yield cluster
