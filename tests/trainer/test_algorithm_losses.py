"""The objectives of GRPO-Guard, DiffusionNFT and AWM on hand-made tensors (no model).

Each direction test fails if a sign is flipped: a positive advantage must pull the policy's
velocity toward the flow-matching target (or keep a ratio-1 step a plain -A step), a negative one
away from it.
"""

from __future__ import annotations

import math

import pytest
import torch

from boogu_schedule import Sampler, flow_target, forward_noise, sde_step
from boogu_trainer.config import FORWARD_OPTIONS_KEYS, ConfigError, NftConfig, load_config
from boogu_trainer.losses import (
    awm_log_prob,
    awm_loss,
    grpo_guard_loss,
    nft_loss,
    policy_loss,
    ratio_norm_bias,
    velocity_kl,
)


def _batch(b=4, seed=0):
    g = torch.Generator().manual_seed(seed)
    x0 = torch.randn(b, 4, 4, 4, generator=g)
    eps = torch.randn(b, 4, 4, 4, generator=g)
    sigma = torch.rand(b, generator=g) * 0.8 + 0.1
    return x0, eps, sigma, forward_noise(x0, eps, sigma)


def _toward_target(loss_fn, v, target):
    """d loss along the direction that moves v toward the target (negative: the loss prefers it)."""
    v = v.clone().requires_grad_(True)
    loss_fn(v).backward()
    return float((v.grad * (target - v.detach())).sum())


@pytest.mark.parametrize("adaptive", [True, False])
def test_nft_positive_advantage_pulls_toward_the_target_negative_pushes_away(adaptive):
    x0, eps, sigma, x = _batch()
    target = flow_target(x0, eps)
    v_old = target + 0.3 * torch.randn_like(target)
    for a, expect in ((3.0, -1), (-3.0, +1)):
        adv = torch.full((4,), a)
        # the current policy a little off the old one, so that the loss is not at a stationary point
        v = v_old + 0.05 * torch.randn_like(v_old)

        def loss(v_, adv=adv):
            return nft_loss(
                v_, v_old, x, x0, sigma, adv, beta=1.0, adv_clip=5.0, adaptive_weight=adaptive
            ).loss

        assert math.copysign(1, _toward_target(loss, v, target)) == expect


def test_nft_at_the_oracle_velocity_has_zero_positive_error():
    x0, eps, sigma, x = _batch()
    target = flow_target(x0, eps)
    out = nft_loss(
        target, target, x, x0, sigma, torch.full((4,), 5.0), beta=1.0, adv_clip=5.0, adaptive_weight=False
    )
    assert float(out.loss) < 1e-10 and float(out.metrics["nft/r_mean"]) == 1.0


def test_nft_optimality_probability_is_the_clipped_affine_advantage():
    x0, eps, sigma, x = _batch()
    v = flow_target(x0, eps)
    adv = torch.tensor([-5.0, 0.0, 2.5, 5.0])
    out = nft_loss(v, v, x, x0, sigma, adv, beta=0.1, adv_clip=5.0)
    assert float(out.metrics["nft/r_mean"]) == pytest.approx((0.0 + 0.5 + 0.75 + 1.0) / 4)


def test_awm_gradient_on_policy_is_the_advantage_weighted_flow_matching_gradient():
    x0, eps, _, _ = _batch()
    target = flow_target(x0, eps)
    v = (target + 0.2 * torch.randn_like(target)).requires_grad_(True)
    adv = torch.tensor([1.5, -0.5, 2.0, -3.0])
    log_prob = awm_log_prob(v, target)
    awm_loss(log_prob, log_prob.detach(), adv, clip_range=None).loss.backward()
    plain = v.detach().clone().requires_grad_(True)
    (adv * (plain - target).pow(2).mean(dim=(1, 2, 3))).mean().backward()
    torch.testing.assert_close(v.grad, plain.grad)
    for a, expect in ((2.0, -1), (-2.0, +1)):
        adv = torch.full((4,), a)

        def loss(v_, adv=adv):
            lp = awm_log_prob(v_, target)
            return awm_loss(lp, lp.detach(), adv, clip_range=None).loss

        assert math.copysign(1, _toward_target(loss, v.detach(), target)) == expect


