"""Recompute window transitions of a trajectory under the current (or the reference) policy.

``TransitionRecompute.step_stats`` goes through :func:`boogu_adapters.step.transition`, the function
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
from boogu_adapters.types import Trajectory, host_tensor
from boogu_schedule.hot import per_iteration


@dataclass(frozen=True)
class StepStats:
    """One window step of a mini-batch under some policy."""

    log_prob: torch.Tensor
    """(b,) float32."""
    mean: torch.Tensor
    """(b, C, h, w) float32 transition mean."""
    std: torch.Tensor
    """(b,) float32 total std."""


class TransitionRecompute:
    """Policy (adapters on) and reference (adapters off) statistics for window step ``k``."""

    def __init__(self, freqs_cis: Sequence[torch.Tensor]):
        self.freqs_cis = list(freqs_cis)

    @staticmethod
    def _host_rows(trajectory: Trajectory, index) -> list[int]:
        if index is None:
            return list(range(trajectory.batch_size))
        if isinstance(index, torch.Tensor):
            if index.device.type != "cpu":
                raise ValueError(
                    "step_stats: index must be host indices (a CPU tensor or a list), not on the device"
                )
            return index.tolist()
        return [int(i) for i in index]

    @staticmethod
    def rows(tensor: torch.Tensor, rows: Sequence[int] | torch.Tensor) -> torch.Tensor:
        """``tensor[rows]`` for host indices: a view for consecutive rows, else one non-blocking gather."""
        rows = rows.tolist() if isinstance(rows, torch.Tensor) else list(rows)
        if rows and rows == list(range(rows[0], rows[0] + len(rows))):
            return tensor[rows[0] : rows[0] + len(rows)]
        return tensor[host_tensor(rows, tensor.device)]

    @per_iteration
    def step_stats(
        self,
        model: torch.nn.Module,
        trajectory: Trajectory,
        k: int,
        *,
        use_adapters: bool = True,
        index: torch.Tensor | Sequence[int] | None = None,
    ) -> StepStats:
        """Log-prob, mean and std of window step ``k`` for the samples ``index`` (host indices; default: all).

        Gradients flow when grad mode is on; ``use_adapters=False`` evaluates the reference policy
        (peft adapters disabled) for the KL term.
        """
        if trajectory.window_size == 0:
            raise ValueError("the trajectory has an empty SDE window: there is no step to train on")
        if not 0 <= k < trajectory.window_size:
            raise IndexError(f"window step {k} outside [0, {trajectory.window_size})")
        rows = self._host_rows(trajectory, index)
        step = self.rows(trajectory.step_index, rows)[:, k]
        sigma = trajectory.sigmas[step]  # (b,) the schedule the rollout used, by index, no float matching
        sigma_next = trajectory.sigmas[step + 1]
        cond = trajectory.conditioning if index is None else trajectory.conditioning.select(rows)
        window = self.rows(trajectory.latents, rows)
        kwargs = dict(
            guidance_scale=trajectory.guidance_scale,
            image_guidance_scale=trajectory.image_guidance_scale,
            freqs_cis=self.freqs_cis,
            sampler=trajectory.sampler,
            noise_level=trajectory.noise_level,
            prev_sample=window[:, k + 1],
            cfg_mode=trajectory.cfg_mode,
        )
        latents = window[:, k]
        if use_adapters:
            out = transition(model, latents, sigma, sigma_next, cond, **kwargs)
        else:
            with adapters_disabled(model):
                out = transition(model, latents, sigma, sigma_next, cond, **kwargs)
        return StepStats(log_prob=out.log_prob, mean=out.mean, std=out.std.flatten())
