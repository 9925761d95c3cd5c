"""The jobs' command line as a user meets it: `--help` lists every key with its default and meaning, exits 0
and answers before torch is imported; megatron-core and DeepSpeed import
without megatron's warnings, TorchDynamo or wandb."""
import ast
import dataclasses
import subprocess
import sys
import typing

import pytest

from pretrain.core.config import Config

# `python -m JOB --help`, reporting afterwards whether torch was imported
RUN_AS_MAIN = """
import runpy, sys
sys.argv = [{job!r}, "--help"]
try:
    runpy.run_module({job!r}, run_name="__main__", alter_sys=True)
except SystemExit as e:
    print("exit", e.code, "torch imported:", "torch" in sys.modules, file=sys.stderr)
"""


def leaf_defaults(schema, prefix=""):
    """{dotted key: default} straight from the dataclasses (the reference the help text is read against); a list of
    dataclasses (data.sources) also lists its entries' keys (data.sources[i].name)."""
    out = {}
    hints = typing.get_type_hints(schema)
    for f in dataclasses.fields(schema):
        default = f.default_factory() if f.default_factory is not dataclasses.MISSING else f.default
        if dataclasses.is_dataclass(default):
            out.update(leaf_defaults(type(default), f"{prefix}{f.name}."))
        else:
            out[prefix + f.name] = default
            item = (typing.get_args(hints[f.name]) or [None])[0]
            if typing.get_origin(hints[f.name]) is list and dataclasses.is_dataclass(item):
                out.update(leaf_defaults(item, f"{prefix}{f.name}[i]."))
    return out


def finetune_schema():
    from pretrain.core.finetune_config import FinetuneConfig
    return FinetuneConfig


@pytest.mark.parametrize("job, schema", [("pretrain.train", lambda: Config), ("pretrain.finetune", finetune_schema)])
def test_help_lists_every_key_with_default_and_meaning_without_torch(job, schema):
    r = subprocess.run([sys.executable, "-c", RUN_AS_MAIN.format(job=job)], capture_output=True, text=True)
    assert r.stderr.strip().splitlines()[-1] == "exit 0 torch imported: False", r.stderr
    assert r.stdout.startswith(f"usage: python -m {job} [-h] [--config FILE]")
    listed = {}
    for line in r.stdout.split("keys (key=default  meaning):\n")[1].splitlines():
        key, _, rest = line.strip().partition("=")
        default, _, meaning = rest.partition("  ")
        listed[key] = (ast.literal_eval(default), meaning.strip())
    expected = leaf_defaults(schema())
    assert {k: d for k, (d, _) in listed.items()} == expected
    assert [k for k, (_, meaning) in listed.items() if not meaning] == []


# after `import pretrain.train`: what megatron's import pulled in, and whether what it borrowed was given back
LEAN_IMPORT = """
import sys, torch
real_compile = torch.compile
import pretrain.train
import megatron.core.jit
import deepspeed.runtime.zero.muon.muon_optimizer  # what deepspeed.initialize imports to check the optimizer
print(sorted(m for m in ("torch._dynamo", "torch._inductor.compile_fx", "wandb") if m in sys.modules),
      torch.compile is real_compile, megatron.core.jit.jit_fuser is real_compile)
import wandb  # still importable for log.wandb
print(wandb.__name__)
"""


def test_megatron_imports_silently_without_compile_or_wandb():
    """pretrain/__init__.py: no import-time warnings; neither megatron-core's import nor DeepSpeed's Muon module
    imports TorchDynamo / Inductor, and megatron-core does not import wandb (4.5 s a process); torch.compile,
    megatron's jit_fuser and wandb are left as they were."""
    r = subprocess.run([sys.executable, "-c", LEAN_IMPORT], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    assert "Transformer Engine and Apex" not in r.stderr
    assert r.stdout.splitlines()[-2:] == ["[] True True", "wandb"], r.stdout
