"""Run configuration: one frozen dataclass per section, loaded from YAML plus `section.key=value` overrides.

Precedence is dataclass defaults < YAML file < command line (merged by OmegaConf). A user mistake (an
unknown key, a value of the wrong type or out of range, a missing file) is a `ConfigError` whose message is one
line naming the key and the closest valid key, the expected type or the allowed range; `parse_args` turns it
into that line on stderr and exit code 2, never a traceback. A section's single-key rules are its
`__post_init__`; rules across sections and the launch are `pretrain.planning.planner.check_job`'s.
"""
from __future__ import annotations

import dataclasses
import difflib
import math
import re
import sys
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import NoReturn, Sequence, TypeVar, Union

import yaml
from omegaconf import OmegaConf
from omegaconf.errors import ConfigKeyError, OmegaConfBaseException, ValidationError

from pretrain.core.cli import exit_on_help
from pretrain.core.files import write_atomic

T = TypeVar("T")


class UsageError(ValueError):
    """A user mistake (bad config value, missing or wrong input file, an impossible layout): the entry points
    print its one-line message and exit 2. Every other exception is a bug or an environment failure and keeps
    its traceback (exit 1). It subclasses ValueError only so that callers catching ValueError keep working."""


class ConfigError(UsageError):
    """A mistake in a config file or an override; the message is one line meant for the user."""


def check_choice(key: str, value: object, choices: Sequence[object]) -> None:
    """A key whose value is one of a few names: `key 'value' is not one of a, b, c`."""
    if value not in choices:
        raise ConfigError(f"{key} '{value}' is not one of {', '.join(map(str, choices))}")


def check_at_least(section: str, cfg: object, lows: dict[str, float]) -> None:
    """A section's single-key lower bounds (its `__post_init__` calls this): `section.key (value) must be >= low`."""
    for key, low in lows.items():
        if not getattr(cfg, key) >= low:  # also NaN
            raise ConfigError(f"{section}.{key} ({getattr(cfg, key)}) must be >= {low}")


def check_above(section: str, cfg: object, keys: Sequence[str]) -> None:
    """Keys that must be > 0 (a scale, an epsilon): `section.key (value) must be > 0`."""
    for key in keys:
        if not getattr(cfg, key) > 0:  # also NaN
            raise ConfigError(f"{section}.{key} ({getattr(cfg, key)}) must be > 0")


def check_fraction(section: str, cfg: object, keys: Sequence[str]) -> None:
    """Keys that are a rate in [0, 1) (dropout, a moment's decay): `section.key (value) must be in [0, 1)`."""
    for key in keys:
        if not 0.0 <= getattr(cfg, key) < 1.0:  # also NaN
            raise ConfigError(f"{section}.{key} ({getattr(cfg, key)}) must be in [0, 1)")


# --------------------------------------------------------------------------------------------------------
# The pretraining schema. Field names are the user-facing contract (docs/configuration.md lists every key).
# --------------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class RunConfig:
    dir: str = "runs/default"  # run folder: config.yaml, metrics.jsonl, tensorboard/, checkpoints/
    seed: int = 1234  # every random stream derives from this (and dp rank, worker, epoch)

    def __post_init__(self) -> None:
        if not self.dir.strip():  # Path("") is the current folder: checkpoints would land wherever the job starts
            raise ConfigError("run.dir is empty; name the run folder (run.dir=runs/NAME)")
        check_at_least("run", self, {"seed": 0})


@dataclass(frozen=True)
class ParallelConfig:
    tensor: int = 1  # tensor-parallel size (TP); data-parallel size is world / TP
    backend: str = "auto"  # auto (nccl on CUDA, gloo on CPU), nccl or gloo
    timeout_s: int = 600  # process-group timeout: a dead rank makes the others fail after this long

    def __post_init__(self) -> None:
        check_at_least("parallel", self, {"tensor": 1, "timeout_s": 1})  # dividing the world size: pretrain.distributed.parallel
        check_choice("parallel.backend", self.backend, ("auto", "nccl", "gloo"))


