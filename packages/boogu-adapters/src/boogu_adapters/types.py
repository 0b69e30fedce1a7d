"""What flows between the rollout engine, the rewards and the trainer.

Shapes use ``B`` for samples in a request (prompts x group size, group-major), ``W`` for the window
size, ``N`` for denoising steps, ``C, h, w`` for latent channels and size, ``L`` for prompt tokens.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Literal

import torch

from boogu_data import PromptRecord
from boogu_schedule import Sampler, WindowPlan
from boogu_schedule.sampling import MAX_OUTPUT_PIXELS, OUTPUT_SIZE_MULTIPLE, host_tensor


class OutputSizeError(ValueError):
    """An output size Boogu cannot produce; ``field`` is ``"height"``, ``"width"`` or ``"height*width"``."""

    def __init__(self, field: str, message: str):
        super().__init__(message)
        self.field = field


def check_output_size(height: int, width: int) -> None:
    """The sizes a config or request may ask for: both sides positive multiples of 16, area at most
    2048^2, exactly the fixed points of ``boogu_schedule.sampling.output_size`` (the size generated)."""
    for name, value in (("height", height), ("width", width)):
        if value < OUTPUT_SIZE_MULTIPLE or value % OUTPUT_SIZE_MULTIPLE:
            raise OutputSizeError(name, f"{name} must be a positive multiple of 16, got {value}")
    if height * width > MAX_OUTPUT_PIXELS:
        raise OutputSizeError("height*width", f"{height}x{width} exceeds the 2048^2 pixel cap")


@dataclass(frozen=True)
class RolloutRequest:
    """One batch of prompts to roll out, ``group_size`` samples each."""

    records: Sequence[PromptRecord]
    """The prompts (with reference images for edit rows)."""
    group_size: int = 4
    """n: samples per prompt; a group never spans requests."""
    num_steps: int = 10
    """N: denoising steps."""
    guidance_scale: float = 4.0
    """Text CFG scale; 1.0 skips the negative forward (half the rollout cost)."""
    image_guidance_scale: float = 1.0
    """Upstream's Edit image guidance (``boogu_schedule.guidance_branches``): on edit rows above 1
    it adds a forward without the reference latents (a third one with text CFG); ignored, as
    upstream ignores it, when no record has a reference image."""
    sampler: Sampler = Sampler.FLOW_SDE
    """Transition kernel inside the window."""
    noise_level: float = 0.7
    """eta inside the window (0 outside)."""
    window: WindowPlan = field(default_factory=lambda: WindowPlan(kind="random", size=2, window_range=(0, 5)))
    """How SDE windows are chosen (default: one per group, drawn from the request's seed)."""
    height: int = 1024
    """Output height in pixels (edit rows follow their reference image instead)."""
    width: int = 1024
    """Output width in pixels."""
    seed: int = 0
    """Seeds the initial noise, the windows, the SDE noise and reference-latent sampling."""
    group_offset: int = 0
    """Global index of this request's first group: group g draws from stream (seed, offset + g),
    so a group's samples do not depend on how groups are split over requests or ranks."""
    iteration: int = 0
    """Training step, for progressive windows."""
    decode: bool = True
    """Decode the final latents to uint8 images (rewards need them)."""

    def __post_init__(self) -> None:
        object.__setattr__(self, "sampler", Sampler(self.sampler))
        if self.group_size < 1:
            raise ValueError(f"RolloutRequest.group_size must be >= 1, got {self.group_size}")
        if self.num_steps < 1:
            raise ValueError(f"RolloutRequest.num_steps must be >= 1, got {self.num_steps}")
        if self.guidance_scale < 1.0:
            raise ValueError(f"RolloutRequest.guidance_scale must be >= 1, got {self.guidance_scale}")
        if self.image_guidance_scale < 1.0:
            raise ValueError(
                f"RolloutRequest.image_guidance_scale must be >= 1, got {self.image_guidance_scale}"
            )
        try:
            check_output_size(self.height, self.width)
        except OutputSizeError as error:
            raise ValueError(f"RolloutRequest.{error}") from None

    @property
    def batch_size(self) -> int:
        return len(self.records) * self.group_size


@dataclass(frozen=True)
class Conditioning:
    """Transformer inputs that stay fixed across the denoising steps of a batch.

    Prompt features are encoded once per unique prompt and gathered per sample by index, so a group
    of n samples shares one encoding.
    """

    hidden_states: torch.Tensor
    """(B, L, D) positive instruction features in the model dtype, right-padded."""
    attention_mask: torch.Tensor
    """(B, L) 1 for valid tokens, valid first."""
    negative_hidden_states: torch.Tensor | None = None
    """(B, L', D) negative features, or None when guidance is off."""
    negative_attention_mask: torch.Tensor | None = None
    """(B, L')."""
    ref_latents: tuple[torch.Tensor | None, ...] | None = None
    """Edit only: per sample, (C, h', w') scaled VAE latents of the reference image, or None."""
    lengths: tuple[int, ...] | None = None
    """Host copy of ``attention_mask.sum(1)`` (valid tokens per sample), so that forwards inside the
    denoising and training loops never read the mask back from the device; None: not known."""
    negative_lengths: tuple[int, ...] | None = None
    """Host copy of the negative mask's valid tokens per sample."""

    def __post_init__(self) -> None:
        b = self.hidden_states.shape[0]
        for name in ("lengths", "negative_lengths"):
            value = getattr(self, name)
            if value is not None and len(value) != b:
                raise ValueError(f"Conditioning: {len(value)} {name} for batch {b}")
        if self.attention_mask.shape[0] != b:
            raise ValueError("Conditioning: attention_mask batch differs from hidden_states")
        if (self.negative_hidden_states is None) != (self.negative_attention_mask is None):
            raise ValueError("Conditioning: negative features and mask must be given together")
        if self.ref_latents is not None:
            if len(self.ref_latents) != b:
                raise ValueError(f"Conditioning: {len(self.ref_latents)} reference entries for batch {b}")
            for i, ref in enumerate(self.ref_latents):
                if ref is not None and ref.dim() != 3:
                    raise ValueError(
                        f"Conditioning: reference latent {i} must be (C, h, w), got {tuple(ref.shape)}"
                    )

    @property
    def batch_size(self) -> int:
        return self.hidden_states.shape[0]

    @property
    def is_edit(self) -> bool:
        return self.ref_latents is not None and any(r is not None for r in self.ref_latents)

    def select(self, index: torch.Tensor | Sequence[int]) -> Conditioning:
        """The rows ``index`` (host indices: a mini-batch), sharing storage where possible."""
        rows = index.tolist() if isinstance(index, torch.Tensor) else [int(i) for i in index]
        if rows and rows == list(range(rows[0], rows[0] + len(rows))):
            return self.slice(rows[0], rows[0] + len(rows))  # contiguous: views, no copies
        idx = host_tensor(rows, self.hidden_states.device)
        neg = self.negative_hidden_states
        return Conditioning(
            hidden_states=self.hidden_states[idx],
            attention_mask=self.attention_mask[idx],
            negative_hidden_states=None if neg is None else neg[idx],
            negative_attention_mask=None if neg is None else self.negative_attention_mask[idx],
            ref_latents=None if self.ref_latents is None else tuple(self.ref_latents[i] for i in rows),
            lengths=None if self.lengths is None else tuple(self.lengths[i] for i in rows),
            negative_lengths=None
            if self.negative_lengths is None
            else tuple(self.negative_lengths[i] for i in rows),
        )

    def map_tensors(self, fn: Callable[[torch.Tensor], torch.Tensor]) -> Conditioning:
        """The same conditioning with ``fn`` applied to every tensor (host lengths kept)."""
        neg, neg_mask = self.negative_hidden_states, self.negative_attention_mask
        return dataclasses.replace(
            self,
            hidden_states=fn(self.hidden_states),
            attention_mask=fn(self.attention_mask),
            negative_hidden_states=None if neg is None else fn(neg),
            negative_attention_mask=None if neg_mask is None else fn(neg_mask),
            ref_latents=None
            if self.ref_latents is None
            else tuple(None if r is None else fn(r) for r in self.ref_latents),
        )

    def slice(self, start: int, stop: int) -> Conditioning:
        """Rows ``start:stop`` as views (a micro-batch)."""
        neg = self.negative_hidden_states
        return Conditioning(
            hidden_states=self.hidden_states[start:stop],
            attention_mask=self.attention_mask[start:stop],
            negative_hidden_states=None if neg is None else neg[start:stop],
            negative_attention_mask=None if neg is None else self.negative_attention_mask[start:stop],
            ref_latents=None if self.ref_latents is None else self.ref_latents[start:stop],
            lengths=None if self.lengths is None else self.lengths[start:stop],
            negative_lengths=None if self.negative_lengths is None else self.negative_lengths[start:stop],
        )


@dataclass(frozen=True)
class Trajectory:
    """A rolled-out batch: what training needs to recompute every window step exactly.

    The trajectory carries the step index and the schedule, never a float timestep to be matched
    again: step ``k`` of sample ``b`` goes ``sigmas[step_index[b, k]] -> sigmas[step_index[b, k] + 1]``
    from ``latents[b, k]`` to ``latents[b, k + 1]``.
    """

    latents: torch.Tensor
    """(B, W+1, C, h, w) float32: the window's entry state, then each window step's output."""
    step_index: torch.Tensor
    """(B, W) int64: the denoising step of each window position."""
    sigmas: torch.Tensor
    """(N+1,) float32: the schedule used (descending, last 0)."""
    log_prob: torch.Tensor
    """(B, W) float32: log-density of each window transition under the rollout policy."""
    mean: torch.Tensor
    """(B, W, C, h, w) float32: each window transition's mean."""
    std: torch.Tensor
    """(B, W) float32: each window transition's total std."""
    window: tuple[tuple[int, int], ...]
    """Per sample, the window ``(start, end)``."""
    group_id: torch.Tensor
    """(B,) int64: which prompt (group) of the request each sample belongs to."""
    conditioning: Conditioning
    """The prompt-embedding handles (and edit reference latents, sampled once and shipped)."""
    final_latents: torch.Tensor
    """(B, C, h, w) float32: the last step's output."""
    images: torch.Tensor | None
    """(B, 3, H, W) uint8, or None when the request did not decode."""
    nfe: int
    """Transformer sample-forwards spent on this batch (B * N times the guidance branches: 2 with
    text CFG, 3 with Edit double guidance)."""
    sampler: Sampler
    """The window's transition kernel."""
    noise_level: float
    """eta inside the window."""
    guidance_scale: float
    """The text CFG scale the rollout used (training must use the same)."""
    image_guidance_scale: float = 1.0
    """The image guidance scale the rollout used (training must use the same; 1: off)."""
    weights_version: int = 0
    """The engine's weights version when this batch was generated."""
    cfg_mode: Literal["batched", "sequential"] = "batched"
    """How positive and negative forwards were run (training repeats it, for bitwise log-probs)."""

    @property
    def batch_size(self) -> int:
        return self.latents.shape[0]

    @property
    def window_size(self) -> int:
        return self.step_index.shape[1]

    @property
    def nfe_per_image(self) -> float:
        return self.nfe / max(self.batch_size, 1)

    def map_tensors(self, fn: Callable[[torch.Tensor], torch.Tensor]) -> Trajectory:
        """The same batch with ``fn`` applied to every tensor but the images (uint8, on the host for
        the rewards): e.g. into pinned host memory while it waits (``rollout.pipeline=one_step``),
        then onto the trainer's device when it is trained on."""
        return dataclasses.replace(
            self,
            latents=fn(self.latents),
            step_index=fn(self.step_index),
            sigmas=fn(self.sigmas),
            log_prob=fn(self.log_prob),
            mean=fn(self.mean),
            std=fn(self.std),
            group_id=fn(self.group_id),
            conditioning=self.conditioning.map_tensors(fn),
            final_latents=fn(self.final_latents),
        )
