"""A study's config (variants x seeds x tasks, the shared pretraining and fine-tuning settings), its cells, each cell's
arguments, and each cell's row read back from the cell's own files (metrics.jsonl, results.json, the export)."""
from __future__ import annotations

import dataclasses
import itertools
import json
import re
from dataclasses import dataclass, field
from pathlib import Path

from pretrain.core.config import ConfigError, ModelConfig
from pretrain.tasks.metrics import COVERAGE

REPO = Path(__file__).resolve().parents[2]


TEXT_ONLY = ("variant", "encoder", "decoder", "settings", "status")


FETCHED_TASKS = ("polarity", "pair")  # the task folders data.fetch makes (prepare_data)


SCRATCH = "scratch"  # row keys "scratch/TASK/METRIC": the task fine-tuned from a random initialisation


# --------------------------------------------------------------------------------------------------------
# Configuration (configs/study/*.yaml)
# --------------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Variant:
    encoder: str = "vanilla"  # model.encoder_attention: a mixer or a mixture "a+b"
    decoder: str = "vanilla"  # model.decoder_attention
    model: list[str] = field(default_factory=list)  # this variant's other model settings: [position_bias=none, ...]
    name: str = ""  # label in tables and figures; default the encoder setting (encoder/decoder when they differ),
    # then the model settings in brackets: random(position_bias=none)

    def __hash__(self) -> int:  # the dataclass's own hashes the list and fails; cells are dict keys
        return hash((self.encoder, self.decoder, tuple(self.model), self.name))

    @property
    def settings(self) -> str:
        """The variant's own model settings as one text ("" for none): rows and verdicts tell variants apart by it."""
        return ", ".join(self.model)

    @property
    def label(self) -> str:
        mixers = self.encoder if self.encoder == self.decoder else f"{self.encoder}/{self.decoder}"
        return self.name or (f"{mixers}({self.settings})" if self.model else mixers)


@dataclass(frozen=True)
class StudyTask:
    name: str = "polarity"  # label; configs/finetune/NAME.yaml unless `config` is set
    config: str = ""  # fine-tuning config file
    data: str = ""  # the task's folder; empty: the fetched set of `polarity` or `pair` (data.fetch)


@dataclass(frozen=True)
class GridConfig:
    dir: str = "runs/study"  # the study folder
    variants: list[Variant] = field(default_factory=lambda: [Variant()])
    seeds: list[int] = field(default_factory=lambda: [1, 2])  # run.seed of each cell
    tasks: list[StudyTask] = field(default_factory=list)  # fine-tuning tasks (empty: pretraining only)
    processes: int = 1  # processes per pretraining / fine-tuning (torchrun via launch.local when > 1)
    concurrent: int = 1  # cells run at once by `python -m pretrain.study` (e.g. 2 one-process jobs on 2 cores)


@dataclass(frozen=True)
class StudyDataConfig:
    fetch: bool = True  # make demo's data chain into `dir`: real text, tokenizer, shards, polarity set, pair probe
    dir: str = ""  # where fetched data goes (default: study.dir/data); reused when already there
    vocab_size: int = 1000  # tokenizer pieces (+ 100 sentinels) when fetching
    train: str = ""  # shards, valid shards and spiece.model when not fetching
    valid: str = ""
    tokenizer: str = ""


@dataclass(frozen=True)
class StageConfig:
    config: str = "configs/tiny.yaml"  # the job's config file (pretraining; fine-tuning uses each task's)
    overrides: list[str] = field(default_factory=list)  # section.key=value for every cell's job


@dataclass(frozen=True)
class StudyConfig:
    study: GridConfig = field(default_factory=GridConfig)
    data: StudyDataConfig = field(default_factory=StudyDataConfig)
    pretrain: StageConfig = field(default_factory=StageConfig)
    finetune: StageConfig = field(default_factory=lambda: StageConfig(config=""))


def check_study(cfg: StudyConfig) -> None:
    labels = [v.label for v in cfg.study.variants]
    if not labels or not cfg.study.seeds:
        raise ConfigError("study.variants and study.seeds must each list at least one entry")
    if len(set(labels)) != len(labels):
        raise ConfigError(f"study.variants: two variants are labelled the same ({labels}); set their name")
    keys = [f.name for f in dataclasses.fields(ModelConfig) if f.name not in ("encoder_attention", "decoder_attention")]
    for variant in cfg.study.variants:
        for setting in variant.model:
            key = setting.partition("=")[0]
            if "=" not in setting or key not in keys:
                raise ConfigError(f"study.variants '{variant.label}': model setting '{setting}' is not KEY=VALUE of a "
                                  f"model key (encoder and decoder are the variant's own; e.g. position_bias=none)")
    if cfg.study.processes < 1 or cfg.study.concurrent < 1:
        raise ConfigError(f"study.processes ({cfg.study.processes}) and study.concurrent ({cfg.study.concurrent}) "
                          "must be >= 1")
    if not cfg.data.fetch and not (cfg.data.train and cfg.data.tokenizer):
        raise ConfigError("data.fetch is false: set data.train, data.valid and data.tokenizer")
    for task in cfg.study.tasks:
        if not task.data and not (cfg.data.fetch and task.name in FETCHED_TASKS):
            raise ConfigError(f"study.tasks '{task.name}': set its data folder (only {' and '.join(FETCHED_TASKS)} "
                              "are fetched)")


