"""Faults as they happen, on real 2-process jobs launched like srun/torchrun, with a DataLoader worker per rank:
every way a rank can end ends every process of the job, non-zero, with the first error shown once (a traceback
for a bug, one line for a user mistake, one line on the ranks that only lost their peer).

`launch_like_srun` fails a test whose job does not end (a hang) instead of waiting forever."""
from __future__ import annotations

import fcntl
import json
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from launch import run as launch_run
from pretrain.data.loader import build_train_loader
from pretrain.data.stream import epoch_shards
from pretrain.runtime.faults import EXIT_FAILED, EXIT_PREEMPTED, EXIT_USAGE
from tests.distributed import free_port, launch_like_srun, run_distributed
from tests.test_loader import cut_shards
from tests.test_metrics import read_metrics
from tests.test_train import COMMON, REPO, TINY, TRAIN, _train_each, data_overrides, losses

PEER_LINE = "another rank failed first"
# past the hang guards (launch_like_srun's, HANG_S): a collective left waiting for a peer fails the test as a hang
NO_TIMEOUT = "parallel.timeout_s=3600"

_AFTER_TWO_STEPS = """
import multiprocessing, os, signal, sys
from pretrain.runtime import loop
original, count = loop.train_step, [0]
def train_step(*args, **kwargs):
    result = original(*args, **kwargs)
    count[0] += 1
    if count[0] == 2 and os.environ["RANK"] == WHICH_RANK:
        FAULT
    return result
loop.train_step = train_step
from pretrain.train import main
sys.exit(main())
"""


def _code(rank: int, fault: str) -> str:
    return _AFTER_TWO_STEPS.replace("WHICH_RANK", repr(str(rank))).replace("FAULT", fault)


def _argv(run_dir: Path, shards, *extra: str) -> list[str]:
    return ["--config", TINY, f"run.dir={run_dir}", *COMMON, *data_overrides(shards, workers=1),
            "parallel.timeout_s=30", *extra]


def test_a_killed_rank_ends_the_job(shards, tmp_path):
    # a node lost mid-run: the survivor's next collective fails (closed connection or the timeout), it says so
    # in one line and exits 1; its loader worker does not keep it alive
    results = launch_like_srun(2, _code(1, "os.kill(os.getpid(), signal.SIGKILL)"), _argv(tmp_path, shards), cwd=REPO)
    assert [code for code, _ in results] == [EXIT_FAILED, -signal.SIGKILL]
    assert PEER_LINE in results[0][1] and "Traceback" not in results[0][1]
    assert not (tmp_path / "checkpoints" / "latest").exists()


def test_an_error_on_one_rank_ends_every_rank_and_shows_once(shards, tmp_path):
    results = launch_like_srun(2, _code(1, "raise RuntimeError('injected fault')"), _argv(tmp_path, shards), cwd=REPO)
    assert [code for code, _ in results] == [EXIT_FAILED, EXIT_FAILED]
    assert results[1][1].count("Traceback") == 1 and "RuntimeError: injected fault" in results[1][1]
    assert PEER_LINE in results[0][1] and "injected fault" not in results[0][1]


def test_a_killed_loader_worker_ends_the_job(shards, tmp_path):
    # a run that goes on until its data runs out: the worker's prefetched items can hold all of a short run's
    # batches (then the death went unseen and the job ended 0, once, beside a full suite)
    kill_worker = "os.kill(multiprocessing.active_children()[0].pid, signal.SIGKILL)"
    results = launch_like_srun(2, _code(0, kill_worker), _argv(tmp_path, shards, "train.steps=1000000",
                                                                 "checkpoint.every=0", "eval.every=0"), cwd=REPO)
    assert [code for code, _ in results] == [EXIT_FAILED, EXIT_FAILED]
    assert "DataLoader worker" in results[0][1] and PEER_LINE in results[1][1]


# rank 1 stops itself (SIGSTOP: a stalled node) and is continued once rank 0, the lock's holder, is gone
_STALL = ("import json, subprocess, time; "
          "run_dir = next(a.split('=', 1)[1] for a in sys.argv if a.startswith('run.dir=')); "
          "holder = json.loads(open(os.path.join(run_dir, 'lock')).read())['pid']; "
          "subprocess.Popen(['sh', '-c', f'while kill -0 {holder} 2>/dev/null; do sleep 0.2; done; "
          "kill -CONT {os.getpid()}']); "
          "os.kill(os.getpid(), signal.SIGSTOP)")


