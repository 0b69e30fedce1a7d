"""The windowed denoising loop both rollout engines run: one implementation, two transformers.

A rollout engine supplies a velocity function (its transformer, its CFG) and this module does the
rest exactly one way: per-group random streams, the SDE window per group, float32 initial noise,
Euler steps outside the window, SDE steps with log-probabilities inside it, and the window's
latents, means, stds and log-probs. The in-process engine (``boogu_adapters.engines``) and the
vllm-omni pipeline (``packages/boogu-vllm``) both call :func:`sample_windowed`, so same weights and
seeds give the same trajectory whichever engine rolled it out.

Order of draws from a group's generator (a second engine must follow it to reproduce the first):

1. the group's reference-image latent (edit rows): one int64 from the group's generator seeds a CPU
   generator for the VAE posterior draw (:func:`reference_generator`), so it is device-independent,
2. the group's SDE window (:func:`draw_windows`),
3. the group's initial noise (:func:`initial_noise`),
4. at each window step, the group's SDE noise, in row order.

The loop makes no device-to-host read: which rows are inside their window at step i, and how many
noise draws each group makes, are derived on the host from the window plan before the first step.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from boogu_schedule.hot import per_iteration
from boogu_schedule.schedule import to_sde_velocity
from boogu_schedule.sde import Sampler, SdeStep, sde_step
from boogu_schedule.seeding import derive_seed, make_generator
from boogu_schedule.window import SdeWindow, WindowPlan, WindowScope

__all__ = [
    "MAX_OUTPUT_PIXELS",
    "OUTPUT_SIZE_MULTIPLE",
    "VelocityFn",
    "WindowSteps",
    "WindowedSamples",
    "dedupe",
    "draw_windows",
    "group_generators",
    "host_tensor",
    "initial_noise",
    "output_size",
    "reference_generator",
    "sample_windowed",
    "sde_transition",
]

VelocityFn = Callable[[torch.Tensor, torch.Tensor, int], torch.Tensor]
"""``(x (B, C, h, w) float32, sigma (B,), step i) -> v_boogu (B, C, h, w)``: the model's Boogu
velocity ``x0 - eps`` after CFG and before the one negation (which :func:`sample_windowed` does)."""


MAX_OUTPUT_PIXELS = 2048 * 2048
"""Upstream's output-area cap (``max_input_image_pixels``)."""
OUTPUT_SIZE_MULTIPLE = 16
"""Output sides are multiples of this (the VAE's 8 times the transformer's 2x2 patches)."""


def output_size(
    height: int,
    width: int,
    reference_sizes: Iterable[tuple[int, int]] = (),
    *,
    max_pixels: int = MAX_OUTPUT_PIXELS,
) -> tuple[int, int]:
    """The (height, width) in pixels a request generates at: the one output-size rule of both engines.

    With edit rows (``reference_sizes``: each reference's preprocessed pixel size) the output is
    their size, which all of a request's references must share (upstream's ``align_res=True``; the
    requested size is ignored). Otherwise the requested size, scaled down by area to ``max_pixels``
    and floored to multiples of 16 (upstream's T2I ``_resolve_output_and_original_size``; a size
    that passes ``boogu_adapters.types.check_output_size`` comes back unchanged).
    """
    sizes = {(int(h), int(w)) for h, w in reference_sizes}
    if len(sizes) > 1:
        raise ValueError(f"edit rows of one request must share a reference size, got {sorted(sizes)}")
    if sizes:
        return sizes.pop()
    if height <= 0 or width <= 0:
        raise ValueError(f"output size must be positive, got {height}x{width}")
    ratio = min((max_pixels / (height * width)) ** 0.5, 1.0)
    m = OUTPUT_SIZE_MULTIPLE
    new_height, new_width = int(height * ratio) // m * m, int(width * ratio) // m * m
    if new_height == 0 or new_width == 0:
        raise ValueError(f"a {height}x{width} output is smaller than {m} px on a side after scaling")
    return new_height, new_width


def sde_transition(
    sampler: Sampler | str,
    sample: torch.Tensor,
    v_boogu: torch.Tensor,
    sigma: torch.Tensor | float,
    sigma_next: torch.Tensor | float,
    noise_level: float,
    generator: torch.Generator | None = None,
    prev_sample: torch.Tensor | None = None,
    *,
    noise: torch.Tensor | None = None,
) -> SdeStep:
    """One step ``sigma -> sigma_next`` from a Boogu velocity ``x0 - eps`` (after CFG): the one
    negation (``to_sde_velocity``), then ``sampler``'s step (:func:`boogu_schedule.sde.sde_step`).

    The one transition both sides compose: the rollout loop (:func:`sample_windowed`, both engines)
    and the training recomputation (``boogu_adapters.step.transition``, ``prev_sample=`` the stored
    next latent), so the log-prob the trainer recomputes is the rollout's by construction.
    """
    velocity = to_sde_velocity(v_boogu)  # negate once, after CFG: Boogu's x0 - eps -> eps - x0
    return sde_step(
        sampler, sample, velocity, sigma, sigma_next, noise_level, generator, prev_sample, noise=noise
    )


