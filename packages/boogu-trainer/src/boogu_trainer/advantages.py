"""Group-relative advantages (GRPO as Flow-GRPO uses it).

For sample i of group g: ``A_i = (R_i - mean_g) / (std + eps)``, clamped to ``[-clip, clip]``,
where ``std`` is the group's or the whole batch's (the reference's ``global_std=True``). The same
advantage applies to every window step of the sample. Samples with a non-finite reward get
advantage 0 and are left out of every statistic; groups whose (finite) rewards are all equal
carry no signal: they are counted in ``zero_std_ratio`` and get advantage 0 exactly. A weight-0
reward is a logged metric only: the advantage is exactly the one computed without it.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Literal

import torch


@dataclass(frozen=True)
class Advantages:
    advantages: torch.Tensor
    """(B,) float32, zero for non-finite rewards and zero-std groups."""
    rewards: torch.Tensor
    """(B,) float32 weighted reward (NaN where a reward was not finite)."""
    finite: torch.Tensor
    """(B,) bool: every reward of the sample was finite."""
    zero_std_ratio: float
    """Fraction of groups whose rewards were all equal (no gradient from them)."""

    def stats(self) -> dict[str, float]:
        a = self.advantages[self.finite]
        return {
            "adv/mean": float(a.mean()) if a.numel() else 0.0,
            "adv/std": float(a.std(unbiased=False)) if a.numel() else 0.0,
            "adv/abs_mean": float(a.abs().mean()) if a.numel() else 0.0,
            "adv/max": float(a.max()) if a.numel() else 0.0,
            "adv/min": float(a.min()) if a.numel() else 0.0,
            "zero_std_ratio": self.zero_std_ratio,
            "nonfinite_rewards": int((~self.finite).sum()),
        }


def _group_stats(values: torch.Tensor, valid: torch.Tensor, group_id: torch.Tensor, num_groups: int):
    """Per-group mean and population std over the valid entries; (G,), (G,), counts (G,)."""
    v = torch.where(valid, values, torch.zeros_like(values)).double()
    w = valid.double()
    count = torch.zeros(num_groups, dtype=torch.float64).index_add_(0, group_id, w)
    total = torch.zeros(num_groups, dtype=torch.float64).index_add_(0, group_id, v)
    mean = total / count.clamp(min=1)
    sq = torch.zeros(num_groups, dtype=torch.float64).index_add_(0, group_id, w * (v - mean[group_id]) ** 2)
    std = (sq / count.clamp(min=1)).sqrt()
    return mean, std, count


def normalize_in_groups(
    values: torch.Tensor,
    valid: torch.Tensor,
    group_id: torch.Tensor,
    *,
    std_scope: Literal["group", "batch"] = "batch",
    normalize_std: bool = True,
    eps: float = 1e-4,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(values - group mean) / (std + eps)`` over valid entries; returns (normalised (B,), zero-std groups (G,))."""
    num_groups = int(group_id.max()) + 1 if group_id.numel() else 0
    mean, std_g, count = _group_stats(values, valid, group_id, num_groups)
    centred = torch.where(
        valid, values.double() - mean[group_id], torch.zeros_like(values, dtype=torch.float64)
    )
    zero_std = (std_g == 0) & (count > 0)
    if normalize_std:
        if std_scope == "group":
            denom = std_g[group_id]
        else:
            vv = values.double()[valid]
            denom = (
                (vv - vv.mean()).pow(2).mean().sqrt().expand_as(centred)
                if vv.numel()
                else torch.ones_like(centred)
            )
        centred = centred / (denom + eps)
    centred = torch.where(zero_std[group_id], torch.zeros_like(centred), centred)
    return centred.float(), zero_std


def compute_advantages(
    rewards: Mapping[str, torch.Tensor],
    weights: Mapping[str, float],
    group_id: torch.Tensor,
    *,
    std_scope: Literal["group", "batch"] = "batch",
    normalize_std: bool = True,
    eps: float = 1e-4,
    clip: float = 5.0,
    per_reward_normalization: bool = False,
    sign: float = 1.0,
) -> Advantages:
    """Advantages from named per-sample rewards ((B,) each), their weights and group ids (B,)."""
    names: Sequence[str] = list(rewards)
    if not names:
        raise ValueError("compute_advantages: no rewards")
    stacked = torch.stack([rewards[n].float().cpu() for n in names])  # (R, B)
    group_id = group_id.cpu().long()
    w = torch.tensor([float(weights[n]) for n in names], dtype=torch.float32)
    # A weight-0 reward is a logged metric only: it is left out of everything below (the finite
    # mask, the sum, the per-reward normalisation), so its NaNs can neither drop samples nor
    # reach an advantage as 0 * NaN. The advantage is the one computed without it.
    active = [i for i in range(len(names)) if w[i] != 0]
    if not active:
        raise ValueError(
            f"compute_advantages: every reward weight is 0 ({dict(weights)}); "
            "expected at least one reward with a nonzero weight"
        )
    stacked, w = stacked[active], w[active]
    finite = torch.isfinite(stacked).all(dim=0)
    total = (w[:, None] * torch.where(torch.isfinite(stacked), stacked, torch.zeros_like(stacked))).sum(0)
    total = torch.where(finite, total, torch.full_like(total, float("nan")))
    opts = dict(std_scope=std_scope, normalize_std=normalize_std, eps=eps)
    if per_reward_normalization and len(active) > 1:
        parts, zero = [], None
        for i in range(len(active)):
            a_i, z_i = normalize_in_groups(stacked[i], finite, group_id, **opts)
            parts.append(w[i] * a_i)
            zero = z_i if zero is None else zero & z_i
        adv = torch.stack(parts).sum(0)
        zero_std = zero
    else:
        adv, zero_std = normalize_in_groups(total, finite, group_id, **opts)
    adv = (sign * adv.clamp(-clip, clip)).where(finite, torch.zeros_like(adv))
    num_groups = int(group_id.max()) + 1 if group_id.numel() else 0
    return Advantages(
        advantages=adv,
        rewards=total,
        finite=finite,
        zero_std_ratio=float(zero_std.float().mean()) if num_groups else 0.0,
    )