def test_a_stalled_rank_is_named_as_a_timeout(shards, tmp_path):
    results = launch_like_srun(2, _code(1, _STALL), _argv(tmp_path, shards, "parallel.timeout_s=20"), cwd=REPO)
    assert results[0][0] == EXIT_FAILED
    line = [l for l in results[0][1].splitlines() if "rank 0:" in l]
    assert len(line) == 1 and "a collective timed out after 20 s (parallel.timeout_s): another rank never arrived" \
        in line[0], results[0][1][-2000:]
    assert PEER_LINE not in results[0][1] and "Traceback" not in results[0][1]


def test_no_readable_data_is_one_line_on_every_rank(shards, tmp_path):
    damaged = tmp_path / "damaged"
    shutil.copytree(shards.train, damaged)
    for shard in damaged.glob("*.tar"):
        shard.write_bytes(os.urandom(shard.stat().st_size))  # garbage of the same size: no pack survives
    results = launch_like_srun(2, "import sys; from pretrain.train import main; sys.exit(main())",
                               _argv(tmp_path / "run", shards, f"data.train={damaged}"), cwd=REPO)
    assert [code for code, _ in results] == [EXIT_USAGE, EXIT_USAGE]
    for _, err in results:
        line = [l for l in err.splitlines() if "error:" in l]
        assert len(line) == 1 and "error: no readable data in any of the 8 shards" in line[0], err[-2000:]
        assert "Traceback" not in err


def _cut_data(shards, cut: Path, *extra: str) -> list[str]:
    return [f"data.train={cut}", f"data.valid={shards.valid}", f"data.tokenizer={shards.tokenizer}", *extra]


def test_damaged_shards_are_skipped_and_the_run_keeps_its_one_data_order(shards, tmp_path):
    # the case: 8 shards (so 8 streams), every other one cut to a quarter: each is the only shard of its
    # stream in some epoch, which stopped the run ("data stream 0 has no readable data"). A 2-rank job with a
    # loader worker per rank trains to the end, naming the shards and the share lost; its step 4 resumed on one
    # rank (other micro batch, no worker) trains on the same examples: the same losses
    cut = cut_shards(shards, tmp_path / "cut", [1, 3, 5, 7])
    data = _cut_data(shards, cut, "data.max_damaged_share=0.6")
    run = tmp_path / "dp2"
    results = launch_like_srun(2, "import sys; from pretrain.train import main; sys.exit(main())",
                               ["--config", TINY, f"run.dir={run}", *COMMON, *data, "data.workers=1"], cwd=REPO)
    assert [code for code, _ in results] == [0, 0], results[0][1][-3000:] + results[1][1][-3000:]
    warned = "".join(err for _, err in results)
    assert "damaged shards skipped: " in warned and "of data.train's documents lost (data.max_damaged_share 0.6)" \
        in warned and "Traceback" not in warned
    assert [r["step"] for r in read_metrics(run)] == list(range(1, 9))
    resumed = tmp_path / "dp1"
    assert run_distributed(_train_each, 1, [(str(resumed), [*COMMON, *data, "data.workers=0", "train.micro_batch=2",
                                                            f"checkpoint.resume={run}/checkpoints/step_4"],
                                             None)]) == [[0]]
    torch.testing.assert_close(losses(resumed), losses(run)[4:], rtol=1e-5, atol=0)


# the one line of a refusal of two cut shards of the fixture's eight (each ~1/8 of the documents)
DAMAGE_REFUSED = (r"pretrain\.train: error: damaged shards lost 2\d\.\d% of data\.train, more than "
                  r"data\.max_damaged_share \(0\.2\): .*/shard-\d+\.tar \(0 of \d+ documents read\), "
                  r".*/shard-\d+\.tar \(0 of \d+ documents read\); repair them or prepare them again, or raise "
                  r"data\.max_damaged_share to train on the rest")


def _cut_for_rank(shards, folder: Path, rank: int) -> Path:
    """The fixture's shards with the epoch-0 shards of two of DP rank `rank`'s streams (of 2 DP ranks) cut: that
    rank alone finds 25% of the documents lost, more than data.max_damaged_share's 0.2, at its first batch."""
    loader = build_train_loader(shards.config(), seed=1234, dp_rank=0, dp_size=1, micro_batch=4)  # tiny's seed
    spec = loader.sources.specs[0]
    return cut_shards(shards, folder, [int(Path(epoch_shards(spec, 0, s)[0]).stem[6:]) for s in (rank, rank + 2)])


