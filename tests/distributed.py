"""Run a function in N real processes (CPU, one thread each) with torchrun's variables set.

`run_distributed(fn, 2, x)` calls `fn(rank, world_size, x)` in 2 new processes whose environment holds
RANK / WORLD_SIZE / LOCAL_RANK / MASTER_ADDR / MASTER_PORT (a free port), so `init_distributed` (or a plain
`dist.init_process_group("gloo")`) joins them. Returns the per-rank return values (picklable), in rank
order. A failing rank's traceback is raised in the test process and the other ranks are terminated, so a
rank stuck in a collective waiting for a dead peer cannot hang the suite.

The processes are forked from one forkserver per test session that has imported torch, DeepSpeed,
megatron-core and the project once (PRELOAD): a spawned rank spent ~13 s of CPU importing them, most of a small
test's cost on CI's 2 cores. The server has run nothing else, so every rank starts as clean as a spawned one;
it takes the test process's environment and working directory as they are at the call.
"""
from __future__ import annotations

import itertools
import os
import pickle
import queue
import resource
import signal
import socket
import traceback
from typing import Any, Callable

import torch
import torch.multiprocessing as mp

_PORTS = itertools.count(os.getpid())  # two pytest sessions side by side start at different ports
_BELOW_EPHEMERAL = range(30000, 32768)  # Linux's ephemeral ports are 32768-60999; SLURM jobs' 20000-29999 (slurm/job.sh)


