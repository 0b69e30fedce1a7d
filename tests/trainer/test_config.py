"""The trainer config: YAML + overrides, errors that name the key, the generated reference."""

from __future__ import annotations

import dataclasses

import pytest
import yaml

from boogu_trainer.cli import main
from boogu_trainer.config import (
    RESUME_FREE_KEYS,
    ConfigError,
    RewardSpec,
    TrainerConfig,
    config_changes,
    config_reference_markdown,
    config_to_dict,
    config_to_yaml,
    demo_config,
    describe,
    load_config,
    scenes_demo_config,
)


def test_defaults_are_the_reference_recipe():
    c = TrainerConfig()
    assert (c.data.prompts_per_step, c.algorithm.group_size, c.optim.lr) == (32, 16, 3e-4)
    assert (c.lora.rank, c.lora.alpha, c.sampler.guidance_scale) == (64, 128.0, 4.0)
    assert (c.sampler.noise_level, c.sampler.window_size, c.sampler.window_range) == (1.2, 2, (0, 5))
    assert (c.algorithm.clip_range, c.algorithm.adv_clip, c.total_steps) == (1e-4, 5.0, 300)
    assert "img_to_q" in c.lora.target_modules and "to_q" in c.lora.target_modules
    assert (c.distributed.timeout_s, c.algorithm.kl_kind, c.resume_allow_changes) == (600.0, "mean", ())
    assert [f.name for f in dataclasses.fields(RewardSpec)] == ["name", "weight", "label", "kwargs"]


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
    assert isinstance(c.reward.rewards[0], RewardSpec) and c.reward.rewards[0].label == ""
    again = load_config(None, [], base=c)
    assert again == c
    assert yaml.safe_load(yaml.safe_dump(config_to_dict(c))) == config_to_dict(c)
    plain = config_to_dict(c)
    assert plain["sampler"]["window_range"] == [1, 4] and isinstance(plain["reward"]["rewards"], list)
    assert plain["reward"]["rewards"][0] == {"name": "ocr", "weight": 2.0, "label": "", "kwargs": {}}


def test_yaml_1_1_exponents_are_floats(tmp_path):
    c = load_config(None, ["optim.lr=1e-3", "optim.eps=1E-9"])
    assert isinstance(c.optim.lr, float) and c.optim.lr == 1e-3 and c.optim.eps == 1e-9
    recipe = tmp_path / "r.yaml"
    recipe.write_text("optim:\n  lr: 5e-5\n")  # YAML 1.1 (PyYAML) reads this as a string
    assert load_config(recipe).optim.lr == 5e-5


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
        ("reward.rewards=[{name: ocr}, {name: demo_brightness, labl: b}]", "reward.rewards[1].labl"),
        ("reward.rewards=[ocr]", "reward.rewards[0]"),
        ("reward=3", "reward"),
        ("sampler.window_range=[1,2,3]", "sampler.window_range"),
        ("optim.betas=[0.9]", "optim.betas"),
        ("optim.betas=[a, b]", "optim.betas"),
        ("data.shuffle=maybe", "data.shuffle"),
        ("data.shuffle=2", "data.shuffle"),  # OmegaConf alone would read 2 as True
        ("logging.name=1e3", "logging.name"),  # ... and this as '1000.0'
        ("optim.lr=${nope}", "optim.lr"),
        ("nokey", "key=value"),
        ("a..b=1", "bad key"),
    ],
)
def test_bad_values_name_the_key(override, needle):
    with pytest.raises(ConfigError) as err:
        load_config(None, [override])
    assert needle in str(err.value)