def test_a_usage_error_found_by_one_rank_ends_every_rank_with_its_line(shards, tmp_path):
    # rank 0 alone refuses the damage (srun's launch: rank 0 serves the job's store): rank 1, whose collective
    # fails, ends with the same line and exit 2, not "a collective failed" and exit 1; and at once, not after the
    # process-group timeout (set past the hang guard: the ranks waited for it while rank 0's connections stayed open)
    cut = _cut_for_rank(shards, tmp_path / "cut", rank=0)
    results = launch_like_srun(2, "import sys; from pretrain.train import main; sys.exit(main())",
                               _argv(tmp_path / "run", shards, *_cut_data(shards, cut), NO_TIMEOUT), cwd=REPO)
    assert [code for code, _ in results] == [EXIT_USAGE, EXIT_USAGE], results[1][1][-3000:]
    lines = [[line for line in err.splitlines() if line.startswith("pretrain.train: ")] for _, err in results]
    assert lines[0] == lines[1] and len(lines[0]) == 1, lines
    assert re.fullmatch(DAMAGE_REFUSED, lines[0][0]), lines[0][0]
    assert not any("Traceback" in err for _, err in results)


def test_a_second_job_on_the_same_run_dir_is_refused(shards, tmp_path):
    # the first job holds run.dir's lock while it sleeps after its second step
    sleeper = _code(0, "time.sleep(3600)").replace("import multiprocessing", "import multiprocessing, time")
    holder = subprocess.Popen([sys.executable, "-c", sleeper, *_argv(tmp_path, shards, "data.workers=0")], cwd=REPO,
                              env={**os.environ, "RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "0",
                                   "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port()),
                                   "OMP_NUM_THREADS": "1"}, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 900  # a hang guard only: the first job needs a few seconds
        while not (tmp_path / "metrics.jsonl").exists() and holder.poll() is None and time.monotonic() < deadline:
            time.sleep(0.5)
        assert holder.poll() is None, holder.stderr.read()
        # a 2-rank job: every rank refuses in one line, not only rank 0 (which holds the lock of a job)
        results = launch_like_srun(2, "import sys; from pretrain.train import main; sys.exit(main())",
                                   _argv(tmp_path, shards), cwd=REPO)
        assert [code for code, _ in results] == [EXIT_USAGE] * 2
        for _, err in results:
            line = [l for l in err.splitlines() if "error:" in l]
            assert len(line) == 1 and f"is in use by another job (pid {holder.pid}" in line[0], err[-2000:]
    finally:
        holder.kill()
        holder.wait()
    # the holder is gone (killed): its lock is stale and the next job takes it over, saying so
    results = launch_like_srun(1, "import sys; from pretrain.train import main; sys.exit(main())",
                               _argv(tmp_path, shards, "data.workers=0", "train.steps=3"), cwd=REPO)
    assert results[0][0] == 0, results[0][1][-2000:]
    assert f"taking over the stale lock of pid {holder.pid}" in results[0][1]


# ----------------------------------------------------------------------------------------------------------------
# Storage that refuses writes: a real filesystem that fills up or turns read-only under a running job
# ----------------------------------------------------------------------------------------------------------------
@pytest.fixture
def small_disk(tmp_path):
    """A 64 MB ext4 filesystem of its own (a loop device; mounting needs root), mounted errors=remount-ro so that
    an error makes the kernel turn it read-only as it does a failing disk: (mount point, the file that raises such
    an error, /sys/fs/ext4/DEV/trigger_fs_error). No blocks reserved for root: the tests run as root."""
    image, disk = tmp_path / "disk.img", tmp_path / "disk"
    disk.mkdir()
    with image.open("wb") as f:
        f.truncate(64 << 20)
    subprocess.run(["mkfs.ext4", "-q", "-F", "-m", "0", str(image)], check=True)
    mounted = subprocess.run(["mount", "-o", "loop,errors=remount-ro", str(image), str(disk)], capture_output=True,
                             text=True)
    if mounted.returncode:
        pytest.skip(f"cannot mount a loop device here (root and /dev/loop* needed): {mounted.stderr.strip()}")
    try:
        device = subprocess.run(["findmnt", "-no", "SOURCE", str(disk)], capture_output=True, text=True,
                                check=True).stdout.strip()
        yield disk, Path("/sys/fs/ext4") / Path(device).name / "trigger_fs_error"
    finally:
        subprocess.run(["umount", "--lazy", str(disk)], check=True)  # lazy: a lingering process holds no test up


# rank 0 makes the storage fail just before the job's second save (step 8 of 8, checkpoint.every=4): nothing of
# the step's checkpoint is written yet; the other rank waits for it at the save's first barrier
_BEFORE_SECOND_SAVE = """
import os, sys
from pretrain.runtime import checkpoint
original, saves = checkpoint.CheckpointManager.save, [0]
def save(self, step, **kwargs):
    saves[0] += 1
    if saves[0] == 2 and os.environ["RANK"] == "0":
        FAULT
    return original(self, step, **kwargs)
checkpoint.CheckpointManager.save = save
from pretrain.train import main
sys.exit(main())
"""
# fill the filesystem: big writes, then page-sized ones, until none succeeds right after an fsync (writeback hands
# back blocks ext4 had set aside for data still in the page cache; a folder made from those let one rank go on)
_FILL = """f = open(os.path.join(DISK, "filler"), "wb", buffering=0)
        full = False
        while not full:
            os.fsync(f.fileno())
            full = True
            for size in (1 << 20, 4096):
                try:
                    while True:
                        f.write(bytes(size))
                        full = False
                except OSError:
                    pass
        f.close()"""


def _storage_lines(results) -> list[str]:
    """Each rank's one error line; no traceback anywhere."""
    lines = []
    for _, err in results:
        errors = [line for line in err.splitlines() if "error:" in line]
        assert len(errors) == 1 and "Traceback" not in err, err[-3000:]
        lines.append(errors[0])
    return lines


def test_a_full_disk_during_a_save_is_one_line_per_rank_naming_enospc(shards, small_disk):
    disk, _ = small_disk
    run_dir = disk / "run"
    argv = _argv(run_dir, shards)
    fill = _FILL.replace("DISK", repr(str(disk)))
    results = launch_like_srun(2, _BEFORE_SECOND_SAVE.replace("FAULT", fill), argv, cwd=REPO)
    assert [code for code, _ in results] == [EXIT_FAILED] * 2
    for rank, line in enumerate(_storage_lines(results)):
        # its own mkdir's error, or the other rank's: every rank learns whether the folder was made everywhere
        assert re.match(rf"pretrain.train: error: rank {rank}: checkpoint step_8 not saved: (rank \d could not write "
                        rf"it: )?no space left on device \(ENOSPC\): {re.escape(str(run_dir))}/checkpoints/step_8",
                        line), line
        assert line.endswith("; step_4 stays the newest checkpoint; once there is space again (or with run.dir "
                             "moved), run the same command again"), line
    assert (run_dir / "checkpoints" / "latest").read_text() == "step_4\n"
    # room made, the same command continues from step 4 to the end
    (disk / "filler").unlink()
    results = launch_like_srun(2, TRAIN, argv, cwd=REPO)
    assert [code for code, _ in results] == [0, 0], results[0][1][-3000:]
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == list(range(1, 9))


def test_a_filesystem_turning_read_only_is_reported_by_its_first_error(shards, small_disk):
    # ext4's errors=remount-ro after an error, as a failing disk does: before, each rank printed four chained
    # OSErrors, the last from the run lock's release, hiding the first
    disk, trigger = small_disk
    run_dir = disk / "run"
    fault = f"open({str(trigger)!r}, 'w').write('1')"
    results = launch_like_srun(2, _BEFORE_SECOND_SAVE.replace("FAULT", fault), _argv(run_dir, shards), cwd=REPO)
    assert [code for code, _ in results] == [EXIT_FAILED] * 2
    for rank, line in enumerate(_storage_lines(results)):
        assert line.startswith(f"pretrain.train: error: rank {rank}: checkpoint step_8 not saved: read-only file "
                               f"system (EROFS): {run_dir / 'checkpoints' / 'step_8'}"), line
    assert (run_dir / "checkpoints" / "latest").read_text() == "step_4\n"


def _timeout_of(rank: int, world: int, tensor: int, flag: str) -> str:
    """Rank 0 waits in a collective of megatron's group that rank 1 never joins; rank 1 waits for rank 0's
    verdict. With parallel.timeout_s=8 rank 0 fails within seconds (both ranks are forked at once, so set-up never
    comes near it); with megatron's default it would wait 30 min (and rank 1's 300 s guard would report it)."""
    import torch
    import torch.distributed as dist
    from megatron.core import parallel_state

    from pretrain.core.config import ParallelConfig
    from pretrain.distributed.parallel import init_distributed

    init_distributed(ParallelConfig(tensor=tensor, timeout_s=8), seed=0)
    group = parallel_state.get_tensor_model_parallel_group() if tensor == 2 else \
        parallel_state.get_data_parallel_group()
    if rank == 0:
        try:
            dist.all_reduce(torch.ones(1), group=group)
            verdict = "completed"
        except RuntimeError as e:
            verdict = "timed out" if "imed out" in str(e) else f"failed: {e}"
        Path(flag).write_text(verdict)
        return verdict
    deadline = time.monotonic() + 300
    while not Path(flag).exists() and time.monotonic() < deadline:
        time.sleep(0.2)
    return Path(flag).read_text() if Path(flag).exists() else "rank 0 still waiting after 300 s"


@pytest.mark.parametrize("tensor", [1, 2], ids=["dp-group", "tp-group"])
def test_model_parallel_groups_get_the_configured_timeout(tmp_path, tensor):
    assert run_distributed(_timeout_of, 2, tensor, str(tmp_path / "flag")) == ["timed out"] * 2


# ----------------------------------------------------------------------------------------------------------------
# Signals to the launcher (python -m launch.run, torchrun's agent): what a scheduler, a terminal or the OOM killer do
# ----------------------------------------------------------------------------------------------------------------
HANG_S = 900  # a hang guard only: each job below needs seconds


def _launch(run_dir: Path, shards, *extra: str) -> subprocess.Popen:
    """The documented launch of a 2-rank job that trains until it is stopped, in a session of its own (a
    terminal's foreground group); its stderr goes to run_dir/../stderr."""
    argv = _argv(run_dir, shards, "train.steps=1000000", "eval.every=0", "checkpoint.every=0", *extra)
    return subprocess.Popen([sys.executable, "-m", "launch.run", "--standalone", "--nproc-per-node", "2",
                             "-m", "pretrain.train", *argv], cwd=REPO, start_new_session=True,
                            stderr=(run_dir.parent / "stderr").open("w"), env={**os.environ, "OMP_NUM_THREADS": "1"})


def _wait_for(condition, what: str) -> None:
    deadline = time.monotonic() + HANG_S
    while not condition():
        assert time.monotonic() < deadline, f"hung: {what} not within {HANG_S} s"
        time.sleep(0.2)


def _training(run_dir: Path, launcher: subprocess.Popen) -> bool:
    """The loop runs: a step's record is in metrics.jsonl (the file itself is made during setup)."""
    assert launcher.poll() is None, (run_dir.parent / "stderr").read_text()[-3000:]
    metrics = run_dir / "metrics.jsonl"
    return metrics.exists() and '"loss"' in metrics.read_text()


def _last_step(run_dir: Path) -> int:
    """The last step with a line in metrics.jsonl (0: none)."""
    metrics = run_dir / "metrics.jsonl"
    return max(map(int, re.findall(r'"step": (\d+)', metrics.read_text() if metrics.exists() else "")), default=0)


def _started(run_dir: Path, launcher: subprocess.Popen, line: str) -> bool:
    """The job printed `line` (a start-up line)."""
    assert launcher.poll() is None, (run_dir.parent / "stderr").read_text()[-3000:]
    return line in (run_dir.parent / "stderr").read_text()


def _last_line(run_dir: Path) -> str:
    return [line for line in (run_dir.parent / "stderr").read_text().splitlines() if line.strip()][-1]


def _catches(pid: int, sig: int) -> bool:
    """Whether process `pid` has a handler for `sig` installed (its SigCgt mask in /proc)."""
    try:
        mask = next(line for line in Path(f"/proc/{pid}/status").read_text().splitlines() if line.startswith("SigCgt:"))
    except (OSError, StopIteration):
        return False
    return bool(int(mask.split()[1], 16) >> (sig - 1) & 1)


def _ranks_of(launcher: subprocess.Popen) -> list[int]:
    """The launcher's ranks that have started their own program: a child between the agent's fork and its exec
    is a copy of the launcher, whose handlers it shows until exec resets them (a signal then killed it)."""
    own = _cmdline(launcher.pid)
    return [pid for pid, (_, parent) in _processes().items() if parent == launcher.pid and _cmdline(pid) != own]


def _cmdline(pid: int) -> bytes:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return b""


def _preempted_everywhere(run_dir: Path, ranks: int = 2) -> str:
    """The job's stderr, once checked: no traceback, and each rank's last line says it exits 75."""
    err = (run_dir.parent / "stderr").read_text()
    assert "Traceback" not in err and "SignalException" not in err, err[-3000:]
    for rank in range(ranks):
        last = [line for line in err.splitlines() if f"[rank {rank}]" in line][-1]
        assert "preempted by " in last and last.endswith(f"exiting {EXIT_PREEMPTED}"), err[-3000:]
    return err


def test_signals_to_the_launched_job_exit_preempted_from_start_up_to_exit(shards, tmp_path):
    # scancel / a scheduler signal the launcher (SIGTERM, or SIGUSR1 ahead of the time limit); Ctrl-C in a terminal
    # signals every process of the foreground group; at any point of the job, each start of the same command
    # exits 75 (a requeue wrapper requeues it) and the next one goes on
    run_dir = tmp_path / "run"
    # 1. before the launcher started the ranks (it imports torch, then the rendezvous): nothing to save
    launcher = _launch(run_dir, shards)
    _wait_for(lambda: launcher.poll() is not None or _catches(launcher.pid, signal.SIGTERM), "the launcher's handler")
    assert not _ranks_of(launcher)
    launcher.send_signal(signal.SIGTERM)
    assert launcher.wait(timeout=HANG_S) == EXIT_PREEMPTED, (tmp_path / "stderr").read_text()[-3000:]
    assert _last_line(run_dir) == f"launch.run: preempted by SIGTERM before the ranks started: nothing to save, " \
                                  f"exiting {EXIT_PREEMPTED}"
    assert not run_dir.exists()
    # 2. while the ranks import torch, DeepSpeed and megatron (seconds): each has installed its handler first thing
    launcher = _launch(run_dir, shards)

    def importing() -> bool:
        ranks = _ranks_of(launcher)
        return launcher.poll() is not None or len(ranks) == 2 and all(_catches(pid, signal.SIGUSR1) for pid in ranks)

    _wait_for(importing, "the ranks' handlers")
    launcher.send_signal(signal.SIGUSR1)
    assert launcher.wait(timeout=HANG_S) == EXIT_PREEMPTED, (tmp_path / "stderr").read_text()[-3000:]
    assert "preempted by SIGUSR1 during start-up: nothing to save" in _preempted_everywhere(run_dir)
    assert not (run_dir / "checkpoints").exists()
    # 3. Ctrl-C once the engine is built (the data set-up follows): before the first step, or with it saved
    launcher = _launch(run_dir, shards)
    _wait_for(lambda: _started(run_dir, launcher, "INFO pretrain.runtime.engine: engine:"), "the engine")
    os.killpg(launcher.pid, signal.SIGINT)
    assert launcher.wait(timeout=HANG_S) == EXIT_PREEMPTED, (tmp_path / "stderr").read_text()[-3000:]
    _preempted_everywhere(run_dir)
    # 4. the next start trains; SIGTERM after a step saves it; signals repeated from "exiting 75" until the launcher
    #    has ended (an impatient scheduler, a second Ctrl-C) change nothing, also while Python finalizes
    before = _last_step(run_dir)  # a line of step 1, if step 3's signal came after the last start-up check
    launcher = _launch(run_dir, shards)
    _wait_for(lambda: _training(run_dir, launcher) and _last_step(run_dir) > before, "a step")
    launcher.send_signal(signal.SIGTERM)
    _wait_for(lambda: "exiting 75" in (tmp_path / "stderr").read_text() or launcher.poll() is not None, "exiting 75")
    repeats = 0
    while launcher.poll() is None:
        os.killpg(launcher.pid, signal.SIGINT) if repeats % 2 else launcher.send_signal(signal.SIGUSR1)
        repeats += 1
        time.sleep(0.1)
    assert (launcher.returncode, repeats > 0) == (EXIT_PREEMPTED, True), (tmp_path / "stderr").read_text()[-3000:]
    assert "checkpoint saved, exiting 75" in _preempted_everywhere(run_dir)
    saved = (run_dir / "checkpoints" / "latest").read_text().strip()
    assert (run_dir / "checkpoints" / saved / "complete.json").is_file()
    # 5. the next start resumes from it; then the OOM killer or a node agent SIGKILLs the launcher, which forwards
    #    nothing: the ranks must not train on as orphans holding the run lock; the kernel's parent-death signal
    #    makes them save and stop
    launcher = _launch(run_dir, shards)
    _wait_for(lambda: _training(run_dir, launcher) and _last_step(run_dir) > int(saved[5:]), "a resumed step")
    ranks = _ranks_of(launcher)  # torchrun's: sessions of their own
    assert len(ranks) == 2
    launcher.kill()
    launcher.wait()
    # zombies do not count: an orphan's new parent may be slow to reap it
    _wait_for(lambda: all(_processes().get(pid, ("Z",))[0] == "Z" for pid in ranks), "the orphaned ranks to end")
    assert _lock_free(run_dir)
    step = (run_dir / "checkpoints" / "latest").read_text().strip()
    assert (run_dir / "checkpoints" / step / "complete.json").is_file() and int(step[5:]) > int(saved[5:])


def test_a_usage_error_is_the_last_line_the_launcher_prints(shards, tmp_path):
    run_dir = tmp_path / "run"
    launcher = _launch(run_dir, shards, "train.exit_after=-1")
    assert launcher.wait(timeout=HANG_S) == EXIT_USAGE
    assert _last_line(run_dir) == "pretrain.train: error: train.exit_after (-1) must be >= 0"


def test_a_usage_error_on_rank_1_only_is_the_last_line_the_launcher_prints(shards, tmp_path):
    # before: rank 0's "a collective failed (...)" was the last line and the launcher exited 1; then, it came after
    # the process-group timeout (rank 0 waited in its collective while rank 1 waited for it to read the line)
    run_dir = tmp_path / "run"
    cut = _cut_for_rank(shards, tmp_path / "cut", rank=1)
    launcher = _launch(run_dir, shards, *_cut_data(shards, cut), NO_TIMEOUT)
    assert launcher.wait(timeout=HANG_S) == EXIT_USAGE, (tmp_path / "stderr").read_text()[-3000:]
    assert re.fullmatch(DAMAGE_REFUSED, _last_line(run_dir)), _last_line(run_dir)
    assert "Traceback" not in (tmp_path / "stderr").read_text()


def test_a_vocabulary_below_the_tokenizer_is_one_line_on_every_rank(shards, tmp_path):
    # with_vocab runs before the job's checks: its ValueError was a traceback on every rank. Every rank raises it
    # at once, so none waits for the others to read it
    results = launch_like_srun(2, "import sys; from pretrain.train import main; sys.exit(main())",
                               _argv(tmp_path / "run", shards, "model.vocab_size=1000"), cwd=REPO)
    assert [code for code, _ in results] == [EXIT_USAGE, EXIT_USAGE]
    for _, err in results:
        assert [line for line in err.splitlines() if line.startswith("pretrain.train: ")] == [
            "pretrain.train: error: model.vocab_size (1000) is smaller than the tokenizer's 1100 ids; set it to 0 "
            "(the tokenizer's) or at least 1100"], err[-3000:]


# rank 1 crashes (NCCL's watchdog ends a rank with std::abort) while rank 0, preempted, saved and exits 75
_CRASH_WHILE_PREEMPTED = """
import os, signal, sys, time
flag = sys.argv[1]
if os.environ["RANK"] == "1":
    open(flag + ".tmp", "w").write(str(os.getpid()))
    os.rename(flag + ".tmp", flag)
    os.abort()
signal.signal(signal.SIGTERM, signal.SIG_IGN)  # the agent's SIGTERM, once rank 1 died: the trainer exits 75 anyway
while not os.path.exists(flag):
    time.sleep(0.05)
stat = f"/proc/{open(flag).read()}/stat"
while os.path.exists(stat) and open(stat).read().rsplit(")", 1)[1].split()[0] != "Z":
    time.sleep(0.05)
sys.exit(75)
"""


def test_a_crashed_rank_is_never_reported_as_preempted(tmp_path):
    assert launch_run.EXIT_PREEMPTED == EXIT_PREEMPTED  # the launcher's copy of the number
    script = tmp_path / "ranks.py"
    script.write_text(_CRASH_WHILE_PREEMPTED)
    out = subprocess.run([sys.executable, "-m", "launch.run", "--standalone", "--nproc-per-node", "2", str(script),
                          str(tmp_path / "pid")], cwd=REPO, capture_output=True, text=True, timeout=HANG_S)
    assert out.returncode == 128 + signal.SIGABRT, out.stderr[-3000:]
    assert out.stderr.strip().splitlines()[-1] == "launch.run: rank 1 was killed by SIGABRT"


# ranks still starting: the interpreter runs, the job's first line (its handler) has not yet
_STARTING_RANKS = """
import os, sys, time
open(os.path.join(sys.argv[1], f"ready.{os.environ['RANK']}"), "w").close()
time.sleep(600)
"""


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGUSR1])
def test_ranks_killed_by_a_preemption_while_starting_exit_preempted(tmp_path, sig):
    # a preemption signal that reaches the ranks before their handlers are installed (the interpreter's start-up,
    # before the job's first line) kills them: the job was preempted all the same, with nothing to save, so 75
    # (requeued), not 143 or 138 (a crash: not requeued); the rank's window is short, so a script stands in for it
    script = tmp_path / "ranks.py"
    script.write_text(_STARTING_RANKS)
    launcher = subprocess.Popen([sys.executable, "-m", "launch.run", "--standalone", "--nproc-per-node", "2",
                                 str(script), str(tmp_path)], cwd=REPO, stderr=subprocess.PIPE, text=True)
    _wait_for(lambda: launcher.poll() is not None or all((tmp_path / f"ready.{r}").exists() for r in (0, 1)),
              "the ranks")
    launcher.send_signal(sig)
    _, err = launcher.communicate(timeout=HANG_S)
    assert launcher.returncode == EXIT_PREEMPTED, err[-3000:]
    assert err.strip().splitlines()[-1] == \
        f"launch.run: preempted by {sig.name} while the ranks started: nothing to save, exiting {EXIT_PREEMPTED}"