def host_tensor(
    values: Sequence[int] | Sequence[bool], device: torch.device, dtype=torch.long
) -> torch.Tensor:
    """A tensor of host values on ``device`` without a blocking copy (pinned + non_blocking on CUDA).

    ``torch.tensor(values, device="cuda")`` waits for the GPU's queue to drain; this does not.
    """
    tensor = torch.tensor(list(values), dtype=dtype)
    if torch.device(device).type == "cuda":
        return tensor.pin_memory().to(device, non_blocking=True)
    return tensor.to(device)


def dedupe(values: Sequence[Any]) -> tuple[list[Any], list[int]]:
    """Unique values in first-seen order, and each input's index into them: how both engines pick
    the prompts (and references) they encode once per request, in one batch, in this order."""
    unique: list[Any] = []
    where: dict[Any, int] = {}
    index = []
    for v in values:
        if v not in where:
            where[v] = len(unique)
            unique.append(v)
        index.append(where[v])
    return unique, index


def group_generators(
    seed: int, group_offset: int, num_groups: int, device: torch.device | str
) -> tuple[list[torch.Generator], torch.Generator]:
    """One generator per group, seeded from ``(seed, group_offset + g)``, plus one for the batch (key -1).

    Each group's initial noise, window and SDE noise come from its own stream, so a group's
    trajectory does not depend on which other groups share its request (or its rank).
    """

    def make(key: int) -> torch.Generator:
        return make_generator(derive_seed(seed, key), device)

    return [make(group_offset + g) for g in range(num_groups)], make(-1)


def reference_generator(group_gen: torch.Generator) -> torch.Generator:
    """The CPU generator a group's reference-image posterior is sampled with: seeded by one int64
    drawn from the group's own generator, so the same request gives the same reference latents on
    any device and in any engine."""
    seed = int(torch.randint(0, 2**62, (1,), generator=group_gen, device=group_gen.device).item())
    return make_generator(seed, "cpu")


def draw_windows(
    plan: WindowPlan,
    num_steps: int,
    noise_level: float,
    iteration: int,
    group_gens: Sequence[torch.Generator],
    batch_gen: torch.Generator,
    group_size: int,
) -> list[SdeWindow]:
    """Per sample (group-major) its SDE window, drawn from the stream ``plan.scope`` names."""

    def one(gen: torch.Generator) -> SdeWindow:
        return plan.one(num_steps, noise_level, gen, iteration)

    if plan.scope is WindowScope.BATCH:
        return [one(batch_gen)] * (len(group_gens) * group_size)
    if plan.scope is WindowScope.GROUP:
        return [w for gen in group_gens for w in [one(gen)] * group_size]
    return [one(gen) for gen in group_gens for _ in range(group_size)]


def initial_noise(
    group_gens: Sequence[torch.Generator], group_size: int, shape: Sequence[int], device: torch.device
) -> torch.Tensor:
    """``(G * n, *shape)`` float32 noise, each group's n samples from its own generator (the float32
    trajectory rule: the running latent is float32 from the first draw)."""
    return torch.cat(
        [torch.randn(group_size, *shape, generator=g, dtype=torch.float32, device=device) for g in group_gens]
    )


class WindowSteps:
    """Per denoising step, the rows inside their SDE window, as device index tensors built up front.

    ``inside[i]`` is ``(rows, k)`` (rows inside their window at step i, ascending, and each row's
    window position) or None; ``entering[i]`` the rows whose window starts at step i, or None;
    ``draws[i]`` the ``(group, count)`` noise draws of step i in row order; ``step_index`` the
    ``(B, W)`` denoising step of each window position. All of it is derived on the host from the
    window starts with one host-to-device copy.
    """

    def __init__(self, starts: list[int], width: int, steps: int, group_of: list[int], device: torch.device):
        self.inside: list[tuple[torch.Tensor, torch.Tensor] | None] = []
        self.entering: list[torch.Tensor | None] = []
        self.draws: list[list[tuple[int, int]]] = []
        self.any_outside: list[bool] = []
        flat: list[int] = []
        spans: list[tuple[str, int, int, int]] = []  # (kind, step, offset, length)
        for i in range(steps):
            rows = [b for b, s in enumerate(starts) if s <= i < s + width]
            entering = [b for b, s in enumerate(starts) if s == i]
            self.any_outside.append(len(rows) < len(starts))
            draws: list[tuple[int, int]] = []
            for b in rows:
                if draws and draws[-1][0] == group_of[b]:
                    draws[-1] = (group_of[b], draws[-1][1] + 1)
                else:
                    draws.append((group_of[b], 1))
            self.draws.append(draws)
            for kind, values in (("rows", rows), ("k", [i - starts[b] for b in rows]), ("enter", entering)):
                spans.append((kind, i, len(flat), len(values)))
                flat.extend(values)
        for s in starts:
            flat.extend(range(s, s + width))  # step_index, row-major (B, W)
        everything = host_tensor(flat, device)  # one host-to-device copy for the whole plan
        by_step: dict[tuple[str, int], torch.Tensor | None] = {
            (kind, i): everything[off : off + length] if length else None for kind, i, off, length in spans
        }
        for i in range(steps):
            rows = by_step[("rows", i)]
            self.inside.append(None if rows is None else (rows, by_step[("k", i)]))
            self.entering.append(by_step[("enter", i)])
        self.step_index = everything[len(flat) - len(starts) * width :].reshape(len(starts), width)


