"""Config loading: defaults < file < overrides, one-line errors for user mistakes, YAML round trip."""
import dataclasses
import re
import subprocess
import sys
import typing

import pytest

from pretrain.core.config import Config, ConfigError, load_config, parse_args, save_config
from pretrain.core.finetune_config import FinetuneConfig

TINY = "configs/tiny.yaml"


def test_precedence_defaults_file_overrides():
    cfg = load_config(Config, TINY, ["train.steps=7", "model.encoder_attention=dense+vanilla"])
    assert cfg.train.steps == 7  # override
    assert cfg.model.d_model == 64  # file
    assert cfg.train.beta1 == 0.9  # default
    assert cfg.model.encoder_attention == "dense+vanilla"


@pytest.mark.parametrize(
    "override, expected",
    [
        (["model.num_head=3"], "unknown config key 'model.num_head'; did you mean 'model.num_heads'?"),
        (["train.steps=abc"], "bad value for config key 'train.steps'"),
        (["steps=3"], "unknown config key 'steps'; did you mean 'train.steps' or 'profile.steps'?"),
        (["model.micro_batch=3"], "unknown config key 'model.micro_batch'; did you mean 'train.micro_batch'?"),
        (["train.steps"], "is not of the form section.key=value"),
        (["train.steps="], "bad value for config key 'train.steps': Value '' of type 'str' could not be converted"),
        (["train.steps=0"], "train.steps (0) must be >= 1"),
        (["train.exit_after=-1"], "train.exit_after (-1) must be >= 0"),
        (["train.max_skipped_steps=-1"], "train.max_skipped_steps (-1) must be >= 0"),
        (["train.lr=0"], "train.lr (0.0) must be > 0: it is the peak learning rate, and 0 trains nothing"),
        (["train.lr=-1e-3"], "train.lr (-0.001) must be > 0"),
        (["train.warmup_steps=-1"], "train.warmup_steps (-1) must be >= 0"),
        (["parallel.tensor=0"], "parallel.tensor (0) must be >= 1"),
        (["parallel.backend=mpi"], "parallel.backend 'mpi' is not one of auto, nccl, gloo"),
        (["data.workers=-1"], "data.workers (-1) must be >= 0"),
        # span corruption's bounds: 1.5 hung the trainer and the planner, the others were tracebacks
        (["data.noise_density=1.5"], "data.noise_density (1.5) must be > 0 and < 1: the share of each chunk's tokens"),
        (["data.noise_density=0"], "data.noise_density (0.0) must be > 0 and < 1"),
        (["data.noise_density=-0.2"], "data.noise_density (-0.2) must be > 0 and < 1"),
        (["data.mean_noise_span_length=0"], "data.mean_noise_span_length (0.0) must be >= 1: the mean length"),
        (["data.max_damaged_share=1.5"], "data.max_damaged_share (1.5) must be >= 0 and <= 1"),
        (["data.http_timeout_s=0"], "data.http_timeout_s (0.0) must be > 0"),
        (["data.http_retries=-1"], "data.http_retries (-1) must be >= 0"),
        (["log.every=0"], "log.every (0) must be >= 1"),
        (["log.straggler_factor=0.9"], "log.straggler_factor (0.9) must be >= 1: how many times the median step"),
        (["profile.start=0"], "profile.start (0) must be >= 1"),
        (["profile.steps=0"], "profile.steps (0) must be >= 1"),
        (["profile.ranks=[0,-1]"], "profile.ranks [0, -1]: rank -1 is negative or named twice"),
        (["profile.ranks=[1,1]"], "profile.ranks [1, 1]: rank 1 is negative or named twice"),
        (["eval.every=5", "eval.batches=0"], "eval.batches (0) must be >= 1 when eval.every (5) is on; eval.every=0 "
                                             "turns evaluation off"),
        (["eval.every=-1"], "eval.every (-1) must be >= 0"),
        (["run.dir="], "run.dir is empty; name the run folder"),
        (["model.position_bias=everywhere"], "model.position_bias 'everywhere' must be one of all, vanilla, none"),
        (["model.synthesizer_init=xavier"], "model.synthesizer_init 'xavier' must be one of mesh_tf, t5"),
        # ModelConfig's own rules (they were the model package's check_model, met by the planner or the build)
        (["model.d_model=0"], "model.d_model (0) must be >= 1"),
        (["model.relative_attention_num_buckets=2"], "model.relative_attention_num_buckets (2) must be >= 4"),
        (["model.dropout=1.5"], "model.dropout (1.5) must be in [0, 1)"),
        (["train=3"], "bad value for config key 'train': it is a section of keys (train.steps, train.micro_batch, "
                      "...), not the int 3"),
        # accepted silently before (a traceback for data.shuffle_buffer): issue 45
        (["checkpoint.every=-1"], "checkpoint.every (-1) must be >= 0"),
        (["checkpoint.keep=0"], "checkpoint.keep (0) must be >= 1"),
        (["checkpoint.keep=-1"], "checkpoint.keep (-1) must be >= 1"),
        (["data.shuffle_buffer=-3"], "data.shuffle_buffer (-3) must be >= 1"),
        (["train.micro_batch=0"], "train.micro_batch (0) must be an integer >= 1 or auto"),
        (["train.beta2=1"], "train.beta2 (1.0) must be in [0, 1)"),
        (["model.layer_norm_eps=0"], "model.layer_norm_eps (0.0) must be > 0"),
    ],
)
def test_user_mistakes_are_one_line(override, expected):
    with pytest.raises(ConfigError) as e:
        load_config(Config, TINY, override)
    assert expected in str(e.value)
    assert "\n" not in str(e.value)