# srun's line per ended task (its format: "srun: error: HOSTS: task(s) IDS: strsignal, or exit code") and srun's
# code (128 + the highest signal of any task, above every exit code) -> slurm/job.sh's code, and its crash line
_KILLED = "srun: error: node1: task 0: Killed"  # --kill-on-bad-exit ending the others
_ABORTED = "srun: error: node2: task 1: Aborted (core dumped)"
_CRASH = "pretrain.train: task 1 crashed ({}): not a preemption, not requeued\n"
_USR1 = "srun: error: node[1-2]: tasks 0-1: User defined signal 1"
_STEPS = {
    "preempted, peers killed while exiting": (137, ["srun: error: node2: task 1: Exited with exit code 75", _KILLED],
                                              EXIT_PREEMPTED, ""),
    "every task preempted": (75, ["srun: error: node[1-2]: tasks 0-1: Exited with exit code 75"], EXIT_PREEMPTED, ""),
    "aborted (NCCL's watchdog)": (137, [_ABORTED, _KILLED], 134, _CRASH.format("Aborted (core dumped)")),
    "aborted while another saved": (134, ["srun: error: node1: task 0: Exited with exit code 75", _ABORTED], 134,
                                    _CRASH.format("Aborted (core dumped)")),
    "segfault": (139, ["srun: error: node2: task 1: Segmentation fault", _KILLED], 139,
                 _CRASH.format("Segmentation fault")),
    "an error": (137, ["srun: error: node2: task 1: Exited with exit code 1", _KILLED], EXIT_FAILED, ""),
    "a lost node": (137, ["srun: error: node2: task 1: Killed", _KILLED], 137, ""),
    # job.sh forwarded the time limit's USR1 while the tasks started (no handler yet: its default action kills)
    "USR1 forwarded while the tasks started": (138, [_USR1], EXIT_PREEMPTED, "", "User defined signal 1"),
    "USR1 that job.sh did not forward": (138, [_USR1], 138,
                                         _CRASH.format("User defined signal 1").replace("task 1", "tasks 0-1")),
}


