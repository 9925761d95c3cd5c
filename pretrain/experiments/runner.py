"""The Synthesizer study: attention variants x seeds, each pretrained on the same data and step budget,
exported, fine-tuned and evaluated on every listed task; one table and a folder of figures.

    python -m pretrain.study --config configs/study/cpu.yaml [section.key=value ...]

Every step is the project's own command in a subprocess (`pretrain.train`, `pretrain.export`,
`pretrain.finetune`; through `launch.local`, i.e. torchrun, when study.processes > 1), so the study runs what
a user runs and knows nothing of the trainer's internals. The parts, for SLURM arrays (slurm/study.sh):

    --stage data                      fetch text, tokenizer, shards, the polarity set and the pair probe
                                      (data.fetch); baseline.json
    --cells                           print the number of cells (variants x seeds) and the study folder
    --cell I --stage pretrain         pretrain cell I          --cell I --stage downstream   export + fine-tune
                                                                (each task from the export and from scratch)
    --stage report                    results.csv, results.md, figures/ from whatever cells finished

study.dir holds data/ (when fetched), baseline.json (the unigram baseline of the pretraining's eval slice),
cells/VARIANT-sSEED/ (pretrain/, export/, finetune/TASK/, scratch/TASK/, logs/, done/ stage markers, and
cell.json, the cell's row, written last), results.csv, results.md and figures/. study.concurrent cells run at once.
Resume: a cell with cell.json is skipped; a stage with its marker is skipped; an unfinished pretraining or
fine-tuning resumes from its run's checkpoints/latest (the jobs auto-resume). A failing stage writes the
cell's failed.json (stage, exit code, log) and the study goes on with the next cell; it is retried on a rerun.
"""
from __future__ import annotations

import json
import os
import resource
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from pretrain.core.files import write_atomic
from pretrain.distributed.env import free_port
from pretrain.experiments.grid import (
    FETCHED_TASKS,
    REPO,
    SCRATCH,
    Cell,
    StudyConfig,
    cell_row,
    cells,
    data_paths,
    pretrain_args,
)


def _module(cfg: StudyConfig, module: str, args: list[str]) -> list[str]:
    if cfg.study.processes == 1:
        return [sys.executable, "-m", module, *args]
    return [sys.executable, "-m", "launch.local", "--nproc-per-node", str(cfg.study.processes), "--module", module, *args]


def _run(cmd: list[str], log_file: Path) -> int:
    return _run_timed(cmd, log_file)[0]


def _run_timed(cmd: list[str], log_file: Path) -> tuple[int, float]:
    """A job in a subprocess from the repository root, its output in `log_file` (appended: resumes add to it);
    (exit code, CPU seconds of the job and every process it waited for, e.g. torchrun's ranks)."""
    log_file.parent.mkdir(parents=True, exist_ok=True)
    # a launcher-free job rendezvous on MASTER_PORT (default 29500): a free one, so concurrent cells and
    # other jobs on the machine do not collide (torchrun --standalone picks its own)
    env = dict(os.environ, PYTHONUNBUFFERED="1", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()))
    with log_file.open("a") as log:
        log.write(f"$ {' '.join(cmd)}\n")
        log.flush()
        proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT)
        try:
            _, status, usage = os.wait4(proc.pid, 0)  # the child's own resource usage (threads share RUSAGE_CHILDREN)
        except BaseException:
            proc.kill()
            proc.wait()
            raise
        proc.returncode = os.waitstatus_to_exitcode(status)
        return proc.returncode, usage.ru_utime + usage.ru_stime


_SAY = threading.Lock()


def _say(msg: str) -> None:
    with _SAY:  # concurrent cells: one whole line each
        sys.stdout.write(f"[{time.strftime('%H:%M:%S')}] {msg}\n")
        sys.stdout.flush()


def prepare_data(cfg: StudyConfig) -> None:
    """make demo's data stages (same commands), each skipped when its output is there; the task sets (polarity, the pair
    probe) only when a task fine-tunes on them."""
    if not cfg.data.fetch:
        return
    paths = data_paths(cfg)
    root, py = Path(paths["polarity"]).parent, sys.executable
    text = root / "text"
    stages = [
        ("text", [py, "-m", "pretrain.data.fetch", "--output", str(text)], text / "c4-validation.00000-of-00001.json.gz"),
        ("tokenizer", [py, "-m", "tokenizer.train", "--input", str(text / "c4-train.*.json.gz"), "--output",
                       str(root / "tokenizer"), "--vocab-size", str(cfg.data.vocab_size)], Path(paths["tokenizer"])),
        ("train shards", [py, "-m", "pretrain.data.prepare", "--input", str(text / "c4-train.*.json.gz"),
                          "--output", paths["train"], "--tokenizer", paths["tokenizer"]], Path(paths["train"]) / "index.json"),
        ("valid shards", [py, "-m", "pretrain.data.prepare", "--input", str(text / "c4-validation.*.json.gz"),
                          "--output", paths["valid"], "--tokenizer", paths["tokenizer"]], Path(paths["valid"]) / "index.json"),
        ("polarity", [py, "-m", "pretrain.tasks.polarity", "--output", paths["polarity"]], Path(paths["polarity"]) / "test.tsv"),
        # the span probe from the validation documents (held out of pretraining), every input within 64 tokens
        ("pair", [py, "-m", "pretrain.tasks.pair_data", "--input", str(text / "c4-validation.*.json.gz"), "--output",
                  paths["pair"], "--tokenizer", paths["tokenizer"], "--max-input-length", "64"],
         Path(paths["pair"]) / "test.tsv"),
    ]
    fetched = {t.name for t in cfg.study.tasks if not t.data}  # a study without tasks fetches no task sets
    for name, cmd, done in stages:
        if done.exists() or (name in FETCHED_TASKS and name not in fetched):
            continue
        _say(f"data: {name}")
        if _run(cmd, root / "logs" / f"{name.replace(' ', '_')}.log") != 0:
            raise SystemExit(f"study: data stage '{name}' failed; its output is in {root / 'logs'}")


