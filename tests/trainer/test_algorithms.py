"""DiffusionNFT, AWM and GRPO-Guard in the trainer on the tiny model: they train, their reward follows
the advantage's sign, their compute is accounted, NFT's old policy resumes exactly, and edit rows
train with their own reference latents."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from boogu_schedule import Sampler
from boogu_trainer.algorithms import flow_grpo as flow_grpo_module
from boogu_trainer.config import FORWARD_OPTIONS_KEYS, demo_config, load_config
from boogu_trainer.data import demo_records
from boogu_trainer.distributed import local_tensor
from boogu_trainer.evaluation import Evaluator
from boogu_trainer.trainer import Trainer

FORWARD = ["sampler.window_size=0", "sampler.guidance_scale=1.0", "algorithm.mini_batches=1"]


def make(tiny_checkpoint: Path, run_dir: Path, *extra: str):
    return load_config(
        None,
        [
            f"model.path={tiny_checkpoint}",
            f"logging.run_dir={run_dir}",
            "logging.progress=false",
            "logging.sample_every=0",
            "logging.plot_every=0",
            "checkpoint.save_every=0",
            "preflight=false",
            "data.prompts_per_step=2",
            *extra,
        ],
        base=demo_config(),
    )


def lines(trainer: Trainer) -> list[dict]:
    return [json.loads(x) for x in (trainer.run_dir / "metrics.jsonl").read_text().splitlines()]


@pytest.mark.slow
def test_nft_old_policy_lags_rolls_out_and_resumes_bitwise(tiny_checkpoint, tmp_path):
    nft = [
        "algorithm.name=diffusion_nft",
        *FORWARD,
        "algorithm.nft.timesteps=2",
        "algorithm.nft.old_decay_rate=0.3",  # the old policy lags from the first update on
        "checkpoint.save_every=1",
        "total_steps=3",
    ]
    straight = Trainer(make(tiny_checkpoint, tmp_path / "a", *nft))
    straight.train()
    learner, nft_state = straight.learner, straight.learner.algorithm
    assert not nft_state.old_is_current and nft_state.last_old_decay == pytest.approx(0.5)
    # Rollouts see the old policy: the module holds it inside sampling_policy() and gets its own back.
    current = [local_tensor(p.detach()).clone() for p in learner.params]
    with learner.sampling_policy():
        assert all(torch.equal(p.detach(), o) for p, o in zip(learner.params, nft_state.old))
    assert all(torch.equal(p.detach(), c) for p, c in zip(learner.params, current))
    assert not all(torch.equal(o, c) for o, c in zip(nft_state.old, current))
    # an engine with its own copy of the weights gets the old policy too, by file key
    sent = learner.rollout_weights()
    assert all(torch.equal(sent[k], v) for k, v in nft_state.old_state().items())
    assert not all(torch.equal(sent[k], v) for k, v in learner.full_lora().items())

    first = Trainer(make(tiny_checkpoint, tmp_path / "b", *nft[:-1], "total_steps=2"))
    first.train()
    first.close()  # the run ends: its folder's lock goes
    resumed = Trainer(make(tiny_checkpoint, tmp_path / "b", *nft, "resume=auto"))
    assert resumed.resume("auto") is not None and resumed.step == 2
    resumed.train()
    a = straight.run_dir / "checkpoints" / "step_000003"
    b = resumed.run_dir / "checkpoints" / "step_000003"
    for name in ("adapter_model.safetensors", "old_policy.safetensors", "optimizer.safetensors"):
        ta, tb = load_file(a / name), load_file(b / name)
        assert ta.keys() == tb.keys() and all(torch.equal(ta[k], tb[k]) for k in ta), name
    last_a, last_b = lines(straight)[-1], lines(resumed)[-1]
    for key in ("reward/mean", "loss", "cum/fe", "cum/images", "nft/old_decay"):
        assert last_a[key] == last_b[key], key


@pytest.mark.slow
def test_forward_equivalents_per_phase_and_cumulative(tiny_checkpoint, tmp_path):
    # Two mini-batches: the second one's old values need their own forwards (T per sample, half
    # the batch on the first step); then every sample's, since the old policy lags (rate 0.001).
    cfg = make(
        tiny_checkpoint,
        tmp_path,
        "algorithm.name=diffusion_nft",
        "sampler.window_size=0",
        "sampler.guidance_scale=1.0",
        "algorithm.nft.timesteps=2",
        "algorithm.kl_coef=1e-4",
        "total_steps=2",
    )
    trainer = Trainer(cfg)
    history = trainer.train()
    steps = cfg.sampler.num_steps
    first, second = history
    assert first["fe/rollout_per_image"] == steps  # ODE, no CFG: one forward per step
    assert first["fe/train_per_image"] == 2 * 3  # two levels, forward + backward (2 FE)
    assert first["fe/backward_per_image"] == 2
    assert first["fe/reference_per_image"] == 2  # the KL's base-model forward per level
    assert first["fe/old_per_image"] == 1 and second["fe/old_per_image"] == 2
    images = cfg.data.prompts_per_step * cfg.algorithm.group_size
    assert first["cum/images"] == images and second["cum/images"] == 2 * images
    assert second["cum/fe"] == (first["fe/total_per_image"] + second["fe/total_per_image"]) * images
    # perf/tflops is each step's model TFLOP (a total, not a rate): cum/tflops adds them up.
    assert first["cum/tflops"] == pytest.approx(first["perf/tflops"], rel=1e-12) and first["perf/tflops"] > 0
    assert second["cum/tflops"] == pytest.approx(first["perf/tflops"] + second["perf/tflops"], rel=1e-12)
    assert second["cum/time_s"] == pytest.approx(first["time/step"] + second["time/step"], rel=1e-12)


def test_grpo_guard_corrects_for_the_rollouts_sampler(tiny_checkpoint, tmp_path, monkeypatch):
    # RatioNorm's bias depends on how the rollout scored its log-probs (cps: unnormalised, no
    # 1/(2 s^2)): the learner must hand the trajectory's sampler to the loss, not the default.
    seen = []
    real = flow_grpo_module.grpo_guard_loss

    def spy(*args, **kwargs):
        seen.append(kwargs.get("sampler"))
        return real(*args, **kwargs)

    monkeypatch.setattr(flow_grpo_module, "grpo_guard_loss", spy)
    cfg = make(tiny_checkpoint, tmp_path, "algorithm.loss=grpo_guard", "sampler.sampler=cps", "total_steps=1")
    history = Trainer(cfg).train()
    assert math.isfinite(history[0]["loss"])
    assert seen and all(s is not None and Sampler(s) is Sampler.CPS for s in seen), seen


@pytest.mark.slow
@pytest.mark.parametrize(("clip", "old_per_image"), [(None, 0.0), (0.1, 0.5)])
def test_awm_computes_old_log_probs_only_for_its_clip(clip, old_per_image, tiny_checkpoint, tmp_path):
    """Plain AWM's ratio is 1 at every optimizer step, so its second mini-batch needs no old-policy
    forward; with a clip that mini-batch's old log-probs cost one forward per sample (half the batch)."""
    cfg = make(
        tiny_checkpoint,
        tmp_path,
        "algorithm.name=awm",
        "sampler.window_size=0",
        "sampler.guidance_scale=1.0",
        "algorithm.mini_batches=2",
        "algorithm.awm.timesteps=1",
        f"algorithm.awm.clip_range={'null' if clip is None else clip}",
        "total_steps=1",
    )
    (record,) = Trainer(cfg).train()
    assert record["optimizer_steps"] == 2
    assert record["fe/old_per_image"] == old_per_image
    assert record["fe/total_per_image"] == cfg.sampler.num_steps + 3 + old_per_image
    if clip is None:  # the ratio is exactly 1 on both mini-batches
        assert record["ratio_mean"] == 1.0 and record["clipfrac"] == 0.0