@pytest.mark.parametrize("step", _STEPS)
def test_job_sh_requeues_a_tasks_own_preemption_only(tmp_path, step):
    srun_code, lines, code, line, *forwarded = _STEPS[step]
    (tmp_path / "srun").write_text("".join(f"{line}\n" for line in ["srun: Job step aborted", *lines]))
    out = subprocess.run(["bash", "-c", f"EXIT_PREEMPTED={EXIT_PREEMPTED}; source slurm/step_exit.sh; "
                          f"step_exit_code {srun_code} {tmp_path / 'srun'} pretrain.train {shlex.join(forwarded)}"],
                         cwd=REPO, capture_output=True, text=True, check=True)
    assert (int(out.stdout), out.stderr) == (code, line)


def _processes() -> dict[int, tuple[str, int]]:
    """{pid: (state, parent pid)} of every process."""
    found = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()  # the name in parentheses may hold spaces
        except OSError:
            continue
        found[int(stat.parent.name)] = (fields[0], int(fields[1]))
    return found


def _lock_free(run_dir: Path) -> bool:
    """Neither of the run lock's flocks is held: the run folder's nor its lock file's."""
    for path, flags in ((run_dir, os.O_RDONLY | os.O_DIRECTORY), (run_dir / "lock", os.O_RDWR)):
        fd = os.open(path, flags)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            return False
        finally:
            os.close(fd)
    return True


