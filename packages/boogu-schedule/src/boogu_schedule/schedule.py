"""Boogu's time-shift schedules, ``t = 1 - sigma`` and the velocity sign.

Upstream's scheduler (``boogu/schedulers/scheduling_flow_match_euler_discrete_time_shifting.py``)
shares its class name with diffusers' ``FlowMatchEulerDiscreteScheduler`` but not its semantics:
loading a Boogu ``scheduler_config.json`` through diffusers silently drops the Boogu keys and
yields a different schedule. :class:`BooguScheduleConfig` keeps every key, known or not.

:func:`boogu_sigmas` reproduces upstream's float32 arithmetic bit for bit (numpy float32 with
Python-float scalars), so a schedule computed here equals the one the released pipeline uses.
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Mapping
from dataclasses import dataclass, field, fields
from typing import Any

import torch

_TIME_SHIFT_VERSIONS = ("v1", "v2")


@dataclass(frozen=True)
class BooguScheduleConfig:
    """Every key of a Boogu ``scheduler_config.json``; defaults equal upstream's class defaults.

    The class defaults (dynamic v2) differ from the released config (static v1, ``seq_len`` 4096):
    a missing file silently changes the schedule upstream, so always load the checkpoint's file.
    """

    num_train_timesteps: int = 1000
    """Training timesteps; scheduler-native timesteps are ``sigma * num_train_timesteps``."""
    do_shift: bool = True
    """Apply a time shift at all."""
    dynamic_time_shift: bool = True
    """Shift from the request's token count (dynamic) or from ``seq_len`` (static)."""
    time_shift_version: str = "v2"
    """``"v1"``: the SD3/Flux exponential shift; ``"v2"``: ``t / (m - m t + t)``."""
    seq_len: int | None = None
    """Token count of the static shift (released config: 4096)."""
    base_shift: float = 0.5
    """v1 shift ``mu`` at 256 tokens."""
    max_shift: float = 1.15
    """v1 shift ``mu`` at 4096 tokens."""
    time_shift_v2_half_scaling_factor: float = 60.0
    """v2: ``m = sqrt(tokens) / (2 * this)``."""
    extra: Mapping[str, Any] = field(default_factory=dict, compare=True)
    """Keys this class does not model (``_class_name``, ``_diffusers_version``, ...), kept verbatim."""

    def __post_init__(self) -> None:
        def bad(key: str, value: Any, expected: str) -> ValueError:
            return ValueError(f"scheduler config key {key!r}: expected {expected}, got {value!r}")

        if self.time_shift_version not in _TIME_SHIFT_VERSIONS:
            raise bad("time_shift_version", self.time_shift_version, "one of 'v1', 'v2'")
        for key in ("do_shift", "dynamic_time_shift"):
            if not isinstance(getattr(self, key), bool):
                raise bad(key, getattr(self, key), "a boolean")
        if isinstance(self.num_train_timesteps, bool) or not isinstance(self.num_train_timesteps, int):
            raise bad("num_train_timesteps", self.num_train_timesteps, "a positive integer")
        if self.num_train_timesteps <= 0:
            raise bad("num_train_timesteps", self.num_train_timesteps, "a positive integer")
        if self.seq_len is not None and (isinstance(self.seq_len, bool) or not isinstance(self.seq_len, int)):
            raise bad("seq_len", self.seq_len, "an integer or null")
        for key in ("base_shift", "max_shift", "time_shift_v2_half_scaling_factor"):
            value = getattr(self, key)
            if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
                raise bad(key, value, "a finite number")
        if self.time_shift_v2_half_scaling_factor <= 0:
            raise bad("time_shift_v2_half_scaling_factor", self.time_shift_v2_half_scaling_factor, "> 0")
        object.__setattr__(self, "extra", dict(self.extra))

    @classmethod
    def known_keys(cls) -> tuple[str, ...]:
        return tuple(f.name for f in fields(cls) if f.name != "extra")

    @classmethod
    def released(cls) -> BooguScheduleConfig:
        """The released Base/Edit checkpoints' config: static v1 with ``seq_len`` 4096 (``mu = 1.15``)."""
        return cls(do_shift=True, dynamic_time_shift=False, time_shift_version="v1", seq_len=4096)

    @classmethod
    def from_dict(cls, mapping: Mapping[str, Any]) -> BooguScheduleConfig:
        """Build from a ``scheduler_config.json`` mapping; unknown keys go to ``extra`` unchanged."""
        if not isinstance(mapping, Mapping):
            raise TypeError(f"scheduler config: expected a mapping, got {type(mapping).__name__}")
        known = set(cls.known_keys())
        kwargs = {k: v for k, v in mapping.items() if k in known}
        extra = {k: v for k, v in mapping.items() if k not in known}
        if "extra" in mapping:
            raise ValueError("scheduler config: the key 'extra' is reserved")
        return cls(**kwargs, extra=extra)

    @classmethod
    def from_json(cls, path: str | os.PathLike[str]) -> BooguScheduleConfig:
        """Read a ``scheduler_config.json`` as raw JSON (never through a diffusers config round trip)."""
        try:
            with open(path, encoding="utf-8") as f:
                data = json.load(f)
        except json.JSONDecodeError as e:
            raise ValueError(f"{os.fspath(path)}: not valid JSON ({e})") from e
        try:
            return cls.from_dict(data)
        except (ValueError, TypeError) as e:
            raise ValueError(f"{os.fspath(path)}: {e}") from e

    def to_dict(self) -> dict[str, Any]:
        """Every key: the modelled ones with their values, then the unknown ones verbatim."""
        out: dict[str, Any] = {k: getattr(self, k) for k in self.known_keys()}
        out.update(self.extra)
        return out

    def to_json(self, path: str | os.PathLike[str]) -> None:
        with open(path, "w", encoding="utf-8") as f:
            json.dump(self.to_dict(), f, indent=2, sort_keys=True)
            f.write("\n")