@pytest.mark.parametrize("override, expected", [
    ("train.lr=0", "train.lr (0.0) must be > 0"), ("train.warmup_steps=-1", "train.warmup_steps (-1) must be >= 0"),
    ("parallel.tensor=0", "parallel.tensor (0) must be >= 1"), ("run.dir=", "run.dir is empty"),
    ("task.train_examples=-1", "task.train_examples (-1) must be >= 0"), ("eval.batch=0", "eval.batch (0) must be >= 1"),
    ("task.max_input_length=1", "task.max_input_length (1) must be >= 2"),
    ("eval.method=beam", "eval.method 'beam' is not one of generate, rank, both"),
    # the schedule, optimizer, stage and precision rules were the engine's: a traceback (exit 1) in fine-tuning
    ("train.schedule=linear", "train.schedule 'linear' is not one of inverse_sqrt, cosine"),
    ("train.optimizer=sgd", "train.optimizer 'sgd' is not one of adamw, adafactor"),
    ("zero.stage=4", "zero.stage (4) must be 0, 1, 2 or 3"), ("precision=fp8", "precision 'fp8' is not one of auto"),
    ("task.dropout=1.5", "task.dropout (1.5) must be in [0, 1)"),
])
def test_finetuning_takes_the_same_rules(override, expected):
    from pretrain.core.finetune_config import FinetuneConfig  # shares run, parallel, train, log, checkpoint with Config

    with pytest.raises(ConfigError, match=re.escape(expected)):
        load_config(FinetuneConfig, "configs/finetune/sst2.yaml", [override])


# the data path's own keys, bounded by the data path's rules (issue 44)
DATA_PATH_KEYS = {"data.input_length", "data.streams"}


def _numeric_keys(schema: type, prefix: str = "") -> list[str]:
    keys = []
    for name, hint in typing.get_type_hints(schema).items():
        if dataclasses.is_dataclass(hint):
            keys += _numeric_keys(hint, f"{prefix}{name}.")
        elif hint in (int, float) or typing.get_origin(hint) is typing.Union and {int, float} & set(typing.get_args(hint)):
            keys.append(prefix + name)
    return keys


@pytest.mark.parametrize("schema, path", [(Config, TINY), (FinetuneConfig, "configs/finetune/sst2.yaml")])
def test_every_numeric_key_has_its_bound(schema, path):
    # -1 is out of range for every number of both jobs (a size, a count, a step, a rate, a seed): refused naming it
    keys = [k for k in _numeric_keys(schema) if k not in DATA_PATH_KEYS]
    assert {"checkpoint.every", "checkpoint.keep", "train.lr", "train.micro_batch"} <= set(keys)
    for key in keys:
        with pytest.raises(ConfigError, match=rf"^{re.escape(key)} \(-1(\.0)?\) must be"):
            load_config(schema, path, [f"{key}=-1"])