@pytest.mark.slow
@pytest.mark.parametrize("name", ["diffusion_nft", "awm"])
def test_guided_training_runs_both_cfg_rows(name, tiny_checkpoint, tmp_path):
    """With `guided` the forward-process learners train the CFG-guided velocity: both rows of every
    training forward and backward (twice the unguided training FE); the rollout's CFG is the same."""
    short = FORWARD_OPTIONS_KEYS[name]
    settings = [
        f"algorithm.name={name}",
        "sampler.window_size=0",
        "sampler.guidance_scale=2.0",
        "algorithm.mini_batches=1",
        f"algorithm.{short}.timesteps=1",
        "total_steps=1",
    ]
    records = {}
    for guided in (False, True):
        cfg = make(
            tiny_checkpoint,
            tmp_path / str(guided),
            *settings,
            f"algorithm.{short}.guided={str(guided).lower()}",
        )
        (records[guided],) = Trainer(cfg).train()
    plain, guided = records[False], records[True]
    assert plain["fe/rollout_per_image"] == guided["fe/rollout_per_image"] == 2 * cfg.sampler.num_steps
    assert plain["fe/train_per_image"] == 3 and guided["fe/train_per_image"] == 6
    # The same rollouts (seed, CFG), a different trained velocity: its error to the target differs.
    error = "nft/x0_error" if name == "diffusion_nft" else "awm/fm_loss"
    assert plain["reward/mean"] == guided["reward/mean"] and plain[error] != guided[error]


