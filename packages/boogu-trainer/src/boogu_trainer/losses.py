"""The learners' objectives.

* FlowGRPO (`policy_loss`): PPO-clip on per-step log-probability ratios
  ``ratio = exp(log p_new - log p_old)`` with per-element-mean Gaussian log-densities (which is why
  clip ranges are ~1e-4), ``loss = mean(max(-A ratio, -A clamp(ratio, 1 - eps, 1 + eps)))``
  (Flow-GRPO, Liu et al. 2025; verl-omni ``FlowGRPOLoss``), plus an optional KL (`kl_to_reference`).
* GRPO-Guard (`grpo_guard_loss`, Wang et al. 2025): the same clipped objective on a RatioNorm'd
  ratio, reweighted by ``1/|dt|`` per step.
* DiffusionNFT (`nft_loss`, Zheng et al. 2025) and AWM (`awm_log_prob` + `awm_loss`, Xue et al.
  2025): losses on the velocity at re-noised clean samples, in Boogu's conventions
  (``boogu_schedule.forward``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from boogu_schedule import Sampler, gaussian_kl, predict_x0


@dataclass(frozen=True)
class PolicyLoss:
    loss: torch.Tensor
    """Scalar policy loss (with grad)."""
    metrics: dict[str, torch.Tensor]
    """ratio mean/std, clip fractions, approx KL: detached 0-d tensors on the loss's device (read
    them with ``float()`` after the loop; reading each one inside it would stall a GPU)."""


class MetricSums:
    """A mini-batch's metrics on the device: each value weighted by its share of the rows (and steps)."""

    def __init__(self) -> None:
        self.sums: dict[str, torch.Tensor] = {}

    def add(self, key: str, value: torch.Tensor, share: float) -> None:
        value = value.detach().double() * share
        self.sums[key] = value if key not in self.sums else self.sums[key] + value

    def add_loss(self, loss: torch.Tensor, pl: PolicyLoss, share: float) -> None:
        """The total loss, the objective's own and its metrics (a `losses.PolicyLoss`)."""
        self.add("loss", loss, share)
        self.add("policy_loss", pl.loss, share)
        for key, value in pl.metrics.items():
            self.add(key, value, share)

    def into(self, acc: dict[str, list]) -> None:
        for key, value in self.sums.items():
            acc[key].append(value)


RATIO_SQ_DEV = "ratio_sq_dev"
"""Key of ``mean((ratio - 1)^2)`` in the loss metrics: with ``ratio_mean`` it gives the update's ratio
std pooled over every sample, window step, micro-batch and mini-batch (`pooled_ratio_std`), which a
mean of per-chunk stds is not (it shrinks with smaller chunks)."""


def pooled_ratio_std(ratio_mean: torch.Tensor, sq_dev: torch.Tensor) -> torch.Tensor:
    """``sqrt(E[(r - 1)^2] - (E[r] - 1)^2)``, the population std of the ratio (0-d, float64)."""
    mean_dev = ratio_mean.double() - 1
    return (sq_dev.double() - mean_dev.square()).clamp_min(0).sqrt()


def ratio_metrics(ratio: torch.Tensor, log_ratio: torch.Tensor, clip_range: float) -> dict[str, torch.Tensor]:
    """Detached 0-d statistics of a clipped ratio: mean, the mean squared deviation from 1 (float64;
    `pooled_ratio_std` turns the update's means into ``ratio_std``), clip fractions, and the k3
    estimator of KL(old || new) from the raw log-ratio (unbiased, >= 0)."""
    with torch.no_grad():
        r, lr = ratio.detach(), log_ratio.detach()
        return {
            "ratio_mean": r.mean(),
            RATIO_SQ_DEV: (r.double() - 1).square().mean(),
            "clipfrac": ((r - 1).abs() > clip_range).float().mean(),
            "clipfrac_upper": (r > 1 + clip_range).float().mean(),
            "clipfrac_lower": (r < 1 - clip_range).float().mean(),
            "approx_kl": (torch.exp(lr) - 1 - lr).mean(),
        }


