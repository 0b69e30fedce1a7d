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


class WindowPlanError(ValueError):
    """A window setting that cannot work over N steps; ``field`` names the `WindowPlan` field to
    change (``size``, ``window_range``, ``start``, ``stride``, ``every``) or ``num_steps``."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(message)
        self.field = field


def _check_bounds(window_range: tuple[int, int] | None) -> None:
    if window_range is not None and not (0 <= window_range[0] <= window_range[1]):
        raise WindowPlanError(
            "window_range", f"window_range must satisfy 0 <= lo <= hi, got {tuple(window_range)}"
        )


def _check_range(num_steps: int, size: int, window_range: tuple[int, int] | None) -> tuple[int, int]:
    if num_steps < 1:
        raise WindowPlanError("num_steps", f"num_steps must be >= 1, got {num_steps}")
    if size < 0:
        raise WindowPlanError("size", f"window size must be >= 0, got {size}")
    _check_bounds(window_range)
    lo, hi = (0, num_steps - 1) if window_range is None else window_range
    hi = min(hi, num_steps - 1)  # the last step is never stochastic
    if size > hi - lo:
        raise WindowPlanError(
            "size",
            f"a window of size {size} does not fit in range [{lo}, {hi}) over {num_steps} steps "
            f"(the last step is excluded)",
        )
    return lo, hi


def _check_fixed(num_steps: int, size: int, start: int) -> None:
    if size < 0:
        raise WindowPlanError("size", f"window size must be >= 0, got {size}")
    if start < 0:
        raise WindowPlanError("start", f"a fixed window's start must be >= 0, got {start}")
    if size > 0 and start + size > num_steps - 1:
        raise WindowPlanError(
            "size" if size > num_steps - 1 else "start",
            f"a fixed window [{start}, {start + size}) over {num_steps} steps covers the last step "
            f"({num_steps - 1}), which must stay deterministic: need start + size <= {num_steps - 1}",
        )


def _check_progression(stride: int, every: int) -> None:
    if stride < 1:
        raise WindowPlanError("stride", f"progressive window: stride must be >= 1, got {stride}")
    if every < 1:
        raise WindowPlanError("every", f"progressive window: every must be >= 1, got {every}")


def full_window(num_steps: int, noise_level: float) -> SdeWindow:
    """Every step but the last: ``[0, N - 1)``."""
    return SdeWindow(0, max(num_steps - 1, 0), noise_level)


def fixed_window(num_steps: int, size: int, start: int, noise_level: float) -> SdeWindow:
    _check_fixed(num_steps, size, start)
    return SdeWindow(start, start + size, noise_level)


def random_window(
    num_steps: int,
    size: int,
    window_range: tuple[int, int] | None,
    noise_level: float,
    generator: torch.Generator,
) -> SdeWindow:
    """A uniformly drawn window inside ``window_range`` (one ``torch.randint`` from ``generator``).

    The draw happens on the generator's device (a CUDA generator refuses to fill a CPU tensor) and
    is read back once: a host read per window, before any denoising step."""
    lo, hi = _check_range(num_steps, size, window_range)
    draw = torch.randint(lo, hi - size + 1, (1,), generator=generator, device=generator.device)
    start = int(draw.item())
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
    if iteration < 0:
        raise ValueError(f"progressive window: iteration must be >= 0, got {iteration}")
    _check_progression(stride, every)
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

    def validate(self, num_steps: int) -> None:
        """Raise `WindowPlanError` unless every window this plan can choose over ``num_steps`` steps
        fits with the last step excluded: the checks `one` makes at each call, made once up front
        (the trainer's config calls this when it loads). ``stride`` and ``every`` must be >= 1
        whatever the kind."""
        _check_progression(self.stride, self.every)
        _check_bounds(self.window_range)
        if self.size is None:
            return
        if self.kind is WindowKind.FIXED:
            _check_fixed(num_steps, self.size, self.start)
        else:
            _check_range(num_steps, self.size, self.window_range)

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
