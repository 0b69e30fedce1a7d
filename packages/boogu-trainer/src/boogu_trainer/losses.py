"""The FlowGRPO objective: PPO-clip on per-step log-probability ratios, plus an optional KL.

``ratio = exp(log p_new - log p_old)`` with per-element-mean Gaussian log-densities (which is why
clip ranges are ~1e-4), ``loss = mean(max(-A ratio, -A clamp(ratio, 1 - eps, 1 + eps)))``
(Flow-GRPO, Liu et al. 2025; verl-omni ``FlowGRPOLoss``).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from boogu_schedule import gaussian_kl


@dataclass(frozen=True)
class PolicyLoss:
    loss: torch.Tensor
    """Scalar policy loss (with grad)."""
    metrics: dict[str, float]
    """ratio mean/std, clip fractions, approx KL."""


def policy_loss(
    log_prob: torch.Tensor, old_log_prob: torch.Tensor, advantages: torch.Tensor, clip_range: float
) -> PolicyLoss:
    """PPO-clip for one window step of a mini-batch; all (b,) float32."""
    log_ratio = log_prob - old_log_prob.detach()
    ratio = torch.exp(log_ratio)
    unclipped = -advantages * ratio
    clipped = -advantages * torch.clamp(ratio, 1.0 - clip_range, 1.0 + clip_range)
    loss = torch.maximum(unclipped, clipped).mean()
    with torch.no_grad():
        r = ratio.detach()
        metrics = {
            "ratio_mean": float(r.mean()),
            "ratio_std": float(r.std(unbiased=False)) if r.numel() > 1 else 0.0,
            "clipfrac": float(((r - 1).abs() > clip_range).float().mean()),
            "clipfrac_upper": float((r > 1 + clip_range).float().mean()),
            "clipfrac_lower": float((r < 1 - clip_range).float().mean()),
            # k3 estimator of KL(old || new): unbiased, >= 0.
            "approx_kl": float(((r - 1) - log_ratio.detach()).mean()),
        }
    return PolicyLoss(loss=loss, metrics=metrics)


def kl_to_reference(
    mean: torch.Tensor, ref_mean: torch.Tensor, std: torch.Tensor, dt: torch.Tensor, kind: str = "mean"
) -> torch.Tensor:
    """(b,) KL penalty between the policy's and the reference's transitions of one step.

    ``"mean"``: the Gaussian KL of the two transition kernels (shared std), averaged per element.
    ``"velocity"``: the squared mean difference divided by ``dt^2``, a velocity-scale penalty that
    does not blow up where the step's std is small.
    """
    shape = (-1,) + (1,) * (mean.dim() - 1)
    if kind == "mean":
        return gaussian_kl(mean, ref_mean.detach(), std.reshape(shape))
    if kind == "velocity":
        diff = (mean - ref_mean.detach()) / dt.reshape(shape)
        return diff.pow(2).mean(dim=tuple(range(1, mean.dim())))
    raise ValueError(f"kl kind must be 'mean' or 'velocity', got {kind!r}")