@pytest.mark.parametrize(
    ("overrides", "key", "value"),
    [
        (["optim.lr=.inf"], "optim.lr", "inf"),
        (["optim.lr=nan"], "optim.lr", "nan"),
        (["optim.lr=-.inf"], "optim.lr", "-inf"),
        (["optim.grad_clip=.inf"], "optim.grad_clip", "inf"),
        (["optim.betas=[0.9, 1.0]"], "optim.betas", "(0.9, 1.0)"),
        (["optim.betas=[-0.1, 0.999]"], "optim.betas", "(-0.1, 0.999)"),
        (["optim.betas=[0.9, .nan]"], "optim.betas", "nan"),
        (["optim.eps=0"], "optim.eps", "0.0"),
        (["optim.weight_decay=-1e-4"], "optim.weight_decay", "-0.0001"),
        (["model.device=cuda:x"], "model.device", "'cuda:x'"),
        (["model.device=gpu"], "model.device", "'gpu'"),
        (["model.device=cpux"], "model.device", "'cpux'"),
        (["model.device='cuda:'"], "model.device", "'cuda:'"),
        (["eval.every=-1"], "eval.every", "-1"),
        (["eval.num_steps=0"], "eval.num_steps", "0"),
        (["eval.num_prompts=0"], "eval.num_prompts", "0"),
        (["logging.sample_every=-1"], "logging.sample_every", "-1"),
        (["logging.num_samples=0"], "logging.num_samples", "0"),
        (["logging.plot_every=-1"], "logging.plot_every", "-1"),
        (["algorithm.clip_range=.inf"], "algorithm.clip_range", "inf"),
        (["algorithm.adv_clip=nan"], "algorithm.adv_clip", "nan"),
        (["algorithm.kl_coef=.inf"], "algorithm.kl_coef", "inf"),
        (["algorithm.kl_kind=exact"], "algorithm.kl_kind", "'exact'"),
        (["ema.decay=1.0"], "ema.decay", "1.0"),
        (["ema.decay=nan"], "ema.decay", "nan"),
        (["lora.alpha=.inf"], "lora.alpha", "inf"),
        (["lora.target_modules=[to_q, '']"], "lora.target_modules", "''"),
        (["lora.target_modules=[]"], "lora.target_modules", "()"),
        (["data.prompts_per_step=0"], "data.prompts_per_step", "0"),
        (["total_steps=0"], "total_steps", "0"),
        (["seed=-1"], "seed", "-1"),
        (["seed=100000000000000000000"], "seed", "100000000000000000000"),  # past derive_seed's 63 bits
        (["seed=9223372036854775808"], "seed", "9223372036854775808"),  # 2**63
        (["distributed.timeout_s=0"], "distributed.timeout_s", "0.0"),
        (["distributed.timeout_s=.inf"], "distributed.timeout_s", "inf"),
        (["sampler.noise_level=.inf"], "sampler.noise_level", "inf"),
        (["sampler.guidance_scale=nan"], "sampler.guidance_scale", "nan"),
        (["sampler.image_guidance_scale=0.5"], "sampler.image_guidance_scale", "0.5"),
        (["sampler.image_guidance_scale=nan"], "sampler.image_guidance_scale", "nan"),
        (["eval.image_guidance_scale=0.9"], "eval.image_guidance_scale", "0.9"),
        (["sampler.window_stride=0"], "sampler.window_stride", "0"),
        (["sampler.window_every=0"], "sampler.window_every", "0"),
        (["sampler.window_range=[4, 2]"], "sampler.window_range", "(4, 2)"),
        (["sampler.window_kind=fixed", "sampler.window_start=8"], "sampler.window_start", "8"),
        (["sampler.window_kind=fixed", "sampler.window_start=-1"], "sampler.window_start", "-1"),
        (["sampler.window_kind=fixed", "sampler.window_size=10"], "sampler.window_size", "10"),
        (["sampler.window_kind=progressive", "sampler.window_size=6"], "sampler.window_size", "6"),
        (["reward.rewards=[{name: ocr, weight: .inf}]"], "reward.rewards[0].weight", "inf"),
        (["reward.rewards=[{name: ocr}, {name: ''}]"], "reward.rewards[1].name", "''"),
    ],
)
def test_load_time_validation_names_key_and_value(overrides, key, value):
    with pytest.raises(ConfigError) as err:
        load_config(None, overrides)
    message = str(err.value)
    assert message.startswith(f"{key}=") and value in message, message


@pytest.mark.parametrize(
    "overrides",
    [
        ["model.device=cuda"],
        ["model.device=cuda:0"],
        ["model.device=cuda:12"],
        ["model.device=cpu"],
        ["sampler.window_kind=fixed", "sampler.window_start=7"],  # [7, 9) over 10 steps: fits
        ["sampler.window_kind=fixed", "sampler.window_range=[0, 1]", "sampler.window_start=5"],
        ["sampler.window_kind=progressive", "sampler.window_stride=3", "sampler.window_every=2"],
        ["sampler.window_size=null", "sampler.window_range=[0, 3]"],
        ["optim.betas=[0.0, 0.5]", "optim.weight_decay=0", "eval.every=0", "logging.sample_every=0"],
        ["seed=9223372036854775807"],  # 2**63 - 1
        # guided NFT with image guidance alone: edit rows have a guided velocity without text CFG
        [
            "algorithm.name=diffusion_nft",
            "sampler.guidance_scale=1",
            "sampler.image_guidance_scale=1.5",
            "algorithm.nft.guided=true",
        ],
    ],
)
def test_valid_edges_load(overrides):
    assert isinstance(load_config(None, overrides), TrainerConfig)