def write_baseline(cfg: StudyConfig) -> None:
    """study.dir/baseline.json: the unigram baseline (pretrain.data.unigram) of the validation slice every cell's
    pretraining evaluates on (the same config, overrides and data), computed anew each time (seconds)."""
    data = data_paths(cfg)
    if not data["valid"]:
        return
    root = Path(cfg.study.dir).resolve()
    cmd = [sys.executable, "-m", "pretrain.data.unigram", "--config", cfg.pretrain.config, *cfg.pretrain.overrides,
           f"data.train={data['train']}", f"data.valid={data['valid']}", f"data.tokenizer={data['tokenizer']}",
           "--output", str(root / "baseline.json")]
    _say("data: unigram baseline")
    if _run(cmd, root / "logs" / "baseline.log") != 0:
        raise SystemExit(f"study: the unigram baseline failed; see {root / 'logs' / 'baseline.log'}")


def _stage(cell: Cell, name: str, cmd: list[str]) -> bool:
    """Run one stage of a cell unless its marker exists; on failure record failed.json and return False."""
    marker = cell.dir / "done" / name
    if marker.exists():
        return True
    _say(f"{cell.title}: {name}")
    start = time.perf_counter()
    log_file = cell.dir / "logs" / f"{name}.log"
    rc, cpu = _run_timed(cmd, log_file)
    if rc != 0:
        _say(f"{cell.title}: {name} FAILED (exit {rc}), see {log_file}")
        (cell.dir / "failed.json").write_text(json.dumps({"stage": name, "exit_code": rc, "log": str(log_file)}) + "\n")
        return False
    marker.parent.mkdir(parents=True, exist_ok=True)
    marker.write_text(json.dumps({"wall_s": round(time.perf_counter() - start, 1), "cpu_s": round(cpu, 1)}) + "\n")
    return True


def run_pretrain(cfg: StudyConfig, cell: Cell) -> bool:
    return _stage(cell, "pretrain", _module(cfg, "pretrain.train", pretrain_args(cfg, cell)))


def run_downstream(cfg: StudyConfig, cell: Cell) -> bool:
    """Export, then fine-tune and evaluate on each task, from the export (finetune/TASK) and from a random
    initialisation of the same model config and seed (scratch/TASK: the export names the model and tokenizer);
    then the cell's row (cell.json) as the last write."""
    export = cell.dir / "export"
    cmd = [sys.executable, "-m", "pretrain.export", "--run", str(cell.dir / "pretrain"), "--output", str(export)]
    if not export.is_dir() and not _stage(cell, "export", cmd):
        return False
    for task in cfg.study.tasks:
        args = ["--config", task.config or f"configs/finetune/{task.name}.yaml", *cfg.finetune.overrides,
                f"init={export}", f"data.dir={task.data or data_paths(cfg)[task.name]}", f"run.seed={cell.seed}"]
        for stage, folder, extra in ((f"finetune-{task.name}", "finetune", []),
                                     (f"{SCRATCH}-{task.name}", SCRATCH, ["from_scratch=true"])):
            run_dir = f"run.dir={cell.dir / folder / task.name}"
            if not _stage(cell, stage, _module(cfg, "pretrain.finetune", [*args, *extra, run_dir])):
                return False
    row = cell_row(cfg, cell)
    write_atomic(cell.dir / "cell.json", json.dumps(row, indent=1) + "\n")
    return True


def run_cell(cfg: StudyConfig, cell: Cell, stages: tuple[str, ...] = ("pretrain", "downstream")) -> bool:
    if (cell.dir / "cell.json").is_file():
        _say(f"{cell.title}: finished earlier, skipped")
        return True
    (cell.dir / "failed.json").unlink(missing_ok=True)  # a rerun retries a failed cell
    ok = "pretrain" not in stages or run_pretrain(cfg, cell)
    return ok and ("downstream" not in stages or run_downstream(cfg, cell))


# --------------------------------------------------------------------------------------------------------
# Command line
# --------------------------------------------------------------------------------------------------------
def run_study(cfg: StudyConfig) -> int:
    """The whole study in this process; exit 1 if a cell failed (the report is written either way)."""
    from pretrain.experiments.report import write_report

    # the jobs share the cores: one thread each unless the user says otherwise (2 jobs of 2 OpenMP threads on 2
    # cores spin against each other: a step took 5-10x longer)
    jobs = cfg.study.concurrent * cfg.study.processes
    os.environ.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // jobs)))
    prepare_data(cfg)
    write_baseline(cfg)
    grid = cells(cfg)

    def run(i: int) -> bool:
        _say(f"cell {i + 1}/{len(grid)}: {grid[i].title}")
        return run_cell(cfg, grid[i])

    # study.concurrent cells at once, taken in grid order; each stage is a subprocess, so threads only wait.
    # On Ctrl-C (the jobs get it too) no further cell starts
    pool = ThreadPoolExecutor(cfg.study.concurrent)
    try:
        done = list(pool.map(run, range(len(grid))))
    finally:
        pool.shutdown(wait=True, cancel_futures=True)
    failed = [cell for cell, ok in zip(grid, done) if not ok]
    write_report(cfg)
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    _say(f"CPU time of every job this run: {usage.ru_utime + usage.ru_stime:.0f} s")
    for cell in failed:
        _say(f"{cell.title}: failed, see {cell.dir / 'failed.json'}")
    return 1 if failed else 0