def free_port() -> int:
    """A port for a job's rendezvous, free now and below the kernel's ephemeral range: a port the kernel handed out
    for a probe (bind to port 0) can be handed out again before the job binds it, to another process's outgoing
    connection or probe; once, beside a full suite, a rank 1 waited in TCPStore for good after its rank 0 could not
    bind. Each pytest-xdist worker takes its own band, so two tests running side by side never pick the same one."""
    worker = int(os.environ.get("PYTEST_XDIST_WORKER", "gw0")[2:])
    workers = max(int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1")), worker + 1)
    band = _BELOW_EPHEMERAL[worker * len(_BELOW_EPHEMERAL) // workers:(worker + 1) * len(_BELOW_EPHEMERAL) // workers]
    for _ in range(len(band)):
        port = band[next(_PORTS) % len(band)]
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:  # in use, or in TIME_WAIT from a job that just ended
                continue
            return port
    raise RuntimeError(f"no free port in {band}")


PRELOAD = ["torch", "deepspeed", "megatron.core", "pretrain.train", "pretrain.finetune", "pretrain.transfer.exporting",
           "tests.distributed"]


def _worker(fn: Callable, rank: int, world_size: int, port: int, results, env: dict, cwd: str, args,
            kwargs) -> None:
    os.chdir(cwd)
    os.environ.clear()
    os.environ.update(env)
    os.environ.update(
        RANK=str(rank),
        WORLD_SIZE=str(world_size),
        LOCAL_RANK=str(rank),
        LOCAL_WORLD_SIZE=str(world_size),
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        OMP_NUM_THREADS="1",
    )
    torch.set_num_threads(1)
    try:
        # plain pickle bytes: torch's queue would pass tensors as shared-memory handles that die with this process
        results.put((rank, True, pickle.dumps(fn(rank, world_size, *args, **kwargs))))
    except BaseException:  # report everything, including SystemExit, to the test process
        results.put((rank, False, traceback.format_exc()))
    finally:
        from pretrain.distributed.parallel import destroy_distributed

        destroy_distributed()


def run_distributed(fn: Callable, world_size: int, *args: Any, **kwargs: Any) -> list[Any]:
    """fn(rank, world_size, *args, **kwargs) in `world_size` gloo-ready processes; per-rank results."""
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(PRELOAD)  # read when the server starts, at the session's first call
    results = ctx.Queue()
    port = free_port()
    env, cwd = dict(os.environ), os.getcwd()
    procs = [
        ctx.Process(target=_worker, args=(fn, rank, world_size, port, results, env, cwd, args, kwargs),
                    daemon=True)
        for rank in range(world_size)
    ]
    for p in procs:
        p.start()
    outputs: dict[int, Any] = {}
    try:
        while len(outputs) < world_size:
            try:
                rank, ok, value = results.get(timeout=1.0)
            except queue.Empty:
                dead = [i for i, p in enumerate(procs) if p.exitcode not in (None, 0) and i not in outputs]
                if dead:
                    raise RuntimeError(f"rank {dead[0]} died with exit code {procs[dead[0]].exitcode}")
                continue
            if not ok:
                raise RuntimeError(f"rank {rank} of {world_size} failed:\n{value}")
            outputs[rank] = pickle.loads(value)
    finally:
        for p in procs:
            if len(outputs) < world_size and p.is_alive():
                p.terminate()
            p.join()
    return [outputs[r] for r in range(world_size)]


def disk_full() -> None:
    """A `preexec_fn` for a process whose disk is full: every file it writes stops at 1 MB, the write failing
    with EFBIG (checkpoint shards are ~2 MB, the tiny model's weights 1.6 MB)."""
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # else the over-limit write kills the process
    resource.setrlimit(resource.RLIMIT_FSIZE, (1_000_000, 1_000_000))


def _launched(code: str, argv: list[str], env: dict, cwd: str | None, stderr_path: str,
              preexec_fn: Callable[[], None] | None) -> None:
    """One process of launch_like_srun, forked from the preloaded server: `python -c code argv` as the interpreter
    runs it, in its own session, stderr to `stderr_path`; it exits with SystemExit's code (1 and the traceback on an
    exception), after the non-daemon threads and atexit handlers, as the interpreter does."""
    import atexit
    import sys
    import threading

    os.setsid()
    if preexec_fn is not None:
        preexec_fn()
    fd = os.open(stderr_path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    os.dup2(fd, 2)
    os.close(fd)
    if cwd is not None:
        os.chdir(cwd)
    os.environ.clear()
    os.environ.update(env)
    torch.set_num_threads(1)
    mp.set_start_method(None, force=True)  # the interpreter's default (fork), not the server's: a loader worker's
    # parent must be its rank (the loader's workers end themselves when their parent is another process)
    sys.argv = ["-c", *argv]
    sys.path.insert(0, "")
    try:
        exec(compile(code, "<string>", "exec"), {"__name__": "__main__"})
        status = 0
    except SystemExit as stop:  # sys.exit("message"): the message on stderr, exit 1
        if stop.code is not None and not isinstance(stop.code, int):
            print(stop.code, file=sys.stderr)
        status = stop.code if isinstance(stop.code, int) else 0 if stop.code is None else 1
    except BaseException:
        traceback.print_exc()
        status = 1
    threading._shutdown()  # what the interpreter does at exit: wait for the non-daemon threads, then atexit
    atexit._run_exitfuncs()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(status)


def launch_like_srun(world_size: int, code: str, argv: list[str], *, cwd: str | os.PathLike | None = None,
                     preexec_fn: Callable[[], None] | None = None, hang_s: float = 900.0,
                     fresh: bool = False) -> list[tuple[int, str]]:
    """`world_size` processes of `python -c code argv`, each with the launcher's variables as srun/torchrun set
    them: [(exit code, stderr)] in rank order (a negative code: killed by that signal).

    Each process is forked from the session's preloaded server (as run_distributed's ranks are) and runs `code` as
    the interpreter would, in its own session: the job as srun runs it, less each rank's ~12 s of CPU of start-up
    imports. fresh=True starts new interpreters instead, for what happens during start-up. `preexec_fn` runs in
    each process first (a module-level function: it travels by name). `hang_s` only tells a hang from a slow run:
    a job whose processes have not all ended by then is killed and the test fails saying so (it is no performance
    limit; the runs here take seconds).
    """
    import subprocess
    import sys
    import tempfile
    import time

    port = free_port()
    envs = [{**os.environ, "RANK": str(r), "WORLD_SIZE": str(world_size), "LOCAL_RANK": str(r),
             "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "OMP_NUM_THREADS": "1"} for r in range(world_size)]
    if fresh:
        procs = [subprocess.Popen([sys.executable, "-c", code, *argv], cwd=cwd, start_new_session=True, text=True,
                                  stderr=subprocess.PIPE, preexec_fn=preexec_fn, env=env) for env in envs]
        results = []
        try:
            for p in procs:
                _, err = p.communicate(timeout=hang_s)
                results.append((p.returncode, err))
        except subprocess.TimeoutExpired:
            for p in procs:
                os.killpg(p.pid, signal.SIGKILL)
            raise AssertionError(f"the job hung: not every process ended within {hang_s:.0f} s") from None
        return results
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(PRELOAD)
    with tempfile.TemporaryDirectory() as tmp:
        errs = [os.path.join(tmp, f"stderr.{r}") for r in range(world_size)]
        procs = [ctx.Process(target=_launched, args=(code, list(argv), env, str(cwd) if cwd else None, err, preexec_fn))
                 for env, err in zip(envs, errs)]
        for p in procs:
            p.start()
        deadline = time.monotonic() + hang_s
        for p in procs:
            p.join(max(0.0, deadline - time.monotonic()))
        if any(p.exitcode is None for p in procs):
            for p in procs:
                if p.exitcode is None:
                    os.killpg(p.pid, signal.SIGKILL)
                p.join()
            raise AssertionError(f"the job hung: not every process ended within {hang_s:.0f} s")
        return [(p.exitcode, open(err).read()) for p, err in zip(procs, errs)]