def test_fixed_window_uses_the_schedule_rule():
    c = load_config(None, ["sampler.window_kind=fixed", "sampler.window_start=7"])
    plan = c.sampler.window_plan
    assert (plan.kind, plan.size, plan.start) == ("fixed", 2, 7)
    with pytest.raises(ValueError, match="last step"):
        dataclasses.replace(plan, start=8).validate(c.sampler.num_steps)


def test_interpolation_in_recipe_and_overrides(tmp_path, monkeypatch):
    monkeypatch.setenv("BOOGU_TEST_RUNS", str(tmp_path / "runs"))
    recipe = tmp_path / "r.yaml"
    recipe.write_text(
        "sampler:\n  height: 512\n  width: ${sampler.height}\n"
        "logging:\n  run_dir: ${oc.env:BOOGU_TEST_RUNS}\n  name: lr_${optim.lr}\n"
        "reward:\n  rewards:\n  - {name: demo_brightness, weight: '${optim.lr}'}\n"
    )
    c = load_config(recipe, ["optim.lr=0.002", "optim.eps=${optim.lr}"])
    assert (c.sampler.width, c.optim.eps, c.reward.rewards[0].weight) == (512, 0.002, 0.002)
    assert c.run_path == tmp_path / "runs" / "lr_0.002"
    assert isinstance(c.optim.eps, float)
    # Resolved before validation: the interpolated value is what gets checked.
    with pytest.raises(ConfigError, match=r"^algorithm\.group_size=1"):
        load_config(None, ["data.prompts_per_step=1", "algorithm.group_size=${data.prompts_per_step}"])
    with pytest.raises(ConfigError, match=r"^sampler\.noise_level="):
        load_config(None, ["sampler.noise_level=${model.dtype}"])


def test_reward_labels_default_to_the_name_and_must_differ():
    c = load_config(
        None,
        ["reward.rewards=[{name: demo_brightness}, {name: demo_brightness, label: bright2, weight: 0.5}]"],
    )
    assert [(r.name, r.label, r.weight) for r in c.reward.rewards] == [
        ("demo_brightness", "", 1.0),
        ("demo_brightness", "bright2", 0.5),
    ]
    for rewards in (
        "[{name: demo_brightness}, {name: demo_brightness}]",
        "[{name: demo_brightness, label: ocr}, {name: ocr}]",  # a label clashes with a name
    ):
        with pytest.raises(ConfigError, match=r"^reward\.rewards: entries 0 and 1 share the label"):
            load_config(None, [f"reward.rewards={rewards}"])


def test_all_zero_reward_weights_are_refused_at_load_time():
    # Weight-0 rewards are metrics only: a run needs at least one reward that trains.
    for rewards in (
        "[{name: demo_brightness, weight: 0}]",
        "[{name: demo_brightness, weight: 0.0}, {name: demo_contrast, weight: 0}]",
    ):
        with pytest.raises(
            ConfigError,
            match=r"^reward\.rewards\[\*\]\.weight=.*expected at least one reward with a nonzero weight",
        ):
            load_config(None, [f"reward.rewards={rewards}"])
    c = load_config(
        None, ["reward.rewards=[{name: demo_brightness, weight: 0}, {name: demo_contrast, weight: -1}]"]
    )
    assert [r.weight for r in c.reward.rewards] == [0.0, -1.0]


def test_reward_name_and_options_are_checked_at_load_time(tmp_path):
    with pytest.raises(ConfigError) as err:
        load_config(None, ["reward.rewards=[{name: ocr, kwargs: {min_confidence: 0.3, nope: 1}}]"])
    assert str(err.value).startswith("reward.rewards[0]") and "nope" in str(err.value)
    recipe = tmp_path / "r.yaml"
    recipe.write_text("reward:\n  rewards:\n  - name: demo_brightness\n  - name: no_such_reward\n")
    with pytest.raises(ConfigError) as err:
        load_config(recipe)
    assert str(err.value).startswith("reward.rewards[1]") and "no_such_reward" in str(err.value)
    ok = load_config(None, ["reward.rewards=[{name: ocr, kwargs: {min_confidence: 0.3}}]"])
    assert ok.reward.rewards[0].kwargs == {"min_confidence": 0.3}


