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


NAN_FROM_CALL: int | None = None
"""`global_noise_then_nan` returns NaN from this call on (1-based, counted in `calls`); None: never."""
calls = 0


def global_noise_then_nan(images, records):
    """`brightness_with_global_noise` (the same draws), all NaN from call `NAN_FROM_CALL` on: a reward
    that breaks in the middle of a run, and that a test then repairs by setting `NAN_FROM_CALL` to None."""
    global calls
    calls += 1
    scores = brightness_with_global_noise(images, records)
    if NAN_FROM_CALL is not None and calls >= NAN_FROM_CALL:
        scores = torch.full_like(scores, float("nan"))
    return scores
