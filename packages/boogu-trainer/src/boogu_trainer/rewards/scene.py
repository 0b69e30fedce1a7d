"""``scene_exact`` / ``scene_dense`` / ``scene_graded``: the GenEval-style verifier of the procedural
scenes of boogu-data, as rewards. The verifier itself (how an image is read, the clauses, the graded
score and how it follows flow_grpo's GenEval reward, its measured accuracy and cost) is the tiny
organism's, `boogu_tiny.verify`; this module gives it the reward interface (the batch check,
``on_error``, the registry's option check).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, get_args

import torch

from boogu_data import PromptRecord
from boogu_tiny.verify import (
    MAX_PER_SHAPE,
    DetectedObject,
    SceneScore,
    VerifyError,
    detect_objects,
    graded_terms,
    scene_clauses,
    score_scenes,
)
from boogu_trainer.rewards.base import OnError, RewardError, check_batch, check_on_error
from boogu_trainer.rewards.registry import register_reward

__all__ = [
    "MAX_PER_SHAPE",
    "DetectedObject",
    "SceneReward",
    "SceneScore",
    "detect_objects",
    "graded_terms",
    "scene_clauses",
    "scene_dense",
    "scene_exact",
    "scene_graded",
]


def _check_options(options: Mapping[str, Any]) -> None:
    """The option values `SceneReward` takes (the registry's cheap check, run when a config loads)."""
    for name, low, high in (("colour_threshold", 0.0, 442.0), ("min_area", 0.0, 0.5), ("margin", 0.0, 0.5)):
        if name in options:
            value = options[name]
            if isinstance(value, bool) or not isinstance(value, int | float) or not low < value < high:
                raise ValueError(f"scene reward: {name} must be a number in ({low}, {high}), got {value!r}")
    if "on_error" in options:
        check_on_error(options["on_error"], "scene")


class SceneReward:
    """GenEval-style verifier of procedural scenes (module docstring); ``score`` picks the score.

    Options: ``colour_threshold`` (RGB distance, default 120), ``min_area`` (fraction of the image,
    default 0.004: 16 pixels at 64²), ``margin`` (fraction of the side a relation needs, default
    0.05), ``on_error`` (``"raise"``: a prompt outside the grammar is a `RewardError`; ``"nan"``:
    it scores NaN).
    """

    def __init__(
        self,
        name: str,
        score: SceneScore,
        colour_threshold: float = 120.0,
        min_area: float = 0.004,
        margin: float = 0.05,
        on_error: OnError = "raise",
    ) -> None:
        if score not in get_args(SceneScore):
            raise ValueError(
                f"scene reward {name!r}: score must be one of {get_args(SceneScore)}, got {score!r}"
            )
        _check_options({"colour_threshold": colour_threshold, "min_area": min_area, "margin": margin})
        self.name = name
        self.score = score
        self.pass_fail = score == "exact"  # scores are verdicts in {0, 1} (RewardFn)
        self.colour_threshold = float(colour_threshold)
        self.min_area = float(min_area)
        self.margin = float(margin)
        self.on_error = check_on_error(on_error, name)

    def __call__(self, images: torch.Tensor, records: Sequence[PromptRecord]) -> torch.Tensor:
        check_batch(images, records, self.name)
        try:
            return score_scenes(
                images,
                records,
                self.score,
                colour_threshold=self.colour_threshold,
                min_area=self.min_area,
                margin=self.margin,
                on_error=self.on_error,
            )
        except VerifyError as error:
            raise RewardError(f"reward {self.name!r}, {error}") from None


_OPTIONS_DOC = """
    Options: ``colour_threshold`` (default 120, RGB distance), ``min_area`` (default 0.004 of the
    image), ``margin`` (default 0.05 of the side), ``on_error`` (``"raise"`` or ``"nan"`` for a
    prompt outside the scene grammar). Cost: ~40 ms for 64 images at 64² (numpy)."""


@register_reward("scene_exact", check=_check_options)
def scene_exact(
    colour_threshold: float = 120.0,
    min_area: float = 0.004,
    margin: float = 0.05,
    on_error: OnError = "raise",
) -> SceneReward:
    """GenEval-style correctness of a procedural scene (boogu_data.scenes): 1.0 when the image shows
    exactly the objects its caption names (colour, shape, count) in the named relation, else 0.0.
    Range: {0, 1}."""
    return SceneReward("scene_exact", "exact", colour_threshold, min_area, margin, on_error)


@register_reward("scene_dense", check=_check_options)
def scene_dense(
    colour_threshold: float = 120.0,
    min_area: float = 0.004,
    margin: float = 0.05,
    on_error: OnError = "raise",
) -> SceneReward:
    """Partial credit on a procedural scene (boogu_data.scenes): the fraction of the caption's clauses
    (per phrase: shape present, colour present, exact count; the number of objects; the relation)
    that the image satisfies. Range: [0, 1]; 1 exactly when ``scene_exact`` is 1."""
    return SceneReward("scene_dense", "dense", colour_threshold, min_area, margin, on_error)


@register_reward("scene_graded", check=_check_options)
def scene_graded(
    colour_threshold: float = 120.0,
    min_area: float = 0.004,
    margin: float = 0.05,
    on_error: OnError = "raise",
) -> SceneReward:
    """GenEval's graded training reward (flow_grpo's GenEval recipe, computed as its reward server
    does) on a procedural scene (boogu_data.scenes): the mean of, per shape the caption names,
    ``1 - |k - n| / k`` for the count and the share of the right colours, plus the relation's term.
    Objects of shapes the caption does not name are not read. Range: [-7, 1] (below 0 only when a
    named shape is drawn more than twice as often as asked); 1 whenever ``scene_exact`` is 1."""
    return SceneReward("scene_graded", "graded", colour_threshold, min_area, margin, on_error)


scene_exact.__doc__ = (scene_exact.__doc__ or "") + _OPTIONS_DOC
scene_dense.__doc__ = (scene_dense.__doc__ or "") + _OPTIONS_DOC
scene_graded.__doc__ = (scene_graded.__doc__ or "") + _OPTIONS_DOC