@dataclass(frozen=True)
class ZeroConfig:
    stage: int = 1  # DeepSpeed ZeRO stage 0-3, sharded over the data-parallel group only
    overlap_comm: bool = True  # overlap the gradient reduction with the backward (ZeRO 1-3)
    reduce_bucket_size: int = 200_000_000  # elements per gradient reduce-scatter bucket
    allgather_bucket_size: int = 200_000_000  # elements per parameter all-gather bucket (ZeRO 1-2)

    def __post_init__(self) -> None:
        if self.stage not in (0, 1, 2, 3):
            raise ConfigError(f"zero.stage ({self.stage}) must be 0, 1, 2 or 3")
        check_at_least("zero", self, {"reduce_bucket_size": 1, "allgather_bucket_size": 1})


@dataclass(frozen=True)
class ModelConfig:
    vocab_size: int = 0  # token ids (0: the tokenizer's; else its ids to twice them); rows padded to 128 x TP
    d_model: int = 512  # hidden width of every layer
    d_ff: int = 1024  # gated-GELU hidden width
    d_kv: int = 64  # per-head width
    num_heads: int = 6  # attention heads (a multiple of parallel.tensor)
    num_layers: int = 8  # encoder layers
    num_decoder_layers: int = 8  # decoder layers
    max_length: int = 512  # N: synthesized logits are N x N and sliced to [:n, :m]
    encoder_attention: str = "vanilla"  # a mixer name or a mixture "a+b[+c]"
    decoder_attention: str = "vanilla"  # same forms as encoder_attention, for decoder self-attention
    factorized_k: int = 8  # rank k of factorized_random (R1 R2^T, R1, R2 in R^{N x k})
    mixture_per_head: bool = False  # one mixture weight vector per head instead of per layer
    relative_attention_num_buckets: int = 32  # T5 relative position buckets (vanilla attention)
    relative_attention_max_distance: int = 128  # distance beyond which positions share a bucket
    dropout: float = 0.0  # dropout rate in [0, 1) (T5 v1.1 pretrains with 0)
    layer_norm_eps: float = 1e-6  # RMS norm epsilon
    initializer_factor: float = 1.0  # T5's init scale (1.0 in all released checkpoints)
    position_bias: str = "all"  # T5's relative bias: all (after mixing), vanilla (on Q K^T, before mixing), none
    synthesizer_init: str = "mesh_tf"  # how synthesizer parameters start: mesh_tf (near-uniform attention) or t5

    def __post_init__(self) -> None:
        for key, allowed in (("position_bias", POSITION_BIAS), ("synthesizer_init", SYNTHESIZER_INIT)):
            if getattr(self, key) not in allowed:
                raise ConfigError(f"model.{key} '{getattr(self, key)}' must be one of {', '.join(allowed)}")
        if self.vocab_size < 0:
            raise ConfigError(f"model.vocab_size ({self.vocab_size}) must be >= 0 (0: the tokenizer's ids)")
        check_at_least("model", self, {"d_model": 1, "d_ff": 1, "d_kv": 1, "num_heads": 1, "num_layers": 1,
                                       "num_decoder_layers": 1, "max_length": 1, "factorized_k": 1,
                                       "relative_attention_num_buckets": 4, "relative_attention_max_distance": 1})
        check_fraction("model", self, ("dropout",))
        check_above("model", self, ("layer_norm_eps", "initializer_factor"))


POSITION_BIAS = ("all", "vanilla", "none")  # docs/model.md, "Position bias"
SYNTHESIZER_INIT = ("mesh_tf", "t5")  # docs/model.md, "Initial scale"
# Model keys added after checkpoints and exports were first written, with the value a saved model config without the
# key means: the behaviour before the key existed (pretrain/model/hf_synthesizer/ keeps the same table for exports)
MODEL_KEYS_ADDED = {"position_bias": "all", "synthesizer_init": "t5"}


