"""The forward process in Boogu's conventions: x_t = t x0 + (1 - t) eps, target x0 - eps.

Every test here fails if a sign or a time direction is flipped: an oracle velocity field (the exact
Boogu velocity of a point-mass data distribution, written in Boogu time) must give a zero loss.
"""

from __future__ import annotations

import pytest
import torch

from boogu_schedule import boogu_time, flow_target, forward_noise, predict_x0, sample_sigmas


def _draw(b: int = 3, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    x0 = torch.randn(b, 4, 3, 3, generator=g)
    eps = torch.randn(b, 4, 3, 3, generator=g)
    sigma = torch.rand(b, generator=g) * 0.9 + 0.05
    return x0, eps, sigma


def oracle_velocity(x: torch.Tensor, t: torch.Tensor, x0: torch.Tensor) -> torch.Tensor:
    """The exact Boogu velocity field when all data is ``x0``: ``(x0 - x) / (1 - t)``, ``t`` in Boogu time."""
    return (x0 - x) / (1 - t).reshape(-1, 1, 1, 1)


def test_endpoints_follow_boogu_time():
    x0, eps, _ = _draw()
    ones, zeros = torch.ones(3), torch.zeros(3)
    assert torch.equal(forward_noise(x0, eps, ones), eps)  # sigma = 1 (t = 0): pure noise
    assert torch.equal(forward_noise(x0, eps, zeros), x0)  # sigma = 0 (t = 1): data


def test_target_is_the_derivative_along_boogu_time():
    x0, eps, sigma = _draw()
    h = 1e-3
    t = boogu_time(sigma)
    ahead = forward_noise(x0, eps, 1 - (t + h))
    behind = forward_noise(x0, eps, 1 - (t - h))
    torch.testing.assert_close((ahead - behind) / (2 * h), flow_target(x0, eps), rtol=1e-3, atol=1e-3)


def test_oracle_velocity_matches_the_target_and_recovers_x0():
    x0, eps, sigma = _draw()
    x = forward_noise(x0, eps, sigma)
    v = oracle_velocity(x, boogu_time(sigma), x0)
    torch.testing.assert_close(v, flow_target(x0, eps), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(predict_x0(x, v, sigma), x0, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("flip", ["time_to_model", "noising", "target_sign", "x0_sign"])
def test_each_flipped_convention_breaks_the_oracle(flip):
    x0, eps, sigma = _draw()
    x = forward_noise(x0, eps, sigma)
    if flip == "noising":  # x_t = sigma x0 + (1 - sigma) eps
        x = forward_noise(x0, eps, 1 - sigma)
    t = sigma if flip == "time_to_model" else boogu_time(sigma)
    v = oracle_velocity(x, t, x0)
    target = -flow_target(x0, eps) if flip == "target_sign" else flow_target(x0, eps)
    x0_hat = x - sigma.reshape(-1, 1, 1, 1) * v if flip == "x0_sign" else predict_x0(x, v, sigma)
    mse_target = (v - target).pow(2).mean()
    mse_x0 = (x0_hat - x0).pow(2).mean()
    assert max(mse_target, mse_x0) > 0.05


def test_float32_only():
    x0, eps, sigma = _draw()
    with pytest.raises(TypeError, match="float32"):
        forward_noise(x0.double(), eps, sigma)
    with pytest.raises(ValueError, match=r"\(B,\)"):
        forward_noise(x0, eps, sigma[:2])


def test_schedule_levels_are_distinct_schedule_values_without_the_final_zero():
    schedule = torch.tensor([1.0, 0.8, 0.5, 0.2, 0.0])
    levels = sample_sigmas(64, 3, torch.Generator().manual_seed(0), schedule=schedule)
    assert levels.shape == (64, 3) and levels.dtype == torch.float32
    for row in levels:
        assert len(set(row.tolist())) == 3 and set(row.tolist()) <= set(schedule[:-1].tolist())
    with pytest.raises(ValueError, match="only 4"):
        sample_sigmas(1, 5, torch.Generator(), schedule=schedule)


def test_uniform_levels_are_stratified_in_the_range_and_reproducible():
    a = sample_sigmas(200, 4, torch.Generator().manual_seed(3), sigma_range=(0.2, 0.6))
    b = sample_sigmas(200, 4, torch.Generator().manual_seed(3), sigma_range=(0.2, 0.6))
    assert torch.equal(a, b)
    assert float(a.min()) >= 0.2 and float(a.max()) <= 0.6
    bins = ((a - 0.2) / 0.1).floor().clamp(max=3).long()  # one draw in each quarter, per sample
    assert all(sorted(row.tolist()) == [0, 1, 2, 3] for row in bins)
    with pytest.raises(ValueError, match="sigma_range"):
        sample_sigmas(1, 1, torch.Generator(), sigma_range=(0.5, 0.5))
