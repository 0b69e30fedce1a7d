"""Shared hypothesis strategies for tensor code: small shapes, finite float32, safe sigmas."""

from __future__ import annotations

import hypothesis.extra.numpy as hnp
import numpy as np
import torch
from hypothesis import strategies as st

EPS = 1e-3

MAX_SIDE = 6
"""Cap on every dimension: tensor tests stay fast on 2 cores."""


def shapes(min_dims: int = 2, max_dims: int = 4) -> st.SearchStrategy[tuple[int, ...]]:
    """Batch-first shapes ``(B, ...)`` with every side in ``[1, MAX_SIDE]``."""
    return hnp.array_shapes(min_dims=min_dims, max_dims=max_dims, min_side=1, max_side=MAX_SIDE)


def f32_floats(lo: float, hi: float) -> st.SearchStrategy[float]:
    """Float32 values in ``[lo, hi]`` (bounds rounded inwards to float32)."""
    lo32, hi32 = np.float32(lo), np.float32(hi)
    if lo32 < lo:
        lo32 = np.nextafter(lo32, np.float32(np.inf))
    if hi32 > hi:
        hi32 = np.nextafter(hi32, np.float32(-np.inf))
    return st.floats(float(lo32), float(hi32), allow_nan=False, allow_infinity=False, width=32)


def finite_f32(bound: float = 10.0) -> st.SearchStrategy[float]:
    return f32_floats(-bound, bound)


@st.composite
def tensors(draw, shape=None, bound: float = 10.0) -> torch.Tensor:
    """A finite float32 tensor of the given (or a drawn) shape."""
    shape = draw(shapes()) if shape is None else shape
    arr = draw(hnp.arrays(np.float32, shape, elements=finite_f32(bound)))
    return torch.from_numpy(arr.copy())


@st.composite
def same_shape_tensors(draw, n: int, bound: float = 10.0) -> tuple[torch.Tensor, ...]:
    shape = draw(shapes())
    return tuple(draw(tensors(shape, bound)) for _ in range(n))


def sigmas(lo: float = EPS, hi: float = 1.0 - EPS) -> st.SearchStrategy[float]:
    """Noise levels strictly inside (0, 1) in float32."""
    return f32_floats(lo, hi)


@st.composite
def sigma_pairs(draw, allow_one: bool = True) -> tuple[float, float]:
    """``(sigma, sigma_next)`` with ``0 <= sigma_next < sigma <= 1`` (float32-representable)."""
    sigma = draw(st.one_of(st.just(1.0), sigmas(2 * EPS, 1.0 - EPS)) if allow_one else sigmas(2 * EPS))
    sigma_next = draw(st.one_of(st.just(0.0), f32_floats(EPS, sigma - EPS)))
    return float(sigma), float(sigma_next)


noise_levels = f32_floats(0.05, 1.5)
seeds = st.integers(0, 2**31 - 1)