def _lin(x: float, base_shift: float, max_shift: float) -> float:
    # The line through (256, base_shift) and (4096, max_shift), evaluated as upstream does.
    m = (max_shift - base_shift) / (4096 - 256)
    b = base_shift - m * 256
    return m * x + b


def _shift_v1(t: torch.Tensor, mu: float) -> torch.Tensor:
    # SD3/Flux exponential shift applied to sigma = 1 - t, in float32 like upstream's numpy code
    # (Python floats are weak scalars there, so every operation rounds to float32). Divisions are
    # written tensor / tensor: torch's ``scalar / tensor`` goes through reciprocal and can differ by an ulp.
    one = torch.ones_like(t)
    t1 = torch.clamp(1.0 - t, min=1e-8, max=1.0 - 1e-8)  # the upper bound rounds to 1.0f, as upstream
    num = torch.full_like(t, math.exp(mu))
    denom = num + (one / t1 - 1.0)
    return 1.0 - num / denom


def _shift_v2(t: torch.Tensor, m: float) -> torch.Tensor:
    return t / (m - m * t + t)


def boogu_timesteps(
    config: BooguScheduleConfig, num_inference_steps: int, num_tokens: int | None = None
) -> torch.Tensor:
    """Upstream's ``_timesteps``: N ascending Boogu times from 0, then a trailing 1.0; (N+1,) float32.

    ``num_tokens`` is the latent area ``h_lat * w_lat`` (latent pixels, not 2x2 patches), as the
    pipeline passes it. A static config ignores it; a dynamic one requires it (upstream silently
    skips the shift without it, which would make rollout and training schedules drift apart).
    """
    if isinstance(num_inference_steps, bool) or not isinstance(num_inference_steps, int):
        raise TypeError(f"num_inference_steps: expected an int, got {num_inference_steps!r}")
    if num_inference_steps < 1:
        raise ValueError(f"num_inference_steps: expected >= 1, got {num_inference_steps}")
    n = num_inference_steps
    # numpy's linspace(0, 1, n+1, dtype=float32): float64 arange * step, last = stop, then cast.
    t64 = torch.arange(n + 1, dtype=torch.float64) * (1.0 / n)
    t64[-1] = 1.0
    t = t64.to(torch.float32)[:-1]

    if config.do_shift:
        version = config.time_shift_version
        if config.dynamic_time_shift:
            if num_tokens is None:
                raise ValueError(
                    "boogu_timesteps: the config has dynamic_time_shift=true, so num_tokens "
                    "(latent height * latent width) is required"
                )
            if num_tokens <= 0:
                raise ValueError(f"boogu_timesteps: num_tokens must be > 0, got {num_tokens}")
            if version == "v1":
                t = _shift_v1(t, _lin(max(1, int(num_tokens) // 4), config.base_shift, config.max_shift))
            else:
                m = math.sqrt(num_tokens) / (2.0 * config.time_shift_v2_half_scaling_factor)
                t = _shift_v2(t, m)
        elif config.seq_len is not None and config.seq_len > 0:
            if version == "v1":
                t = _shift_v1(t, _lin(int(config.seq_len), config.base_shift, config.max_shift))
            else:
                m = math.sqrt(config.seq_len) / (2.0 * config.time_shift_v2_half_scaling_factor)
                t = _shift_v2(t, m)
        # static with no seq_len: upstream applies no shift; so do we (the config says so explicitly).
    return torch.cat([t.to(torch.float32), torch.ones(1, dtype=torch.float32)])


def boogu_sigmas(
    config: BooguScheduleConfig, num_inference_steps: int, num_tokens: int | None = None
) -> torch.Tensor:
    """The N+1 descending float32 sigmas (``sigmas[0] == 1``, ``sigmas[-1] == 0``) of a Boogu schedule.

    ``sigmas[i] = 1 - t_i`` for upstream's N times, and a final 0. For the released static-v1 config
    and N = 10: ``[1.0, 0.966, 0.9266, 0.8805, 0.8257, 0.7595, 0.678, 0.5751, 0.4412, 0.2598, 0]``.
    The SDE step consumes these directly: there is no second shift anywhere downstream.
    """
    t = boogu_timesteps(config, num_inference_steps, num_tokens)
    sigmas = 1.0 - t
    sigmas[-1] = 0.0
    return sigmas


def boogu_time(sigma: torch.Tensor | float) -> torch.Tensor | float:
    """Boogu time for a noise level: ``t = 1 - sigma`` (what the transformer receives as ``timestep``)."""
    return 1.0 - sigma


def sigma_from_time(t: torch.Tensor | float) -> torch.Tensor | float:
    """Inverse of :func:`boogu_time`: ``sigma = 1 - t``."""
    return 1.0 - t


def to_sde_velocity(boogu_velocity: torch.Tensor) -> torch.Tensor:
    """Boogu's ``x0 - eps`` to the SDE convention ``eps - x0``. Apply exactly once, after CFG."""
    return -boogu_velocity
