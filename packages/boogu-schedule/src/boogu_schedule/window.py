"""SDE windows: which denoising steps are stochastic (and trained on).

A window ``[start, end)`` over N steps: steps inside use the sampler's noise level and are collected
for training; steps outside are deterministic (noise 0). The last step (``N - 1``, which lands on
``sigma = 0``) is never inside a window. Plans:

* ``fixed``: the same window every time.
* ``random``: a start drawn uniformly so the window lies inside ``window_range``, from an explicit
  generator (Flow-GRPO-Fast / the reference recipe: size 2 in ``[0, 5)`` over 10 steps).
* ``progressive``: MixGRPO's sliding window: the start moves by ``stride`` every ``every`` iterations
  and wraps around inside ``window_range``.

Scope: by default one window per prompt group (all n samples share it, so their rewards compare
like with like); ``batch`` shares one across the whole batch; ``sample`` draws one per sample, as
the reference integration does.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from enum import StrEnum

import torch


class WindowKind(StrEnum):
    FIXED = "fixed"
    RANDOM = "random"
    PROGRESSIVE = "progressive"


class WindowScope(StrEnum):
    GROUP = "group"
    BATCH = "batch"
    SAMPLE = "sample"


@dataclass(frozen=True)
class SdeWindow:
    """The stochastic steps ``start <= i < end`` of an N-step trajectory, with their noise level."""

    start: int
    end: int
    noise_level: float

    def __post_init__(self) -> None:
        if not (0 <= self.start <= self.end):
            raise ValueError(f"SdeWindow: need 0 <= start <= end, got start={self.start}, end={self.end}")
        if not math.isfinite(self.noise_level) or self.noise_level < 0:
            raise ValueError(f"SdeWindow: noise_level must be finite and >= 0, got {self.noise_level}")

    @property
    def size(self) -> int:
        return self.end - self.start

    def validate(self, num_steps: int) -> None:
        """Raise unless the window fits N steps with the last step outside it."""
        if self.end > num_steps - 1 and self.size > 0:
            raise ValueError(
                f"SdeWindow [{self.start}, {self.end}) over {num_steps} steps: the last step "
                f"({num_steps - 1}) must stay deterministic, so end must be <= {num_steps - 1}"
            )

    def contains(self, step: int) -> bool:
        return self.start <= step < self.end

    def noise_levels(self, num_steps: int) -> torch.Tensor:
        """(N,) float32: ``noise_level`` inside the window, 0 outside."""
        self.validate(num_steps)
        levels = torch.zeros(num_steps, dtype=torch.float32)
        levels[self.start : self.end] = self.noise_level
        return levels


def _check_range(num_steps: int, size: int, window_range: tuple[int, int] | None) -> tuple[int, int]:
    if num_steps < 1:
        raise ValueError(f"num_steps must be >= 1, got {num_steps}")
    if size < 0:
        raise ValueError(f"window size must be >= 0, got {size}")
    lo, hi = (0, num_steps - 1) if window_range is None else window_range
    if not (0 <= lo <= hi):
        raise ValueError(f"window_range must satisfy 0 <= lo <= hi, got {window_range}")
    hi = min(hi, num_steps - 1)  # the last step is never stochastic
    if size > hi - lo:
        raise ValueError(
            f"a window of size {size} does not fit in range [{lo}, {hi}) over {num_steps} steps "
            f"(the last step is excluded)"
        )
    return lo, hi


def full_window(num_steps: int, noise_level: float) -> SdeWindow:
    """Every step but the last: ``[0, N - 1)``."""
    return SdeWindow(0, max(num_steps - 1, 0), noise_level)


def fixed_window(num_steps: int, size: int, start: int, noise_level: float) -> SdeWindow:
    window = SdeWindow(start, start + size, noise_level)
    window.validate(num_steps)
    return window


def random_window(
    num_steps: int,
    size: int,
    window_range: tuple[int, int] | None,
    noise_level: float,
    generator: torch.Generator,
) -> SdeWindow:
    """A uniformly drawn window inside ``window_range`` (one ``torch.randint`` from ``generator``)."""
    lo, hi = _check_range(num_steps, size, window_range)
    start = int(torch.randint(lo, hi - size + 1, (1,), generator=generator).item())
    return SdeWindow(start, start + size, noise_level)


def progressive_window(
    num_steps: int,
    size: int,
    window_range: tuple[int, int] | None,
    noise_level: float,
    iteration: int,
    stride: int = 1,
    every: int = 1,
) -> SdeWindow:
    """MixGRPO's sliding window: start ``lo + (iteration // every) * stride``, wrapping in range."""
    if stride < 1 or every < 1 or iteration < 0:
        raise ValueError(
            f"progressive window: need stride >= 1, every >= 1, iteration >= 0; got {stride}, {every}, {iteration}"
        )
    lo, hi = _check_range(num_steps, size, window_range)
    positions = hi - size - lo + 1
    start = lo + ((iteration // every) * stride) % positions
    return SdeWindow(start, start + size, noise_level)


@dataclass(frozen=True)
class WindowPlan:
    """How to choose windows for a batch. ``size=None`` means the full window ``[0, N - 1)``."""

    kind: WindowKind = WindowKind.RANDOM
    size: int | None = None
    window_range: tuple[int, int] | None = None
    start: int = 0
    """``fixed`` only: the window's first step."""
    scope: WindowScope = WindowScope.GROUP
    stride: int = 1
    """``progressive`` only: steps moved per advance."""
    every: int = 1
    """``progressive`` only: iterations between advances."""

    def __post_init__(self) -> None:
        object.__setattr__(self, "kind", WindowKind(self.kind))
        object.__setattr__(self, "scope", WindowScope(self.scope))
        if self.window_range is not None:
            object.__setattr__(self, "window_range", tuple(self.window_range))

    def one(
        self, num_steps: int, noise_level: float, generator: torch.Generator, iteration: int
    ) -> SdeWindow:
        if self.size is None:
            return full_window(num_steps, noise_level)
        if self.kind is WindowKind.FIXED:
            return fixed_window(num_steps, self.size, self.start, noise_level)
        if self.kind is WindowKind.PROGRESSIVE:
            return progressive_window(
                num_steps, self.size, self.window_range, noise_level, iteration, self.stride, self.every
            )
        return random_window(num_steps, self.size, self.window_range, noise_level, generator)


def plan_windows(
    plan: WindowPlan,
    num_steps: int,
    noise_level: float,
    num_groups: int,
    group_size: int,
    generator: torch.Generator,
    iteration: int = 0,
) -> list[SdeWindow]:
    """One window per sample (``num_groups * group_size``, group-major), shared as ``plan.scope`` says."""
    if num_groups < 0 or group_size < 1:
        raise ValueError(
            f"plan_windows: need num_groups >= 0 and group_size >= 1, got {num_groups}, {group_size}"
        )
    if plan.scope is WindowScope.BATCH:
        window = plan.one(num_steps, noise_level, generator, iteration)
        return [window] * (num_groups * group_size)
    if plan.scope is WindowScope.GROUP:
        out: list[SdeWindow] = []
        for _ in range(num_groups):
            out.extend([plan.one(num_steps, noise_level, generator, iteration)] * group_size)
        return out
    return [plan.one(num_steps, noise_level, generator, iteration) for _ in range(num_groups * group_size)]
