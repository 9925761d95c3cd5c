"""Session fixtures with real data for every part's tests: C4-layout text, a tiny tokenizer, prepared shards.

Each is built once per machine into the cache (~/.cache/synthesizer-pretrain/test-fixtures, or
$SYNTHESIZER_CACHE) under a folder keyed on its inputs and on the code that builds it, so a change to
the tokenizer or shard code rebuilds it and an unchanged suite reuses it. Building goes to a temporary
folder that is renamed into place, so an interrupted build is never mistaken for a finished one.
Also a second Python environment with the last transformers 4.x over the project's packages (exports must load
in both major versions; tests/test_hf_versions.py).
"""
from __future__ import annotations

import dataclasses
import functools
import hashlib
import os
import shutil
import subprocess
import sys
import sysconfig
from dataclasses import dataclass
from pathlib import Path

import pytest

from pretrain.core.config import DataConfig
from pretrain.data import fetch as fetch_module
from pretrain.data.documents import expand_glob
from pretrain.data.prepare import prepare
from pretrain.data.shards import FORMAT_VERSION
from tokenizer.train import train

pytest_plugins = ("tests.slurm_cluster",)  # one real SLURM cluster per session, for the tests that ask for it

REPO = Path(__file__).resolve().parents[1]
TOKENIZER_PIECES = 1000  # + 100 sentinels = 1100 ids: configs/tiny.yaml's vocab_size
TOKENIZER_SAMPLE_BYTES = 1_000_000  # ~7 s of training; the whole 3 MB sample takes ~20 s for no test benefit
# the last transformers 4.x and the tokenizers / huggingface_hub it accepts (tokenizers <= 0.23.0, hub < 1.0)
TRANSFORMERS_4 = ("transformers==4.57.6", "tokenizers==0.22.2", "huggingface_hub==0.36.2")


@dataclass(frozen=True)
class PreparedData:
    """Shard folders prepared with `tokenizer` from the fetched text: 8 train shards, 1 validation shard."""

    train: str
    valid: str
    tokenizer: str

    def config(self, **overrides) -> DataConfig:
        """A DataConfig over these shards, tiny.yaml's input length, plus `overrides`."""
        base = DataConfig(train=self.train, valid=self.valid, tokenizer=self.tokenizer, input_length=64,
                          workers=1, shuffle_buffer=64)
        return dataclasses.replace(base, **overrides)


def _key(*parts: object, code: tuple[str, ...]) -> str:
    h = hashlib.sha256()
    for part in parts:
        h.update(repr(part).encode())
    for rel in code:
        h.update((REPO / rel).read_bytes())
    return h.hexdigest()[:16]


def _build_once(folder: Path, build) -> Path:
    """Run build(tmp) unless `folder` exists; the result appears atomically under `folder`."""
    if not folder.is_dir():
        tmp = folder.with_name(f"{folder.name}.tmp{os.getpid()}")
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
        build(tmp)
        try:
            tmp.rename(folder)
        except OSError:  # another session finished the same build first
            shutil.rmtree(tmp, ignore_errors=True)
    return folder


def _files_digest(files: list[str]) -> list[tuple[str, str]]:
    return [(os.path.basename(f), hashlib.sha256(Path(f).read_bytes()).hexdigest()) for f in files]


@pytest.fixture(scope="session")
def data_cache() -> Path:
    return fetch_module.default_cache()


@pytest.fixture(scope="session")
def c4_dir(data_cache: Path) -> Path:
    """Real English text (the gensim Wikipedia sample + news) as 8 c4-train files and 1 c4-validation file."""
    key = _key(code=("pretrain/data/fetch.py", "pretrain/data/documents.py"))
    return _build_once(data_cache / "test-fixtures" / f"c4-{key}",
                       lambda tmp: fetch_module.fetch(tmp, data_cache, num_train_files=8))


