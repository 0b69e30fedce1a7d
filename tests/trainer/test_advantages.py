"""Group-relative advantages against an independent float64 statement."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from boogu_schedule import sde_step
from boogu_trainer.advantages import compute_advantages
from boogu_trainer.losses import kl_to_reference, policy_loss


@st.composite
def grouped_rewards(draw):
    groups = draw(st.integers(1, 5))
    n = draw(st.integers(2, 6))
    values = draw(st.lists(st.floats(-5, 5, allow_nan=False), min_size=groups * n, max_size=groups * n))
    return torch.tensor(values, dtype=torch.float32), torch.arange(groups).repeat_interleave(n), n


def reference(r, gid, scope, eps=1e-4, clip=5.0):
    r = r.double()
    out = torch.zeros_like(r)
    glob = r.std(unbiased=False)
    for g in gid.unique():
        m = gid == g
        centred = r[m] - r[m].mean()
        std = r[m].std(unbiased=False) if scope == "group" else glob
        out[m] = 0 if r[m].std(unbiased=False) == 0 else centred / (std + eps)
    return out.clamp(-clip, clip)


@given(data=grouped_rewards(), scope=st.sampled_from(["group", "batch"]))
def test_matches_reference_and_groups_are_centred(data, scope):
    r, gid, _ = data
    adv = compute_advantages({"r": r}, {"r": 1.0}, gid, std_scope=scope)
    torch.testing.assert_close(adv.advantages.double(), reference(r, gid, scope), rtol=1e-4, atol=1e-4)
    for g in gid.unique():
        unclamped = reference(r, gid, scope, clip=1e9)[gid == g]
        if unclamped.abs().max() < 5:
            assert abs(float(adv.advantages[gid == g].sum())) < 1e-3


def test_zero_std_groups_nonfinite_samples_and_sign():
    r = torch.tensor([1.0, 1.0, 1.0, 0.0, 2.0, float("nan")])
    gid = torch.tensor([0, 0, 0, 1, 1, 1])
    adv = compute_advantages({"r": r}, {"r": 1.0}, gid, std_scope="group")
    assert adv.advantages[:3].tolist() == [0.0, 0.0, 0.0]  # all-equal group: no gradient
    assert adv.zero_std_ratio == 0.5
    assert adv.finite.tolist() == [True] * 5 + [False] and adv.advantages[5] == 0
    assert adv.advantages[3] < 0 < adv.advantages[4]  # the NaN sample is left out of the group stats
    flipped = compute_advantages({"r": r}, {"r": 1.0}, gid, std_scope="group", sign=-1.0)
    torch.testing.assert_close(flipped.advantages, -adv.advantages)


def test_weighted_sum_and_per_reward_normalisation():
    gid = torch.tensor([0, 0, 1, 1])
    a = torch.tensor([0.0, 1.0, 0.0, 1.0])
    b = torch.tensor([0.0, 100.0, 5.0, 5.0])
    summed = compute_advantages({"a": a, "b": b}, {"a": 1.0, "b": 0.01}, gid, std_scope="group")
    torch.testing.assert_close(summed.rewards, torch.tensor([0.0, 2.0, 0.05, 1.05]))
    per = compute_advantages(
        {"a": a, "b": b}, {"a": 1.0, "b": 1.0}, gid, std_scope="group", per_reward_normalization=True
    )
    # group 0: both rewards say sample 1 is better, each normalised to +-1: sum +-2 (up to eps)
    assert math.isclose(float(per.advantages[1]), 2.0, rel_tol=1e-3)
    # group 1: b is constant (contributes 0), a says +-1
    assert math.isclose(float(per.advantages[3]), 1.0, rel_tol=1e-3)
    nan_b = compute_advantages({"a": a, "b": torch.full((4,), float("nan"))}, {"a": 1.0, "b": 0.0}, gid)
    assert bool(nan_b.finite.all())  # a weight-0 reward is a metric: its NaNs drop nothing


@pytest.mark.parametrize("per_reward_normalization", [True, False])
@pytest.mark.parametrize("scope", ["group", "batch"])
def test_weight_zero_rewards_never_enter_the_advantage(per_reward_normalization, scope):
    # A metric-only reward (weight 0) with a NaN, and one that varies inside a group whose
    # weighted rewards are all equal: the advantages, rewards and zero-std share are exactly
    # those computed without the metric.
    gid = torch.tensor([0, 0, 0, 1, 1, 1])
    a = torch.tensor([0.0, 1.0, 3.0, 2.0, 2.0, 2.0])
    b = torch.tensor([1.0, 0.0, 4.0, 5.0, 5.0, 5.0])
    metric = torch.tensor([0.3, float("nan"), 0.1, 0.0, 1.0, 2.0])
    opts = dict(std_scope=scope, per_reward_normalization=per_reward_normalization)
    without = compute_advantages({"a": a, "b": b}, {"a": 1.0, "b": 0.5}, gid, **opts)
    with_metric = compute_advantages(
        {"a": a, "m": metric, "b": b}, {"a": 1.0, "m": 0.0, "b": 0.5}, gid, **opts
    )
    assert bool(torch.isfinite(with_metric.advantages).all()), with_metric.advantages
    torch.testing.assert_close(with_metric.advantages, without.advantages, rtol=0, atol=0)
    torch.testing.assert_close(with_metric.rewards, without.rewards, rtol=0, atol=0)
    assert with_metric.finite.all() and with_metric.zero_std_ratio == without.zero_std_ratio == 0.5
    # One weighted reward beside a metric is one reward: the plain normalisation of ``a``.
    alone = compute_advantages({"a": a}, {"a": 1.0}, gid, std_scope=scope)
    one = compute_advantages({"a": a, "m": metric}, {"a": 1.0, "m": 0.0}, gid, **opts)
    torch.testing.assert_close(one.advantages, alone.advantages, rtol=0, atol=0)
    with pytest.raises(ValueError, match="every reward weight is 0"):
        compute_advantages({"m": metric}, {"m": 0.0}, gid, **opts)


@given(st.lists(st.floats(-3, 3), min_size=2, max_size=8), st.floats(1e-4, 0.2), st.integers(0, 2**31))
def test_policy_loss_on_policy_is_minus_mean_advantage(advs, clip, seed):
    a = torch.tensor(advs)
    lp = torch.randn(len(advs), generator=torch.Generator().manual_seed(seed)).requires_grad_()
    out = policy_loss(lp, lp.detach(), a, clip)
    assert math.isclose(float(out.loss.detach()), -float(a.mean()), rel_tol=1e-5, abs_tol=1e-6)
    out.loss.backward()
    torch.testing.assert_close(lp.grad, -a / len(advs))  # REINFORCE gradient at ratio 1
    assert out.metrics["ratio_mean"] == 1.0 and out.metrics["clipfrac"] == 0.0


def test_policy_loss_clips_outside_the_trust_region():
    old = torch.zeros(2)
    new = torch.tensor([0.1, -0.1], requires_grad=True)  # ratios e^0.1 and e^-0.1, clip 0.01
    a = torch.tensor([1.0, -1.0])
    out = policy_loss(new, old, a, 0.01)
    out.loss.backward()
    assert new.grad.abs().max() == 0  # both pushed further in their advantage's direction: clipped
    assert out.metrics["clipfrac_upper"] == 0.5 and out.metrics["clipfrac_lower"] == 0.5
    assert math.isclose(float(out.loss.detach()), -1.01 / 2 + 0.99 / 2, rel_tol=1e-5)


def test_kl_kinds():
    m, r = torch.ones(2, 3, 2, 2), torch.zeros(2, 3, 2, 2)
    std, dt = torch.tensor([0.5, 1.0]), torch.tensor([-0.1, -0.2])
    torch.testing.assert_close(kl_to_reference(m, r, std, dt, "transition"), torch.tensor([2.0, 0.5]))
    torch.testing.assert_close(kl_to_reference(m, r, std, dt, "mean"), torch.tensor([0.2, 0.1]))
    torch.testing.assert_close(kl_to_reference(m, r, std, dt, "mean", "cps"), torch.tensor([2.0, 0.5]))
    torch.testing.assert_close(kl_to_reference(m, r, std, dt, "velocity"), torch.tensor([100.0, 25.0]))
    with pytest.raises(ValueError, match="kl kind"):
        kl_to_reference(m, r, std, dt, "exact")


@pytest.mark.parametrize("step", [0, 3, 7])
def test_default_kl_is_the_references_formula_on_flow_sde_steps(step):
    """kl_kind='mean' on real flow_sde transitions equals flow_grpo's / verl-omni's formula, written
    here in float64 from the schedule: mean((mu - mu_ref)^2) / (2 std_dev_t^2) with
    std_dev_t = eta * sqrt(sigma / (1 - sigma)); 'transition' is that divided by |dt|."""
    g = torch.Generator().manual_seed(step)
    sigmas = torch.linspace(1.0, 0.0, 11)[1:]  # sigma < 1 everywhere, so no sigma_max special case
    sigma, sigma_next, eta = sigmas[step], sigmas[step + 1], 0.7
    x, v, v_ref = (torch.randn(3, 4, 2, 2, generator=g) for _ in range(3))
    pol = sde_step("flow_sde", x, v, sigma, sigma_next, eta, generator=g)
    ref = sde_step("flow_sde", x, v_ref, sigma, sigma_next, eta, prev_sample=pol.prev_sample)
    dt = (sigma_next - sigma).expand(3)
    got = kl_to_reference(pol.mean, ref.mean, pol.std.flatten(), dt, "mean", "flow_sde")

    s, sn = float(sigma), float(sigma_next)
    d = sn - s
    std_dev_t = eta * math.sqrt(s / (1 - s))
    # Both means share the x term; their difference is the velocity term of the flow_sde mean.
    mean_diff = (v.double() - v_ref.double()) * (1 + std_dev_t**2 * (1 - s) / (2 * s)) * d
    expected = mean_diff.pow(2).mean(dim=(1, 2, 3)) / (2 * std_dev_t**2)
    torch.testing.assert_close(got.double(), expected, rtol=2e-5, atol=1e-9)
    exact = kl_to_reference(pol.mean, ref.mean, pol.std.flatten(), dt, "transition")
    torch.testing.assert_close(exact.double(), expected / abs(d), rtol=2e-5, atol=1e-9)
