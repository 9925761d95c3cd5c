"""The tree reads as commands on top of packages (README's Layout): each package imports only the packages above
it in README's table and never a command, no module import cycle, the map matches the files, data/ imports neither
the runtime nor the launchers, planning/ does not import the runtime, and model/ does not import megatron's global
parallel state."""
import ast
import re
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _readme_map() -> tuple[list[str], list[str]]:
    """(commands, packages in their order) as README's Layout section lists them."""
    section = (ROOT / "README.md").read_text().split("## Layout\n", 1)[1].split("\n## ", 1)[0]
    commands_line = section.split("`python -m pretrain.NAME`:", 1)[1].split(".\n", 1)[0]
    commands = re.findall(r"`(\w+)`", commands_line)
    packages = re.findall(r"^\| `pretrain/(\w+)/` \|", section, re.M)
    return commands, packages


def _imports() -> dict[str, set[str]]:
    """module -> the pretrain modules it imports (anywhere in it, deferred imports included)."""
    files = subprocess.run(["git", "ls-files", "pretrain/*.py"], cwd=ROOT, capture_output=True, text=True,
                           check=True).stdout.split()
    modules = {".".join(Path(f).with_suffix("").parts).removesuffix(".__init__"): f for f in files}
    graph = {}
    for mod, file in modules.items():
        deps = set()
        for node in ast.walk(ast.parse((ROOT / file).read_text())):
            if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("pretrain"):
                deps.add(node.module)
                deps.update(f"{node.module}.{a.name}" for a in node.names)
            elif isinstance(node, ast.Import):
                deps.update(a.name for a in node.names)
        graph[mod] = {d for d in deps if d in modules and d != mod}
    return graph


def _group(module: str, commands: list[str]) -> str:
    parts = module.split(".")
    if len(parts) == 2:
        return "command" if parts[1] in commands else parts[1]
    return parts[1]


def test_readme_map_matches_the_tree():
    commands, packages = _readme_map()
    tree = {Path(f).parts[1] for f in subprocess.run(["git", "ls-files", "pretrain"], cwd=ROOT, capture_output=True,
                                                    text=True, check=True).stdout.split() if len(Path(f).parts) > 2}
    top = {Path(f).stem for f in subprocess.run(["git", "ls-files", "pretrain/*.py"], cwd=ROOT, capture_output=True,
                                               text=True, check=True).stdout.split() if len(Path(f).parts) == 2}
    assert sorted(packages) == sorted(tree)
    assert sorted(commands) == sorted(top - {"__init__"})  # every top-level module is a command


def test_packages_import_only_packages_above_them_and_no_command():
    commands, packages = _readme_map()
    rank = {p: i for i, p in enumerate(packages)}
    wrong = []
    for mod, deps in _imports().items():
        if mod == "pretrain":
            continue
        group = _group(mod, commands)
        for dep in deps - {"pretrain"}:  # pretrain/__init__.py: a warnings filter, imported by everything
            target = _group(dep, commands)
            if group == "command" or target == group:
                continue
            if target == "command" or rank[target] > rank[group]:
                wrong.append(f"{mod} imports {dep}")
    assert not wrong


def test_no_module_import_cycle():
    graph = _imports()
    # pretrain.model's __init__ re-exports its modules: an edge into a package's own __init__ is its members'
    cycles = []
    for start in graph:
        seen, todo = set(), [start]
        while todo:
            for dep in graph[todo.pop()]:
                if dep == start:
                    cycles.append(start)
                elif dep not in seen:
                    seen.add(dep)
                    todo.append(dep)
    assert not cycles


def _imported(files: str) -> dict[str, set[str]]:
    """file -> the modules its imports name (`from a.b import c`: a.b and a.b.c), for each file git lists as `files`."""
    out = {}
    for file in subprocess.run(["git", "ls-files", files], cwd=ROOT, capture_output=True, text=True,
                               check=True).stdout.split():
        out[file] = set()
        for node in ast.walk(ast.parse((ROOT / file).read_text())):
            if isinstance(node, ast.ImportFrom) and node.level == 0:
                out[file].update([node.module, *(f"{node.module}.{a.name}" for a in node.names)])
            elif isinstance(node, ast.Import):
                out[file].update(a.name for a in node.names)
    return out


def test_data_imports_neither_the_runtime_nor_the_launchers():
    # data/ feeds the jobs from below: its loader workers and the prepare jobs need neither the runtime (DeepSpeed,
    # the loop) nor the launchers; what they share with them (the preemption signals, die_with_parent) is core's
    imported = _imported("pretrain/data/*.py")
    wrong = [f"{file} imports {name}" for file, names in imported.items() for name in names
             if name.split(".")[0] == "launch" or name.split(".")[:2] == ["pretrain", "runtime"]]
    assert imported
    assert not wrong


def test_planning_imports_no_runtime():
    # every job is checked by the planner before its engine exists (check_job, check_memory), so the start path may
    # call it from below: planning sits above runtime in README's table; what both need (DeepSpeed's config dict,
    # the batch split) is core's (pretrain/core/deepspeed_config.py)
    packages = _readme_map()[1]
    assert packages.index("planning") < packages.index("runtime")
    imported = _imported("pretrain/planning/*.py")
    wrong = [f"{file} imports {name}" for file, names in imported.items() for name in names
             if name.split(".")[:2] == ["pretrain", "runtime"]]
    assert imported
    assert not wrong


def test_the_model_takes_its_process_group_and_reads_no_global_one():
    # megatron's global parallel state is read in pretrain/distributed/parallel.py, where the groups are made; the
    # model gets its TP group from there once, at construction (tests/test_tensor_parallel.py runs it without)
    imported = _imported("pretrain/model/*.py")
    wrong = [f"{file} imports {name}" for file, names in imported.items() for name in names
             if name == "megatron.core.parallel_state"]
    assert imported
    assert not wrong


def test_the_launchers_and_the_tokenizer_command_sit_above_the_packages():
    # launch/ starts the jobs (torchrun, the ranks' exit codes) and tokenizer/train.py is a command that reads corpora
    # through pretrain.data: both sit on top of pretrain, which may import neither. tokenizer/spm.py, the vocabulary
    # the data and the models read, sits below them: of the project it imports pretrain.core alone (its errors)
    wrong = [f"{file} imports {name}" for file, names in _imported("pretrain/*.py").items() for name in names
             if name.split(".")[0] == "launch" or name == "tokenizer.train"]
    wrong += [f"tokenizer/spm.py imports {name}" for name in _imported("tokenizer/spm.py")["tokenizer/spm.py"]
              if name.split(".")[0] in ("pretrain", "launch") and name.split(".")[:2] != ["pretrain", "core"]]
    assert not wrong