@pytest.fixture(scope="session")
def tokenizer_model(c4_dir: Path, data_cache: Path) -> str:
    """Path to a tiny T5-style spiece.model: 1000 pieces + 100 sentinels = 1100 ids."""
    files = expand_glob(str(c4_dir / "c4-train.*.json.gz"))
    key = _key(_files_digest(files), TOKENIZER_PIECES, TOKENIZER_SAMPLE_BYTES,
               code=("tokenizer/train.py", "pretrain/data/documents.py"))
    folder = _build_once(data_cache / "test-fixtures" / f"tokenizer-{key}",
                         lambda tmp: train(files, tmp, TOKENIZER_PIECES, TOKENIZER_SAMPLE_BYTES, seed=0))
    return str(folder / "spiece.model")


@pytest.fixture(scope="session")
def shards(c4_dir: Path, tokenizer_model: str, data_cache: Path) -> PreparedData:
    """Train shards (8: enough for 2 DP ranks x 2 workers) and validation shards made with `tokenizer_model`.

    The cache key includes the shard format version, so fixtures of an older format are rebuilt."""
    train_files = expand_glob(str(c4_dir / "c4-train.*.json.gz"))
    valid_files = expand_glob(str(c4_dir / "c4-validation.*.json.gz"))
    key = _key(_files_digest(train_files + valid_files), hashlib.sha256(Path(tokenizer_model).read_bytes()).hexdigest(),
               FORMAT_VERSION,
               code=("pretrain/data/prepare.py", "pretrain/data/shards.py", "pretrain/data/documents.py", "tokenizer/spm.py"))

    def build(tmp: Path) -> None:
        prepare(train_files, tmp / "train", tokenizer_model, workers=2)  # the default pack size, as the SLURM
        prepare(valid_files, tmp / "valid", tokenizer_model, workers=1)  # pipeline test compares byte for byte

    folder = _build_once(data_cache / "test-fixtures" / f"shards-{key}", build)
    return PreparedData(train=str(folder / "train"), valid=str(folder / "valid"), tokenizer=tokenizer_model)


@pytest.fixture(scope="session")
def transformers4_python(data_cache: Path) -> Path:
    """The interpreter of a virtual environment holding TRANSFORMERS_4 over the project's site-packages (a .pth
    file adds them after its own, so its transformers shadows the pinned 5.x and torch is the project's). Built
    with pip from PyPI once per machine and project environment (~40 s), keyed on both."""
    project = str(Path(sysconfig.get_path("purelib")).resolve())  # worktrees may reach one venv through links
    key = _key(TRANSFORMERS_4, project, sys.version, code=())

    def build(tmp: Path) -> None:
        subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(tmp)], check=True)
        own = Path(sysconfig.get_path("purelib", vars={"base": str(tmp), "platbase": str(tmp)}))
        (own / "project.pth").write_text(f"import site; site.addsitedir({project!r})\n")
        # pip (the project's, found through the .pth) installs into this environment and leaves the project's alone
        subprocess.run([str(tmp / "bin" / "python"), "-m", "pip", "install", "--quiet", "--disable-pip-version-check",
                        *TRANSFORMERS_4], check=True)

    return _build_once(data_cache / "test-fixtures" / f"transformers4-{key}", build) / "bin" / "python"



def _work_unit(nodeid: str) -> str:
    """The unit pytest-xdist hands one worker (`make test` runs two): the SLURM cluster's tests together (one cluster
    starts; two would hand out the same job ids, and srun jobs derive their rendezvous port from the id), a module
    with a module-scoped fixture together (the fixture is built once: the study's and the SLURM runs' take minutes),
    every other test alone, to whichever worker is free. Decided from the file's text: the controller never imports
    the tests (and xdist's own `xdist_group` marks do not reach pytest 9's node ids)."""
    path = nodeid.split("::", 1)[0]
    text = _test_file_text(path)
    if "slurm_cluster" in text:
        return "slurm"
    return path if 'scope="module"' in text else nodeid


@functools.cache
def _test_file_text(path: str) -> str:
    file = REPO / path
    return file.read_text() if file.is_file() else ""


def pytest_xdist_make_scheduler(config: pytest.Config, log):
    from xdist.scheduler import LoadScopeScheduling

    class SharedFixtureScheduling(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            return _work_unit(nodeid)

    return SharedFixtureScheduling(config, log)
