"""The FlowGRPO objective: PPO-clip on per-step log-probability ratios, plus an optional KL.

``ratio = exp(log p_new - log p_old)`` with per-element-mean Gaussian log-densities (which is why
clip ranges are ~1e-4), ``loss = mean(max(-A ratio, -A clamp(ratio, 1 - eps, 1 + eps)))``
(Flow-GRPO, Liu et al. 2025; verl-omni ``FlowGRPOLoss``).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from boogu_schedule import Sampler, gaussian_kl


@dataclass(frozen=True)
class PolicyLoss:
    loss: torch.Tensor
    """Scalar policy loss (with grad)."""
    metrics: dict[str, torch.Tensor]
    """ratio mean/std, clip fractions, approx KL: detached 0-d tensors on the loss's device (read
    them with ``float()`` after the loop; reading each one inside it would stall a GPU)."""


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
            "ratio_mean": r.mean(),
            "ratio_std": r.std(unbiased=False) if r.numel() > 1 else r.new_zeros(()),
            "clipfrac": ((r - 1).abs() > clip_range).float().mean(),
            "clipfrac_upper": (r > 1 + clip_range).float().mean(),
            "clipfrac_lower": (r < 1 - clip_range).float().mean(),
            # k3 estimator of KL(old || new): unbiased, >= 0.
            "approx_kl": ((r - 1) - log_ratio.detach()).mean(),
        }
    return PolicyLoss(loss=loss, metrics=metrics)


def kl_to_reference(
    mean: torch.Tensor,
    ref_mean: torch.Tensor,
    std: torch.Tensor,
    dt: torch.Tensor,
    kind: str = "mean",
    sampler: Sampler | str = Sampler.FLOW_SDE,
) -> torch.Tensor:
    """(b,) KL penalty between the policy's and the reference's transitions of one step.

    ``mean``, ``ref_mean``: (b, C, h, w) float32 transition means; ``std``: (b,) the step's total std;
    ``dt``: (b,) ``sigma_next - sigma`` (negative).

    * ``"mean"``: the references' formula (flow_grpo ``kl_loss``, verl-omni ``KLLoss``):
      ``mean((mu - mu_ref)^2) / (2 std_dev_t^2)``, where ``std_dev_t`` is the std their SDE step
      returns: for ``flow_sde`` and ``dance_sde`` the std *before* the ``sqrt(-dt)`` factor, so this
      is the exact transition KL times ``|dt|`` (5.5-29x smaller on the 10-step schedule); for
      ``cps`` their step returns the full std, so it equals ``"transition"``. A ``kl_coef`` copied
      from their recipes means the same here.
    * ``"transition"``: the exact Gaussian KL of the two transition kernels (shared std).
    * ``"velocity"``: the squared mean difference divided by ``dt^2``, a velocity-scale penalty that
      does not blow up where the step's std is small.
    """
    shape = (-1,) + (1,) * (mean.dim() - 1)
    exact = gaussian_kl(mean, ref_mean.detach(), std.reshape(shape))
    if kind == "transition":
        return exact
    if kind == "mean":
        if Sampler(sampler) is Sampler.CPS:
            return exact
        return exact * dt.abs().reshape(-1)
    if kind == "velocity":
        diff = (mean - ref_mean.detach()) / dt.reshape(shape)
        return diff.pow(2).mean(dim=tuple(range(1, mean.dim())))
    raise ValueError(f"kl kind must be 'mean', 'transition' or 'velocity', got {kind!r}")
