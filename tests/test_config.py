"""Config loading: defaults < file < overrides, one-line errors for user mistakes, YAML round trip."""
import subprocess
import sys

import pytest

from pretrain.config import Config, ConfigError, load_config, save_config

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


@pytest.mark.parametrize("name", ["tiny", "small", "base", "large", "xl", "xxl"])
def test_shipped_configs_load(name):
    load_config(Config, f"configs/{name}.yaml")


def test_cli_error_has_no_traceback():
    code = "from pretrain.config import Config, parse_args; parse_args(Config, ['--config', 'configs/tiny.yaml', 'model.bogus=1'], prog='x')"
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert r.returncode == 2
    assert r.stderr.strip() == "x: error: unknown config key 'model.bogus'"