def policy_loss(
    log_prob: torch.Tensor, old_log_prob: torch.Tensor, advantages: torch.Tensor, clip_range: float
) -> PolicyLoss:
    """PPO-clip for one window step of a mini-batch; all (b,) float32."""
    log_ratio = log_prob - old_log_prob.detach()
    ratio = torch.exp(log_ratio)
    unclipped = -advantages * ratio
    clipped = -advantages * torch.clamp(ratio, 1.0 - clip_range, 1.0 + clip_range)
    loss = torch.maximum(unclipped, clipped).mean()
    return PolicyLoss(loss=loss, metrics=ratio_metrics(ratio, log_ratio, clip_range))


def ratio_norm_bias(
    mean: torch.Tensor, old_mean: torch.Tensor, std: torch.Tensor, sampler: Sampler | str
) -> torch.Tensor:
    """(b,) ``-E_old[log p - log p_old]``: the bias below 0 of one step's log-ratio that RatioNorm removes.

    With ``x' = mu_old + s eps`` drawn from the old kernel and ``d = mu - mu_old``:

    * Gaussian log-densities (``flow_sde``, ``dance_sde``; and the reference's RatioNorm):
      ``log p - log p_old = -mean((x' - mu)^2 - (x' - mu_old)^2) / (2 s^2) = -mean(d^2 - 2 s eps d) / (2 s^2)``,
      expectation ``-mean(d^2) / (2 s^2)``;
    * ``cps``, scored with Flow-CPS's unnormalised ``log p = -mean((x' - mu)^2)`` (`boogu_schedule.sde_step`'s
      ``cps_log_prob="reference"``, the one the trainer uses): the same difference without the
      ``1 / (2 s^2)``, expectation ``-mean(d^2)``. The Gaussian bias would over-correct by
      ``1 / (2 s^2)`` (x50 at ``s = 0.1``) and push every ratio above 1.

    ``mean``, ``old_mean``: (b, C, h, w); ``std``: (b,) the transition's total std.
    """
    sq = (mean - old_mean.detach()).pow(2).mean(dim=tuple(range(1, mean.dim())))
    if Sampler(sampler) is Sampler.CPS:
        return sq
    return sq / (2 * std.reshape(-1).pow(2))


def grpo_guard_loss(
    log_prob: torch.Tensor,
    old_log_prob: torch.Tensor,
    mean: torch.Tensor,
    old_mean: torch.Tensor,
    std: torch.Tensor,
    dt: torch.Tensor,
    advantages: torch.Tensor,
    clip_range: float,
    sampler: Sampler | str = Sampler.FLOW_SDE,
) -> PolicyLoss:
    """GRPO-Guard for one window step: RatioNorm, then PPO-clip reweighted by ``1/|dt|``.

    Per sample, with ``s`` the transition's total std (``sigma_t sqrt(-dt)``)::

        b     = ratio_norm_bias(...)                  # mean((mu - mu_old)^2) / (2 s^2); cps: no 1/(2 s^2)
        rho   = exp((log p - log p_old + b) * s)      # centred, and scaled to a comparable spread per step
        loss  = mean(max(-A rho, -A clamp(rho, 1 - eps, 1 + eps)) / |dt|)

    ``mean``, ``old_mean``: (b, C, h, w) float32; ``std``, ``dt``, the log-probs, ``advantages``: (b,);
    ``sampler``: the rollout's (`Trajectory.sampler`), which fixes how the log-probs were scored.
    Per sample rather than with batch means (verl-omni's ``GRPOGuardLoss`` averages ``s`` and ``dt``
    over the micro-batch): samples of one micro-batch may sit at different steps of their windows.
    On-policy (``mu = mu_old``) ``rho`` is exactly 1, as for PPO-clip.
    """
    s = std.reshape(-1)
    bias = ratio_norm_bias(mean, old_mean, std, sampler)
    log_ratio = log_prob - old_log_prob.detach()
    ratio = torch.exp((log_ratio + bias) * s)
    unclipped = -advantages * ratio
    clipped = -advantages * torch.clamp(ratio, 1.0 - clip_range, 1.0 + clip_range)
    loss = (torch.maximum(unclipped, clipped) / dt.abs().reshape(-1)).mean()
    metrics = ratio_metrics(ratio, log_ratio, clip_range)
    with torch.no_grad():
        metrics["guard/raw_ratio_mean"] = torch.exp(log_ratio.detach()).mean()
        metrics["guard/bias_mean"] = bias.detach().mean()
    return PolicyLoss(loss=loss, metrics=metrics)


