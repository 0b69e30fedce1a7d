"""One denoising step of each sampler, with its Gaussian transition and log-probability.

All math in the SDE convention: noise level ``sigma`` descends from 1 (noise) to 0 (data), the step
goes ``sigma -> sigma_next`` with ``dt = sigma_next - sigma < 0``, and ``velocity = eps - x0`` (the
negated Boogu prediction). Everything is float32 because the log-probabilities feed importance
ratios: a bf16 latent scored against a float32 mean biases the ratio (verl-omni's
"float32 precision loss in stored rollout latents"), so non-float32 inputs are refused, not cast.

Samplers:

* ``ode``: the Euler step ``x + dt * v``. Deterministic (std 0).
* ``flow_sde``: Flow-GRPO (Liu et al. 2025, ``sde_step_with_logprob``): marginal-preserving SDE with
  ``s = eta * sqrt(sigma / (1 - sigma))``; at ``sigma == 1`` the denominator uses ``sigma_max``
  (default ``sigma_next``, which is what the reference's ``sigmas[1]`` is at step 0).
* ``cps``: coefficient-preserving sampling (Flow-CPS): ``s = sigma_next * sin(eta * pi / 2)``.
* ``dance_sde``: DanceGRPO's score-corrected Euler-Maruyama step, ``s = eta * sqrt(sigma - sigma_next)``.

A step whose std is 0 (noise level 0, or the last step of ``cps``) has no density: its
``log_prob`` is NaN on purpose, so it cannot be used by mistake.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from enum import StrEnum
from typing import Literal

import torch

_LOG_SQRT_2PI = 0.5 * math.log(2.0 * math.pi)


class Sampler(StrEnum):
    """The per-step transition kernels."""

    ODE = "ode"
    FLOW_SDE = "flow_sde"
    CPS = "cps"
    DANCE_SDE = "dance_sde"


@dataclass(frozen=True)
class SdeStep:
    """The result of one step. Shapes: ``sample`` is ``(B, *S)``; all tensors are float32."""

    prev_sample: torch.Tensor
    """(B, *S) the next latent: drawn, or the one given as ``prev_sample=``."""
    mean: torch.Tensor
    """(B, *S) the transition mean."""
    std: torch.Tensor
    """(B, 1, ..., 1) the total std of the transition (broadcasts against ``mean``)."""
    log_prob: torch.Tensor
    """(B,) log-density of ``prev_sample``, averaged over the non-batch dimensions."""


def _require_float32(name: str, x: torch.Tensor) -> None:
    if x.dtype != torch.float32:
        raise TypeError(
            f"sde_step: {name} must be float32 (log-probabilities are computed in float32; cast with "
            f".float() before the step), got {x.dtype}"
        )


def _per_sample(name: str, value: torch.Tensor | float, like: torch.Tensor) -> torch.Tensor:
    """A 0-d, (B,) or Python-float sigma as a float32 (B, 1, ..., 1) tensor."""
    batch = like.shape[0]
    if isinstance(value, torch.Tensor):
        _require_float32(name, value)
        if value.dim() == 0:
            value = value.expand(batch)
        elif value.shape != (batch,):
            raise ValueError(f"sde_step: {name} must be 0-d or ({batch},), got {tuple(value.shape)}")
        v = value.to(like.device)
    else:
        v = torch.full((batch,), float(value), dtype=torch.float32, device=like.device)
    return v.reshape(batch, *([1] * (like.dim() - 1)))


def _gaussian_log_prob(x: torch.Tensor, mean: torch.Tensor, std: torch.Tensor) -> torch.Tensor:
    # Per-element log N(x; mean, std^2), then the mean over non-batch dims (Flow-GRPO's reduction;
    # it is why clip ranges are ~1e-4).
    lp = -((x - mean) ** 2) / (2.0 * std**2) - torch.log(std) - _LOG_SQRT_2PI
    return lp.mean(dim=tuple(range(1, x.dim())))


def sde_step(
    sampler: Sampler | str,
    sample: torch.Tensor,
    velocity: torch.Tensor,
    sigma: torch.Tensor | float,
    sigma_next: torch.Tensor | float,
    noise_level: float,
    generator: torch.Generator | None = None,
    prev_sample: torch.Tensor | None = None,
    *,
    sigma_max: torch.Tensor | float | None = None,
    cps_log_prob: Literal["reference", "gaussian"] = "reference",
    noise: torch.Tensor | None = None,
) -> SdeStep:
    """One step ``sigma -> sigma_next`` of ``sampler`` from ``sample`` with SDE velocity ``eps - x0``.

    Args:
        sample: (B, *S) float32 current latent.
        velocity: (B, *S) float32 velocity in the SDE convention (``to_sde_velocity`` of Boogu's).
        sigma, sigma_next: noise levels, Python floats, 0-d or (B,) float32 tensors (a batch may
            mix steps).
        noise_level: ``eta``; 0 gives the deterministic Euler step for every sampler.
        generator: the only source of randomness for the drawn noise.
        prev_sample: if given, score this next latent instead of drawing one (training side).
        sigma_max: ``flow_sde`` only: the value used in place of ``sigma`` in ``sqrt(sigma/(1-sigma))``
            where ``sigma == 1``. Defaults to ``sigma_next`` (the reference's ``sigmas[1]`` at step 0).
        cps_log_prob: ``cps`` only. ``"reference"`` is Flow-CPS's unnormalised ``-(x' - mu)^2``
            (what Flow-GRPO and verl-omni optimise; it drops the ``1/(2 s^2)`` factor and the
            normaliser, so ratios are ``exp`` of a differently scaled quantity); ``"gaussian"`` is the
            true Gaussian log-density with std ``s``.
        noise: (B, *S) float32 standard-normal draw to use instead of drawing from ``generator``
            (``prev_sample = mean + std * noise``); lets a caller draw per-group noise streams.
    """
    sampler = Sampler(sampler)
    _require_float32("sample", sample)
    _require_float32("velocity", velocity)
    if velocity.shape != sample.shape:
        raise ValueError(f"sde_step: velocity {tuple(velocity.shape)} != sample {tuple(sample.shape)}")
    if prev_sample is not None:
        _require_float32("prev_sample", prev_sample)
        if prev_sample.shape != sample.shape:
            raise ValueError(
                f"sde_step: prev_sample {tuple(prev_sample.shape)} != sample {tuple(sample.shape)}"
            )
    if not math.isfinite(noise_level) or noise_level < 0:
        raise ValueError(f"sde_step: noise_level must be finite and >= 0, got {noise_level}")
    if cps_log_prob not in ("reference", "gaussian"):
        raise ValueError(f"sde_step: cps_log_prob must be 'reference' or 'gaussian', got {cps_log_prob!r}")

    s = _per_sample("sigma", sigma, sample)
    s_next = _per_sample("sigma_next", sigma_next, sample)
    dt = s_next - s  # (B, 1, ..., 1), negative

    if sampler is Sampler.ODE or noise_level == 0.0:
        mean = sample + dt * velocity
        std = torch.zeros_like(s)
    elif sampler is Sampler.FLOW_SDE:
        s_max = s_next if sigma_max is None else _per_sample("sigma_max", sigma_max, sample)
        s_den = torch.where(s == 1.0, s_max, s)
        std_dev_t = noise_level * torch.sqrt(s / (1.0 - s_den))
        mean = (
            sample * (1.0 + std_dev_t**2 / (2.0 * s) * dt)
            + velocity * (1.0 + std_dev_t**2 * (1.0 - s) / (2.0 * s)) * dt
        )
        std = std_dev_t * torch.sqrt(-dt)
    elif sampler is Sampler.CPS:
        std = s_next * math.sin(noise_level * math.pi / 2.0)
        x0_hat = sample - s * velocity
        eps_hat = sample + (1.0 - s) * velocity
        mean = (1.0 - s_next) * x0_hat + torch.sqrt(s_next**2 - std**2) * eps_hat
    else:  # DANCE_SDE
        x0_hat = sample - s * velocity
        score = -(sample - (1.0 - s) * x0_hat) / s**2
        mean = sample + dt * velocity + (-0.5 * noise_level**2 * score) * dt
        std = noise_level * torch.sqrt(-dt)

    if prev_sample is not None and noise is not None:
        raise ValueError("sde_step: give prev_sample (to score) or noise (to draw with), not both")
    if prev_sample is None:
        if noise_level == 0.0 or sampler is Sampler.ODE:
            prev_sample = mean
        else:
            if noise is None:
                noise = torch.randn(
                    sample.shape, generator=generator, dtype=torch.float32, device=sample.device
                )
            else:
                _require_float32("noise", noise)
                if noise.shape != sample.shape:
                    raise ValueError(f"sde_step: noise {tuple(noise.shape)} != sample {tuple(sample.shape)}")
            prev_sample = mean + std * noise

    # The sample is data, not a function of the parameters: no gradient flows through it.
    x_next = prev_sample.detach()
    if sampler is Sampler.CPS and cps_log_prob == "reference":
        log_prob = -((x_next - mean) ** 2).mean(dim=tuple(range(1, sample.dim())))
    else:
        log_prob = _gaussian_log_prob(x_next, mean, std)
    # A deterministic transition has no density: NaN, whatever the arithmetic above gave.
    log_prob = torch.where(std.flatten() > 0, log_prob, torch.full_like(log_prob, math.nan))
    return SdeStep(prev_sample=prev_sample, mean=mean, std=std, log_prob=log_prob)


def gaussian_kl(mean_p: torch.Tensor, mean_q: torch.Tensor, std: torch.Tensor) -> torch.Tensor:
    """KL(N(mean_p, std^2) || N(mean_q, std^2)) per element, averaged like the log-prob: (B,).

    The transition KL used as Flow-GRPO's penalty: both policies share the step's std, so it is
    ``(mean_p - mean_q)^2 / (2 std^2)``.
    """
    _require_float32("mean_p", mean_p)
    _require_float32("mean_q", mean_q)
    _require_float32("std", std)
    kl = (mean_p - mean_q) ** 2 / (2.0 * std**2)
    return kl.mean(dim=tuple(range(1, mean_p.dim())))


def euler_step_boogu(
    x: torch.Tensor, t: torch.Tensor | float, t_next: torch.Tensor | float, v_boogu: torch.Tensor
) -> torch.Tensor:
    """Upstream Boogu's own Euler step in Boogu time: ``x + (t_next - t) * v_boogu`` (t ascending).

    Equal to ``sde_step("ode", x, -v_boogu, 1 - t, 1 - t_next, 0).prev_sample`` up to float rounding.
    """
    if isinstance(t, torch.Tensor) and t.dim() == 1:
        t = t.reshape(-1, *([1] * (x.dim() - 1)))
    if isinstance(t_next, torch.Tensor) and t_next.dim() == 1:
        t_next = t_next.reshape(-1, *([1] * (x.dim() - 1)))
    return x + (t_next - t) * v_boogu
