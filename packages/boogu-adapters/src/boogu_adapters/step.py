"""The one per-step function that the rollout and the training adapter both call.

Rollout and training must compute the same numbers for the same weights, or the importance ratio
is not 1 on-policy and the clip fires on noise. Both compose the same two functions: the local
rollout's loop (``boogu_schedule.sampling.sample_windowed``) calls :func:`boogu_velocity` and then
``boogu_schedule.sampling.sde_transition`` per step; the training recomputation calls
:func:`transition`, which is exactly those two:

1. the transformer gets the latent in its own dtype and Boogu time ``t = 1 - sigma``;
2. text CFG combines the Boogu velocities (``x0 - eps``) in float32 (:func:`boogu_velocity`);
3. the result is negated exactly once (``eps - x0``) and
4. ``boogu_schedule.sde_step`` runs in float32 on the float32 latent (3 and 4: ``sde_transition``).
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Literal

import torch

from boogu_adapters.model.transformer import InstructionCache
from boogu_adapters.types import Conditioning
from boogu_schedule import (
    Sampler,
    SdeStep,
    boogu_time,
    combine_guidance,
    guidance_branches,
    uses_cfg,
)
from boogu_schedule.guidance import BRANCH_INPUTS, GuidanceBranch
from boogu_schedule.hot import per_iteration
from boogu_schedule.sampling import sde_transition

CfgMode = Literal["batched", "sequential"]


def model_dtype(module: torch.nn.Module) -> torch.dtype:
    for p in module.parameters():
        return p.dtype
    return torch.float32


def pad_features(hidden: torch.Tensor, mask: torch.Tensor, length: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Right-pad (B, L, D) features and their (B, L) mask with zeros to ``length`` tokens."""
    extra = length - hidden.shape[1]
    if extra < 0:
        raise ValueError(f"pad_features: cannot pad {hidden.shape[1]} tokens down to {length}")
    if extra == 0:
        return hidden, mask
    hidden = torch.cat([hidden, hidden.new_zeros(hidden.shape[0], extra, hidden.shape[2])], dim=1)
    mask = torch.cat([mask, mask.new_zeros(mask.shape[0], extra)], dim=1)
    return hidden, mask


def _ref_inputs(refs: Sequence[torch.Tensor | None] | None, dtype: torch.dtype) -> list | None:
    # Upstream's ``ref_image_hidden_states``: per sample, a list of (C, h, w) latents or None.
    if refs is None or all(r is None for r in refs):
        return None
    return [None if r is None else [r.to(dtype)] for r in refs]


@functools.cache
def _takes_keyword(cls: type, name: str) -> bool:
    """Whether ``cls.forward`` accepts the keyword ``name``: ``instruction_lengths`` and
    ``instruction_cache`` are our port's (upstream's class has neither)."""
    return name in inspect.signature(cls.forward).parameters


def _forward(transformer, x, t, hidden, mask, refs, freqs_cis, lengths=None, cache=None) -> torch.Tensor:
    extra = {}
    if lengths is not None and _takes_keyword(type(transformer), "instruction_lengths"):
        extra["instruction_lengths"] = lengths  # the model then never reads the mask back to the host
    if cache is not None and _takes_keyword(type(transformer), "instruction_cache"):
        extra["instruction_cache"] = cache
    out = transformer(x, t, hidden, freqs_cis, mask, ref_image_hidden_states=refs, return_dict=False, **extra)
    if isinstance(out, tuple):  # canonical classes that return tuples
        out = out[0]
    return getattr(out, "sample", out)


Branches = tuple[GuidanceBranch, ...]
"""The guidance branches one transformer call takes (`boogu_schedule.guidance_branches`): one of
them, or several stacked along the batch (batched CFG: in that order, each right-padded to the
longest instruction)."""


@dataclass(frozen=True)
class _ForwardInputs:
    """The transformer's conditioning inputs for one forward (see :func:`_branch_inputs`)."""

    hidden: torch.Tensor
    mask: torch.Tensor
    refs: list | None
    lengths: tuple[int, ...] | None


