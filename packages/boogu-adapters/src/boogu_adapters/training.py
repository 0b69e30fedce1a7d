"""Recompute window transitions of a trajectory under the current (or the reference) policy.

``TrainingAdapter.step_stats`` goes through :func:`boogu_adapters.step.transition`, the function
the local rollout engine's loop is made of, with the stored float32 latents, the stored schedule
and step indices, the rollout's CFG scale and CFG batching, and ``prev_sample=`` the stored next
latent. With the weights that produced the trajectory it reproduces the rollout's log-prob exactly.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from boogu_adapters.lora import adapters_disabled
from boogu_adapters.step import transition
from boogu_adapters.types import Trajectory


@dataclass(frozen=True)
class StepStats:
    """One window step of a mini-batch under some policy."""

    log_prob: torch.Tensor
    """(b,) float32."""
    mean: torch.Tensor
    """(b, C, h, w) float32 transition mean."""
    std: torch.Tensor
    """(b,) float32 total std."""


class TrainingAdapter:
    """Policy (adapters on) and reference (adapters off) statistics for window step ``k``."""

    def __init__(self, freqs_cis: Sequence[torch.Tensor]):
        self.freqs_cis = list(freqs_cis)

    def step_stats(
        self,
        model: torch.nn.Module,
        trajectory: Trajectory,
        k: int,
        *,
        use_adapters: bool = True,
        index: torch.Tensor | Sequence[int] | None = None,
    ) -> StepStats:
        """Log-prob, mean and std of window step ``k`` for the samples ``index`` (default: all).

        Gradients flow when grad mode is on; ``use_adapters=False`` evaluates the reference policy
        (peft adapters disabled) for the KL term.
        """
        if trajectory.window_size == 0:
            raise ValueError("the trajectory has an empty SDE window: there is no step to train on")
        if not 0 <= k < trajectory.window_size:
            raise IndexError(f"window step {k} outside [0, {trajectory.window_size})")
        rows = (
            torch.arange(trajectory.batch_size, device=trajectory.latents.device)
            if index is None
            else torch.as_tensor(index, dtype=torch.long, device=trajectory.latents.device)
        )
        step = trajectory.step_index[rows, k]
        sigma = trajectory.sigmas[step]  # (b,) the schedule the rollout used, by index, no float matching
        sigma_next = trajectory.sigmas[step + 1]
        cond = trajectory.conditioning if index is None else trajectory.conditioning.select(rows.cpu())
        kwargs = dict(
            guidance_scale=trajectory.guidance_scale,
            freqs_cis=self.freqs_cis,
            sampler=trajectory.sampler,
            noise_level=trajectory.noise_level,
            prev_sample=trajectory.latents[rows, k + 1],
            cfg_mode=trajectory.cfg_mode,
        )
        latents = trajectory.latents[rows, k]
        if use_adapters:
            out = transition(model, latents, sigma, sigma_next, cond, **kwargs)
        else:
            with adapters_disabled(model):
                out = transition(model, latents, sigma, sigma_next, cond, **kwargs)
        return StepStats(log_prob=out.log_prob, mean=out.mean, std=out.std.flatten())