def test_an_empty_override_is_the_empty_string(tmp_path):
    # data.valid's empty value means "no validation data", as `valid: ''` in YAML does
    path = tmp_path / "run.yaml"
    path.write_text("data:\n  valid: shards/valid\n")
    cfg = load_config(Config, path, ["data.valid=", "data.train=pipe:cat a=b="])
    assert cfg.data.valid == "" and cfg.data.train == "pipe:cat a=b="  # a value ending in "=" stays whole


def test_a_section_given_a_value_is_named(tmp_path):
    path = tmp_path / "run.yaml"
    path.write_text("train: [1, 2]\n")
    with pytest.raises(ConfigError, match=re.escape("bad value for config key 'train': it is a section of keys "
                                                    "(train.steps, train.micro_batch, ...), not the list [1, 2]")):
        load_config(Config, path)
    path.write_text("model:\n  d_model: 64\nlog: 5\n")
    with pytest.raises(ConfigError, match=r"bad value for config key 'log': .*not the int 5"):
        load_config(Config, path)


def test_a_key_given_twice_in_a_yaml_file_is_named(tmp_path):
    # PyYAML keeps the last: the first `train:` section's keys were dropped without a word
    path = tmp_path / "run.yaml"
    path.write_text("train:\n  steps: 3\nmodel:\n  d_model: 64\ntrain:\n  lr: 0.1\n")
    with pytest.raises(ConfigError, match=re.escape(f"{path}: the key 'train' is given twice (lines 1 and 5); the "
                                                    "second would replace the first and all its keys: merge them")):
        load_config(Config, path)
    path.write_text("train:\n  steps: 3\n  steps: 4\n")  # inside a section too
    with pytest.raises(ConfigError, match=re.escape("the key 'steps' is given twice (lines 2 and 3)")):
        load_config(Config, path)


@pytest.mark.parametrize("argv, expected", [
    (["--config", "configs"], "the config configs is a folder; give a YAML file in it (_t5_v1_1.yaml, base.yaml"),
    (["--config", TINY, "--config=configs/small.yaml"],
     "--config is given 2 times (configs/tiny.yaml, configs/small.yaml); give one file"),
])
def test_config_flag_mistakes_are_one_line(argv, expected, capsys):
    with pytest.raises(SystemExit) as e:
        parse_args(Config, argv, prog="x")
    assert e.value.code == 2
    assert capsys.readouterr().err.startswith(f"x: error: {expected}")


def test_resolved_config_round_trips(tmp_path):
    cfg = load_config(Config, TINY, ["run.seed=9"])
    save_config(cfg, tmp_path / "config.yaml")
    assert load_config(Config, tmp_path / "config.yaml") == cfg


# T5 v1.1 as published (google-research/text-to-text-transfer-transformer, t5.1.1 gin files):
# d_model, d_ff, num_heads, layers per stack; every size has 64-wide heads
T5_V1_1 = {"small": (512, 1024, 6, 8), "base": (768, 2048, 12, 12), "large": (1024, 2816, 16, 24),
           "xl": (2048, 5120, 32, 24), "xxl": (4096, 10240, 64, 24)}


@pytest.mark.parametrize("name", sorted(T5_V1_1))
def test_size_configs_are_t5_v1_1(name):
    m = load_config(Config, f"configs/{name}.yaml").model
    assert (m.d_model, m.d_ff, m.num_heads, m.num_layers) == T5_V1_1[name]
    assert m.num_decoder_layers == m.num_layers and m.d_kv == 64


def test_tiny_config_is_smaller_than_small():
    tiny, small = load_config(Config, TINY).model, load_config(Config, "configs/small.yaml").model
    assert tiny.d_model < small.d_model and tiny.num_layers < small.num_layers


def test_config_flag_with_equals_sign():
    expected = load_config(Config, TINY, ["train.steps=3"])
    assert parse_args(Config, ["--config=" + TINY, "train.steps=3"]) == expected
    assert parse_args(Config, ["train.steps=3", "--config", TINY]) == expected


def test_cli_error_has_no_traceback():
    code = "from pretrain.core.config import Config, parse_args; parse_args(Config, ['--config', 'configs/tiny.yaml', 'model.bogus=1'], prog='x')"
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert r.returncode == 2
    assert r.stderr.strip() == "x: error: unknown config key 'model.bogus'"