def test_awm_clip_stops_the_gradient_outside_the_trust_region():
    lp_old = torch.zeros(2)
    lp = torch.tensor([0.5, -0.5], requires_grad=True)  # ratios e^0.5 and e^-0.5
    out = awm_loss(lp, lp_old, torch.tensor([1.0, -1.0]), clip_range=0.1)
    out.loss.backward()
    assert torch.equal(lp.grad, torch.zeros(2)) and float(out.metrics["clipfrac"]) == 1.0


def test_grpo_guard_is_ratio_one_on_policy_and_centres_the_log_ratio():
    g = torch.Generator().manual_seed(1)
    mean_old = torch.randn(3, 4, 2, 2, generator=g)
    std = torch.tensor([0.2, 0.1, 0.3])
    dt = torch.tensor([-0.1, -0.2, -0.05])
    adv = torch.tensor([1.0, -2.0, 0.5])
    lp = torch.randn(3, generator=g)
    on = grpo_guard_loss(lp, lp, mean_old, mean_old, std, dt, adv, 2e-6)
    assert torch.equal(on.metrics["ratio_mean"], torch.tensor(1.0))
    torch.testing.assert_close(on.loss, (-adv / dt.abs()).mean())
    # With the sample at the old mean, log p - log p_old = -mean(dmu^2) / (2 s^2): RatioNorm undoes it.
    mean_new = mean_old + 0.01 * torch.randn(3, 4, 2, 2, generator=g)
    x = mean_old
    shape = (-1, 1, 1, 1)
    logp = lambda m: (-(x - m).pow(2) / (2 * std.reshape(shape) ** 2)).mean(dim=(1, 2, 3))  # noqa: E731
    out = grpo_guard_loss(logp(mean_new), logp(mean_old), mean_new, mean_old, std, dt, adv, 2e-6)
    torch.testing.assert_close(out.metrics["ratio_mean"], torch.tensor(1.0))
    assert float(out.metrics["guard/raw_ratio_mean"]) < 1.0  # the bias GRPO-Guard corrects


def _log_prob(sampler: Sampler, x: torch.Tensor, mean: torch.Tensor, std: float) -> torch.Tensor:
    """Per-sample log-prob as the rollout scores it, float64: cps's unnormalised ``-mean((x - mu)^2)``,
    the Gaussian log-density (per element, averaged) for the SDE samplers."""
    if sampler is Sampler.CPS:
        return -(x - mean).pow(2).mean(dim=1)
    return (-(x - mean).pow(2) / (2 * std**2) - math.log(std) - 0.5 * math.log(2 * math.pi)).mean(dim=1)