def saved_model_config(saved: dict) -> ModelConfig:
    """The ModelConfig of a checkpoint's config.yaml or an export's config.json (`model` section), older ones too."""
    return ModelConfig(**{**MODEL_KEYS_ADDED, **saved})


PRECISIONS = ("fp32", "bf16", "fp16")
OPTIMIZERS = ("adamw", "adafactor")
SCHEDULES = ("inverse_sqrt", "cosine")  # pretrain.runtime.schedule


@dataclass(frozen=True)
class TrainConfig:
    steps: int = 1000  # optimizer steps of the whole schedule
    micro_batch: Union[int, str] = 8  # sequences per rank per forward pass, or auto (the largest that fits, see pretrain.plan)
    global_batch: int = 8  # micro_batch x gradient accumulation x DP
    exit_after: int = 0  # end this run after K steps with a checkpoint (0: run to `steps`)
    optimizer: str = "adamw"  # adamw or adafactor
    lr: Union[float, int, str] = 1e-3  # peak learning rate, or auto (fine-tuning: set by the export's d_model)
    weight_decay: float = 0.0  # decoupled; never applied to norms
    beta1: float = 0.9  # AdamW first-moment decay
    beta2: float = 0.999  # AdamW second-moment decay
    schedule: str = "inverse_sqrt"  # inverse_sqrt (T5) or cosine
    warmup_steps: int = 100  # steps of linear warmup to lr
    min_lr: float = 0.0  # cosine floor
    grad_clip: float = 1.0  # global-norm clipping (0: off)
    max_skipped_steps: int = 10  # non-finite losses tolerated before the run stops
    activation_checkpointing: str = "none"  # none, full (layers) or selective (core attention); true/false = full/none
    compile: bool = False  # torch.compile each encoder and decoder layer

    def __post_init__(self) -> None:
        check_at_least("train", self, {"steps": 1, "global_batch": 1, "exit_after": 0, "max_skipped_steps": 0,
                                       "warmup_steps": 0, "weight_decay": 0, "min_lr": 0, "grad_clip": 0})
        if self.micro_batch != "auto" and not (isinstance(self.micro_batch, int) and self.micro_batch >= 1):
            raise ConfigError(f"train.micro_batch ({self.micro_batch}) must be an integer >= 1 or auto")
        check_fraction("train", self, ("beta1", "beta2"))
        check_choice("train.optimizer", self.optimizer, OPTIMIZERS)
        check_choice("train.schedule", self.schedule, SCHEDULES)
        if self.lr != "auto":  # auto: fine-tuning's width rule (pretrain.runtime.schedule.with_finetune_lr)
            try:  # a number; YAML reads 1e-3 (no dot) as text, and the frozen field is set once, here
                object.__setattr__(self, "lr", float(self.lr))
            except ValueError:
                raise ConfigError(f"train.lr '{self.lr}' must be a number > 0 or auto") from None
            if not self.lr > 0:  # also NaN
                raise ConfigError(f"train.lr ({self.lr}) must be > 0: it is the peak learning rate, and 0 trains "
                                  "nothing")


SOURCE_NAME = re.compile(r"[A-Za-z0-9_.-]+")  # a source's name is a metric key's last part (tokens_seen/NAME)
WEIGHT_SUM_TOLERANCE = 1e-6  # 0.1 + 0.2 is 0.30000000000000004: a sum this close to 1 is taken as 1


