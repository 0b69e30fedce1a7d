"""The forward (noising) process in Boogu's conventions, for losses on re-noised clean samples.

Forward-process algorithms (DiffusionNFT, AWM) do not train on the rollout's transitions: they take
the clean latent ``x0`` a rollout produced, noise it again at a sampled level and regress the
model's velocity there. In Boogu's conventions (``t = 1 - sigma``, velocity ``x0 - eps``):

* ``x_sigma = (1 - sigma) * x0 + sigma * eps``, i.e. ``x_t = t * x0 + (1 - t) * eps``
  (:func:`forward_noise`); the transformer receives ``t = boogu_time(sigma)``;
* the flow-matching target is Boogu's raw velocity ``x0 - eps`` (:func:`flow_target`), the
  derivative of ``x_t`` along ``t``: no negation here, the prediction is compared as it comes out;
* the clean sample a velocity implies is ``x0_hat = x_sigma + sigma * v`` (:func:`predict_x0`).

Everything is float32 (these values feed a loss); ``sigma`` is per sample, shape ``(B,)``.
Timesteps to train on are drawn by :func:`sample_sigmas` from an explicit generator.
"""

from __future__ import annotations

import torch

__all__ = ["flow_target", "forward_noise", "predict_x0", "sample_sigmas"]


def _per_sample(sigma: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    if sigma.dim() != 1 or sigma.shape[0] != like.shape[0]:
        raise ValueError(f"sigma must be (B,) = ({like.shape[0]},), got {tuple(sigma.shape)}")
    return sigma.reshape((-1,) + (1,) * (like.dim() - 1))


def _check_float32(**tensors: torch.Tensor) -> None:
    for name, t in tensors.items():
        if t.dtype != torch.float32:
            raise TypeError(f"{name} must be float32 (it feeds a loss), got {t.dtype}")


def forward_noise(x0: torch.Tensor, noise: torch.Tensor, sigma: torch.Tensor) -> torch.Tensor:
    """``x_sigma = (1 - sigma) * x0 + sigma * noise``: Boogu's ``t * x0 + (1 - t) * eps``."""
    _check_float32(x0=x0, noise=noise, sigma=sigma)
    if noise.shape != x0.shape:
        raise ValueError(f"noise {tuple(noise.shape)} and x0 {tuple(x0.shape)} differ in shape")
    s = _per_sample(sigma, x0)
    return (1.0 - s) * x0 + s * noise


def flow_target(x0: torch.Tensor, noise: torch.Tensor) -> torch.Tensor:
    """The velocity a Boogu transformer should predict on ``forward_noise(x0, noise, sigma)``: ``x0 - noise``."""
    _check_float32(x0=x0, noise=noise)
    return x0 - noise


def predict_x0(x_sigma: torch.Tensor, velocity: torch.Tensor, sigma: torch.Tensor) -> torch.Tensor:
    """The clean sample implied by a Boogu velocity ``v = x0 - eps`` at ``x_sigma``: ``x_sigma + sigma * v``."""
    _check_float32(x_sigma=x_sigma, velocity=velocity, sigma=sigma)
    return x_sigma + _per_sample(sigma, x_sigma) * velocity


def sample_sigmas(
    count: int,
    num: int,
    generator: torch.Generator,
    *,
    schedule: torch.Tensor | None = None,
    sigma_range: tuple[float, float] = (0.0, 1.0),
) -> torch.Tensor:
    """``(count, num)`` float32 noise levels to train on, ``num`` per sample, drawn from ``generator``.

    With ``schedule`` (a rollout's descending ``(N+1,)`` sigmas, last 0): each sample gets ``num``
    distinct levels among the first ``N`` (the last step's 0 is never a training level), in a random
    order (DiffusionNFT's "timesteps of the sampler, permuted per sample"). Without it: stratified
    uniform draws in ``sigma_range`` (one draw in each of ``num`` equal bins, shuffled), so a few
    levels per sample still cover the range.
    """
    if num < 1:
        raise ValueError(f"need at least one training level per sample, got {num}")
    device = generator.device
    if count == 0:
        return torch.zeros(0, num, dtype=torch.float32, device=device)
    if schedule is not None:
        levels = schedule[:-1].to(device=device, dtype=torch.float32)
        if num > levels.numel():
            raise ValueError(f"{num} training levels per sample, but the schedule has only {levels.numel()}")
        order = torch.stack(
            [torch.randperm(levels.numel(), generator=generator, device=device) for _ in range(count)]
        )
        return levels[order[:, :num]]
    lo, hi = sigma_range
    if not 0.0 <= lo < hi <= 1.0:
        raise ValueError(f"sigma_range must satisfy 0 <= lo < hi <= 1, got {sigma_range}")
    u = torch.rand(count, num, generator=generator, device=device, dtype=torch.float32)
    bins = torch.stack([torch.randperm(num, generator=generator, device=device) for _ in range(count)])
    return lo + (hi - lo) * (bins.to(torch.float32) + u) / num
