"""Shared helpers of the rollout and trainer benchmarks: models, a forward clock, profiling, tables.

The clock measures the wall time spent *inside* model calls by wrapping the modules themselves
(forward pre/post hooks, or a wrapper around a method such as ``vae.decode``), so it does not rely
on the engine's or the trainer's own timers; the benchmarks print both side by side.
"""

from __future__ import annotations

import cProfile
import dataclasses
import io
import json
import os
import pstats
import time
from collections import defaultdict
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch

# Benchmarks never reach a model hub (the tiny checkpoint is built locally).
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

MID_SIZE_OVERRIDES: dict[str, Any] = {
    "hidden_size": 256,
    "num_layers": 8,  # 4 double-stream + 4 single-stream blocks
    "num_double_stream_layers": 4,
    # TINY_CONFIG keeps 4 heads (2 kv heads): head dim 64 at hidden 256, so the RoPE axes must sum
    # to 64; the tiny config's (4, 6, 6) scaled by 4.
    "axes_dim_rope": (16, 24, 24),
}
"""The benchmark's mid-size random transformer: TINY_CONFIG with these overrides (~23 M parameters)."""


# ----------------------------------------------------------------------------------------------
# Models


def tiny_checkpoint(path: str | None, tmp: str) -> Path:
    """The tiny random checkpoint at ``path`` (built there if missing), or a fresh one under ``tmp``."""
    from boogu_tiny.checkpoints import ensure_tiny_checkpoint

    return ensure_tiny_checkpoint(Path(path).expanduser() if path else Path(tmp) / "Boogu-Image")


def load_tiny_parts(path: Path, device: str = "cpu"):
    from boogu_adapters.loading import load_boogu

    return load_boogu(path, transformer="native", device=device)


def mid_size_config(parts) -> dict[str, Any]:
    from boogu_adapters.model import TINY_CONFIG

    text_width = parts.text_encoder.config.text_config.hidden_size
    features = {**TINY_CONFIG["instruction_feature_configs"], "instruction_feat_dim": text_width}
    return {**TINY_CONFIG, **MID_SIZE_OVERRIDES, "instruction_feature_configs": features}


def with_mid_size_transformer(parts, *, seed: int = 0):
    """``parts`` (the tiny checkpoint's encoder, VAE, processor, scheduler) with a randomised
    mid-size transformer in place of the tiny one."""
    from boogu_adapters.model import BooguImageTransformer2DModel, randomize_parameters

    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = BooguImageTransformer2DModel(**mid_size_config(parts))
    randomize_parameters(model, seed)
    device = next(parts.transformer.parameters()).device
    return dataclasses.replace(parts, transformer=model.to(device).eval())


def count_parameters(module: torch.nn.Module) -> int:
    return sum(p.numel() for p in module.parameters())


# ----------------------------------------------------------------------------------------------
# The clock


