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
import fcntl
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

# one real SLURM cluster per session, for the tests that ask for it; how the xdist workers share the suite
pytest_plugins = ("tests.slurm_cluster", "tests.scheduling")

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
                          workers=1, shuffle_buffer=64, streams=8)  # a stream per shard: DP 1, 2, 4 and 8
        return dataclasses.replace(base, **overrides)


def _key(*parts: object, code: tuple[str, ...]) -> str:
    h = hashlib.sha256()
    for part in parts:
        h.update(repr(part).encode())
    for rel in code:
        h.update((REPO / rel).read_bytes())
    return h.hexdigest()[:16]


def _build_once(folder: Path, build) -> Path:
    """Run build(tmp) unless `folder` exists; the result appears atomically under `folder`. One build at a time per
    folder: another xdist worker or session that needs it waits for that build rather than running the same one
    beside it (on a fresh machine both workers' first tests need the text, tokenizer and shards)."""
    if folder.is_dir():
        return folder
    folder.parent.mkdir(parents=True, exist_ok=True)
    with open(folder.with_name(f"{folder.name}.lock"), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file closes, also when build() raises
        if not folder.is_dir():
            tmp = folder.with_name(f"{folder.name}.tmp{os.getpid()}")
            shutil.rmtree(tmp, ignore_errors=True)
            tmp.mkdir(parents=True)
            build(tmp)
            tmp.rename(folder)
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
def polarity_dir(data_cache: Path) -> Path:
    """The Pang & Lee sentence-polarity set in SST-2's layout (500 dev, 500 test sentences), as `make demo` writes it.
    Session-wide, not per module: a module fixture would bind its file's tests into one unit of work
    (tests/scheduling.py)."""
    from pretrain.tasks.polarity import fetch_polarity

    folder = _build_once(data_cache / "test-fixtures" / f"polarity-{_key(code=('pretrain/tasks/polarity.py',))}",
                         lambda tmp: fetch_polarity(tmp / "SST-2", data_cache / "downloads"))
    return folder / "SST-2"


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