# --------------------------------------------------------------------------------------------------------
# Cells and their commands
# --------------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Cell:
    variant: Variant
    seed: int
    dir: Path

    @property
    def title(self) -> str:
        return f"{self.variant.label} seed {self.seed}"


def slug(label: str) -> str:
    """A file-name form of a variant label: 'random+vanilla' -> 'random-vanilla', 'random(position_bias=none)' ->
    'random-position_bias-none'."""
    return re.sub(r"[^A-Za-z0-9_.]+", "-", label).strip("-")


def cells(cfg: StudyConfig) -> list[Cell]:
    root = Path(cfg.study.dir).resolve() / "cells"  # absolute: the jobs run from the repository root
    return [Cell(v, s, root / f"{slug(v.label)}-s{s}") for v, s in itertools.product(cfg.study.variants, cfg.study.seeds)]


def data_paths(cfg: StudyConfig) -> dict[str, str]:
    """data.train / data.valid / data.tokenizer for the jobs, and `polarity` and `pair`, the fetched task folders."""
    if not cfg.data.fetch:
        return {"train": cfg.data.train, "valid": cfg.data.valid, "tokenizer": cfg.data.tokenizer, "polarity": "",
                "pair": ""}
    root = Path(cfg.data.dir or Path(cfg.study.dir) / "data").resolve()
    return {"train": str(root / "shards" / "train"), "valid": str(root / "shards" / "valid"),
            "tokenizer": str(root / "tokenizer" / "spiece.model"), "polarity": str(root / "polarity"),
            "pair": str(root / "pair")}


def pretrain_args(cfg: StudyConfig, cell: Cell) -> list[str]:
    """`pretrain.train`'s arguments for `cell`. Cells of one seed differ only in the attention settings and
    run.dir: the same data order (a function of run.seed) and, through the model's name-keyed initialisation,
    the same initial values of the parameters they share; that pairs them."""
    data = data_paths(cfg)
    return ["--config", cfg.pretrain.config, *cfg.pretrain.overrides, f"run.dir={cell.dir / 'pretrain'}",
            f"run.seed={cell.seed}", f"model.encoder_attention={cell.variant.encoder}",
            f"model.decoder_attention={cell.variant.decoder}", *(f"model.{s}" for s in cell.variant.model),
            f"data.train={data['train']}", f"data.valid={data['valid']}", f"data.tokenizer={data['tokenizer']}"]


# --------------------------------------------------------------------------------------------------------
# Rows: every number read back from the cell's own files
# --------------------------------------------------------------------------------------------------------
def read_metrics(run_dir: Path) -> list[dict]:
    path = run_dir / "metrics.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()] if path.is_file() else []


def pretrain_figures(records: list[dict]) -> dict[str, float]:
    """tokens/s: the mean over logged windows but the first (it holds start-up and warm-up, when there are
    several); eval loss and token accuracy: the last evaluation."""
    speeds = [r["tokens_per_s"] for r in records if "tokens_per_s" in r]
    speeds = speeds[1:] if len(speeds) > 1 else speeds
    evals = [r for r in records if "eval_loss" in r]
    out = {"tokens_per_s": sum(speeds) / len(speeds) if speeds else float("nan")}
    out["eval_loss"] = evals[-1]["eval_loss"] if evals else float("nan")
    out["eval_accuracy"] = evals[-1]["eval_accuracy"] if evals else float("nan")
    return out


def downstream_figures(task: str, results: dict[str, dict[str, float]]) -> dict[str, float]:
    """results.json {split: {metric: value}} -> {"task/metric"} (one split) or {"task/split/metric"}; the counts of
    examples beside the metrics are left out."""
    results = {split: {k: v for k, v in scores.items() if k not in COVERAGE} for split, scores in results.items()}
    if len(results) == 1:
        return {f"{task}/{k}": v for scores in results.values() for k, v in scores.items()}
    return {f"{task}/{split}/{k}": v for split, scores in results.items() for k, v in scores.items()}


def count_parameters(export: Path) -> int:
    from safetensors import safe_open

    with safe_open(str(export / "model.safetensors"), "pt") as f:
        total = 0
        for key in f.keys():
            n = 1
            for d in f.get_slice(key).get_shape():
                n *= d
            total += n
    return total


def _identity(cell: Cell) -> dict:
    v = cell.variant
    return {"variant": v.label, "encoder": v.encoder, "decoder": v.decoder, "settings": v.settings, "seed": cell.seed}


def cell_row(cfg: StudyConfig, cell: Cell) -> dict:
    row = {**_identity(cell), "status": "ok", "parameters": count_parameters(cell.dir / "export")}
    row.update(pretrain_figures(read_metrics(cell.dir / "pretrain")))
    for task in cfg.study.tasks:
        for folder, prefix in (("finetune", task.name), (SCRATCH, f"{SCRATCH}/{task.name}")):
            results = json.loads((cell.dir / folder / task.name / "results.json").read_text())
            row.update(downstream_figures(prefix, results))
    return row


def collect(cfg: StudyConfig) -> list[dict]:
    """One row per cell: its cell.json, or its variant, seed and what became of it."""
    rows = []
    for cell in cells(cfg):
        if (cell.dir / "cell.json").is_file():
            rows.append(json.loads((cell.dir / "cell.json").read_text()))
            continue
        status = "not run"
        if (cell.dir / "failed.json").is_file():
            failed = json.loads((cell.dir / "failed.json").read_text())
            status = f"failed at {failed['stage']} (exit {failed['exit_code']}; {failed['log']})"
        rows.append({**_identity(cell), "status": status})
    return rows
