"""``scene_edit_exact`` / ``scene_edit_dense``: the verifier of the scene edit pairs (boogu-data), as
rewards. An edit is right when the instruction was carried out *and* nothing else changed; the
clauses and how the images are read are the tiny organism's verifier, `boogu_tiny.verify`; this
module gives it the reward interface (the batch check, ``on_error``, the registry's option check).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from boogu_data import PromptRecord
from boogu_tiny.verify import VerifyError, edit_clauses, referent, score_edits
from boogu_trainer.rewards.base import OnError, RewardError, check_batch, check_on_error
from boogu_trainer.rewards.registry import register_reward

__all__ = ["SceneEditReward", "edit_clauses", "referent", "scene_edit_dense", "scene_edit_exact"]


def _check_options(options: dict) -> None:
    for name, low, high in (
        ("tolerance", 0.0, 0.5),
        ("min_move", 0.0, 0.5),
        ("colour_threshold", 0.0, 442.0),
        ("min_area", 0.0, 0.5),
    ):
        if name in options:
            value = options[name]
            if isinstance(value, bool) or not isinstance(value, int | float) or not low < value < high:
                raise ValueError(
                    f"scene edit reward: {name} must be a number in ({low}, {high}), got {value!r}"
                )
    if "on_error" in options:
        check_on_error(options["on_error"], "scene_edit")


class SceneEditReward:
    """The edit verifier (module docstring); ``dense`` picks the score.

    Options: ``tolerance`` (how far an object may sit from where it should, a fraction of the side,
    default 0.06: 4 pixels at 64²), ``min_move`` (default 0.125: half of a move's quarter side),
    ``colour_threshold`` and ``min_area`` (the scene reader's), ``on_error`` (``"raise"``: an
    instruction outside the grammar or a reference without its referent is a `RewardError`;
    ``"nan"``: it scores NaN).
    """

    def __init__(
        self,
        name: str,
        dense: bool,
        tolerance: float = 0.06,
        min_move: float = 0.125,
        colour_threshold: float = 120.0,
        min_area: float = 0.004,
        on_error: OnError = "raise",
    ) -> None:
        _check_options(
            {
                "tolerance": tolerance,
                "min_move": min_move,
                "colour_threshold": colour_threshold,
                "min_area": min_area,
            }
        )
        self.name = name
        self.dense = dense
        self.pass_fail = not dense  # scores are verdicts in {0, 1} (RewardFn)
        self.tolerance = float(tolerance)
        self.min_move = float(min_move)
        self.colour_threshold = float(colour_threshold)
        self.min_area = float(min_area)
        self.on_error = check_on_error(on_error, name)

    def __call__(self, images: torch.Tensor, records: Sequence[PromptRecord]) -> torch.Tensor:
        check_batch(images, records, self.name)
        try:
            return score_edits(
                images,
                records,
                dense=self.dense,
                tolerance=self.tolerance,
                min_move=self.min_move,
                colour_threshold=self.colour_threshold,
                min_area=self.min_area,
                on_error=self.on_error,
            )
        except VerifyError as error:
            raise RewardError(f"reward {self.name!r}, {error}") from None


@register_reward("scene_edit_exact", check=_check_options)
def scene_edit_exact(
    tolerance: float = 0.06,
    min_move: float = 0.125,
    colour_threshold: float = 120.0,
    min_area: float = 0.004,
    on_error: OnError = "raise",
) -> SceneEditReward:
    """Correctness of a scene edit (boogu_data.scene_edits): 1.0 when the instruction was carried out
    on the reference image's named object and every other object stayed (colour, shape, place) with
    nothing added, else 0.0. Reads the instruction and the record's reference image. Range: {0, 1}."""
    return SceneEditReward(
        "scene_edit_exact", False, tolerance, min_move, colour_threshold, min_area, on_error
    )


@register_reward("scene_edit_dense", check=_check_options)
def scene_edit_dense(
    tolerance: float = 0.06,
    min_move: float = 0.125,
    colour_threshold: float = 120.0,
    min_area: float = 0.004,
    on_error: OnError = "raise",
) -> SceneEditReward:
    """Partial credit on a scene edit: the fraction of its clauses that hold (the instruction, each
    other object kept in place, the object count). Range: [0, 1]; 1 exactly when scene_edit_exact is 1."""
    return SceneEditReward(
        "scene_edit_dense", True, tolerance, min_move, colour_threshold, min_area, on_error
    )