def paired_gain(before, after) -> tuple[float, float]:
    """Mean and standard error of the per-prompt reward change on the same ODE noise."""
    diffs = [b["reward"] - a["reward"] for a, b in zip(before.prompts, after.prompts, strict=True)]
    mean = sum(diffs) / len(diffs)
    var = sum((d - mean) ** 2 for d in diffs) / (len(diffs) - 1)
    return mean, math.sqrt(var / len(diffs))


def _sign_run(tiny_checkpoint, run_dir, sign, settings):
    """Train a few steps with the advantage's sign set; the evaluation reward before and after, paired
    per prompt on the same noise (a few steps move it far beyond its paired standard error, where the
    rollouts' own reward means are too noisy to tell)."""
    cfg = make(tiny_checkpoint, run_dir, *settings, f"algorithm.advantage_sign={sign}", "eval.num_steps=6")
    trainer = Trainer(cfg)
    evaluator = Evaluator(
        cfg.eval,
        cfg.sampler,
        trainer.engine,
        trainer.rewards,
        trainer.dist,
        demo_records(16),
        seed=cfg.seed,
        total_steps=cfg.total_steps,
    )
    before = evaluator.evaluate(0)
    history = trainer.train()
    assert all(math.isfinite(h["loss"]) for h in history)
    return paired_gain(before, evaluator.evaluate(cfg.total_steps))


SIGN_SETTINGS = {
    "flow_grpo": ["total_steps=3"],  # the demo's settings
    "diffusion_nft": ["algorithm.name=diffusion_nft", *FORWARD, "algorithm.nft.timesteps=2", "total_steps=3"],
    # The benchmark's diffusion_nft_cfg: CFG 2 ODE rollouts, one noise per group, the guided velocity.
    "diffusion_nft_cfg": [
        "algorithm.name=diffusion_nft",
        "sampler.window_size=0",
        "sampler.guidance_scale=2.0",
        "algorithm.mini_batches=1",
        "algorithm.nft.timesteps=2",
        "algorithm.nft.group_noise=true",
        "algorithm.nft.guided=true",
        "total_steps=3",
    ],
    "awm": ["algorithm.name=awm", *FORWARD, "algorithm.awm.timesteps=2", "total_steps=3"],
    "grpo_guard": ["algorithm.loss=grpo_guard", "algorithm.clip_range=1e-2", "total_steps=3"],
}


@pytest.mark.slow
@pytest.mark.parametrize("algorithm", sorted(SIGN_SETTINGS))
def test_reward_follows_the_advantage_sign(algorithm, tiny_checkpoint, tmp_path):
    up, up_err = _sign_run(tiny_checkpoint, tmp_path / "up", 1, SIGN_SETTINGS[algorithm])
    down, down_err = _sign_run(tiny_checkpoint, tmp_path / "down", -1, SIGN_SETTINGS[algorithm])
    assert up > 2 * up_err, (up, up_err)
    assert -down > 2 * down_err, (down, down_err)


