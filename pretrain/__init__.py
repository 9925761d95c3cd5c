"""Synthesizer/T5 pretraining and fine-tuning (see README.md).

How megatron-core and DeepSpeed are imported, set here before any of our modules imports them:

- megatron-core warns at import, once per module, that Transformer Engine and Apex are missing and it falls back
  to its local implementations: four lines from every process of every job, not actionable (the fallbacks are what
  this project uses). Filtered.
- Modules that apply `torch.compile` as a decorator at import pay for importing TorchDynamo and Inductor (~3 s
  on a 2-core Xeon) before anything is compiled: megatron-core's package `__init__` (its jit-fused kernels,
  `megatron.core.jit.jit_fuser`) and DeepSpeed's Muon optimizer, which `deepspeed.initialize` imports to check
  the optimizer's type. megatron-core's inference engine also imports wandb (optional there, ~1 s). Every rank of
  every job paid 4.5 s for code this project never runs, and the test suite starts about 200 such processes. So
  those imports run with `torch.compile` deferred (a decorated function is compiled at its first call, as
  `torch.compile` itself does: the same functions, compiled when used) and, for megatron-core, wandb reading as
  absent; both are restored when the import ends, and megatron's `jit_fuser` is set back to `torch.compile`.
- DeepSpeed's notice of the accelerator it picked goes to DEBUG (`_DebugLevel`); torch's deprecation of the
  collective DeepSpeed's ZeRO gathers with is filtered.
"""
import contextlib
import functools
import importlib.abc
import importlib.machinery
import logging
import sys
import warnings

warnings.filterwarnings("ignore", message="Transformer Engine and Apex are not installed", category=UserWarning)
# torch 2.11 deprecates the collective DeepSpeed's ZeRO optimizer gathers its partitions with (DeepSpeed's to change, not a
# user's): a FutureWarning per rank at each gather of a job
warnings.filterwarnings("ignore", message="`torch.distributed.all_gather_into_tensor` is deprecated",
                        category=FutureWarning)
# NCCL's barrier on the device "under current context": init_distributed sets each rank's device before any
# collective, so that is the rank's own GPU (seen once per process in the H200 check's pretraining and fine-tuning)
warnings.filterwarnings("ignore", message=r"barrier\(\): using the device under current context", category=UserWarning)


class _DebugLevel(logging.Filter):
    """DeepSpeed's notice of the accelerator it picked ("Setting accelerator to CPU. If you have GPU ...", a
    WARNING on stdout from every rank of every CPU job; "Setting ds_accelerator to cuda" on a GPU) at DEBUG:
    the handlers, at WARNING or INFO, drop it, and a DeepSpeed logger set to DEBUG still shows it."""

    def filter(self, record: logging.LogRecord) -> bool:
        if record.getMessage().startswith(("Setting accelerator to", "Setting ds_accelerator to")):
            record.levelno, record.levelname = logging.DEBUG, "DEBUG"
        return True


logging.getLogger("DeepSpeed").addFilter(_DebugLevel())  # the logger DeepSpeed makes at import, filters kept

# module -> whether its import also hides wandb
_LEAN_IMPORTS = {"megatron.core": True, "deepspeed.runtime.zero.muon.original_muon": False}


@contextlib.contextmanager
def _deferred_compile(hide_wandb: bool):
    import torch

    compile_ = torch.compile

    def compile_on_first_call(model=None, **options):
        """`torch.compile`'s signature; `compile(fn)` and `compile(**options)(fn)` compile fn at its first call."""
        if model is None:
            return lambda fn: compile_on_first_call(fn, **options)
        compiled = None

        @functools.wraps(model)
        def call(*args, **kwargs):
            nonlocal compiled
            if compiled is None:
                compiled = compile_(model, **options)
            return compiled(*args, **kwargs)
        return call

    hide_wandb = hide_wandb and "wandb" not in sys.modules
    torch.compile = compile_on_first_call
    if hide_wandb:
        sys.modules["wandb"] = None  # `import wandb` raises ImportError, which megatron catches
    try:
        yield
    finally:
        torch.compile = compile_
        if hide_wandb and sys.modules.get("wandb", 0) is None:
            del sys.modules["wandb"]


class _LeanImports(importlib.abc.MetaPathFinder):
    """Finds each module of `_LEAN_IMPORTS` once, and runs it in `_deferred_compile`."""

    def __init__(self, pending: dict[str, bool]):
        self.pending = pending

    def find_spec(self, name, path, target=None):
        if name not in self.pending:
            return None
        hide_wandb = self.pending.pop(name)
        if not self.pending:
            sys.meta_path.remove(self)
        spec = importlib.machinery.PathFinder.find_spec(name, path)
        if spec is None or spec.loader is None:
            return spec
        exec_module = spec.loader.exec_module

        def lean_exec_module(module):
            with _deferred_compile(hide_wandb):
                exec_module(module)
            if name == "megatron.core":
                sys.modules["megatron.core.jit"].enable_jit_fuser()

        spec.loader.exec_module = lean_exec_module
        return spec


_pending = {name: hide for name, hide in _LEAN_IMPORTS.items() if name not in sys.modules}
if _pending:
    sys.meta_path.insert(0, _LeanImports(_pending))
