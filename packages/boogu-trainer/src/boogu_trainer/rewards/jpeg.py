"""``jpeg_compressibility`` / ``jpeg_incompressibility``: the size of the image as a JPEG.

The classic DDPO task (ddpo-pytorch ``rewards.py``, kept by flow_grpo): encode at quality 95 with
Pillow and reward the size in kB (1 kB = 1000 bytes), negated for compressibility. flow_grpo
divides the compressibility score by 500; a weight of 1/500 in `build_rewards` reproduces that.
"""

from __future__ import annotations

import io
from collections.abc import Sequence

import torch
from PIL import Image

from boogu_data import PromptRecord
from boogu_trainer.rewards.base import check_batch, images_to_numpy
from boogu_trainer.rewards.registry import register_reward

__all__ = ["JpegSizeReward", "jpeg_compressibility", "jpeg_incompressibility", "jpeg_size_kb"]


def jpeg_size_kb(images: torch.Tensor, quality: int = 95) -> torch.Tensor:
    """``(B,)`` float32: each ``(3, H, W)`` uint8 image's JPEG size in kB at ``quality``."""
    sizes = []
    for rgb in images_to_numpy(images):
        buffer = io.BytesIO()
        Image.fromarray(rgb).save(buffer, format="JPEG", quality=quality)
        sizes.append(buffer.tell() / 1000.0)
    return torch.tensor(sizes, dtype=torch.float32)


class JpegSizeReward:
    """``sign * (JPEG size in kB)``; built by the two registered factories below."""

    def __init__(self, name: str, sign: float, quality: int = 95) -> None:
        if isinstance(quality, bool) or not isinstance(quality, int) or not 1 <= quality <= 100:
            raise ValueError(f"{name}: quality must be an int in [1, 100], got {quality!r}")
        self.name = name
        self.sign = sign
        self.quality = quality

    def __call__(self, images: torch.Tensor, records: Sequence[PromptRecord]) -> torch.Tensor:
        check_batch(images, records, self.name)
        return self.sign * jpeg_size_kb(images, self.quality)


@register_reward("jpeg_compressibility")
def jpeg_compressibility(quality: int = 95) -> JpegSizeReward:
    """Rewards images that compress well (flat, smooth, little detail).

    Measures: minus the JPEG size (quality 95) in kB. Range: (-inf, 0); about -10 to -150 for a
    512² image. Cost: one JPEG encode per image, about 1-5 ms at 512² (prompts are ignored).
    """
    return JpegSizeReward("jpeg_compressibility", -1.0, quality)


@register_reward("jpeg_incompressibility")
def jpeg_incompressibility(quality: int = 95) -> JpegSizeReward:
    """Rewards images that compress badly (busy, detailed, noisy).

    Measures: the JPEG size (quality 95) in kB. Range: (0, inf); about 10 to 150 for a 512² image.
    Cost: one JPEG encode per image, about 1-5 ms at 512² (prompts are ignored).
    """
    return JpegSizeReward("jpeg_incompressibility", 1.0, quality)