@dataclass(frozen=True)
class WindowedSamples:
    """What :func:`sample_windowed` returns (all float32 but ``step_index``)."""

    latents: torch.Tensor
    """(B, W+1, C, h, w): the window's entry state, then each window step's output."""
    step_index: torch.Tensor
    """(B, W) int64: the denoising step of each window position."""
    log_prob: torch.Tensor
    """(B, W): log-density of each window transition."""
    mean: torch.Tensor
    """(B, W, C, h, w): each window transition's mean."""
    std: torch.Tensor
    """(B, W): each window transition's total std."""
    final: torch.Tensor
    """(B, C, h, w): the last step's output."""


@per_iteration
def sample_windowed(
    velocity: VelocityFn,
    x: torch.Tensor,
    sigmas: torch.Tensor,
    windows: Sequence[SdeWindow],
    group_gens: Sequence[torch.Generator],
    group_size: int,
    sampler: Sampler,
    noise_level: float,
    on_step: Callable[[int, int], None] | None = None,
) -> WindowedSamples:
    """Run the N-step denoising loop from ``x`` (float32 initial noise) with SDE windows.

    Rows are group-major (``group_size`` rows per generator of ``group_gens``). ``velocity`` gives
    Boogu velocities after CFG; :func:`sde_transition` negates them once. Every row takes a
    deterministic Euler step; rows inside their window are overwritten by the SDE step, whose noise
    each group draws from its own generator, in row order.
    """
    if x.dtype != torch.float32:
        raise TypeError(f"sample_windowed: the initial latent must be float32, got {x.dtype}")
    batch, steps = x.shape[0], sigmas.numel() - 1
    sizes = {win.size for win in windows}
    if len(windows) != batch or len(sizes) != 1:
        raise ValueError(
            f"sample_windowed: need one window per row and one window size, got {len(windows)} windows "
            f"for {batch} rows with sizes {sorted(sizes)}"
        )
    width = sizes.pop()
    if len(group_gens) * group_size != batch:
        raise ValueError(f"sample_windowed: {len(group_gens)} groups x {group_size} != {batch} rows")
    device = x.device
    group_of = [g for g in range(len(group_gens)) for _ in range(group_size)]
    plan = WindowSteps([win.start for win in windows], width, steps, group_of, device)
    shape = tuple(x.shape[1:])
    latents = x.new_zeros(batch, width + 1, *shape)
    means = x.new_zeros(batch, width, *shape)
    log_probs = x.new_zeros(batch, width)
    stds = x.new_zeros(batch, width)
    for i in range(steps):
        sigma = sigmas[i].expand(batch).contiguous()
        sigma_next = sigmas[i + 1].expand(batch).contiguous()
        v = velocity(x, sigma, i)  # Boogu velocity after CFG; sde_transition negates it
        entering = plan.entering[i]
        if entering is not None:
            latents[entering, 0] = x[entering]  # the window's entry state, before its first step
        # Deterministic Euler steps for every row (elementwise, so a row's value does not depend on
        # the others); the rows inside their window are then overwritten by the SDE step.
        if plan.any_outside[i]:
            x_next = sde_transition(Sampler.ODE, x, v, sigma, sigma_next, 0.0).prev_sample
        else:
            x_next = torch.empty_like(x)
        inside = plan.inside[i]
        if inside is not None:
            rows, k = inside
            noise = torch.cat(
                [
                    torch.randn(count, *shape, generator=group_gens[g], device=device)
                    for g, count in plan.draws[i]
                ]
            )
            step = sde_transition(
                sampler, x[rows], v[rows], sigma[rows], sigma_next[rows], noise_level, noise=noise
            )
            x_next[rows] = step.prev_sample
            latents[rows, k + 1] = step.prev_sample
            means[rows, k] = step.mean
            log_probs[rows, k] = step.log_prob
            stds[rows, k] = step.std.flatten()
        x = x_next
        if on_step is not None:
            on_step(i, steps)
    return WindowedSamples(latents, plan.step_index, log_probs, means, stds, x)
