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
from typing import Literal

import torch

from boogu_adapters.types import Conditioning
from boogu_schedule import Sampler, SdeStep, boogu_time, text_cfg, uses_cfg
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
def _takes_lengths(cls: type) -> bool:
    """Whether ``cls.forward`` accepts host-side ``instruction_lengths`` (our port does; upstream's does not)."""
    return "instruction_lengths" in inspect.signature(cls.forward).parameters


def _forward(transformer, x, t, hidden, mask, refs, freqs_cis, lengths=None) -> torch.Tensor:
    extra = {}
    if lengths is not None and _takes_lengths(type(transformer)):
        extra["instruction_lengths"] = lengths  # the model then never reads the mask back to the host
    out = transformer(x, t, hidden, freqs_cis, mask, ref_image_hidden_states=refs, return_dict=False, **extra)
    if isinstance(out, tuple):  # canonical classes that return tuples
        out = out[0]
    return getattr(out, "sample", out)


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
) -> torch.Tensor:
    """Guided Boogu velocity ``x0 - eps`` as float32, before negation.

    Args:
        latents: (B, C, h, w) float32 running latent.
        sigma: (B,) float32 noise levels; the transformer receives ``t = 1 - sigma``.
        cfg_mode: ``"batched"`` runs positive and negative in one forward of 2B samples (equal to the
            sequential result within float tolerance, faster); ``"sequential"`` runs two forwards.
        micro_batch_size: at most this many latents per transformer call (consecutive rows;
            0 = all). Without gradients only (a RuntimeError under autograd): a training step splits
            its rows itself, so that each micro-batch's activations are freed by its own backward.
    """
    if latents.dtype != torch.float32 or sigma.dtype != torch.float32:
        raise TypeError(
            f"boogu_velocity: latents and sigma must be float32, got {latents.dtype}, {sigma.dtype}"
        )
    batch = latents.shape[0]
    if 0 < micro_batch_size < batch:
        if torch.is_grad_enabled():
            raise RuntimeError(
                f"boogu_velocity: micro_batch_size={micro_batch_size} is for forwards without gradients "
                "(torch.no_grad or inference_mode); a training step splits its rows itself, so that each "
                "micro-batch's backward frees its activations"
            )
        return torch.cat(
            [
                boogu_velocity(
                    transformer,
                    latents[i : i + micro_batch_size],
                    sigma[i : i + micro_batch_size],
                    cond.slice(i, i + micro_batch_size),
                    guidance_scale,
                    freqs_cis,
                    cfg_mode=cfg_mode,
                )
                for i in range(0, batch, micro_batch_size)
            ]
        )
    dtype = model_dtype(transformer)
    x = latents.to(dtype)
    t = boogu_time(sigma).to(dtype)  # (B,) Boogu time: 0 = noise, 1 = data
    hidden = cond.hidden_states.to(dtype)
    refs = _ref_inputs(cond.ref_latents, dtype)
    use_cfg = uses_cfg(guidance_scale)
    if use_cfg and cond.negative_hidden_states is None:
        raise ValueError(
            f"guidance_scale={guidance_scale} needs negative prompt features; the conditioning has none"
        )

    lengths, neg_lengths = cond.lengths, cond.negative_lengths
    if not use_cfg:
        v_pos = _forward(transformer, x, t, hidden, cond.attention_mask, refs, freqs_cis, lengths)
        return v_pos.float()

    neg_hidden = cond.negative_hidden_states.to(dtype)
    neg_mask = cond.negative_attention_mask
    # Edit: the negative branch keeps the reference latents (upstream's text-only TI2I guidance).
    if cfg_mode == "batched":
        length = max(hidden.shape[1], neg_hidden.shape[1])
        h_pos, m_pos = pad_features(hidden, cond.attention_mask, length)
        h_neg, m_neg = pad_features(neg_hidden, neg_mask, length)
        both = _forward(
            transformer,
            torch.cat([x, x]),
            torch.cat([t, t]),
            torch.cat([h_pos, h_neg]),
            torch.cat([m_pos, m_neg]),
            None if refs is None else refs + refs,
            freqs_cis,
            None if lengths is None or neg_lengths is None else lengths + neg_lengths,
        )
        v_pos, v_neg = both.float().chunk(2)
    elif cfg_mode == "sequential":
        v_pos = _forward(transformer, x, t, hidden, cond.attention_mask, refs, freqs_cis, lengths).float()
        v_neg = _forward(transformer, x, t, neg_hidden, neg_mask, refs, freqs_cis, neg_lengths).float()
    else:
        raise ValueError(f"cfg_mode must be 'batched' or 'sequential', got {cfg_mode!r}")
    return text_cfg(v_pos, v_neg, guidance_scale)


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
) -> SdeStep:
    """One denoising step ``sigma -> sigma_next`` (both (B,) float32) through the model and the SDE."""
    v_boogu = boogu_velocity(transformer, latents, sigma, cond, guidance_scale, freqs_cis, cfg_mode=cfg_mode)
    # The rollout loop's own transition (negation + step), so the recomputed log-prob is the rollout's.
    return sde_transition(sampler, latents, v_boogu, sigma, sigma_next, noise_level, generator, prev_sample)


def forwards_per_step(batch_size: int, guidance_scale: float) -> int:
    """Transformer sample-forwards one step costs."""
    return batch_size * (2 if uses_cfg(guidance_scale) else 1)