@pytest.mark.slow
@pytest.mark.parametrize("name", ["diffusion_nft", "awm"])
def test_forward_process_learners_train_edit_rows_with_their_reference(
    name, tiny_checkpoint, tmp_path, monkeypatch
):
    """Edit rows through DiffusionNFT and AWM: every training forward on the re-noised final latents
    carries each row's own reference latents (the rollout's, in row order), and the step trains."""
    import boogu_trainer.algorithms.renoise as fp
    from tests.trainer.golden_runs import edit_rows

    path = edit_rows(tmp_path)
    short = FORWARD_OPTIONS_KEYS[name]
    cfg = make(
        tiny_checkpoint,
        tmp_path / "run",
        f"algorithm.name={name}",
        *FORWARD,
        f"algorithm.{short}.timesteps=1",
        f"data.train_files=[{path}]",
        "total_steps=1",
    )
    seen: list[tuple] = []
    real = fp.boogu_velocity

    def spy(transformer, x, sigma, cond, *args, **kwargs):
        seen.append(tuple(cond.ref_latents or ()))
        return real(transformer, x, sigma, cond, *args, **kwargs)

    monkeypatch.setattr(fp, "boogu_velocity", spy)
    trainer = Trainer(cfg)
    (record,) = trainer.train()
    assert record["edit_samples"] == record["samples"] == 2 * cfg.algorithm.group_size
    assert seen, "no training forward went through the forward-process update"
    for call in seen:
        assert call and all(r is not None for r in call), "a training forward lost its reference latents"
    # Rows of the two prompts carry different references (each row its own image, not one for all).
    first = seen[0]
    assert not torch.equal(first[0], first[-1]), "the first and the last row carry the same reference"
    assert math.isfinite(record["loss"]) and record["optimizer_steps"] == 1


@pytest.mark.slow
@pytest.mark.parametrize("name", ["flow_grpo", "diffusion_nft", "awm"])
def test_every_learner_trains_edit_rows_under_double_guidance(name, tiny_checkpoint, tmp_path, monkeypatch):
    """Edit rows rolled out with upstream's double guidance (text 2, image 2: three forwards a step)
    and trained at the rollout's scales: flow_grpo recomputes the window's log-probs through the same
    three branches (bitwise: its first step is on-policy to the bit), and the guided forward-process
    learners train the guided velocity (three rows per training forward)."""
    import boogu_adapters.step as step_module
    from tests.trainer.golden_runs import edit_rows

    path = edit_rows(tmp_path)
    common = ["sampler.guidance_scale=2.0", "sampler.image_guidance_scale=2.0", "algorithm.mini_batches=1"]
    if name == "flow_grpo":
        extra = ["sampler.window_size=2", "sampler.window_range=[0,3]"]
    else:
        short = FORWARD_OPTIONS_KEYS[name]
        extra = ["sampler.window_size=0", f"algorithm.{short}.timesteps=1", f"algorithm.{short}.guided=true"]
    cfg = make(
        tiny_checkpoint,
        tmp_path / "run",
        f"algorithm.name={name}",
        *common,
        *extra,
        f"data.train_files=[{path}]",
        "total_steps=1",
    )
    scales: list[tuple[float, float]] = []
    real = step_module.boogu_velocity

    def spy(transformer, x, sigma, cond, guidance_scale, *args, **kwargs):
        if torch.is_grad_enabled():  # the training forwards (the rollout's run without autograd)
            scales.append((guidance_scale, kwargs.get("image_guidance_scale", 1.0)))
        return real(transformer, x, sigma, cond, guidance_scale, *args, **kwargs)

    monkeypatch.setattr(step_module, "boogu_velocity", spy)
    if name != "flow_grpo":
        import boogu_trainer.algorithms.renoise as fp

        monkeypatch.setattr(fp, "boogu_velocity", spy)
    (record,) = Trainer(cfg).train()
    assert record["edit_samples"] == record["samples"] == 2 * cfg.algorithm.group_size
    assert record["fe/rollout_per_image"] == 3 * cfg.sampler.num_steps
    assert scales and set(scales) == {(2.0, 2.0)}, scales
    if name == "flow_grpo":
        assert record["logprob_diff/step0"] == 0.0 and record["logprob_diff/step1"] == 0.0
    else:
        assert record["fe/train_per_image"] == 9  # three guidance rows of each of the three forwards
    assert math.isfinite(record["loss"]) and record["optimizer_steps"] == 1