def test_an_aborted_rank_leaves_no_loader_worker_and_frees_the_run_lock(shards, tmp_path):
    # NCCL's watchdog ends a rank with std::abort (SIGABRT): no `finally`, no stop_child_processes. Rank 0 holds the
    # run lock, which its forked loader worker shares; the worker is stopped first (busy: a slow shard read), so
    # torch's own check for a dead parent, every 5 s between batches, cannot end it (before PR_SET_PDEATHSIG it
    # lived on, holding the lock and rank 0's stderr: the job "hung")
    abort = ("workers = [c.pid for c in multiprocessing.active_children()]; "
             "print('workers', *workers, file=sys.stderr, flush=True); "
             "[os.kill(pid, signal.SIGSTOP) for pid in workers]; os.abort()")
    results = launch_like_srun(2, _code(0, abort), _argv(tmp_path, shards), cwd=REPO)
    assert [code for code, _ in results] == [-signal.SIGABRT, EXIT_FAILED], results[0][1][-2000:]
    workers = [int(pid) for pid in next(l for l in results[0][1].splitlines() if l.startswith("workers")).split()[1:]]
    alive = [pid for pid in workers if _processes().get(pid, ("Z",))[0] != "Z"]
    for pid in alive:  # the old behaviour: end them here, so the test leaves nothing behind
        os.kill(pid, signal.SIGKILL)
    assert workers and not alive
    assert _lock_free(tmp_path)