class ForwardClock:
    """Wall time and call counts inside chosen model calls, split by category and by phase.

    ``watch_module`` times a module's forward with pre/post hooks; ``wrap`` times any callable (a
    bound method such as ``vae.decode``, ``Tensor.backward``, a reward function). Only the
    outermost timed call counts, so nested watched calls are never counted twice. ``phase`` (set
    with :meth:`in_phase`) labels where in the caller's code a call happened. On CUDA every timed
    region synchronises before and after, so the time is the kernels', not the launch's.
    """

    def __init__(self, device: torch.device | str = "cpu"):
        self.device = torch.device(device)
        self.seconds: dict[tuple[str, str], float] = defaultdict(float)
        self.calls: dict[tuple[str, str], int] = defaultdict(int)
        self.rows: dict[tuple[str, str], int] = defaultdict(int)
        self.phase = "-"
        self.phase_wall: dict[str, float] = defaultdict(float)
        self.phase_calls: dict[str, int] = defaultdict(int)
        # (phase, category active around the call, label) -> seconds, for functions timed inside models.
        self.sub_seconds: dict[tuple[str, str, str], float] = defaultdict(float)
        self._active: str | None = None
        self._t0 = 0.0
        self._handles: list[Any] = []
        # With --profile: a cProfile.Profile that is paused inside timed model calls, so that it
        # profiles only the code outside the models.
        self.profiler: cProfile.Profile | None = None
        self._restore: list[Callable[[], None]] = []

    # -- timing core ---------------------------------------------------------------------------
    def _sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def _start(self, category: str, rows: int) -> bool:
        if self._active is not None:
            return False
        if self.profiler is not None:
            self.profiler.disable()
        self._sync()
        self._active = category
        key = (self.phase, category)
        self.calls[key] += 1
        self.rows[key] += rows
        self._t0 = time.perf_counter()
        return True

    def _stop(self, category: str) -> None:
        if self._active != category:
            return
        self._sync()
        self.seconds[(self.phase, category)] += time.perf_counter() - self._t0
        self._active = None
        if self.profiler is not None:
            self.profiler.enable()

    # -- instrumentation -----------------------------------------------------------------------
    def watch_module(self, category: str, module: torch.nn.Module, rows: Callable[..., int] | None = None):
        """Time ``module``'s forward; ``rows(args, kwargs)`` counts the samples of a call."""
        started: list[bool] = []

        def pre(_module, args, kwargs):
            started.append(self._start(category, rows(args, kwargs) if rows else 0))

        def post(_module, args, kwargs, output):
            if started.pop():
                self._stop(category)

        self._handles.append(module.register_forward_pre_hook(pre, with_kwargs=True))
        self._handles.append(module.register_forward_hook(post, with_kwargs=True, always_call=True))

    def wrap(self, category: str, fn: Callable, rows: Callable[..., int] | None = None) -> Callable:
        """``fn`` timed under ``category``."""

        def timed(*args, **kwargs):
            mine = self._start(category, rows(args, kwargs) if rows else 0)
            try:
                return fn(*args, **kwargs)
            finally:
                if mine:
                    self._stop(category)

        timed.__wrapped__ = fn  # type: ignore[attr-defined]
        return timed

    def wrap_attribute(self, category: str, owner: Any, name: str, rows=None) -> None:
        """Replace ``owner.name`` by a timed version (undone by :meth:`remove`)."""
        original = getattr(owner, name)
        had_own = name in vars(owner) if hasattr(owner, "__dict__") else False
        setattr(owner, name, self.wrap(category, original, rows))

        def restore() -> None:
            if had_own:
                setattr(owner, name, original)
            else:
                delattr(owner, name)

        self._restore.append(restore)

    def wrap_inner(self, label: str, owner: Any, name: str) -> None:
        """Time calls of ``owner.name`` made inside the timed model calls, as a breakdown of them.

        They are attributed to the category running at the time and never stop or start the main
        clock. No CUDA synchronisation here: on a GPU these are launch times, so use it on CPU.
        """
        original = getattr(owner, name)

        def timed(*args, **kwargs):
            t0 = time.perf_counter()
            try:
                return original(*args, **kwargs)
            finally:
                self.sub_seconds[(self.phase, self._active or "-", label)] += time.perf_counter() - t0

        setattr(owner, name, timed)
        self._restore.append(lambda: setattr(owner, name, original))

    def remove(self) -> None:
        for handle in self._handles:
            handle.remove()
        for restore in reversed(self._restore):
            restore()
        self._handles.clear()
        self._restore.clear()

    @contextmanager
    def in_phase(self, phase: str) -> Iterator[None]:
        previous, self.phase = self.phase, phase
        try:
            yield
        finally:
            self.phase = previous

    def phased(self, phase: str, fn: Callable) -> Callable:
        """``fn`` run in ``phase``; its wall time adds to ``phase_wall[phase]``."""

        def run(*args, **kwargs):
            with self.in_phase(phase):
                self._sync()
                t0 = time.perf_counter()
                try:
                    return fn(*args, **kwargs)
                finally:
                    self._sync()
                    self.phase_wall[phase] += time.perf_counter() - t0
                    self.phase_calls[phase] += 1

        run.__wrapped__ = fn  # type: ignore[attr-defined]
        return run

    # -- reading -------------------------------------------------------------------------------
    def reset(self) -> None:
        for table in (
            self.seconds,
            self.calls,
            self.rows,
            self.phase_wall,
            self.phase_calls,
            self.sub_seconds,
        ):
            table.clear()

    def inner_total(self, category: str, label: str, phase: str | None = None) -> float:
        return sum(
            v
            for (p, c, lab), v in self.sub_seconds.items()
            if c == category and lab == label and (phase is None or p == phase)
        )

    def total(self, category: str | None = None, phase: str | None = None, field: str = "seconds") -> float:
        table = getattr(self, field)
        return sum(
            v
            for (p, c), v in table.items()
            if (category is None or c == category) and (phase is None or p == phase)
        )


def transformer_rows(args, kwargs) -> int:
    x = args[0] if args else kwargs.get("hidden_states")
    return int(x.shape[0]) if isinstance(x, torch.Tensor) else len(x)


def encoder_rows(args, kwargs) -> int:
    ids = kwargs.get("input_ids", args[0] if args else None)
    return int(ids.shape[0]) if isinstance(ids, torch.Tensor) else 0


def vae_rows(args, kwargs) -> int:
    z = args[0] if args else next(iter(kwargs.values()))
    return int(z.shape[0]) if isinstance(z, torch.Tensor) else 0