def _sample_mean(x: torch.Tensor) -> torch.Tensor:
    return x.mean(dim=tuple(range(1, x.dim())))


def nft_loss(
    velocity: torch.Tensor,
    old_velocity: torch.Tensor,
    x_sigma: torch.Tensor,
    x0: torch.Tensor,
    sigma: torch.Tensor,
    advantages: torch.Tensor,
    *,
    beta: float,
    adv_clip: float,
    adaptive_weight: bool = True,
) -> PolicyLoss:
    """DiffusionNFT's loss at one noise level: implicit positive and negative policies in x0 space.

    ``velocity`` (with grad) and ``old_velocity`` are Boogu velocities ``x0 - eps`` at ``x_sigma``
    (the clean latent ``x0`` re-noised to ``sigma``), all float32 ``(b, C, h, w)``::

        v+ = v_old + beta (v - v_old)          v- = v_old - beta (v - v_old)
        r  = clamp(A / (2 adv_clip) + 1/2, 0, 1)          # the optimality probability
        L  = adv_clip * mean(r |x0(v+) - x0|^2 / w+ + (1 - r) |x0(v-) - x0|^2 / w-) / beta

    with ``x0(v) = x_sigma + sigma v`` and ``w`` the detached per-sample mean absolute x0 error
    (``adaptive_weight``; else 1). A sample with A > 0 pulls v+ toward the target, one with A < 0
    pulls v- there, i.e. pushes v away from it by the same amount.
    """
    old = old_velocity.detach()
    positive = old + beta * (velocity - old)
    negative = old - beta * (velocity - old)

    def error(v: torch.Tensor) -> torch.Tensor:
        diff = predict_x0(x_sigma, v, sigma) - x0
        err = _sample_mean(diff.pow(2))
        if adaptive_weight:
            err = err / _sample_mean(diff.detach().abs()).clamp(min=1e-5)
        return err

    r = (advantages / (2 * adv_clip) + 0.5).clamp(0.0, 1.0)
    per_sample = r * error(positive) + (1 - r) * error(negative)
    loss = adv_clip * per_sample.mean() / beta
    with torch.no_grad():
        metrics = {
            "nft/r_mean": r.mean(),
            "nft/old_deviation": _sample_mean((velocity.detach() - old).pow(2)).mean(),
            "nft/x0_error": _sample_mean((predict_x0(x_sigma, velocity.detach(), sigma) - x0).pow(2)).mean(),
        }
    return PolicyLoss(loss=loss, metrics=metrics)


def awm_log_prob(velocity: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """AWM's per-sample log-likelihood surrogate: ``-mean((v - target)^2)``, (b,) float32."""
    return -_sample_mean((velocity - target).pow(2))


def awm_loss(
    log_prob: torch.Tensor, old_log_prob: torch.Tensor, advantages: torch.Tensor, clip_range: float | None
) -> PolicyLoss:
    """AWM at one noise level: ``-A exp(log p - log p_old)``, PPO-clipped when ``clip_range`` is set.

    Its gradient at ``log p = log p_old`` is ``A * grad mean((v - target)^2)``: the pretraining
    flow-matching loss weighted by the advantage.
    """
    log_ratio = log_prob - old_log_prob.detach()
    ratio = torch.exp(log_ratio)
    objective = -advantages * ratio
    if clip_range is not None:
        clipped = -advantages * torch.clamp(ratio, 1.0 - clip_range, 1.0 + clip_range)
        objective = torch.maximum(objective, clipped)
    loss = objective.mean()
    metrics = ratio_metrics(ratio, log_ratio, clip_range if clip_range is not None else math.inf)
    metrics["awm/fm_loss"] = -log_prob.detach().mean()
    return PolicyLoss(loss=loss, metrics=metrics)


def velocity_kl(velocity: torch.Tensor, ref_velocity: torch.Tensor) -> torch.Tensor:
    """(b,) the forward-process algorithms' penalty to the base model: ``mean((v - v_ref)^2)``."""
    return _sample_mean((velocity - ref_velocity.detach()).pow(2))


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
