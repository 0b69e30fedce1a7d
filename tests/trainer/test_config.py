"""The trainer config: YAML + overrides, errors that name the key, the generated reference."""

from __future__ import annotations

import pytest
import yaml

from boogu_trainer.cli import main
from boogu_trainer.config import (
    ConfigError,
    TrainerConfig,
    config_reference_markdown,
    config_to_dict,
    demo_config,
    load_config,
)


def test_defaults_are_the_reference_recipe():
    c = TrainerConfig()
    assert (c.data.prompts_per_step, c.algorithm.group_size, c.optim.lr) == (32, 16, 3e-4)
    assert (c.lora.rank, c.lora.alpha, c.sampler.guidance_scale) == (64, 128.0, 4.0)
    assert (c.sampler.noise_level, c.sampler.window_size, c.sampler.window_range) == (1.2, 2, (0, 5))
    assert (c.algorithm.clip_range, c.algorithm.adv_clip, c.total_steps) == (1e-4, 5.0, 300)
    assert "img_to_q" in c.lora.target_modules and "to_q" in c.lora.target_modules


def test_yaml_then_overrides(tmp_path):
    recipe = tmp_path / "r.yaml"
    recipe.write_text(
        "optim:\n  lr: 1e-4\nsampler:\n  height: 512\n  width: 512\nalgorithm:\n  group_size: 4\n"
    )
    c = load_config(
        recipe, ["optim.lr=2e-4", "sampler.window_range=[1,4]", "reward.rewards=[{name: ocr, weight: 2}]"]
    )
    assert c.optim.lr == 2e-4 and c.sampler.height == 512 and c.algorithm.group_size == 4
    assert c.sampler.window_range == (1, 4) and c.reward.rewards[0].weight == 2.0
    again = load_config(None, [], base=c)
    assert again == c
    assert yaml.safe_load(yaml.safe_dump(config_to_dict(c))) == config_to_dict(c)


@pytest.mark.parametrize(
    ("override", "needle"),
    [
        ("optim.lrr=1", "optim.lrr"),
        ("optim.lr=abc", "optim.lr"),
        ("sampler.height=100", "sampler.height"),
        ("algorithm.group_size=1", "algorithm.group_size"),
        ("sampler.window_size=9", "sampler.window_size"),
        ("model.dtype=float8", "model.dtype"),
        ("reward.rewards=[{name: ocr, wieght: 1}]", "reward.rewards[0].wieght"),
        ("data.shuffle=maybe", "data.shuffle"),
        ("nokey", "key=value"),
    ],
)
def test_bad_values_name_the_key(override, needle):
    with pytest.raises(ConfigError) as err:
        load_config(None, [override])
    assert needle in str(err.value)


def test_bad_recipe_file_names_the_file(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("optim: [1, 2\n")
    with pytest.raises(ConfigError, match=r"bad\.yaml"):
        load_config(bad)
    with pytest.raises(ConfigError, match=r"missing\.yaml"):
        load_config(tmp_path / "missing.yaml")


def test_reference_lists_every_key_with_its_doc():
    ref = config_reference_markdown()
    for key in ("optim.lr", "sampler.window_scope", "algorithm.std_scope", "checkpoint.keep_last", "resume"):
        assert f"`{key}`" in ref
    assert "| `optim.lr` | float | `0.0003` |" in ref


def test_cli_print_config_and_errors(capsys):
    assert main(["--print-config", "optim.lr=1e-3"]) == 0
    printed = yaml.safe_load(capsys.readouterr().out)
    assert printed["optim"]["lr"] == 1e-3 and printed["total_steps"] == demo_config().total_steps
    assert main(["optim.nope=1"]) == 2
    assert "optim.nope" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["--help"])
    assert "sampler.noise_level" in capsys.readouterr().out
