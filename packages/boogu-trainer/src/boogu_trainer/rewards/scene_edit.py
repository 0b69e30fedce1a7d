"""``scene_edit_exact`` / ``scene_edit_dense``: the verifier of the scene edit pairs (boogu-data).

An edit is right when the instruction was carried out *and* nothing else changed. The verifier
reads the instruction's text (`boogu_data.scene_edits.parse_instruction`) and the record's reference
image (``ref_image``: the scene before the edit), finds the objects of both images with the scene
verifier's reader (`boogu_trainer.rewards.scene.detect_objects`: palette segmentation, connected
components, shape), and checks the clauses:

* **the instruction** (one clause), against the reference's object of the named colour and shape
  (the referent; an instruction whose referent is missing from the reference, or not unique, is
  bad data: a `RewardError`, or NaN with ``on_error: nan``):
  - ``recolour``: an object of the new colour and the same shape within ``tolerance`` of the
    referent's centroid, and none of the old colour and shape left;
  - ``add``: one more object of the named colour and shape than the reference holds;
  - ``remove``: no object of the named colour and shape;
  - ``move``: an object of the named colour and shape whose centroid moved by more than
    ``min_move`` of the side in the named direction and by at most ``tolerance`` across it;
* **preservation** (one clause per other object of the reference): an object of the same colour
  and shape within ``tolerance`` of where it was (each output object answers for one at most);
* **the count** (one clause): the output holds as many objects as the edited scene does.

``scene_edit_exact`` is 1.0 when every clause holds, else 0.0; ``scene_edit_dense`` the fraction
that hold. The instruction alone (a re-drawn scene with the edit done) and preservation alone (the
reference returned unchanged) both score 0 exact. Centroids are compared as the reader finds them
on both images, so a triangle's centroid (two thirds down its box) is compared with a triangle's.
"""

from __future__ import annotations

import io
from collections.abc import Sequence

import numpy as np
import torch
from PIL import Image

from boogu_data import PromptRecord
from boogu_data.scene_edits import DIRECTIONS, EditInstruction, parse_instruction
from boogu_trainer.rewards.base import OnError, RewardError, check_batch, check_on_error
from boogu_trainer.rewards.registry import register_reward
from boogu_trainer.rewards.scene import DetectedObject, detect_objects

__all__ = ["SceneEditReward", "edit_clauses", "scene_edit_dense", "scene_edit_exact"]


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


def _near(a: DetectedObject, b: DetectedObject, tolerance: float) -> bool:
    return max(abs(a.centroid[0] - b.centroid[0]), abs(a.centroid[1] - b.centroid[1])) <= tolerance


def referent(instruction: EditInstruction, source: Sequence[DetectedObject]) -> int | None:
    """The index of the reference's object the instruction names (None for ``add``).

    Raises:
        ValueError: a recolour, remove or move names an object the reference does not hold once.
    """
    if instruction.op == "add":
        return None
    found = [
        i for i, o in enumerate(source) if (o.colour, o.shape) == (instruction.colour, instruction.shape)
    ]
    if len(found) != 1:
        raise ValueError(
            f"the reference image holds {len(found)} {instruction.colour} {instruction.shape}(s); "
            f"{instruction.text()!r} needs exactly one"
        )
    return found[0]


def edit_clauses(
    instruction: EditInstruction,
    source: Sequence[DetectedObject],
    output: Sequence[DetectedObject],
    *,
    tolerance: float = 0.06,
    min_move: float = 0.125,
) -> list[bool]:
    """The clauses (module docstring): ``[instruction, *preservation per other object, count]``."""
    index = referent(instruction, source)
    named = [o for o in output if (o.colour, o.shape) == (instruction.colour, instruction.shape)]
    if instruction.op == "add":
        before = sum(1 for o in source if (o.colour, o.shape) == (instruction.colour, instruction.shape))
        done = len(named) == before + 1
        expected = len(source) + 1
    elif instruction.op == "remove":
        done, expected = not named, len(source) - 1
    elif instruction.op == "recolour":
        assert index is not None
        old = source[index]
        done = not named and any(
            (o.colour, o.shape) == (instruction.new_colour, old.shape) and _near(o, old, tolerance)
            for o in output
        )
        expected = len(source)
    else:
        assert index is not None and instruction.direction is not None
        old = source[index]
        dx, dy = DIRECTIONS[instruction.direction]

        def moved(o: DetectedObject) -> bool:
            along = (o.centroid[0] - old.centroid[0]) * dx + (o.centroid[1] - old.centroid[1]) * dy
            across = abs((o.centroid[0] - old.centroid[0]) * dy) + abs((o.centroid[1] - old.centroid[1]) * dx)
            return along > min_move and across <= tolerance

        done = len(named) == 1 and moved(named[0])
        expected = len(source)
    free = list(output)
    kept = []
    for i, obj in enumerate(source):
        if i == index:
            continue
        match = next(
            (o for o in free if (o.colour, o.shape) == (obj.colour, obj.shape) and _near(o, obj, tolerance)),
            None,
        )
        kept.append(match is not None)
        if match is not None:
            free.remove(match)
    return [done, *kept, len(output) == expected]


def _decode(record: PromptRecord, height: int, width: int) -> torch.Tensor:
    """The record's reference image as ``(3, H, W)`` uint8 at the output's size (nearest: hard edges stay hard)."""
    if record.ref_image is None:
        raise ValueError("the record has no reference image (an edit row's input)")
    image = Image.open(io.BytesIO(record.ref_image)).convert("RGB")
    if image.size != (width, height):
        image = image.resize((width, height), Image.Resampling.NEAREST)
    return torch.from_numpy(np.asarray(image).copy()).permute(2, 0, 1)


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
        height, width = images.shape[-2:]
        instructions: list[EditInstruction | None] = []
        references = []
        for i, record in enumerate(records):
            try:
                instructions.append(parse_instruction(record.instruction))
                references.append(_decode(record, height, width))
            except (ValueError, OSError) as error:
                if self.on_error == "raise":
                    raise RewardError(f"reward {self.name!r}, sample {i}: {error}") from None
                instructions.append(None)
                references.append(torch.full((3, height, width), 255, dtype=torch.uint8))
        options = {"colour_threshold": self.colour_threshold, "min_area": self.min_area}
        sources = detect_objects(torch.stack(references), **options)
        outputs = detect_objects(images, **options)
        scores = []
        for i, (instruction, source, output) in enumerate(zip(instructions, sources, outputs, strict=True)):
            if instruction is None:
                scores.append(float("nan"))
                continue
            try:
                clauses = edit_clauses(
                    instruction, source, output, tolerance=self.tolerance, min_move=self.min_move
                )
            except ValueError as error:
                if self.on_error == "raise":
                    raise RewardError(f"reward {self.name!r}, sample {i}: {error}") from None
                scores.append(float("nan"))
                continue
            scores.append(sum(clauses) / len(clauses) if self.dense else float(all(clauses)))
        return torch.tensor(scores, dtype=torch.float32)


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