def test_recipe_errors_name_the_full_key(tmp_path):
    recipe = tmp_path / "r.yaml"
    recipe.write_text("sampler:\n  window_range: [1, 2, 3]\n")
    with pytest.raises(ConfigError, match=r"^sampler\.window_range="):
        load_config(recipe)
    recipe.write_text("reward:\n  rewards:\n  - {name: ocr}\n  - {name: demo_brightness, wieght: 2}\n")
    with pytest.raises(ConfigError, match=r"'reward\.rewards\[1\]\.wieght'"):
        load_config(recipe)
    recipe.write_text("optim:\n  lr: .inf\n")
    with pytest.raises(ConfigError, match=r"^optim\.lr=inf"):
        load_config(recipe)


def test_resume_allow_changes_entries_are_config_keys():
    c = load_config(None, ["resume_allow_changes=[optim.lr, sampler, reward.rewards]"])
    assert c.resume_allow_changes == ("optim.lr", "sampler", "reward.rewards")
    for entries, needle in (
        ("[optim.lrr]", "resume_allow_changes[0]='optim.lrr'"),
        ("[optim.lr, optimizer]", "resume_allow_changes[1]='optimizer'"),
        ("['optim.*']", "resume_allow_changes[0]='optim.*'"),
        ("['reward.rewards[0].weight']", "resume_allow_changes[0]"),
    ):
        with pytest.raises(ConfigError) as err:
            load_config(None, [f"resume_allow_changes={entries}"])
        assert str(err.value).startswith(needle)


def test_config_changes():
    old = yaml.safe_load(yaml.safe_dump(config_to_dict(demo_config())))  # as read from config.yaml

    def new(*overrides: str) -> dict:
        return config_to_dict(load_config(None, list(overrides), base=demo_config()))

    assert config_changes(old, new()) == []
    assert config_changes(old, new("optim.lr=1e-4", "sampler.window_range=[1,4]")) == [
        ("sampler.window_range", [0, 4], [1, 4]),
        ("optim.lr", 3e-3, 1e-4),
    ]
    assert config_changes(old, new("optim.lr=1e-4"), allowed=["optim"]) == []
    assert config_changes(old, new("optim.lr=1e-4"), allowed=["optim.lr"]) == []
    assert config_changes(old, new("optim.lr=1e-4"), allowed=["optim.l", "optim.eps"]) == [
        ("optim.lr", 3e-3, 1e-4)
    ]
    free = new(
        "total_steps=99",
        "resume=auto",
        "resume_allow_changes=[optim]",
        "logging.name=other",
        "checkpoint.keep_last=9",
        "eval.num_prompts=5",
        "distributed.timeout_s=60",
    )
    assert config_changes(old, free) == []
    assert {"logging", "checkpoint", "eval", "distributed.timeout_s"} <= set(RESUME_FREE_KEYS)
    assert config_changes(old, new("distributed.fsdp=false")) == [("distributed.fsdp", True, False)]


def test_config_changes_keys_new_in_this_version_compare_as_their_default():
    old = config_to_dict(demo_config())
    del old["algorithm"]["kl_kind"], old["distributed"]["timeout_s"], old["resume_allow_changes"]
    for spec in old["reward"]["rewards"]:
        del spec["label"]
    old["algorithm"]["removed_key"] = 1  # gone from this version: cannot be honoured, not reported
    assert config_changes(old, config_to_dict(demo_config())) == []
    changed = config_to_dict(
        load_config(
            None,
            ["algorithm.kl_kind=velocity", "reward.rewards=[{name: demo_brightness, label: b}]"],
            base=demo_config(),
        )
    )
    assert config_changes(old, changed) == [
        ("algorithm.kl_kind", "mean", "velocity"),
        (
            "reward.rewards",
            [{"name": "demo_brightness", "weight": 1.0, "label": "", "kwargs": {}}],
            [{"name": "demo_brightness", "weight": 1.0, "label": "b", "kwargs": {}}],
        ),
    ]


