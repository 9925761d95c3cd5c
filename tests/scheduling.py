"""How `make test`'s pytest-xdist workers share the suite: which tests go to one worker together (a unit of work), and
in which order the units are handed out (the longest first).

A unit is the SLURM cluster's tests (one cluster starts per session; two would hand out the same job ids, and srun
jobs derive their rendezvous port from the id), or the tests of one file that reach the same fixture of that file
scoped wider than a test (the study's and the SLURM runs' take minutes; built once), or else one test alone. Decided
from the files' text: the controller never imports the tests, and xdist's own `xdist_group` marks do not reach pytest
9's node ids.

The order is longest-processing-time first: each free worker takes the unit of the most estimated seconds. In file
order, the longest tests started last on one worker while the other had nothing left (`make test` of 15fd370: 24 min
wall for 2,094 CPU seconds on 2 workers, whose lower bound is 17.5 min).
"""
from __future__ import annotations

import ast
import functools
from pathlib import Path
from typing import Iterable

import pytest

REPO = Path(__file__).resolve().parents[1]

# Seconds of the known-slow tests and shared fixtures (a fixture under its unit's name, FILE::FIXTURE), from
# `make test` of 4fcbfdf with two workers (--durations; quiet, 8 min 13 s): the order needs their rank, not their
# exact value. Every other test counts OTHER_TEST_S, every other shared fixture SHARED_FIXTURE_S (one is shared
# because it is slow to build: runs of real processes, mostly).
SLOW_S = {
    "tests/test_study.py::study": 130,
    "slurm": 69 + 31,  # the SLURM runs' fixture and the study on SLURM (the cluster's start: its first test's setup)
    "tests/test_finetune.py::test_a_pretrained_export_finetunes_on_real_polarity_data": 60,  # one process: 225 -> 122 CPU s
    "tests/test_faults.py::test_signals_to_the_launched_job_exit_preempted_from_start_up_to_exit": 63,
    "tests/test_fast_paths.py::test_compiled_layers_equal_eager": 36,
    "tests/test_train.py::zero_runs": 29,
    "tests/test_faults.py::test_a_stalled_rank_is_named_as_a_timeout": 22,
    "tests/test_faults.py::test_model_parallel_groups_get_the_configured_timeout": 9,  # each of 2
    "tests/test_study_report.py::test_rebuilt_initialisation_equals_a_run_that_did_not_move": 20,
    "tests/test_hf_users.py::test_exports_load_alike_in_transformers_4_and_5": 18,
    "tests/test_pair_task.py::test_finetuning_on_pairs_from_the_export_and_from_scratch": 16,
    "tests/test_parallel.py::test_reshard_writes_the_universal_checkpoint_of_the_latest": 15,
    "tests/test_finetune.py::test_finetuning_start_up_holds_the_model_once_on_the_host": 14,
    "tests/test_bench.py::test_throughput_table_under_torchrun": 13,
    "tests/test_finetune_faults.py::test_an_export_that_tp_does_not_split_is_one_line_before_the_lock": 12,
    "tests/test_faults.py::test_a_usage_error_on_rank_1_only_is_the_last_line_the_launcher_prints": 11,
    # 2026-12-04, one file alone: the fake-CUDA rehearsal runs every case in its module fixture (43.6 s at load
    # 2.4), each of its 117 cases then reads a result; the HF users' exports build in ~5 s, their file takes 32 s
    "tests/test_fake_cuda.py::rehearsal": 45,
    "tests/test_fake_cuda.py::test_cuda_train_step": 0.05,
    "tests/test_hf_users.py::exports": 5,
    "tests/test_hf_users.py::test_automodel_in_transformers_4": 7,
}
OTHER_TEST_S = 2.0
SHARED_FIXTURE_S = 30.0


def work_unit(nodeid: str) -> str:
    """The unit `nodeid` belongs to: "slurm", FILE::FIXTURE (the file's wide fixture that names its group), or
    `nodeid` itself."""
    path, _, rest = nodeid.partition("::")
    if "slurm_cluster" in _test_file_text(path):
        return "slurm"
    fixture = _shared_fixtures(path).get(rest.split("[", 1)[0].rsplit("::", 1)[-1])
    return f"{path}::{fixture}" if fixture else nodeid


def unit_seconds(unit: str, nodeids: Iterable[str]) -> float:
    """The estimated seconds of a unit of these tests: theirs plus its shared fixture's."""
    nodeids = list(nodeids)
    tests = sum(SLOW_S.get(n.split("[", 1)[0], OTHER_TEST_S) for n in nodeids)
    return tests + (SLOW_S.get(unit, SHARED_FIXTURE_S) if unit not in nodeids else 0.0)


@functools.cache
def _test_file_text(path: str) -> str:
    file = REPO / path
    return file.read_text() if file.is_file() else ""


def _fixture_decorator(func: ast.FunctionDef) -> tuple[str, bool] | None:
    """(scope, autouse) when `func` is a pytest fixture."""
    for decorator in func.decorator_list:
        call = decorator if isinstance(decorator, ast.Call) else None
        if ast.unparse(call.func if call else decorator) in ("pytest.fixture", "fixture"):
            keywords = {k.arg: k.value for k in call.keywords} if call else {}
            scope, autouse = keywords.get("scope"), keywords.get("autouse")
            return (scope.value if isinstance(scope, ast.Constant) else "function",
                    isinstance(autouse, ast.Constant) and autouse.value is True)
    return None


@functools.cache
def _shared_fixtures(path: str) -> dict[str, str]:
    """Per test function of the file, the wide fixture naming its unit: tests that reach (through the file's
    fixtures) a fixture scoped wider than a test share a unit with every test reaching the same one, transitively."""
    try:
        body = ast.parse(_test_file_text(path)).body
    except SyntaxError:  # pytest reports it when it collects the file
        return {}
    functions = [f for f in body if isinstance(f, ast.FunctionDef)]
    arguments = {f.name: {a.arg for a in f.args.args} for f in functions}
    fixtures = {f.name: found for f in functions if (found := _fixture_decorator(f))}
    wide = {name for name, (scope, _) in fixtures.items() if scope != "function"}
    autouse = {name for name, (_, auto) in fixtures.items() if auto}

    @functools.cache
    def reached(name: str) -> frozenset[str]:
        found = {name} & wide
        for argument in arguments.get(name, ()) & fixtures.keys() - {name}:
            found |= reached(argument)
        return frozenset(found)

    parent: dict[str, str] = {}

    def root(name: str) -> str:
        while parent.setdefault(name, name) != name:
            name = parent[name]
        return name

    tests = {}
    for f in functions:
        if f.name.startswith("test") and f.name not in fixtures:
            shared = set().union(*(reached(a) for a in (arguments[f.name] | autouse) & fixtures.keys()))
            for name in sorted(shared)[1:]:
                parent[root(name)] = root(min(shared))
            tests[f.name] = shared
    return {test: root(min(shared)) for test, shared in tests.items() if shared}


@pytest.hookimpl(optionalhook=True)  # pytest-xdist's hook: pytest runs without xdist too (the GPU check)
def pytest_xdist_make_scheduler(config: pytest.Config, log):
    from xdist.scheduler import LoadScopeScheduling

    class LongestFirstScheduling(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            return work_unit(nodeid)

        def _assign_work_unit(self, node) -> None:
            # xdist hands out the queue's first unit: make it the longest left
            longest = max(self.workqueue, key=lambda unit: unit_seconds(unit, self.workqueue[unit]))
            self.workqueue.move_to_end(longest, last=False)
            super()._assign_work_unit(node)

    return LongestFirstScheduling(config, log)
