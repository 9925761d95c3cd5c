"""Config loading: defaults < file < overrides, one-line errors for user mistakes, YAML round trip."""
import subprocess
import sys

import pytest

from pretrain.config import Config, ConfigError, load_config, parse_args, save_config

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
        (["steps=3"], "unknown config key 'steps'"),
        (["train.steps"], "is not of the form section.key=value"),
    ],
)
def test_user_mistakes_are_one_line(override, expected):
    with pytest.raises(ConfigError) as e:
        load_config(Config, TINY, override)
    assert expected in str(e.value)
    assert "\n" not in str(e.value)


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
    code = "from pretrain.config import Config, parse_args; parse_args(Config, ['--config', 'configs/tiny.yaml', 'model.bogus=1'], prog='x')"
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert r.returncode == 2
    assert r.stderr.strip() == "x: error: unknown config key 'model.bogus'"
