"""User rewards loaded by import path in the trainer tests."""

from __future__ import annotations

import random

import numpy as np
import torch


def always_nan(images, records):
    return torch.full((images.shape[0],), float("nan"))


def half_nan(images, records):
    scores = images.float().mean(dim=(1, 2, 3)) / 255
    scores[::2] = float("nan")
    return scores


def brightness_with_global_noise(images, records):
    """Brightness plus noise from the three global RNGs (torch, numpy, random), as a careless user's
    reward would draw it; the number of draws depends on the prompts, so ranks' streams diverge."""
    extra = sum(len(record.instruction) for record in records) % 7
    torch.rand(extra)
    np.random.rand(extra)
    noise = torch.rand(images.shape[0]) + float(np.random.rand()) + random.random()
    return images.float().mean(dim=(1, 2, 3)) / 255 + 1e-2 * noise