def test_the_rollout_scores_cps_unnormalised_and_flow_sde_gaussian():
    # The two log-prob forms the Monte Carlo test below relies on are the ones sde_step returns.
    g = torch.Generator().manual_seed(3)
    x, v = torch.randn(2, 8, generator=g), torch.randn(2, 8, generator=g)
    for sampler in (Sampler.CPS, Sampler.FLOW_SDE):
        step = sde_step(sampler, x, v, 0.6, 0.5, 0.8, g)
        std = float(step.std.flatten()[0])
        expected = _log_prob(sampler, step.prev_sample.double(), step.mean.double(), std)
        torch.testing.assert_close(step.log_prob.double(), expected, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("sampler", [Sampler.CPS, Sampler.FLOW_SDE])
def test_ratio_norm_centres_the_log_ratio_under_the_old_kernel(sampler):
    """Monte Carlo, float64: draw x' = mu_old + s eps from the old kernel many times; the RatioNorm'd
    log-ratio ``(log p - log p_old + b) * s`` has mean 0 (within 4 standard errors) with the
    sampler's own bias, and not with the other form's (the Gaussian one is what cps used to get)."""
    n, d, s = 40_000, 16, 0.3
    g = torch.Generator().manual_seed(7)
    mean_old = torch.randn(1, d, generator=g, dtype=torch.float64).expand(n, d)
    mean = mean_old + 0.1 * torch.randn(1, d, generator=g, dtype=torch.float64).expand(n, d)
    x = mean_old + s * torch.randn(n, d, generator=g, dtype=torch.float64)
    std = torch.full((n,), s, dtype=torch.float64)
    log_ratio = _log_prob(sampler, x, mean, s) - _log_prob(sampler, x, mean_old, s)

    def centred(kind: Sampler) -> tuple[float, float]:
        normed = (log_ratio + ratio_norm_bias(mean, mean_old, std, kind)) * s
        return float(normed.mean()), float(normed.std() / math.sqrt(n))

    m, se = centred(sampler)
    assert abs(m) < 4 * se, (sampler, m, se)
    # Falsifiable: the raw log-ratio is biased, and the other sampler's correction misses.
    assert abs(float(log_ratio.mean()) * s) > 20 * se
    other = Sampler.FLOW_SDE if sampler is Sampler.CPS else Sampler.CPS
    m_other, _ = centred(other)
    assert abs(m_other) > 20 * se, (other, m_other, se)
    # grpo_guard_loss uses the same correction: its ratio is exp of the centred log-ratio.
    out = grpo_guard_loss(
        _log_prob(sampler, x, mean, s),
        _log_prob(sampler, x, mean_old, s),
        mean,
        mean_old,
        std,
        torch.full((n,), -0.1, dtype=torch.float64),
        torch.ones(n, dtype=torch.float64),
        2e-6,
        sampler=sampler,
    )
    expected = torch.exp((log_ratio + ratio_norm_bias(mean, mean_old, std, sampler)) * s).mean()
    torch.testing.assert_close(out.metrics["ratio_mean"], expected)


def test_grpo_guard_matches_ppo_clip_direction():
    mean = torch.zeros(2, 1, 1, 1)
    std, dt = torch.ones(2), -torch.ones(2)
    lp = torch.zeros(2, requires_grad=True)
    adv = torch.tensor([1.0, -1.0])
    grpo_guard_loss(lp, lp.detach(), mean, mean, std, dt, adv, 1e-3).loss.backward()
    lp2 = torch.zeros(2, requires_grad=True)
    policy_loss(lp2, lp2.detach(), adv, 1e-3).loss.backward()
    torch.testing.assert_close(lp.grad, lp2.grad)  # s = 1, |dt| = 1: the same objective


def test_velocity_kl_is_the_per_sample_mse():
    v = torch.ones(2, 3, 2, 2)
    assert torch.equal(velocity_kl(v, torch.zeros_like(v)), torch.ones(2))


def test_old_decay_schedules_match_the_reference_types():
    type1 = NftConfig()  # flat 0, +0.001 per step, up to 0.5
    assert [type1.old_decay(s) for s in (0, 10, 600)] == [0.0, pytest.approx(0.01), 0.5]
    type2 = NftConfig(old_decay_start=75, old_decay_rate=0.0075, old_decay_max=0.999)
    assert type2.old_decay(74) == 0.0 and type2.old_decay(85) == pytest.approx(0.075)
    assert type2.old_decay(10_000) == 0.999


def _level_plan(name: str, group_ids: list[int], group_noise: bool, n: int = 4):
    from types import SimpleNamespace

    from boogu_trainer.algorithms.renoise import LevelPlan

    short = FORWARD_OPTIONS_KEYS[name]
    cfg = load_config(
        None,
        [
            f"algorithm.name={name}",
            f"algorithm.group_size={n}",
            f"algorithm.{short}.timesteps=2",
            f"algorithm.{short}.group_noise={str(group_noise).lower()}",
            "sampler.window_size=0",
        ],
    )
    b = n * len(group_ids)
    traj = SimpleNamespace(
        sigmas=torch.linspace(1.0, 0.0, cfg.sampler.num_steps + 1),
        group_id=torch.tensor(group_ids).repeat_interleave(n),
        final_latents=torch.zeros(b, 4, 4, 4),
    )
    return LevelPlan(
        cfg.algorithm, cfg.algorithm.forward_options, cfg.seed, torch.device("cpu"), traj, step=7
    )


@pytest.mark.parametrize("name", ["diffusion_nft", "awm"])
def test_group_noise_gives_a_group_one_set_of_levels_and_noise(name):
    """Common random numbers: with group_noise, every sample of a group is re-noised at the same
    levels with the same noise, another group gets others, and a group's draws do not depend on
    which other groups a rank holds; without it, every sample draws its own."""
    shared = _level_plan(name, [3, 5], group_noise=True)
    for j in range(2):
        noise = shared.noise(list(range(8)), j)
        for rows in (range(0, 4), range(4, 8)):
            assert all(torch.equal(noise[r], noise[rows[0]]) for r in rows)
            assert all(torch.equal(shared.sigmas[r], shared.sigmas[rows[0]]) for r in rows)
        assert not torch.equal(noise[0], noise[4])
    assert not torch.equal(shared.sigmas[0], shared.sigmas[4])
    alone = _level_plan(name, [5], group_noise=True)  # group 5 on a rank of its own
    assert torch.equal(alone.sigmas, shared.sigmas[4:])
    assert torch.equal(alone.noise([0], 1), shared.noise([4], 1))

    own = _level_plan(name, [3, 5], group_noise=False)
    noise = own.noise([0, 1, 2, 3], 0)
    assert all(not torch.equal(noise[0], noise[r]) for r in (1, 2, 3))
    assert not torch.equal(own.sigmas[0], own.sigmas[1])


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (["sampler.window_size=0"], "flow_grpo trains on the SDE window"),
        (["algorithm.name=awm", "algorithm.loss=grpo_guard"], "GRPO-Guard is a flow_grpo objective"),
        (["algorithm.name=diffusion_nft", "algorithm.nft.timesteps=11"], "algorithm.nft.timesteps=11"),
        (["algorithm.nft.beta=0"], "algorithm.nft.beta=0"),
        (["algorithm.awm.sigma_range=[0.5,0.2]"], "algorithm.awm.sigma_range"),
        (
            ["algorithm.name=diffusion_nft", "sampler.guidance_scale=1.0", "algorithm.nft.guided=true"],
            "algorithm.nft.guided=true trains the CFG-guided velocity",
        ),
        (
            ["algorithm.name=awm", "sampler.guidance_scale=1.0", "algorithm.awm.guided=true"],
            "awm.guided=false",
        ),
        (["algorithm.name=ppo"], "algorithm.name"),
    ],
)
def test_bad_algorithm_settings_name_the_key(overrides, message):
    with pytest.raises(ConfigError, match=message):
        load_config(None, overrides)


