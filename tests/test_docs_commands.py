"""Every pretraining command in README.md and docs/*.md (`python -m launch.run ... -m pretrain.train` or plain
`torchrun ...`, `sbatch ... slurm/pretrain.sbatch`, `slurm/pipeline.sh`) passes the planner at its shape: nodes from
`--nodes`, 8 x 80 GB GPUs per node for SLURM jobs, `--nproc-per-node` GPUs for the launcher, the command's config and overrides. The
other SLURM scripts (tokenizer, data, export, fine-tuning) start no pretraining and are not planned.

README's own `python -m ...` commands run as a newcomer runs them: in a shell that entered the venv with the
README's `source .venv/bin/activate` (the system python lacks the packages), each module answers `--help`, and
every flag and config key a command uses is one that module lists."""
from __future__ import annotations

import os
import re
import shlex
import subprocess
from pathlib import Path

import pytest

from pretrain.plan import main as plan

REPO = Path(__file__).resolve().parents[1]
DOCS = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
GPUS_PER_NODE = 8  # slurm/site.sh's default
LAUNCHERS = ("launch.run", "torchrun")  # `python -m launch.run` (the documented one) takes torchrun's options
PLACEHOLDER_PROCS = 2  # `--nproc-per-node N` in a doc: the walk-through's 2 (tiny's batch of 8 splits over 1 or 2)


def _code_lines(text: str) -> list[str]:
    """Lines of the fenced code blocks, continuation lines joined, comments dropped."""
    lines, inside, pending = [], False, ""
    for line in text.splitlines():
        if line.strip().startswith("```"):
            inside, pending = not inside, ""
            continue
        if not inside:
            continue
        line = re.sub(r"\s+#.*$", "", line)
        if line.rstrip().endswith("\\"):
            pending += line.rstrip()[:-1] + " "
            continue
        lines.append(pending + line)
        pending = ""
    return lines


def _commands() -> list[tuple[str, list[str]]]:
    """(where, argv) of every launch.run / torchrun / sbatch / pipeline.sh command in the docs' code blocks."""
    found = []
    for doc in DOCS:
        for line in _code_lines(doc.read_text()):
            if not re.search(r"\b(torchrun|sbatch)\b|pipeline\.sh|launch\.run", line):
                continue
            try:
                words = shlex.split(line.replace("$(", " ").replace(")", " "))
            except ValueError:  # shell beyond one command (a loop's quoting): words as written
                words = line.split()
            for i, word in enumerate(words):
                if word in LAUNCHERS or word == "sbatch" or word.endswith("pipeline.sh"):
                    found.append((f"{doc.name}: {line.strip()[:80]}", words[i:]))
                    break
    return found


def _plan_args(argv: list[str]) -> list[str] | None:
    """The planner's arguments for a pretraining command, None for one that starts no pretraining."""
    nodes, procs, config, overrides = 1, GPUS_PER_NODE, None, []
    if argv[0] in LAUNCHERS:
        if "pretrain.train" not in argv:
            return None
        procs = argv[argv.index("--nproc-per-node") + 1]
        procs = int(procs) if procs.isdigit() else PLACEHOLDER_PROCS
        rest = argv[argv.index("pretrain.train") + 1:]
    elif argv[0] == "sbatch":
        script = next((w for w in argv if w.endswith(".sbatch")), "")
        if not script.endswith("pretrain.sbatch"):
            return None
        for opt in (w for w in argv[: argv.index(script)] if w.startswith("--nodes")):
            nodes = int(opt.split("=")[1]) if "=" in opt else int(argv[argv.index(opt) + 1])
        rest = argv[argv.index(script) + 1:]
    else:  # pipeline.sh: its own options, then `-- overrides` for the trainer
        if "--config" not in argv:
            return None
        if "--nodes" in argv:
            nodes = int(argv[argv.index("--nodes") + 1])
        config = argv[argv.index("--config") + 1]
        overrides = argv[argv.index("--") + 1:] if "--" in argv else []
        rest = []
    if rest:
        config = rest[rest.index("--config") + 1]
        overrides = [w for w in rest if "=" in w and not w.startswith(("-", "["))]  # not a "[key=value ...]" placeholder
    return ["--config", config, "--nodes", str(nodes), "--gpus-per-node", str(procs), *overrides]


COMMANDS = _commands()
PRETRAINING = [(where, args) for where, argv in COMMANDS if (args := _plan_args(argv)) is not None]


def test_the_docs_commands_are_found():
    scripts = {argv[0] if argv[0] != "sbatch" else next(w for w in argv if w.endswith(".sbatch")) for _, argv in COMMANDS}
    assert {"launch.run", "slurm/pretrain.sbatch", "slurm/pipeline.sh", "slurm/finetune.sbatch"} <= scripts
    assert len(PRETRAINING) >= 4


@pytest.mark.parametrize("where, args", PRETRAINING, ids=[w for w, _ in PRETRAINING])
def test_docs_command_passes_the_planner(where, args, capsys):
    code = plan(args)
    err = capsys.readouterr().err
    assert code == 0, f"{where}\n  planner {' '.join(args)}\n  {err}"


ACTIVATE = "source .venv/bin/activate"


def _readme_python_commands() -> dict[str, set[str]]:
    """{module: the flags and config keys its README commands use}, launch.run's inner module included."""
    used: dict[str, set[str]] = {}
    for line in _code_lines((REPO / "README.md").read_text()):
        if not line.startswith("python -m "):
            continue
        words = shlex.split(line)
        starts = [i + 1 for i, w in enumerate(words) if w == "-m"]
        for begin, end in zip(starts, [*starts[1:], len(words) + 1]):
            module, args = words[begin], words[begin + 1 : end - 1]
            used.setdefault(module, set()).update(
                w.split("=", 1)[0] for w in args if w.startswith("--") or re.fullmatch(r"[a-z_.]+=\S*", w))
    return used


def test_readme_commands_run_in_the_venv_as_written(tmp_path):
    lines = _code_lines((REPO / "README.md").read_text())
    assert ACTIVATE in lines
    assert lines.index(ACTIVATE) < min(i for i, line in enumerate(lines) if line.startswith("python "))
    used = _readme_python_commands()
    assert {"pretrain.data.fetch", "tokenizer.train", "pretrain.data.prepare", "launch.run", "pretrain.train",
            "pretrain.export", "pretrain.finetune"} <= set(used)
    # a shell outside any venv: PATH without .venv/bin, no VIRTUAL_ENV; `python` is whatever activate makes it
    venv_bin = str(REPO / ".venv" / "bin")
    env = {k: v for k, v in os.environ.items() if k != "VIRTUAL_ENV"}
    env["PATH"] = os.pathsep.join(p for p in env.get("PATH", os.defpath).split(os.pathsep) if p != venv_bin)
    script = ["set -e", ACTIVATE, f"python -c 'import sys; print(sys.prefix)' > {tmp_path / 'prefix'}"]
    script += [f"python -m {m} --help > {tmp_path / m}.txt" for m in sorted(used)]
    done = subprocess.run(["bash", "-c", "\n".join(script)], cwd=REPO, env=env, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-3000:]
    assert Path((tmp_path / "prefix").read_text().strip()).resolve() == (REPO / ".venv").resolve()
    for module, words in used.items():
        listed = (tmp_path / f"{module}.txt").read_text()
        missing = sorted(w for w in words if w not in listed)
        assert not missing, f"README's python -m {module} uses {missing}, which its --help does not list"