@dataclass(frozen=True)
class SourceConfig:
    """One corpus of a mixture (`data.sources`); pretrain.data.sources puts the sources in one global order."""

    name: str = ""  # the source's key in metrics (tokens_seen/NAME) and checkpoints: letters, digits, _ . -
    train: str = ""  # its train shards, in any form data.train takes
    weight: float = 0.0  # its share of the examples, > 0; the weights of data.sources sum to 1
    valid: str = ""  # its validation shards (optional): eval_loss/NAME beside eval_loss

    def __post_init__(self) -> None:
        if not SOURCE_NAME.fullmatch(self.name):
            raise ConfigError(f"data.sources: the name {self.name!r} (train {self.train!r}) must be letters, digits, "
                              "_ . or - (it names the source's metrics, e.g. tokens_seen/c4)")
        if not self.train.strip():
            raise ConfigError(f"data.sources {self.name!r}: train is empty; give its shards (a directory, glob, "
                              "brace pattern or URL)")
        if not self.weight > 0:  # also NaN
            raise ConfigError(f"data.sources {self.name!r}: weight ({self.weight}) must be > 0: its share of the "
                              "examples (leave the source out to train without it)")


MIN_INPUT_LENGTH = 3  # data.input_length: a chunk of 2 tokens (the least span corruption splits) corrupts to 3


@dataclass(frozen=True)
class DataConfig:
    train: str = ""  # shards: a directory, glob, brace pattern or webdataset URL
    valid: str = ""  # same forms; empty: no evaluation data
    sources: list[SourceConfig] = field(default_factory=list)  # a mixture instead of train: [{name, train, weight}]
    reweight: bool = False  # resume with another data.sources: unchanged sources keep their positions
    tokenizer: str = ""  # path to spiece.model
    input_length: int = 512  # encoder length after span corruption; targets length follows (568 -> 114)
    noise_density: float = 0.15  # fraction of input tokens masked by span corruption, in (0, 1)
    mean_noise_span_length: float = 3.0  # mean length of a masked span, at least 1
    workers: int = 1  # DataLoader worker processes per rank (at most one per data stream the rank owns)
    streams: int = 0  # lanes the train data is dealt to (0: 64, whatever the shards); every DP size must divide it
    shuffle_buffer: int = 1000  # chunks held by the seeded shuffle buffer
    max_damaged_share: float = 0.2  # the run stops once damaged shards lost more than this share of data.train
    http_timeout_s: float = 60.0  # http(s) shards: seconds per connection attempt and per read
    http_retries: int = 6  # http(s) shards: failed attempts retried in a row, with backoff 1, 2, 4 ... 60 s

    def __post_init__(self) -> None:
        check_at_least("data", self, {"workers": 0, "http_retries": 0, "shuffle_buffer": 1, "streams": 0,
                                      "input_length": MIN_INPUT_LENGTH})
        if not 0 < self.noise_density < 1:  # also NaN; span_corruption's length search needs it
            raise ConfigError(f"data.noise_density ({self.noise_density}) must be > 0 and < 1: the share of each "
                              "chunk's tokens that span corruption masks (T5: 0.15)")
        if not self.mean_noise_span_length >= 1:
            raise ConfigError(f"data.mean_noise_span_length ({self.mean_noise_span_length}) must be >= 1: the mean "
                              "length in tokens of a masked span (T5: 3)")
        if not 0 <= self.max_damaged_share <= 1:
            raise ConfigError(f"data.max_damaged_share ({self.max_damaged_share}) must be >= 0 and <= 1")
        if not self.http_timeout_s > 0:
            raise ConfigError(f"data.http_timeout_s ({self.http_timeout_s}) must be > 0")
        if self.sources:
            self._check_sources()

    def _check_sources(self) -> None:
        if self.train:
            raise ConfigError("data.train and data.sources are both set: data.train is the one-source form of "
                              "data.sources; set one of them (data.train= to use the mixture)")
        names = [s.name for s in self.sources]
        if twice := sorted({n for n in names if names.count(n) > 1}):
            raise ConfigError(f"data.sources names {', '.join(repr(n) for n in twice)} more than once: each source "
                              "needs a name of its own (its metrics and checkpoint positions key on it)")
        total = math.fsum(s.weight for s in self.sources)
        if abs(total - 1) > WEIGHT_SUM_TOLERANCE:  # refused, not normalised: 0.7 + 0.2 is more likely a typo
            given = ", ".join(f"{s.name} {s.weight:g}" for s in self.sources)
            shares = ", ".join(f"{s.name} {s.weight / total:.4g}" for s in self.sources)
            raise ConfigError(f"data.sources weights sum to {total:g} ({given}), not 1: each weight is its source's "
                              f"share of the examples; to keep their ratio, set {shares}")


