"""A fake CUDA device for a CPU-only torch, to rehearse the project's CUDA path on every CPU machine.

`build_shim()` compiles shim.cpp (a fake CUDA device guard and CUDA hooks: hasCUDA/isBuilt true, isAvailable false,
one device) against the installed torch's headers with torch's cpp_extension, once per machine and torch version
(about 5-12 s of g++), into the project's cache. ATen reads its CUDA hooks once, during `import torch`, so the shim
must be in the process before torch is: `fake_cuda_env(so)` is the environment of a fresh interpreter that preloads
it (LD_PRELOAD). In that interpreter, fake tensors (`FakeTensorMode`) on device "cuda" go through autograd, autocast
and fused optimizers as on a GPU, as shapes and dtypes without values: tests/fake_cuda/rehearsal.py.
"""
from __future__ import annotations

import os
import shutil
import sysconfig
from pathlib import Path

import torch

SOURCE = Path(__file__).with_name("shim.cpp")


def compiler() -> str | None:
    """The C++ compiler torch's cpp_extension would call ($CXX or c++), or None when there is none."""
    return shutil.which(os.environ.get("CXX", "c++"))


def build_shim(cache: Path) -> Path:
    """The shim's shared library under `cache`/fake_cuda/<torch version>, built on first use (torch's
    cpp_extension rebuilds it when shim.cpp changes and serialises concurrent builds with a lock file)."""
    from torch.utils.cpp_extension import load

    folder = cache / "fake_cuda" / torch.__version__.replace("+", "_")
    folder.mkdir(parents=True, exist_ok=True)
    torch_lib = Path(torch.__file__).parent / "lib"
    # cpp_extension runs `ninja` from PATH: the venv's (a DeepSpeed requirement) where the venv is not activated
    path = os.environ["PATH"]
    os.environ["PATH"] = os.pathsep.join([sysconfig.get_path("scripts"), path])
    try:
        # the rpath lets the preloaded library find libc10 / libtorch_cpu before torch's own import loads them
        load("fake_cuda_shim", [str(SOURCE)], build_directory=str(folder), is_python_module=False,
             extra_ldflags=[f"-Wl,-rpath,{torch_lib}"])
    finally:
        os.environ["PATH"] = path
    return folder / "fake_cuda_shim.so"


def fake_cuda_env(so: Path) -> dict[str, str]:
    """os.environ plus the shim preloaded into the interpreter that gets it."""
    env = dict(os.environ)
    env["LD_PRELOAD"] = " ".join(filter(None, [str(so), env.get("LD_PRELOAD", "")]))
    return env
