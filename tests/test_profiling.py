"""Where the time goes, on real gloo process groups, the tiny config and real text shards: profiler traces on demand
(`profile.*`, pretrain.runtime.profiling) and the slowest rank in every metrics line with the straggler warning
(pretrain.runtime.stragglers). Both runs share one 2-rank group."""
from __future__ import annotations

import json
import logging
import time
from pathlib import Path

import pytest

from tests.test_metrics import read_metrics
from tests.test_train import TINY, data_overrides

SLEEP_S = 1.0  # per micro batch of the slow rank: ~15x a tiny step (0.06 s) on an idle core; named up to 2 s steps


class SlowLoader:
    """A train loader that waits `seconds` before each micro batch (a slow disk or a busy host), otherwise the
    loader it wraps (state, close)."""

    def __init__(self, loader, seconds: float) -> None:
        self.loader, self.seconds = loader, seconds

    def __iter__(self):
        for batch in self.loader:
            time.sleep(self.seconds)
            yield batch

    def __getattr__(self, name):
        return getattr(self.loader, name)


def _train_runs(rank: int, world_size: int, runs: list[tuple[str, list[str], bool]]) -> list[tuple[int, list[str]]]:
    """Each (run_dir, overrides, slow) in turn; `slow`: rank 1's loader is a SlowLoader. Returns per run the exit
    code and the straggler warnings this rank logged."""
    from pretrain import train as train_module
    from pretrain.core.config import Config, load_config

    warnings: list[str] = []

    class Collect(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            warnings.append(record.getMessage())

    logging.getLogger("pretrain.runtime.stragglers").addHandler(Collect(logging.WARNING))
    build, out = train_module.build_train_loader, []
    for run_dir, overrides, slow in runs:
        if slow and rank == 1:
            train_module.build_train_loader = lambda *a, **k: SlowLoader(build(*a, **k), SLEEP_S)
        try:
            code = train_module.train(load_config(Config, TINY, [f"run.dir={run_dir}", *overrides]))
        finally:
            train_module.build_train_loader = build
        out.append((code, list(warnings)))
        warnings.clear()
    return out


@pytest.fixture(scope="module")
def runs(shards, tmp_path_factory) -> dict[str, tuple[Path, list[tuple[int, list[str]]]]]:
    """{"profiled": steps 2-3 of 3 traced on both ranks, a checkpoint at step 3; "plain": the same without
    profile.enabled; "slow": 4 steps with rank 1's loader waiting SLEEP_S per micro batch}: (run dir, per rank
    (exit code, straggler warnings))."""
    from tests.distributed import run_distributed

    root = tmp_path_factory.mktemp("profiling")
    common = [*data_overrides(shards), "log.every=1", "eval.every=0", "checkpoint.every=0"]
    plan = {"profiled": (["train.steps=3", "profile.enabled=true", "profile.start=2", "profile.steps=2"], False),
            "plain": (["train.steps=3"], False),
            "slow": (["train.steps=4"], True)}
    jobs = [(str(root / name), [*common, *overrides], slow) for name, (overrides, slow) in plan.items()]
    per_rank = run_distributed(_train_runs, 2, jobs)
    return {name: (root / name, [ranks[i] for ranks in per_rank]) for i, name in enumerate(plan)}


RANGES = {"data_wait", "forward", "backward", "loss_all_reduce", "optimizer_step", "checkpoint"}


def test_a_profiled_run_writes_a_trace_per_rank(runs):
    """One Chrome/Perfetto trace per rank, JSON with the step's named ranges (the checkpoint's at step 3, inside
    the window), two steps of each; none without profile.enabled."""
    run_dir, ranks = runs["profiled"]
    assert [code for code, _ in ranks] == [0, 0]
    traces = sorted(p.name for p in (run_dir / "profile").iterdir())
    assert traces == ["rank0.pt.trace.json", "rank1.pt.trace.json"]
    for name in traces:
        events = json.loads((run_dir / "profile" / name).read_text())["traceEvents"]
        names = [e.get("name") for e in events if e.get("ph") == "X"]
        assert RANGES <= set(names), RANGES - set(names)
        assert names.count("optimizer_step") == 2 and names.count("checkpoint") == 2  # steps 2 and 3
    plain_dir, plain_ranks = runs["plain"]
    assert [code for code, _ in plain_ranks] == [0, 0] and not (plain_dir / "profile").exists()


def test_every_line_names_the_slowest_rank(runs):
    """Rank 1 waits SLEEP_S for each batch: every line names it, its step time (which the fast rank's wait at the
    gradient reduction is not charged to) beats rank 0's, and the loader wait shows it; without a slow rank the
    keys are there too."""
    run_dir, ranks = runs["slow"]
    assert [code for code, _ in ranks] == [0, 0]
    lines = read_metrics(run_dir)
    assert [r["step"] for r in lines] == [1, 2, 3, 4]
    for r in lines:
        assert r["slowest_rank"] == 1, r
        assert r["data_wait_s"] >= SLEEP_S and r["step_time_max_s"] >= SLEEP_S, r
        assert r["step_time_max_s"] - r["step_time_min_s"] >= 0.5 * SLEEP_S, r
    for r in read_metrics(runs["plain"][0]):
        assert {"step_time_max_s", "step_time_min_s", "slowest_rank", "data_wait_s"} <= set(r), r
        assert r["step_time_min_s"] <= r["step_time_max_s"] and r["data_wait_s"] >= 0


def test_a_straggler_is_named_once(runs):
    """3 lines running over 1.2x the median: one warning, on rank 0, naming rank 1 and its host."""
    import socket

    (_, rank0_warnings), (_, rank1_warnings) = runs["slow"][1]
    assert len(rank0_warnings) == 1 and not rank1_warnings, (rank0_warnings, rank1_warnings)
    assert rank0_warnings[0].startswith(f"straggler: rank 1 on {socket.gethostname()} took ")
    assert "for 3 metrics lines running" in rank0_warnings[0]


def test_profile_ranks_are_the_jobs(tmp_path):
    """Off: no profiler at all; on: one for the listed ranks only; a rank outside the job is one line (exit 2)."""
    import torch

    from pretrain.core.config import ProfileConfig, UsageError
    from pretrain.distributed.parallel import ParallelDims
    from pretrain.runtime.profiling import build_profiler

    def dims(rank: int) -> ParallelDims:
        return ParallelDims(world=2, rank=rank, local_rank=rank, tp=1, dp=2, tp_rank=0, dp_rank=rank,
                            device=torch.device("cpu"))

    assert build_profiler(ProfileConfig(), tmp_path, dims(0)) is None
    assert build_profiler(ProfileConfig(enabled=True), tmp_path, dims(1)) is not None
    assert build_profiler(ProfileConfig(enabled=True, ranks=[1]), tmp_path, dims(0)) is None
    assert build_profiler(ProfileConfig(enabled=True, ranks=[1]), tmp_path, dims(1)) is not None
    with pytest.raises(UsageError, match=r"^profile.ranks \[0, 2\]: rank 2 is not a rank of this job of 2; name "
                                         r"ranks 0-1, or \[\] for all$"):
        build_profiler(ProfileConfig(enabled=True, ranks=[0, 2]), tmp_path, dims(0))