def _branch_inputs(
    cond: Conditioning, branches: Branches, dtype: torch.dtype, refs: list | None
) -> _ForwardInputs:
    """The inputs of ``branches``; ``refs`` (``_ref_inputs`` of ``cond``) is shared by all of them.

    ``drop_text`` keeps the reference latents (upstream's text-only TI2I guidance); ``drop_image``
    and ``drop_all`` take none (upstream's image guidance).
    """
    parts = []
    for branch in branches:
        positive, keeps_refs = BRANCH_INPUTS[branch]
        if positive:
            hidden, mask, lengths = cond.hidden_states.to(dtype), cond.attention_mask, cond.lengths
        else:
            assert cond.negative_hidden_states is not None and cond.negative_attention_mask is not None
            hidden, mask = cond.negative_hidden_states.to(dtype), cond.negative_attention_mask
            lengths = cond.negative_lengths
        parts.append((hidden, mask, lengths, refs if keeps_refs else None))
    if len(parts) == 1:
        hidden, mask, lengths, branch_refs = parts[0]
        return _ForwardInputs(hidden, mask, branch_refs, lengths)
    length = max(p[0].shape[1] for p in parts)
    padded = [pad_features(p[0], p[1], length) for p in parts]
    rows = cond.batch_size
    stacked_refs = [r for p in parts for r in (p[3] if p[3] is not None else [None] * rows)]
    return _ForwardInputs(
        torch.cat([h for h, _ in padded]),
        torch.cat([m for _, m in padded]),
        None if all(r is None for r in stacked_refs) else stacked_refs,
        None if any(p[2] is None for p in parts) else tuple(n for p in parts for n in p[2]),
    )


class RolloutTextCache:
    """What the denoising steps of one rollout share: per micro-batch and branch, the transformer's
    conditioning inputs built from the rollout's `Conditioning` (the CFG concatenation, the dtype
    casts) and the transformer's `InstructionCache` over them.

    Passed to :func:`boogu_velocity` (``text_cache``) at every step of one rollout, it hands the
    transformer the same feature tensors each step, so our port runs the caption embedder and the
    context refiner once per rollout instead of once per step (the text path sees neither the
    timestep nor the latents). Results are bitwise those without it: the inputs are built by the
    same code from the same tensors, and the port reuses its text path only while the features and
    its weights are unchanged (`InstructionCache`). One cache serves one conditioning, without
    autograd (a rollout); the training recomputation never takes one.
    """

    def __init__(self) -> None:
        self.cond: Conditioning | None = None
        self._parts: dict[tuple[Any, ...], tuple[Conditioning, list | None]] = {}
        self._entries: dict[tuple[Any, ...], tuple[_ForwardInputs, InstructionCache]] = {}

    def entry(
        self, cond: Conditioning, rows: tuple[int, int] | None, branch: Branches, dtype: torch.dtype
    ) -> tuple[_ForwardInputs, InstructionCache]:
        """The inputs of the branches ``branch`` for the rows ``rows`` (None: all) of ``cond``, and the
        `InstructionCache` of the forwards that take them; built on first use."""
        if self.cond is None:
            self.cond = cond
        elif cond is not self.cond:
            raise ValueError(
                "a RolloutTextCache serves the steps of one rollout: it was given another conditioning"
            )
        hit = self._entries.get((rows, branch, dtype))
        if hit is None:
            part = self._parts.get((rows, dtype))
            if part is None:  # the rows and their reference inputs, one list for every branch
                rows_cond = cond if rows is None else cond.slice(*rows)
                part = self._parts[(rows, dtype)] = (rows_cond, _ref_inputs(rows_cond.ref_latents, dtype))
            inputs = _branch_inputs(part[0], branch, dtype, part[1])
            hit = self._entries[(rows, branch, dtype)] = (inputs, InstructionCache())
        return hit


@per_iteration
def boogu_velocity(
    transformer: torch.nn.Module,
    latents: torch.Tensor,
    sigma: torch.Tensor,
    cond: Conditioning,
    guidance_scale: float,
    freqs_cis: Sequence[torch.Tensor],
    *,
    cfg_mode: CfgMode = "batched",
    micro_batch_size: int = 0,
    text_cache: RolloutTextCache | None = None,
    image_guidance_scale: float = 1.0,
) -> torch.Tensor:
    """Guided Boogu velocity ``x0 - eps`` as float32, before negation.

    Args:
        latents: (B, C, h, w) float32 running latent.
        sigma: (B,) float32 noise levels; the transformer receives ``t = 1 - sigma``.
        cfg_mode: ``"batched"`` runs the guidance branches in one forward of (branches x B) samples
            (equal to the sequential result within float tolerance, faster); ``"sequential"`` runs
            one forward per branch.
        micro_batch_size: at most this many latents per transformer call (consecutive rows;
            0 = all). Without gradients only (a RuntimeError under autograd): a training step splits
            its rows itself, so that each micro-batch's activations are freed by its own backward.
        text_cache: one :class:`RolloutTextCache` for every step of a rollout over ``cond`` (without
            autograd): the text path then runs once per rollout; None builds everything per call.
        image_guidance_scale: upstream's Edit image guidance (1: off; no effect without reference
            latents). The branches and their combination are `boogu_schedule.guidance_branches` /
            `combine_guidance`: with text CFG too, upstream's double guidance (three forwards).
    """
    if latents.dtype != torch.float32 or sigma.dtype != torch.float32:
        raise TypeError(
            f"boogu_velocity: latents and sigma must be float32, got {latents.dtype}, {sigma.dtype}"
        )
    batch = latents.shape[0]
    if 0 < micro_batch_size < batch and torch.is_grad_enabled():
        raise RuntimeError(
            f"boogu_velocity: micro_batch_size={micro_batch_size} is for forwards without gradients "
            "(torch.no_grad or inference_mode); a training step splits its rows itself, so that each "
            "micro-batch's backward frees its activations"
        )
    if uses_cfg(guidance_scale) and cond.negative_hidden_states is None:
        raise ValueError(
            f"guidance_scale={guidance_scale} needs negative prompt features; the conditioning has none"
        )
    if image_guidance_scale < 1.0:
        raise ValueError(f"image_guidance_scale must be >= 1, got {image_guidance_scale}")
    # One set of branches for every micro-batch: whether the whole batch edits, as upstream's task type.
    branches = guidance_branches(guidance_scale, image_guidance_scale, edit=cond.is_edit)
    if len(branches) > 1 and cfg_mode not in ("batched", "sequential"):
        raise ValueError(f"cfg_mode must be 'batched' or 'sequential', got {cfg_mode!r}")
    guidance = (guidance_scale, image_guidance_scale, cond.is_edit)
    if 0 < micro_batch_size < batch:
        return torch.cat(
            [
                _velocity(
                    transformer,
                    latents[i : i + micro_batch_size],
                    sigma[i : i + micro_batch_size],
                    cond,
                    (i, min(i + micro_batch_size, batch)),
                    branches,
                    guidance,
                    freqs_cis,
                    cfg_mode,
                    text_cache,
                )
                for i in range(0, batch, micro_batch_size)
            ]
        )
    return _velocity(
        transformer, latents, sigma, cond, None, branches, guidance, freqs_cis, cfg_mode, text_cache
    )


