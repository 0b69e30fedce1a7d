"""The per-step transition kernels against independent float64 statements of the papers' formulas."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import example, given
from hypothesis import strategies as st

from boogu_schedule import Sampler, gaussian_kl, sde_step
from tests.strategies import noise_levels, same_shape_tensors, seeds, sigma_pairs

SAMPLERS = ["flow_sde", "cps", "dance_sde"]


def reference_kernel(sampler: str, x, v, sigma: float, sigma_next: float, eta: float):
    """(mean, std) in float64, written from the formulas (docs/reference-integration.md §2)."""
    x, v = x.double(), v.double()
    dt = sigma_next - sigma
    if sampler == "flow_sde":
        s_den = sigma_next if sigma == 1.0 else sigma
        s = eta * math.sqrt(sigma / (1 - s_den))
        mean = x * (1 + s**2 / (2 * sigma) * dt) + v * (1 + s**2 * (1 - sigma) / (2 * sigma)) * dt
        return mean, s * math.sqrt(-dt)
    if sampler == "cps":
        s = sigma_next * math.sin(eta * math.pi / 2)
        x0, eps = x - sigma * v, x + (1 - sigma) * v
        return (1 - sigma_next) * x0 + math.sqrt(max(sigma_next**2 - s**2, 0.0)) * eps, s
    if sampler == "dance_sde":
        x0 = x - sigma * v
        score = -(x - (1 - sigma) * x0) / sigma**2
        return x + dt * v - 0.5 * eta**2 * score * dt, eta * math.sqrt(sigma - sigma_next)
    return x + dt * v, 0.0


def reference_log_prob(x_next, mean, std: float):
    lp = -((x_next.double() - mean) ** 2) / (2 * std**2) - math.log(std) - 0.5 * math.log(2 * math.pi)
    return lp.flatten(1).mean(1)


@pytest.mark.parametrize("sampler", SAMPLERS)
@given(xs=same_shape_tensors(2), sig=sigma_pairs(), seed=seeds)
@example(xs=(torch.ones(2, 3), torch.ones(2, 3)), sig=(1.0, 0.966), seed=0)
def test_noise_zero_equals_ode(sampler, xs, sig, seed):
    x, v = xs
    ode = sde_step("ode", x, v, *sig, 0.0)
    step = sde_step(sampler, x, v, *sig, 0.0, generator=torch.Generator().manual_seed(seed))
    assert torch.equal(step.prev_sample, ode.prev_sample) and torch.equal(step.mean, ode.mean)
    assert bool((step.std == 0).all()) and bool(step.log_prob.isnan().all())
    torch.testing.assert_close(
        ode.prev_sample.double(), x.double() + (sig[1] - sig[0]) * v.double(), rtol=1e-5, atol=1e-5
    )


@pytest.mark.parametrize("sampler", SAMPLERS)
@given(xs=same_shape_tensors(2, bound=3.0), sig=sigma_pairs(), eta=noise_levels, seed=seeds)
@example(xs=(torch.ones(1, 4), torch.ones(1, 4)), sig=(1.0, 0.966), eta=1.2, seed=0)
def test_mean_std_and_log_prob_equal_closed_form(sampler, xs, sig, eta, seed):
    x, v = xs
    sigma, sigma_next = sig
    if sampler == "cps" and sigma_next == 0.0:
        return  # deterministic last step: covered by the NaN test below
    mean64, std64 = reference_kernel(sampler, x, v, sigma, sigma_next, eta)
    step = sde_step(sampler, x, v, sigma, sigma_next, eta, generator=torch.Generator().manual_seed(seed))
    for out in (step.prev_sample, step.mean, step.std, step.log_prob):
        assert out.dtype == torch.float32
    assert step.log_prob.shape == (x.shape[0],)
    # float32 vs float64 evaluation of the same expression; sqrt(s/(1-s)) amplifies near sigma = 1.
    torch.testing.assert_close(step.mean.double(), mean64, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(
        step.std.double().flatten(),
        torch.full((x.shape[0],), std64, dtype=torch.float64),
        rtol=1e-5,
        atol=1e-7,
    )
    if sampler == "cps":
        expected = -((step.prev_sample.double() - step.mean.double()) ** 2).flatten(1).mean(1)
    else:
        expected = reference_log_prob(step.prev_sample, step.mean.double(), float(step.std.flatten()[0]))
    torch.testing.assert_close(step.log_prob.double(), expected, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("sampler", SAMPLERS)
@given(xs=same_shape_tensors(2), sig=sigma_pairs(), eta=noise_levels, seed=seeds)
def test_scoring_the_drawn_sample_reproduces_its_log_prob_bitwise(sampler, xs, sig, eta, seed):
    x, v = xs
    drawn = sde_step(sampler, x, v, *sig, eta, generator=torch.Generator().manual_seed(seed))
    scored = sde_step(sampler, x, v, *sig, eta, prev_sample=drawn.prev_sample)
    assert torch.equal(scored.prev_sample, drawn.prev_sample)
    torch.testing.assert_close(scored.log_prob, drawn.log_prob, rtol=0, atol=0, equal_nan=True)


@pytest.mark.parametrize("sampler", SAMPLERS)
@given(seed=seeds, eta=st.sampled_from([0.3, 0.7, 1.2]))
def test_drawn_samples_have_the_stated_mean_and_std(sampler, seed, eta):
    n = 20_000
    x = torch.randn(1, n, generator=torch.Generator().manual_seed(seed + 1)).expand(2, n).contiguous()
    v = torch.randn(1, n, generator=torch.Generator().manual_seed(seed + 2)).expand(2, n).contiguous()
    step = sde_step(sampler, x, v, 0.8, 0.6, eta, generator=torch.Generator().manual_seed(seed))
    z = (step.prev_sample - step.mean) / step.std  # should be standard normal
    assert abs(z.mean().item()) < 0.03  # 4.2 standard errors at n = 40k
    assert abs(z.std().item() - 1.0) < 0.02


def test_same_generator_state_same_sample_and_different_seed_differs():
    x, v = torch.randn(2, 3, 4), torch.randn(2, 3, 4)
    a = sde_step("flow_sde", x, v, 0.9, 0.8, 0.7, generator=torch.Generator().manual_seed(7))
    b = sde_step("flow_sde", x, v, 0.9, 0.8, 0.7, generator=torch.Generator().manual_seed(7))
    c = sde_step("flow_sde", x, v, 0.9, 0.8, 0.7, generator=torch.Generator().manual_seed(8))
    assert torch.equal(a.prev_sample, b.prev_sample)
    assert not torch.equal(a.prev_sample, c.prev_sample)


def test_flow_sde_at_sigma_one_uses_sigma_next_in_the_denominator():
    x, v = torch.zeros(1, 4), torch.zeros(1, 4)
    step = sde_step("flow_sde", x, v, 1.0, 0.966, 1.2)
    s = 1.2 * math.sqrt(1.0 / (1 - 0.966))
    assert step.std.item() == pytest.approx(s * math.sqrt(1 - 0.966), rel=1e-5)
    assert step.std.item() == pytest.approx(1.2, rel=1e-4)  # the reference's table: noise std 1.200 at step 0
    other = sde_step("flow_sde", x, v, 1.0, 0.966, 1.2, sigma_max=0.9)
    assert other.std.item() == pytest.approx(1.2 * math.sqrt(1 / 0.1) * math.sqrt(0.034), rel=1e-5)


@pytest.mark.parametrize("sampler", ["ode", *SAMPLERS])
@given(xs=same_shape_tensors(2), seed=seeds, data=st.data())
def test_per_sample_sigmas_equal_running_each_sample_alone(sampler, xs, seed, data):
    x, v = xs
    b = x.shape[0]
    pairs = [data.draw(sigma_pairs()) for _ in range(b)]
    sigma = torch.tensor([p[0] for p in pairs])
    sigma_next = torch.tensor([p[1] for p in pairs])
    drawn = sde_step(sampler, x, v, sigma, sigma_next, 0.7, generator=torch.Generator().manual_seed(seed))
    for i in range(b):
        alone = sde_step(
            sampler, x[i : i + 1], v[i : i + 1], *pairs[i], 0.7, prev_sample=drawn.prev_sample[i : i + 1]
        )
        torch.testing.assert_close(alone.mean, drawn.mean[i : i + 1], rtol=0, atol=0)
        torch.testing.assert_close(alone.log_prob, drawn.log_prob[i : i + 1], rtol=0, atol=0, equal_nan=True)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float64])
@pytest.mark.parametrize("arg", ["sample", "velocity", "prev_sample", "sigma"])
def test_non_float32_inputs_are_refused(dtype, arg):
    kwargs = {
        "sample": torch.zeros(2, 3),
        "velocity": torch.zeros(2, 3),
        "prev_sample": torch.zeros(2, 3),
        "sigma": torch.tensor(0.5),
    }
    kwargs[arg] = kwargs[arg].to(dtype)
    with pytest.raises(TypeError, match=f"{arg} must be float32"):
        sde_step(
            "flow_sde",
            kwargs["sample"],
            kwargs["velocity"],
            kwargs["sigma"],
            0.4,
            0.7,
            prev_sample=kwargs["prev_sample"],
        )


def test_cps_reference_log_prob_differs_from_the_gaussian_by_scale_and_normaliser():
    x, v = torch.randn(3, 8), torch.randn(3, 8)
    ref = sde_step("cps", x, v, 0.8, 0.6, 0.7, generator=torch.Generator().manual_seed(0))
    gauss = sde_step("cps", x, v, 0.8, 0.6, 0.7, prev_sample=ref.prev_sample, cps_log_prob="gaussian")
    s = 0.6 * math.sin(0.7 * math.pi / 2)
    expected = ref.log_prob.double() / (2 * s**2) - math.log(s) - 0.5 * math.log(2 * math.pi)
    torch.testing.assert_close(gauss.log_prob.double(), expected, rtol=1e-5, atol=1e-5)


def test_last_cps_step_is_deterministic_and_has_no_density():
    x, v = torch.randn(2, 4), torch.randn(2, 4)
    step = sde_step("cps", x, v, 0.26, 0.0, 0.7, generator=torch.Generator().manual_seed(0))
    torch.testing.assert_close(step.prev_sample, x - 0.26 * v)
    assert bool(step.log_prob.isnan().all())


def test_gradient_reaches_the_velocity_through_the_mean_only():
    x = torch.randn(2, 5)
    v = torch.randn(2, 5, requires_grad=True)
    drawn = sde_step("flow_sde", x, v.detach(), 0.9, 0.8, 0.7, generator=torch.Generator().manual_seed(3))
    scored = sde_step("flow_sde", x, v, 0.9, 0.8, 0.7, prev_sample=drawn.prev_sample)
    scored.log_prob.sum().backward()
    # d/dv of mean_b(-(x' - mu)^2 / (2 s^2)) = mean_b((x' - mu) / s^2 * dmu/dv), dmu/dv = c * dt.
    s = 0.7 * math.sqrt(0.9 / 0.1)
    c = (1 + s**2 * 0.1 / (2 * 0.9)) * (0.8 - 0.9)
    expected = (drawn.prev_sample - scored.mean.detach()) / (s**2 * 0.1) * c / 5
    torch.testing.assert_close(v.grad, expected, rtol=1e-4, atol=1e-5)


@given(xs=same_shape_tensors(2), std=st.floats(0.05, 2.0))
def test_gaussian_kl_equals_closed_form_and_is_zero_on_equal_means(xs, std):
    p, q = xs
    std_t = torch.full((p.shape[0],) + (1,) * (p.dim() - 1), std, dtype=torch.float32)
    kl = gaussian_kl(p, q, std_t)
    expected = ((p.double() - q.double()) ** 2 / (2 * float(std_t.flatten()[0]) ** 2)).flatten(1).mean(1)
    torch.testing.assert_close(kl.double(), expected, rtol=1e-5, atol=1e-6)
    assert bool((kl >= 0).all()) and torch.equal(gaussian_kl(p, p, std_t), torch.zeros(p.shape[0]))


def test_sampler_accepts_enum_or_string_and_rejects_unknown():
    x = torch.zeros(1, 2)
    assert torch.equal(
        sde_step(Sampler.ODE, x, x, 0.5, 0.4, 0.0).prev_sample,
        sde_step("ode", x, x, 0.5, 0.4, 0.0).prev_sample,
    )
    with pytest.raises(ValueError, match="euler"):
        sde_step("euler", x, x, 0.5, 0.4, 0.0)


@pytest.mark.parametrize("sampler", SAMPLERS)
@given(xs=same_shape_tensors(2), sig=sigma_pairs(), eta=noise_levels, seed=seeds)
def test_given_noise_equals_drawing_it_from_the_generator(sampler, xs, sig, eta, seed):
    x, v = xs
    drawn = sde_step(sampler, x, v, *sig, eta, generator=torch.Generator().manual_seed(seed))
    noise = torch.randn(x.shape, generator=torch.Generator().manual_seed(seed))
    given_noise = sde_step(sampler, x, v, *sig, eta, noise=noise)
    assert torch.equal(given_noise.prev_sample, drawn.prev_sample)
    with pytest.raises(ValueError, match="not both"):
        sde_step(sampler, x, v, *sig, eta, noise=noise, prev_sample=drawn.prev_sample)