def test_ode_rollouts_are_allowed_for_forward_process_algorithms():
    for name in ("diffusion_nft", "awm"):
        cfg = load_config(None, [f"algorithm.name={name}", "sampler.window_size=0"])
        assert cfg.algorithm.name == name and cfg.sampler.window_size == 0


def test_every_example_recipe_loads_with_its_algorithm():
    from pathlib import Path

    root = Path(__file__).resolve().parents[2] / "examples"
    found = {}
    for path in sorted(root.rglob("*.yaml")):
        cfg = load_config(path)
        found[path.relative_to(root).as_posix()] = (cfg.algorithm.name, cfg.algorithm.loss)
    assert found["flowgrpo_trainer/boogu_image/boogu_image_ocr_lora.yaml"] == ("flow_grpo", "ppo_clip")
    assert found["flowgrpo_trainer/boogu_image/boogu_image_ocr_grpo_guard_lora.yaml"] == (
        "flow_grpo",
        "grpo_guard",
    )
    assert found["diffusion_nft_trainer/boogu_image/boogu_image_ocr_lora.yaml"] == (
        "diffusion_nft",
        "ppo_clip",
    )
    assert found["awm_trainer/boogu_image/boogu_image_ocr_lora.yaml"] == ("awm", "ppo_clip")


def test_the_ratio_std_is_pooled_over_chunks():
    """``ratio_std`` of an update is the std over all its ratios, whatever the chunks (here two equal
    halves with different spreads, each chunk's metrics averaged with share 1/2)."""
    from boogu_trainer.losses import RATIO_SQ_DEV, pooled_ratio_std, ratio_metrics

    gen = torch.Generator().manual_seed(0)
    ratio = torch.cat([1 + 1e-3 * torch.randn(8, generator=gen), 1.01 + 3e-3 * torch.randn(8, generator=gen)])
    halves = [ratio_metrics(r, r.log(), 0.1) for r in ratio.chunk(2)]
    mean = sum(h["ratio_mean"].double() for h in halves) / 2
    sq = sum(h[RATIO_SQ_DEV] for h in halves) / 2
    expected = ratio.double().std(unbiased=False)
    torch.testing.assert_close(pooled_ratio_std(mean, sq), expected, rtol=1e-5, atol=0)
    on_policy = ratio_metrics(torch.ones(4), torch.zeros(4), 0.1)
    assert pooled_ratio_std(on_policy["ratio_mean"], on_policy[RATIO_SQ_DEV]) == 0
