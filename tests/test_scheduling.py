"""`make test`'s scheduler (tests/scheduling.py) over the suite's own files: which tests share a worker, and that the
longest unit goes out first, driven through pytest-xdist's real LoadScopeScheduling with two stand-in workers."""
from __future__ import annotations

import ast
from pathlib import Path
from types import SimpleNamespace

from tests.scheduling import pytest_xdist_make_scheduler, unit_seconds, work_unit

REPO = Path(__file__).resolve().parents[1]
FINETUNE = "tests/test_finetune.py::test_a_pretrained_export_finetunes_on_real_polarity_data"
SIGNALS = "tests/test_faults.py::test_signals_to_the_launched_job_exit_preempted_from_start_up_to_exit"


def _suite() -> list[str]:
    """The node id of every test function of the suite, in file order (parameters left out)."""
    ids = []
    for file in sorted((REPO / "tests").glob("test_*.py")):
        for f in ast.parse(file.read_text()).body:
            if isinstance(f, ast.FunctionDef) and f.name.startswith("test"):
                ids.append(f"tests/{file.name}::{f.name}")
    return ids


def test_tests_reaching_one_wide_fixture_share_a_unit_and_every_other_test_is_alone():
    units = {nodeid: work_unit(nodeid) for nodeid in _suite()}
    slurm = ("tests/test_slurm_launch.py", "tests/test_slurm_pipeline.py", "tests/test_slurm_pretrain.py",
             "tests/test_study_slurm.py")  # the files asking for the session's SLURM cluster
    assert {n for n, u in units.items() if u == "slurm"} == {n for n in units if n.startswith(slurm)}
    study = {n for n, u in units.items() if n.startswith("tests/test_study.py::")}
    assert {units[n] for n in study - {"tests/test_study.py::test_bad_study_config_is_one_line"}} == \
        {"tests/test_study.py::study"}
    assert units["tests/test_study.py::test_bad_study_config_is_one_line"] == \
        "tests/test_study.py::test_bad_study_config_is_one_line"  # it builds no study
    # test_train's two module fixtures: two units, each built once
    assert units["tests/test_train.py::test_loss_falls_on_real_text"] == "tests/test_train.py::zero_runs"
    assert units["tests/test_train.py::test_tp2_matches_tp1"] == "tests/test_train.py::tp_runs"
    # the polarity folder is a session fixture: the longest test does not drag the file's others along
    finetune = [n for n in units if n.startswith("tests/test_finetune.py::")]
    assert len(finetune) > 1 and all(units[n] == n for n in finetune)
    assert units["tests/test_study_report.py::test_rebuilt_initialisation_equals_a_run_that_did_not_move"] != \
        units["tests/test_study_report.py::test_report_of_hand_made_cells"]


class Worker:
    """What the scheduler asks of an xdist worker: run these tests (recorded in a log shared by the workers), shut
    down."""

    def __init__(self, name: str, log: list) -> None:
        self.gateway, self.log, self.sent, self.shutting_down = SimpleNamespace(id=name), log, [], False

    def send_runtest_some(self, indices: list[int]) -> None:
        self.log.append(indices)
        self.sent.extend(indices)

    def shutdown(self) -> None:
        self.shutting_down = True


def test_each_free_worker_takes_the_longest_unit_left():
    suite = _suite()
    config = SimpleNamespace(getvalue=lambda name: ["2*popen"], option=SimpleNamespace(loadscopereorder=True))
    scheduler = pytest_xdist_make_scheduler(config, None)
    log: list[list[int]] = []
    workers = [Worker("gw0", log), Worker("gw1", log)]
    for w in workers:
        scheduler.add_node(w)
    for w in workers:
        scheduler.add_node_collection(w, suite)
    scheduler.schedule()
    done = {w: 0 for w in workers}
    while busy := [w for w in workers if done[w] < len(w.sent)]:
        w = min(busy, key=lambda w: done[w])  # the worker that has run fewer tests finishes its next one
        scheduler.mark_test_complete(w, w.sent[done[w]])
        done[w] += 1
    units: dict[str, list[str]] = {}
    for nodeid in suite:
        units.setdefault(work_unit(nodeid), []).append(nodeid)
    order = [work_unit(suite[indices[0]]) for indices in log]  # one unit per send, whole
    assert all({work_unit(suite[i]) for i in indices} == {unit} for indices, unit in zip(log, order))
    assert sorted(order) == sorted(units) and sum(done.values()) == len(suite)  # each unit once, every test run
    assert order[:4] == ["tests/test_study.py::study", "slurm", SIGNALS, FINETUNE]
    seconds = [unit_seconds(u, units[u]) for u in order]
    assert seconds == sorted(seconds, reverse=True), list(zip(order, seconds))[:12]