@dataclass(frozen=True)
class CheckpointConfig:
    every: int = 1000  # steps between checkpoints (0: only at the end)
    keep: int = 3  # newest checkpoints kept
    resume: str = "auto"  # without checkpoints of its own: auto (fresh), a checkpoint path, none (refused if any)
    # (named async_save: `async` is a Python keyword, and so cannot be a dataclass field)
    async_save: bool = False  # periodic saves copy the state to host memory and write it in the background

    def __post_init__(self) -> None:
        check_at_least("checkpoint", self, {"every": 0, "keep": 1})  # keep 0 would keep the newest anyway


@dataclass(frozen=True)
class LogConfig:
    every: int = 10  # steps between metrics lines
    peak_flops: float = 0.0  # device peak FLOP/s for MFU (0: measured matmul rate on CPU, table on GPU)
    wandb: str = ""  # Weights & Biases project to mirror the metrics to ("": off; WANDB_MODE=offline works offline)
    straggler_factor: float = 1.2  # warn when a rank's step exceeds the median's by this factor 3 log steps running

    def __post_init__(self) -> None:
        check_at_least("log", self, {"every": 1, "peak_flops": 0})
        if not self.straggler_factor >= 1:  # also NaN; below 1 every rank but the fastest is a straggler
            raise ConfigError(f"log.straggler_factor ({self.straggler_factor}) must be >= 1: how many times the "
                              "median step time a rank may take before it is named a straggler")


@dataclass(frozen=True)
class ProfileConfig:
    enabled: bool = False  # write a torch.profiler trace per rank to run.dir/profile/ (pretrain.runtime.profiling)
    start: int = 10  # the first profiled step (counted from 1, as in metrics.jsonl)
    steps: int = 3  # how many steps the trace covers
    ranks: list[int] = field(default_factory=list)  # global ranks that trace ([]: all)
    memory: bool = False  # also a CUDA memory snapshot of the same steps (ignored on CPU)
    shapes: bool = False  # record operator input shapes (larger traces)
    stacks: bool = False  # record Python stacks of operators (much larger traces, slower steps)

    def __post_init__(self) -> None:
        check_at_least("profile", self, {"start": 1, "steps": 1})
        wrong = [r for r in self.ranks if r < 0] or [r for r in set(self.ranks) if self.ranks.count(r) > 1]
        if wrong:
            raise ConfigError(f"profile.ranks {list(self.ranks)}: rank {wrong[0]} is negative or named twice; "
                              "list global ranks once each, or [] for all")


@dataclass(frozen=True)
class EvalConfig:
    every: int = 0  # steps between evaluations (0: off)
    batches: int = 4  # global batches of the fixed validation slice (the same examples on every layout)

    def __post_init__(self) -> None:
        check_at_least("eval", self, {"every": 0, "batches": 0})
        if self.every and not self.batches:  # an evaluation of no examples, every `every` steps
            raise ConfigError(f"eval.batches (0) must be >= 1 when eval.every ({self.every}) is on; "
                              "eval.every=0 turns evaluation off")


