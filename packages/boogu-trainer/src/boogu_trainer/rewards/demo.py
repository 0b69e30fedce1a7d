"""Demo rewards: cheap, smooth, bounded scores that even a tiny random model can move.

The CPU demo (`uv run trainer` without a recipe) trains a tiny random Boogu model at 64×64,
which can draw no text; it needs a reward that every sample gets a graded score on and that a
LoRA can raise in ~30 steps by shifting the output's global colour statistics. These rewards
measure nothing about prompt fidelity: they show that the RL loop works, not that it helps.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch

from boogu_data import PromptRecord
from boogu_trainer.rewards.base import check_batch
from boogu_trainer.rewards.registry import register_reward

__all__ = ["BrightnessReward", "ContrastReward", "SkyReward", "TargetColorReward"]


@register_reward("demo_brightness")
class BrightnessReward:
    """Demo reward: how bright the image is (the CPU demo's reward).

    Measures: the mean of all pixel values over 255 (0 black, 1 white); prompts are ignored.
    On the tiny checkpoint, whose smooth random VAE decoder maps latent shifts to colour shifts
    nearly linearly, a rank-8 LoRA raises it by about two batch standard deviations in 30 steps.
    Range: [0, 1]; linear in every pixel, so every sample gets a graded score.
    Cost: one mean over the batch, microseconds.
    """

    name = "demo_brightness"

    def __call__(self, images: torch.Tensor, records: Sequence[PromptRecord]) -> torch.Tensor:
        check_batch(images, records, self.name)
        return images.detach().cpu().to(torch.float32).mean(dim=(1, 2, 3)) / 255.0


@register_reward("demo_target_color")
class TargetColorReward:
    """Demo reward: how close the image's mean colour is to a target colour.

    Measures: ``1 - |mean_rgb - target| / (255 * sqrt(3))``, the Euclidean distance between the
    image's mean RGB and ``target`` (RGB in [0, 255], default orange ``(255, 128, 0)``) over the
    largest possible distance; prompts are ignored.
    Range: [0, 1], 1 exactly at the target colour.
    Cost: one mean over the batch, microseconds.
    """

    name = "demo_target_color"

    def __init__(self, target: Sequence[float] = (255, 128, 0)) -> None:
        values = tuple(target) if isinstance(target, Sequence) and not isinstance(target, str) else ()
        if len(values) != 3 or not all(
            isinstance(v, int | float) and not isinstance(v, bool) and 0 <= v <= 255 for v in values
        ):
            raise ValueError(
                f"demo_target_color: target must be three numbers in [0, 255] (RGB), got {target!r}"
            )
        self.target = torch.tensor(values, dtype=torch.float32)

    def __call__(self, images: torch.Tensor, records: Sequence[PromptRecord]) -> torch.Tensor:
        check_batch(images, records, self.name)
        mean_rgb = images.detach().cpu().to(torch.float32).mean(dim=(2, 3))  # (B, 3) in [0, 255]
        distance = torch.linalg.vector_norm(mean_rgb - self.target, dim=1)
        # The clamp only absorbs float32 rounding at the far corner (NaN would pass through).
        return (1.0 - distance / (255.0 * math.sqrt(3.0))).clamp(0.0, 1.0)


@register_reward("demo_contrast")
class ContrastReward:
    """Demo reward: how much contrast the image has.

    Measures: the standard deviation of all pixel values of an image over 127.5 (0 for a flat
    image, 1 for a half-black, half-white one); prompts are ignored.
    Range: [0, 1].
    Cost: one std over the batch, microseconds.
    """

    name = "demo_contrast"

    def __call__(self, images: torch.Tensor, records: Sequence[PromptRecord]) -> torch.Tensor:
        check_batch(images, records, self.name)
        pixels = images.detach().cpu().to(torch.float32).flatten(1)
        return (pixels.std(dim=1, unbiased=False) / 127.5).clamp(0.0, 1.0)


@register_reward("demo_sky")
class SkyReward:
    """Demo reward: is the top of the image brighter than the bottom (a sky-over-ground layout)?

    Measures: ``0.5 + (mean(top half) - mean(bottom half)) / 510``, over all channels; prompts are
    ignored. Harder than the global-colour rewards: the model has to learn a spatial layout.
    Range: [0, 1]; 0.5 when both halves are equally bright.
    Cost: two means over the batch, microseconds.
    """

    name = "demo_sky"

    def __call__(self, images: torch.Tensor, records: Sequence[PromptRecord]) -> torch.Tensor:
        check_batch(images, records, self.name)
        pixels = images.detach().cpu().to(torch.float32)
        half = pixels.shape[2] // 2
        top = pixels[:, :, :half].mean(dim=(1, 2, 3))
        bottom = pixels[:, :, pixels.shape[2] - half :].mean(dim=(1, 2, 3))
        return 0.5 + (top - bottom) / 510.0