def _velocity(
    transformer: torch.nn.Module,
    latents: torch.Tensor,
    sigma: torch.Tensor,
    cond: Conditioning,
    rows: tuple[int, int] | None,
    branches: Branches,
    guidance: tuple[float, float, bool],
    freqs_cis: Sequence[torch.Tensor],
    cfg_mode: CfgMode,
    text_cache: RolloutTextCache | None,
) -> torch.Tensor:
    """`boogu_velocity` of the rows ``rows`` of ``cond`` (None: all of them); ``guidance``: the text
    and image scales and whether the batch edits, ``branches`` their `guidance_branches`."""
    dtype = model_dtype(transformer)
    x = latents.to(dtype)
    t = boogu_time(sigma).to(dtype)  # (B,) Boogu time: 0 = noise, 1 = data

    if text_cache is None:
        part = cond if rows is None else cond.slice(*rows)
        refs = _ref_inputs(part.ref_latents, dtype)  # one list for every branch

    def forward(call: Branches, x: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
        if text_cache is None:
            inputs, cache = _branch_inputs(part, call, dtype, refs), None
        else:
            inputs, cache = text_cache.entry(cond, rows, call, dtype)
        return _forward(
            transformer, x, t, inputs.hidden, inputs.mask, inputs.refs, freqs_cis, inputs.lengths, cache
        )

    if len(branches) == 1:
        return forward(branches, x, t).float()
    if cfg_mode == "batched":
        k = len(branches)
        predictions = forward(branches, x.repeat(k, 1, 1, 1), t.repeat(k)).float().chunk(k)
    else:
        predictions = tuple(forward((branch,), x, t).float() for branch in branches)
    scale, image_scale, edit = guidance
    return combine_guidance(predictions, scale, image_scale, edit=edit)


def transition(
    transformer: torch.nn.Module,
    latents: torch.Tensor,
    sigma: torch.Tensor,
    sigma_next: torch.Tensor,
    cond: Conditioning,
    *,
    guidance_scale: float,
    freqs_cis: Sequence[torch.Tensor],
    sampler: Sampler | str,
    noise_level: float,
    generator: torch.Generator | None = None,
    prev_sample: torch.Tensor | None = None,
    cfg_mode: CfgMode = "batched",
    image_guidance_scale: float = 1.0,
) -> SdeStep:
    """One denoising step ``sigma -> sigma_next`` (both (B,) float32) through the model and the SDE."""
    v_boogu = boogu_velocity(
        transformer,
        latents,
        sigma,
        cond,
        guidance_scale,
        freqs_cis,
        cfg_mode=cfg_mode,
        image_guidance_scale=image_guidance_scale,
    )
    # The rollout loop's own transition (negation + step), so the recomputed log-prob is the rollout's.
    return sde_transition(sampler, latents, v_boogu, sigma, sigma_next, noise_level, generator, prev_sample)


def forwards_per_step(
    batch_size: int, guidance_scale: float, image_guidance_scale: float = 1.0, *, edit: bool = False
) -> int:
    """Transformer sample-forwards one step costs: one per guidance branch (`guidance_branches`)."""
    return batch_size * len(guidance_branches(guidance_scale, image_guidance_scale, edit=edit))