@dataclass(frozen=True)
class JobConfig:
    """The sections every job shares, those the job skeleton reads (pretrain.runtime.jobs.run_job); a job's schema
    extends it with its own (Config: pretraining's; pretrain.core.finetune_config.FinetuneConfig)."""

    run: RunConfig = field(default_factory=RunConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    zero: ZeroConfig = field(default_factory=ZeroConfig)
    precision: str = "fp32"  # fp32, bf16 or fp16 (with loss scaling)
    train: TrainConfig = field(default_factory=TrainConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    log: LogConfig = field(default_factory=LogConfig)
    profile: ProfileConfig = field(default_factory=ProfileConfig)

    def __post_init__(self) -> None:
        check_choice("precision", self.precision, PRECISIONS)


@dataclass(frozen=True)
class Config(JobConfig):
    init: str = ""  # start from these weights: an export (pretrain.export) or a HuggingFace T5 v1.1 folder
    init_resize_vocab: bool = False  # init: keep the token rows that fit a vocabulary of another size or tokenizer
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)


# --------------------------------------------------------------------------------------------------------
# Loading
# --------------------------------------------------------------------------------------------------------
def _all_keys(schema: type) -> list[str]:
    hints = {f.name: f for f in dataclasses.fields(schema)}
    keys = []
    for name, f in hints.items():
        default = f.default_factory() if f.default_factory is not dataclasses.MISSING else f.default
        keys.append(name)
        if dataclasses.is_dataclass(default):
            keys += [f"{name}.{k}" for k in _all_keys(type(default))]
    return keys


def _explain(err: OmegaConfBaseException, schema: type) -> str:
    key = getattr(err, "full_key", None) or "?"
    if isinstance(err, ConfigKeyError) or "not in struct" in str(err) or "Key '" in str(err):
        # compare within the section, so a shared "model." prefix does not make every key look close
        section, _, leaf = key.rpartition(".")
        siblings = [k.rpartition(".")[2] for k in _all_keys(schema) if k.rpartition(".")[0] == section]
        close = difflib.get_close_matches(leaf, siblings, n=1, cutoff=0.6)
        # a key without its section, or in another one (`steps=4`, `model.steps=4`): the sections that hold it
        elsewhere = [k for k in _all_keys(schema) if k.rpartition(".")[2] == leaf and k != key]
        if close:
            hint = f"; did you mean '{section + '.' if section else ''}{close[0]}'?"
        elif elsewhere:
            hint = f"; did you mean {' or '.join(repr(k) for k in elsewhere)}?"
        else:
            hint = ""
        return f"unknown config key '{key}'{hint}"
    if isinstance(err, ValidationError):
        msg = str(err).splitlines()[0]
        return f"bad value for config key '{key}': {msg}"
    return f"config error at '{key}': {str(err).splitlines()[0]}"


def _list_items(schema: type) -> dict[str, type]:
    """{field: item class} of the fields that hold a list of dataclasses (data.sources)."""
    out = {}
    for name, hint in typing.get_type_hints(schema).items():
        args = typing.get_args(hint)
        if typing.get_origin(hint) is list and args and dataclasses.is_dataclass(args[0]):
            out[name] = args[0]
    return out


def _check_list(value: object, item: type, key: str) -> None:
    """A list of `item`s (data.sources) as given, named where it is not: OmegaConf's errors there name no key, or
    are a TypeError."""
    fields, hints = [f.name for f in dataclasses.fields(item)], typing.get_type_hints(item)
    form = "{" + ", ".join(fields) + "}"
    if not isinstance(value, list):
        raise ConfigError(f"bad value for config key '{key}': a list [{form}, ...], not the {type(value).__name__} "
                          f"{value!r} (on the command line the whole list: {key}=[{{name: a, ...}}, ...])")
    for i, entry in enumerate(value):
        if not isinstance(entry, dict):
            raise ConfigError(f"bad value for config key '{key}[{i}]': a mapping {form}, not the "
                              f"{type(entry).__name__} {entry!r}")
        for k, v in entry.items():
            if k not in fields:
                close = difflib.get_close_matches(str(k), fields, n=1, cutoff=0.6)
                hint = f"; did you mean '{close[0]}'?" if close else f"; its keys are {', '.join(fields)}"
                raise ConfigError(f"unknown config key '{key}[{i}].{k}'{hint}")
            if hints[k] in (int, float) and not _is_number(v, hints[k]):
                raise ConfigError(f"bad value for config key '{key}[{i}].{k}': {v!r} is not a{'n' * (hints[k] is int)} "
                                  f"{hints[k].__name__}")


def _is_number(value: object, kind: type) -> bool:
    if isinstance(value, bool):
        return False
    try:
        return kind(value) == float(value)  # an int key takes 3 and "3", not 3.5
    except (TypeError, ValueError):
        return False


def _check_sections(layer: dict, schema: type, prefix: str = "") -> None:
    """A section given a value instead of its keys (`train: [1, 2]`) is named here: OmegaConf's merge error
    names no key. So is a mistake inside a list of dataclasses (`_check_list`)."""
    sections = {f.name: f.default_factory for f in dataclasses.fields(schema)
                if f.default_factory is not dataclasses.MISSING and dataclasses.is_dataclass(f.default_factory)}
    lists = _list_items(schema)
    for name, value in layer.items():
        if name in lists and value is not None:  # None: OmegaConf's "not Optional" names the key
            _check_list(value, lists[name], prefix + name)
        if name not in sections:
            continue  # a plain key, or an unknown one (OmegaConf's error names it)
        if isinstance(value, dict):
            _check_sections(value, sections[name], f"{prefix}{name}.")
        elif value is not None:  # an empty section (`train:`) is OmegaConf's "not Optional"
            keys = [f"{prefix}{name}.{f.name}" for f in dataclasses.fields(sections[name])][:2]
            raise ConfigError(f"bad value for config key '{prefix}{name}': it is a section of keys ({', '.join(keys)}, "
                              f"...), not the {type(value).__name__} {value!r}")


class _DuplicateKey(yaml.YAMLError):
    pass


class _UniqueKeyLoader(yaml.SafeLoader):
    """YAML's safe loader that refuses a key given twice in one mapping: PyYAML keeps the last, so a section
    named twice (`train:` ... `train:`) lost every key of the first without a word."""

    def construct_mapping(self, node: yaml.MappingNode, deep: bool = False) -> dict:
        seen: dict[object, int] = {}
        for key_node, _ in node.value:
            key = self.construct_object(key_node, deep=True)
            line = key_node.start_mark.line + 1
            if key in seen:
                raise _DuplicateKey(f"the key '{key}' is given twice (lines {seen[key]} and {line}); the second "
                                    "would replace the first and all its keys: merge them into one")
            seen[key] = line
        return super().construct_mapping(node, deep)


def _with_bases(path: Path, seen: tuple[Path, ...] = ()) -> list[dict]:
    """The YAML file at `path` after the files its `base:` key names (relative to it), bases first: size
    configs share one recipe file and state only what differs."""
    if path.is_dir():
        found = sorted(p.name for p in path.glob("*.yaml"))
        listed = ", ".join(found[:4]) + (", ..." if len(found) > 4 else "")
        raise ConfigError(f"the config {path} is a folder; give a YAML file" + (f" in it ({listed})" if found else ""))
    if not path.is_file():
        raise ConfigError(f"config file not found: {path}" + (f" (the base of {seen[-1]})" if seen else ""))
    if path.resolve() in seen:
        raise ConfigError(f"{path} names itself as a base through {', '.join(str(p) for p in seen)}")
    try:
        data = yaml.load(path.read_text(encoding="utf-8"), Loader=_UniqueKeyLoader) or {}
    except UnicodeDecodeError as e:
        raise ConfigError(f"{path} is not UTF-8 text ({e.reason} at byte {e.start}); is it a config file?") from None
    except _DuplicateKey as e:
        raise ConfigError(f"{path}: {e}") from None
    except yaml.YAMLError as e:
        raise ConfigError(f"{path} is not valid YAML: {str(e).splitlines()[0]}") from None
    if not isinstance(data, dict):
        raise ConfigError(f"{path} must hold a mapping of sections, got {type(data).__name__}")
    base = data.pop("base", None)
    if base is None:
        return [data]
    if not isinstance(base, str):
        raise ConfigError(f"{path}: base must name one YAML file, got {base!r}")
    return _with_bases(path.parent / base, seen + (path.resolve(),)) + [data]


def load_config(schema: type[T], path: str | Path | None = None, overrides: Sequence[str] = ()) -> T:
    """Build `schema` from its defaults, then the YAML file at `path` (after the files its `base:` names),
    then `section.key=value` overrides."""
    merged = OmegaConf.structured(schema)
    layers = []
    if path is not None:
        layers += [OmegaConf.create(layer) for layer in _with_bases(Path(path))]
    for item in overrides:
        if "=" not in item or item.startswith("="):
            raise ConfigError(f"override '{item}' is not of the form section.key=value")
    for item in overrides:
        # `key=` is the empty string, as in YAML `key: ''` (OmegaConf would read None, which no key accepts)
        try:
            layers.append(OmegaConf.from_dotlist([item if item.partition("=")[2] else item + "''"]))
        except yaml.YAMLError as e:  # OmegaConf reads each value as YAML: `[{train: a/{0..3}.tar}]` is not
            raise ConfigError(f"override '{item}' is not valid YAML ({str(e).splitlines()[0]}); inside [...] and "
                              "{...} quote values that hold { } [ ] , or : (train: 'DIR/shard-{0..7}.tar')") from None
    try:
        for layer in layers:
            _check_sections(OmegaConf.to_container(layer), schema)
            merged = OmegaConf.merge(merged, layer)
        return OmegaConf.to_object(merged)
    except OmegaConfBaseException as e:
        raise ConfigError(_explain(e, schema)) from None


def to_yaml(cfg) -> str:
    """The resolved config as YAML (what `config.yaml` in the run folder holds), credentials in URLs hidden."""
    from pretrain.core.redact import redact

    return redact(yaml.safe_dump(dataclasses.asdict(cfg), sort_keys=False))


def save_config(cfg, path: str | Path) -> None:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    write_atomic(path, to_yaml(cfg))


def parse_args(schema: type[T], argv: Sequence[str] | None = None, prog: str = "") -> T:
    """`[--config FILE] [section.key=value ...]` -> config; `--help` lists the keys (pretrain.core.cli) and exits 0;
    user mistakes exit 2 with one line on stderr."""
    argv = list(sys.argv[1:] if argv is None else argv)
    exit_on_help(schema.__name__, prog or schema.__module__, argv)
    paths = []
    while (at := next((i for i, a in enumerate(argv) if a == "--config" or a.startswith("--config=")), None)) is not None:
        inline = argv[at].startswith("--config=")
        paths.append(argv[at].partition("=")[2] if inline else (argv[at + 1] if at + 1 < len(argv) else ""))
        del argv[at : at + (1 if inline else 2)]
        if not paths[-1]:
            _exit(prog, "--config needs a file")
    if len(paths) > 1:
        _exit(prog, f"--config is given {len(paths)} times ({', '.join(paths)}); give one file (a YAML file's "
                    "`base: FILE` key builds it on another)")
    path = paths[0] if paths else None
    stray = [a for a in argv if a.startswith("-")]
    if stray:
        _exit(prog, f"unknown option {stray[0]}; use --config FILE and section.key=value overrides (--help lists the keys)")
    try:
        return load_config(schema, path, argv)
    except ConfigError as e:
        _exit(prog, str(e))


def print_error(prog: str, msg: str) -> None:
    """`PROG: error: MSG` on stderr in one write: the ranks of a job share one stderr under torchrun, and print()
    writes the text and its newline separately, so two ranks' lines ran into one (a short write is atomic)."""
    sys.stderr.write(f"{prog + ': ' if prog else ''}error: {msg}\n")
    sys.stderr.flush()


def _exit(prog: str, msg: str) -> NoReturn:
    print_error(prog, msg)
    raise SystemExit(2)
