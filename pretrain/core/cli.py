"""`--help` of the jobs (`pretrain.train`, `pretrain.finetune`): every config key with its default and meaning.

The config dataclasses are the one source: a key's meaning is the `# comment` after its field. They are read
from source (`ast`), not imported, because the jobs' modules import torch, DeepSpeed and megatron (seconds)
and a schema may live in such a module; so an entry point can answer `--help` before its heavy imports:

    if __name__ == "__main__":  # answer --help before the heavy imports below
        from pretrain.core.cli import exit_on_help
        exit_on_help("Config", prog="pretrain.train")
"""
from __future__ import annotations

import ast
import importlib.util
import io
import sys
import tokenize
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

HELP_FLAGS = ("-h", "--help")
# the schemas and their sections (Config, RunConfig, TrainConfig, ...; FinetuneConfig, TaskConfig, ...)
CONFIG_SOURCES = (Path(__file__).with_name("config.py"), Path(__file__).with_name("finetune_config.py"))


@dataclass(frozen=True)
class Key:
    name: str  # dotted: "train.lr"
    default: str  # as written in the source: 0.001, 'runs/default', False
    meaning: str  # the field's trailing comment


def _dataclass_fields(path: Path) -> dict[str, tuple[list[str], list[tuple[str, ast.expr | None, str, ast.expr]]]]:
    """{class name: ([its bases], [(field, default expression, comment, annotation)] of its own body)} for every
    @dataclass class in the file."""
    source = path.read_text()
    comments = {t.start[0]: t.string.lstrip("#").strip()
                for t in tokenize.generate_tokens(io.StringIO(source).readline) if t.type == tokenize.COMMENT}
    classes = {}
    for node in ast.parse(source).body:
        decorators = [d.func if isinstance(d, ast.Call) else d for d in getattr(node, "decorator_list", [])]
        if isinstance(node, ast.ClassDef) and any(getattr(d, "id", "") == "dataclass" for d in decorators):
            classes[node.name] = ([ast.unparse(b) for b in node.bases],
                                  [(s.target.id, s.value, comments.get(s.end_lineno, ""), s.annotation)
                                   for s in node.body
                                   if isinstance(s, ast.AnnAssign) and isinstance(s.target, ast.Name)])
    return classes


def _section(value: ast.expr | None) -> str | None:
    """The class name in `field(default_factory=Name)`, else None."""
    if isinstance(value, ast.Call) and getattr(value.func, "id", "") == "field":
        for kw in value.keywords:
            if kw.arg == "default_factory" and isinstance(kw.value, ast.Name):
                return kw.value.id
    return None


def _list_item(annotation: ast.expr) -> str | None:
    """The class name in a `list[Name]` annotation (a list of dataclasses: data.sources), else None."""
    if isinstance(annotation, ast.Subscript) and getattr(annotation.value, "id", "") in ("list", "List"):
        return getattr(annotation.slice, "id", None)
    return None


def _default(value: ast.expr | None) -> str:
    if isinstance(value, ast.Call) and getattr(value.func, "id", "") == "field":
        keywords = {kw.arg: kw.value for kw in value.keywords}
        if "default_factory" in keywords:  # list, dict, tuple: shown as the empty literal
            name = ast.unparse(keywords["default_factory"])
            return {"list": "[]", "dict": "{}", "tuple": "()"}.get(name, f"{name}()")
        value = keywords.get("default")
    return "(required)" if value is None else ast.unparse(value)


def schema_keys(module_file: str | Path, schema: str) -> list[Key]:
    """Every key of the dataclass `schema` defined in `module_file` (or in CONFIG_SOURCES), sections nested."""
    classes = {name: f for source in CONFIG_SOURCES for name, f in _dataclass_fields(source).items()}
    classes.update(_dataclass_fields(Path(module_file)))

    def fields(name: str) -> list[tuple[str, ast.expr | None, str, ast.expr]]:
        """The bases' fields first, as `dataclasses` orders them: a field declared again keeps its base's place."""
        bases, own = classes[name]
        merged = {f[0]: f for base in bases if base in classes for f in fields(base)}
        merged.update((f[0], f) for f in own)
        return list(merged.values())

    def walk(name: str, prefix: str) -> list[Key]:
        keys = []
        for field_name, value, comment, annotation in fields(name):
            section = _section(value)
            if section in classes:
                keys += walk(section, f"{prefix}{field_name}.")
            else:
                keys.append(Key(prefix + field_name, _default(value), comment))
                if _list_item(annotation) in classes:  # the keys of each entry: data.sources[i].name ...
                    keys += walk(_list_item(annotation), f"{prefix}{field_name}[i].")
        return keys

    return walk(schema, "")


def help_text(schema: str, prog: str) -> str:
    """Usage, the first paragraph of module `prog`'s docstring, and every key of `schema` (defined there or in
    pretrain/core/config.py or finetune_config.py)."""
    module_file = Path(importlib.util.find_spec(prog).origin)  # found, not imported
    keys = schema_keys(module_file, schema)
    doc = ast.get_docstring(ast.parse(module_file.read_text())) or ""
    width = max(len(f"{k.name}={k.default}") for k in keys) + 2
    lines = [f"usage: python -m {prog} [-h] [--config FILE] [section.key=value ...]", "",
             doc.split("\n\n")[0], "",
             "Each key takes its default, then the value in --config FILE, then a section.key=value override.",
             "", "options:",
             f"  {'-h, --help':<{width}}show this help and exit",
             f"  {'--config FILE':<{width}}YAML file of sections, e.g. configs/tiny.yaml (also --config=FILE)",
             "", "keys (key=default  meaning):"]
    lines += [f"  {f'{k.name}={k.default}':<{width}}{k.meaning}".rstrip() for k in keys]
    return "\n".join(lines) + "\n"


def exit_on_help(schema: str, prog: str, argv: Sequence[str] | None = None) -> None:
    """Print the help of job `prog` (a module name) and exit 0 when argv holds -h or --help; else return."""
    if any(a in HELP_FLAGS for a in (sys.argv[1:] if argv is None else argv)):
        sys.stdout.write(help_text(schema, prog))
        raise SystemExit(0)