def test_bad_recipe_file_names_the_file(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("optim: [1, 2\n")
    with pytest.raises(ConfigError, match=r"bad\.yaml"):
        load_config(bad)
    with pytest.raises(ConfigError, match=r"missing\.yaml"):
        load_config(tmp_path / "missing.yaml")
    bad.write_text("- optim\n")
    with pytest.raises(ConfigError, match=r"bad\.yaml: a recipe must be a mapping"):
        load_config(bad)
    bad.write_bytes("logging:\n  name: café\n".encode("latin-1"))  # not UTF-8
    with pytest.raises(ConfigError, match=r"bad\.yaml: not UTF-8 text \(byte 0xe9 at offset 20\); save"):
        load_config(bad)


def test_reference_lists_every_key_with_its_doc():
    ref = config_reference_markdown()
    for key in ("optim.lr", "sampler.window_scope", "algorithm.std_scope", "checkpoint.keep_last", "resume"):
        assert f"`{key}`" in ref
    assert "| `optim.lr` | float | `0.0003` |" in ref
    assert "| `distributed.timeout_s` | float | `600.0` | Seconds a collective may wait" in ref
    assert "| `algorithm.kl_kind` | 'mean' \\| 'transition' \\| 'velocity' | `\"mean\"` |" in ref
    assert "1/\\|dt\\| times smaller" in ref  # a | inside a docstring must not split the cell
    rows = {key: (tp, default, doc) for key, tp, default, doc in describe()}
    assert rows["resume_allow_changes"][:2] == ("tuple[str, ...]", "[]")
    assert rows["optim"][0] == "section"


def test_cli_print_config_and_errors(capsys):
    assert main(["--print-config", "optim.lr=1e-3"]) == 0
    printed = yaml.safe_load(capsys.readouterr().out)
    # no recipe: the scene demo's config (scenes_demo_config) with the overrides
    expected = config_to_dict(scenes_demo_config())
    expected["optim"]["lr"] = 1e-3
    assert printed == yaml.safe_load(yaml.safe_dump(expected))
    assert main(["optim.nope=1"]) == 2
    assert "optim.nope" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["--help"])
    out = capsys.readouterr().out
    assert "sampler.noise_level" in out and "distributed.timeout_s" in out and "Seconds a collective" in out


@pytest.mark.parametrize(
    ("overrides", "needle"),
    [
        (
            ["algorithm.name=diffusion_nft", "algorithm.clip_range=1e-3"],
            "algorithm.clip_range=0.001 with algorithm.name='diffusion_nft'",
        ),
        (
            ["algorithm.name=awm", "algorithm.kl_kind=velocity"],
            "algorithm.kl_kind='velocity' with algorithm.name='awm'",
        ),
        (
            ["data.prompts_per_step=2", "algorithm.mini_batches=3"],
            "algorithm.mini_batches=3 with data.prompts_per_step=2",
        ),
        (["eval.every=5"], "eval.every=5 without data.val_files"),
        (["checkpoint.keep_best=true"], "checkpoint.keep_best=True without data.val_files"),
        (["eval.stop_on_divergence=2"], "eval.stop_on_divergence=2 without data.val_files"),
        (
            ["data.val_files=[v.parquet]", "checkpoint.keep_best=true"],
            "checkpoint.keep_best=True with eval.every=0",
        ),
        (["data.demo_eval_split=val"], "data.demo_eval_split='val': it picks the built-in scene captions"),
        (
            ["data.demo_set=scenes", "data.val_files=[v.parquet]", "data.demo_eval_split=test"],
            "data.demo_eval_split='test': it picks the built-in scene captions (or edit pairs) an evaluation "
            "scores when data.demo_set is 'scenes' or 'scene_edits' and data.val_files is empty, but "
            "data.val_files=['v.parquet'] is",
        ),
        (["optim.lr=1e39"], "optim.lr=1e+39"),
        (["optim.lr=2"], "optim.lr=2.0"),
    ],
)
def test_contradictory_settings_are_refused_naming_both_keys(overrides, needle):
    with pytest.raises(ConfigError) as err:
        load_config(None, overrides)
    assert needle in str(err.value)


def test_flow_grpo_settings_inherited_from_a_base_do_not_count_as_given():
    # The demo sets clip_range=1e-3 for flow_grpo; switching its algorithm is not a contradiction,
    # giving clip_range again is.
    assert (
        load_config(None, ["algorithm.name=diffusion_nft"], base=demo_config()).algorithm.clip_range == 1e-3
    )
    with pytest.raises(
        ConfigError, match=r"^algorithm\.clip_range=0\.001 with algorithm\.name='diffusion_nft'"
    ):
        load_config(None, ["algorithm.name=diffusion_nft", "algorithm.clip_range=1e-3"], base=demo_config())


