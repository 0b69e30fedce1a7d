"""The uphill check (`benchmarks/gradient_check.py`) on every learner: a step along the estimated
gradient raises the expected reward, and a flipped advantage or log-prob sign makes it fall.

The tiny random checkpoint with the brightness reward (a reward it can move in one step), a few
prompt groups: the instrument is the same one users run on their own recipe and reward.
"""

from __future__ import annotations

import dataclasses
import importlib
import sys
from pathlib import Path

import pytest
import torch

from boogu_trainer import losses
from boogu_trainer.algorithms import awm as awm_module
from boogu_trainer.algorithms import flow_grpo as flow_grpo_module
from boogu_trainer.checkpoint import CheckpointError
from boogu_trainer.config import load_config
from boogu_trainer.trainer import Trainer

BENCHMARKS = Path(__file__).resolve().parents[2] / "benchmarks"

LEARNERS = {
    "flow_grpo": [
        "algorithm.name=flow_grpo",
        "algorithm.loss=ppo_clip",
        "sampler.window_size=2",
        "sampler.window_range=[0,3]",
        "sampler.noise_level=0.8",
    ],
    "grpo_guard": [
        "algorithm.name=flow_grpo",
        "algorithm.loss=grpo_guard",
        "sampler.window_size=2",
        "sampler.window_range=[0,3]",
        "sampler.noise_level=0.8",
    ],
    "diffusion_nft": ["algorithm.name=diffusion_nft", "algorithm.nft.timesteps=2", "sampler.window_size=0"],
    "awm": ["algorithm.name=awm", "algorithm.awm.timesteps=2", "sampler.window_size=0"],
}


@pytest.fixture(scope="module")
def gradient_check():
    sys.path.insert(0, str(BENCHMARKS))  # the script imports its sibling _common
    try:
        yield importlib.import_module("gradient_check")
    finally:
        sys.path.remove(str(BENCHMARKS))


def flip_log_prob(monkeypatch, learner: str) -> None:
    """The log-probability's sign flipped where the learner's loss reads it."""
    if learner == "flow_grpo":
        monkeypatch.setattr(
            flow_grpo_module,
            "policy_loss",
            lambda log_prob, old, adv, clip: losses.policy_loss(-log_prob, -old, adv, clip),
        )
    elif learner == "grpo_guard":
        monkeypatch.setattr(
            flow_grpo_module,
            "grpo_guard_loss",
            lambda log_prob, old, *rest, **kw: losses.grpo_guard_loss(-log_prob, -old, *rest, **kw),
        )
    else:
        monkeypatch.setattr(awm_module, "awm_log_prob", lambda v, target: -losses.awm_log_prob(v, target))


# DiffusionNFT has no log-probability: its one sign is the optimality probability r(A), which decides
# whether v+ or v- is pulled to the sample, so swapping them is exactly the advantage flip.
FLIPS = {
    "flow_grpo": ("none", "advantage", "log_prob"),
    "grpo_guard": ("none", "advantage", "log_prob"),
    "diffusion_nft": ("none", "advantage"),
    "awm": ("none", "advantage", "log_prob"),
}


def tiny_overrides(tiny_checkpoint, run_dir, learner: str) -> list[str]:
    """The tiny random model with the brightness reward: a reward it can move in one step."""
    return [
        f"model.path={tiny_checkpoint}",
        "model.device=cpu",
        "data.prompts_per_step=2",
        "algorithm.group_size=4",
        "sampler.num_steps=4",
        "sampler.height=32",
        "sampler.width=32",
        "sampler.guidance_scale=2.0",
        "lora.rank=4",
        "lora.alpha=8",
        "optim.lr=1e-3",
        "reward.rewards=[{name: demo_brightness}]",
        *LEARNERS[learner],
        f"logging.run_dir={run_dir}",
        "logging.progress=false",
        "preflight=false",
        "seed=5",
    ]


