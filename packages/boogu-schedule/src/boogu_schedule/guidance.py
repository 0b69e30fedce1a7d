"""Classifier-free guidance on Boogu velocities (``x0 - eps``), before the single negation.

Upstream Boogu (``pipeline_boogu.py``) combines its per-condition predictions with plain linear
extrapolation, no renormalisation (unlike Qwen-Image's ``true_cfg``). The combination is linear,
so applying it before or after the negation gives the same result; the rule here is: combine Boogu
velocities, then negate once with :func:`boogu_schedule.to_sde_velocity`.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Literal

import torch

DEFAULT_GUIDANCE_SCALE = 4.0
"""Upstream's default ``text_guidance_scale``."""


def uses_cfg(guidance_scale: float) -> bool:
    """Whether text CFG is on at ``guidance_scale``: every scale but 1 needs the negative forward.

    The one predicate for "CFG is on": both rollout engines (whether to encode negatives and run the
    negative forward), the training recomputation, the forward counts, the memory plan and the config
    checks ask it, so none can disagree about ``g = 1``.
    """
    return guidance_scale != 1.0


def text_cfg(v_pos: torch.Tensor, v_neg: torch.Tensor | None, guidance_scale: float) -> torch.Tensor:
    """Text CFG: ``v_pos + (g - 1) * (v_pos - v_neg)``.

    ``guidance_scale == 1`` returns ``v_pos`` unchanged and accepts ``v_neg=None``: callers skip the
    negative forward in that case, which halves the rollout cost.
    """
    if not uses_cfg(guidance_scale):
        return v_pos
    if v_neg is None:
        raise ValueError(f"text_cfg: guidance_scale={guidance_scale} needs a negative prediction, got None")
    if v_neg.shape != v_pos.shape:
        raise ValueError(f"text_cfg: v_pos {tuple(v_pos.shape)} and v_neg {tuple(v_neg.shape)} differ")
    return v_pos + (guidance_scale - 1.0) * (v_pos - v_neg)


def image_guidance(
    v_cond: torch.Tensor, v_drop_image: torch.Tensor, image_guidance_scale: float
) -> torch.Tensor:
    """Edit-mode image guidance alone: ``cond + (ig - 1) * (cond - drop_image)``.

    ``drop_image`` is the prediction with the instruction kept and the reference latents removed
    (upstream's TI2I branch with ``text_guidance_scale <= 1 < image_guidance_scale``).
    """
    if image_guidance_scale == 1.0:
        return v_cond
    return v_cond + (image_guidance_scale - 1.0) * (v_cond - v_drop_image)


def double_guidance(
    v_cond: torch.Tensor,
    v_drop_text: torch.Tensor,
    v_drop_all: torch.Tensor,
    text_guidance_scale: float,
    image_guidance_scale: float,
) -> torch.Tensor:
    """Upstream's TI2I double guidance (``tg > 1`` and ``ig > 1``).

    ``cond + (tg - 1) * (cond - drop_text) + (ig - 1) * (drop_text - drop_all)``, where
    ``drop_text`` keeps the reference latents with the negative instruction and ``drop_all`` removes
    both (docs/upstream-model.md §9.7). Upstream's optional empty-instruction term is not modelled.
    """
    return (
        v_cond
        + (text_guidance_scale - 1.0) * (v_cond - v_drop_text)
        + (image_guidance_scale - 1.0) * (v_drop_text - v_drop_all)
    )


GuidanceBranch = Literal["cond", "drop_text", "drop_image", "drop_all"]
"""One forward of a guided step, named as upstream names its predictions: ``cond`` (the instruction,
the references kept), ``drop_text`` (the negative instruction, the references kept), ``drop_image``
(the instruction, no references) and ``drop_all`` (the negative instruction, no references). Without
references ``drop_text`` is upstream's T2I ``uncond``."""

BRANCH_INPUTS: dict[str, tuple[bool, bool]] = {
    "cond": (True, True),
    "drop_text": (False, True),
    "drop_image": (True, False),
    "drop_all": (False, False),
}
"""Per branch: (takes the positive instruction, keeps the reference latents)."""


def guidance_branches(
    guidance_scale: float, image_guidance_scale: float = 1.0, *, edit: bool
) -> tuple[GuidanceBranch, ...]:
    """The forwards one guided step runs, in upstream's order (``pipeline_boogu.py``'s loop).

    The one rule for "which forwards": both rollout engines, the training recomputation, the
    forward counts and the memory plan ask it. ``edit``: the batch has reference latents. Image
    guidance is an Edit-only term; without references upstream forces ``image_guidance_scale`` to 1,
    and so does this. The scales are the ones a request validates (>= 1), so "on" is ``!= 1`` as
    for text CFG (:func:`uses_cfg`).
    """
    text = uses_cfg(guidance_scale)
    image = edit and uses_cfg(image_guidance_scale)
    if text and image:
        return ("cond", "drop_text", "drop_all")
    if image:
        return ("cond", "drop_image")
    if text:
        return ("cond", "drop_text")
    return ("cond",)


def combine_guidance(
    predictions: Sequence[torch.Tensor],
    guidance_scale: float,
    image_guidance_scale: float = 1.0,
    *,
    edit: bool,
) -> torch.Tensor:
    """Combine the predictions of :func:`guidance_branches` (same order) into the guided velocity:
    the conditional one, :func:`text_cfg`, :func:`image_guidance` or :func:`double_guidance`, as
    upstream's branches do (there in the model dtype; callers here pass float32, the rule of this
    package)."""
    branches = guidance_branches(guidance_scale, image_guidance_scale, edit=edit)
    if len(predictions) != len(branches):
        raise ValueError(
            f"combine_guidance: {len(predictions)} predictions for the branches {branches} "
            f"(guidance_scale={guidance_scale}, image_guidance_scale={image_guidance_scale}, edit={edit})"
        )
    v = dict(zip(branches, predictions, strict=True))
    for name, value in v.items():
        if value.shape != v["cond"].shape:
            raise ValueError(
                f"combine_guidance: {name} {tuple(value.shape)} and cond {tuple(v['cond'].shape)} differ"
            )
    if "drop_all" in v:
        return double_guidance(v["cond"], v["drop_text"], v["drop_all"], guidance_scale, image_guidance_scale)
    if "drop_image" in v:
        return image_guidance(v["cond"], v["drop_image"], image_guidance_scale)
    if "drop_text" in v:
        return text_cfg(v["cond"], v["drop_text"], guidance_scale)
    return v["cond"]