@pytest.mark.parametrize(
    ("make_base", "name"),
    [
        (demo_config, "flow_grpo"),
        (demo_config, "diffusion_nft"),
        (demo_config, "awm"),
        (scenes_demo_config, "diffusion_nft"),
        (scenes_demo_config, "awm"),
    ],
)
def test_a_runs_saved_config_loads_back_as_it_was(tmp_path, name, make_base):
    """A run writes every key to its config.yaml (the algorithm's unused ones and the evaluation
    split included); `boogu-sample` reads it back with ``saved=True``: none of them counts as the
    user's choice, while an override still does."""
    config = load_config(None, [f"algorithm.name={name}"], base=make_base())
    path = tmp_path / "config.yaml"
    path.write_text(config_to_yaml(config))  # as a run writes it
    # Read as a user's recipe, the written clip_range (not flow_grpo) or demo_eval_split (the OCR
    # prompts) is refused.
    with pytest.raises(ConfigError, match=r"remove (algorithm\.clip_range|data\.demo_eval_split) from"):
        load_config(path)
    assert load_config(path, saved=True) == config
    assert load_config(path, ["model.device=cuda"], saved=True).model.device == "cuda"
    if name != "flow_grpo":
        with pytest.raises(ConfigError, match=r"^algorithm\.clip_range=0\.5 with"):
            load_config(path, ["algorithm.clip_range=0.5"], saved=True)


def test_demo_eval_split_is_taken_where_the_built_in_scene_captions_are_the_evaluation_set():
    # The scene demo's base has demo_set=scenes and no val_files: the split is read, not refused.
    base = scenes_demo_config()
    assert load_config(None, ["data.demo_eval_split=test"], base=base).data.demo_eval_split == "test"
    with pytest.raises(ConfigError, match=r"data\.demo_set='ocr' has no built-in evaluation captions"):
        load_config(None, ["data.demo_eval_split=test"], base=demo_config())  # the OCR prompts


def test_a_bare_off_in_an_override_or_recipe_is_the_word_not_a_boolean(tmp_path):
    """YAML 1.1 reads ``off`` as False: a choice field that has an ``off`` gets the word back."""
    assert load_config(None, ["rollout.pipeline=off"]).rollout.pipeline == "off"
    recipe = tmp_path / "recipe.yaml"
    recipe.write_text("rollout:\n  engine: vllm_omni\n  pipeline: off\n")
    assert load_config(recipe).rollout.pipeline == "off"
    with pytest.raises(ConfigError, match=r"rollout.cfg_mode=False: expected 'batched' \| 'sequential'"):
        load_config(None, ["rollout.cfg_mode=off"])  # no 'off' among its choices: still an error


def test_built_in_prompt_counts_are_bounded_when_the_config_loads():
    # Issue 49 item 8: data.demo_prompts=1000000000000 drew scenes until memory ran out.
    from importlib import resources

    from boogu_trainer.data import MAX_DEMO_PROMPTS, OCR_DEMO_PROMPTS

    text = resources.files("boogu_trainer").joinpath("assets/demo_prompts.txt").read_text(encoding="utf-8")
    assert len(text.splitlines()) == OCR_DEMO_PROMPTS
    for overrides, needle in (
        (["data.demo_set=scenes", "data.demo_prompts=1000000000000"], f"expected <= {MAX_DEMO_PROMPTS}"),
        (["eval.num_prompts=1000000000000"], f"expected <= {MAX_DEMO_PROMPTS}"),
        # More OCR prompts than ship was silently cut to 64.
        (["data.demo_prompts=65"], f"expected <= {OCR_DEMO_PROMPTS} (the built-in OCR prompts"),
    ):
        with pytest.raises(ConfigError) as err:
            load_config(None, overrides)
        key, value = overrides[-1].split("=")
        assert str(err.value).startswith(f"{key}={value}: {needle}"), str(err.value)
    edges = load_config(None, ["data.demo_set=scenes", f"data.demo_prompts={MAX_DEMO_PROMPTS}"])
    assert edges.data.demo_prompts == MAX_DEMO_PROMPTS
    assert load_config(None, [f"data.demo_prompts={OCR_DEMO_PROMPTS}"]).data.demo_prompts == OCR_DEMO_PROMPTS