def watch_pipeline(clock: ForwardClock, parts, transformer: torch.nn.Module | None = None) -> None:
    """Time the transformer, the text encoder and the VAE (encode and decode) of a pipeline."""
    clock.watch_module(
        "transformer", transformer if transformer is not None else parts.transformer, transformer_rows
    )
    clock.watch_module("encoder", parts.text_encoder, encoder_rows)
    # The codec calls vae.decode / vae.encode (not vae.forward): wrap those methods.
    clock.wrap_attribute("vae", parts.vae, "decode", vae_rows)
    clock.wrap_attribute("vae", parts.vae, "encode", vae_rows)


def watch_transformer_internals(clock: ForwardClock) -> None:
    """Break the transformer forward down: RoPE (``apply_rotary``) and SDPA calls."""
    from boogu_adapters.model import attention

    clock.wrap_inner("rope", attention, "apply_rotary")
    clock.wrap_inner("sdpa", attention.F, "scaled_dot_product_attention")


@contextmanager
def timed_backward(clock: ForwardClock, category: str = "backward") -> Iterator[None]:
    """Time every ``Tensor.backward()`` call (the trainer's ``loss.backward()``) under ``category``."""
    original = torch.Tensor.backward
    torch.Tensor.backward = clock.wrap(category, original)  # type: ignore[method-assign]
    try:
        yield
    finally:
        torch.Tensor.backward = original  # type: ignore[method-assign]


# ----------------------------------------------------------------------------------------------
# Profiling and output


@contextmanager
def maybe_profile(
    enabled: bool, clock: ForwardClock | None = None, top: int = 30
) -> Iterator[dict[str, Any]]:
    """Run the body under cProfile when ``enabled``; the printed report lands in the yielded dict.

    With a ``clock`` the profiler is paused inside every timed model call (transformer, encoder,
    VAE, backward, reward), so the report shows only the code *outside* the models: the
    non-model time, by function. Functions that span a model call (the loop bodies) show up in
    fragments, so read ``tottime`` (own time), not ``cumtime``.
    """
    out: dict[str, Any] = {}
    if not enabled:
        yield out
        return
    profiler = cProfile.Profile()
    if clock is not None:
        clock.profiler = profiler
    profiler.enable()
    try:
        yield out
    finally:
        profiler.disable()
        if clock is not None:
            clock.profiler = None
        stream = io.StringIO()
        stats = pstats.Stats(profiler, stream=stream)
        where = "outside the timed model calls" if clock is not None else "everything"
        stream.write(f"== cProfile ({where}): top functions by own time (tottime) ==\n")
        stats.sort_stats("tottime").print_stats(top)
        stream.write(f"== cProfile ({where}): workspace code (boogu_*) by own time ==\n")
        stats.sort_stats("tottime").print_stats(r"boogu_", top)
        out["report"] = stream.getvalue()


def share(part: float, whole: float) -> float:
    return part / whole if whole > 0 else float("nan")


def rounded(value: Any, digits: int = 4) -> Any:
    if isinstance(value, float):
        return round(value, digits)
    if isinstance(value, Mapping):
        return {k: rounded(v, digits) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [rounded(v, digits) for v in value]
    return value


def write_json(path: str | None, figures: Mapping[str, Any]) -> None:
    if path:
        Path(path).write_text(json.dumps(rounded(figures), indent=2) + "\n")
        print(f"figures written to {path}")


def write_json_atomic(path: str | None, figures: Mapping[str, Any]) -> None:
    """Write ``figures`` (as they are, unrounded) to ``path`` through a temporary file and a rename:
    a run killed mid-write leaves the previous complete file, never half of one. For scripts that
    rewrite their JSON after every case (``gpu_path.py``, ``gpu_scale.py``)."""
    if not path:
        return
    from boogu_data.atomic import atomic_write_text

    atomic_write_text(Path(path), json.dumps(figures, indent=2))


def environment() -> dict[str, Any]:
    import platform

    return {
        "torch": torch.__version__,
        "threads": torch.get_num_threads(),
        "omp_wait_policy": os.environ.get("OMP_WAIT_POLICY", "(default)"),
        "cpus": os.cpu_count(),
        "load_avg_1min": os.getloadavg()[0] if hasattr(os, "getloadavg") else None,
        "python": platform.python_version(),
        "date": time.strftime("%Y-%m-%d"),
    }


def table(rows: list[tuple[str, ...]], header: tuple[str, ...]) -> str:
    widths = [max(len(str(r[i])) for r in [header, *rows]) for i in range(len(header))]
    fmt = "  ".join(f"{{:<{w}}}" if i == 0 else f"{{:>{w}}}" for i, w in enumerate(widths))
    lines = [fmt.format(*header), fmt.format(*("-" * w for w in widths))]
    lines += [fmt.format(*map(str, r)) for r in rows]
    return "\n".join(lines)