@pytest.mark.slow
@pytest.mark.parametrize("learner", list(LEARNERS))
def test_uphill_check_catches_a_flipped_sign(gradient_check, tiny_checkpoint, tmp_path, learner):
    trainer = Trainer(load_config(None, tiny_overrides(tiny_checkpoint, tmp_path, learner)))
    right = trainer.rollout.algorithm
    before = [p.detach().clone() for p in trainer.learner.params]
    try:
        for flip in FLIPS[learner]:
            with pytest.MonkeyPatch.context() as patch:
                if flip == "advantage":
                    patch.setattr(
                        trainer.rollout, "algorithm", dataclasses.replace(right, advantage_sign=-1.0)
                    )
                if flip == "log_prob":
                    flip_log_prob(patch, learner)
                result = gradient_check.measure(
                    trainer, groups=8, sizes=[8], eps=[0.3], eval_groups=4, cosine=True
                )
            step = result["uphill"]["steps"][0]
            assert result["rollouts"]["images"] == 32 and result["uphill"]["images"] == 16
            assert len(result["cosine"]) == 1 and result["cosine"][0]["batches"] == 4
            if flip == "none":
                assert step["uphill"], step
                assert step["plus"] > result["uphill"]["base"] > step["minus"], step
            else:
                assert step["margin"] < -2 * step["margin_se"], (flip, step)
            # the check puts the weights back bitwise and leaves no gradient behind
            assert all(bool((p == b).all()) for p, b in zip(trainer.learner.params, before))
            assert all(p.grad is None for p in trainer.learner.params)
    finally:
        trainer.close()


def test_group_gradients_stream_the_exact_statistics_and_a_sketch_keeps_the_cosines(gradient_check):
    # 64 "group gradients" over 20000 parameters: a common direction under noise 4x its size
    generator = torch.Generator().manual_seed(0)
    signal = torch.randn(20000, generator=generator)
    grads = signal + 4 * torch.randn(64, 20000, generator=generator)
    exact = gradient_check.GroupGradients(20000)
    sketched = gradient_check.GroupGradients(20000, sketch=4096, seed=1)
    for g in grads:
        exact.add(g)
        sketched.add(g)
    # S and V exactly as from all the vectors at once (unbiased: S ~ |signal|^2, V ~ 16 P)
    g = grads.double()
    s_all = (float(g.sum(0) @ g.sum(0)) - float((g * g).sum())) / (64 * 63)
    assert exact.signal_and_noise() == pytest.approx((s_all, float((g * g).sum()) / 64 - s_all), rel=1e-12)
    assert sketched.signal_and_noise() == exact.signal_and_noise()  # the sums never go through the sketch
    assert torch.equal(sketched.mean(), exact.mean()) and exact.vectors().shape == (64, 20000)
    assert sketched.vectors().shape == (64, 4096)
    # the cosine table from the sketch reads the gradients' own to ~sqrt((1 + cos^2) / 4096) per pair
    s, v = exact.signal_and_noise()
    from_grads = gradient_check.cosine_table(exact.vectors(), 8, [8, 64, 256], s, v)
    from_sketch = gradient_check.cosine_table(sketched.vectors(), 8, [8, 64, 256], s, v)
    for a, b in zip(from_grads, from_sketch, strict=True):
        assert b["cosine"] == pytest.approx(a["cosine"], abs=0.05), (a, b)  # ~2.5 sd for one pair
        assert a["cosine_expected"] == b["cosine_expected"]
    assert 0.1 < from_grads[1]["cosine"] < 0.6  # 8 groups of 8: 1 / (1 + 16/8), about 1/3


def test_the_check_measures_at_a_trained_checkpoint_and_refuses_another_runs(
    gradient_check, tiny_checkpoint, tmp_path
):
    # `--resume`: the instruments at the end of a run, not only at the base. One trained step saved
    # as a checkpoint; the check's trainer (a fresh run folder, as the script makes) holds that
    # step's LoRA bitwise, and a recipe that differs from the run's is refused by the resume check.
    overrides = tiny_overrides(tiny_checkpoint, tmp_path / "run", "diffusion_nft")
    config = load_config(None, [*overrides, "total_steps=1", "checkpoint.save_every=1"])
    with Trainer(config) as trainer:
        base = [p.detach().clone() for p in trainer.learner.params]
        trainer.train()
        trained = [p.detach().clone() for p in trainer.learner.params]
    checkpoint = next((tmp_path / "run").rglob("step_000001"))
    assert any(not torch.equal(t, b) for t, b in zip(trained, base))

    fresh = load_config(None, [*overrides, f"logging.run_dir={tmp_path / 'check'}"])
    trainer = gradient_check.open_trainer(fresh, str(checkpoint))
    try:
        assert all(torch.equal(p, t) for p, t in zip(trainer.learner.params, trained))
        assert trainer.step == 1
    finally:
        trainer.close()

    other = load_config(None, [*overrides, "optim.lr=3e-4", f"logging.run_dir={tmp_path / 'other'}"])
    with pytest.raises(CheckpointError, match=r"optim\.lr"):
        gradient_check.open_trainer(other, str(checkpoint))
    with pytest.raises(SystemExit, match="not an intact checkpoint"):
        gradient_check.main(["--resume", str(tmp_path / "nowhere"), "--quick"])
