"""Edit pairs on the procedural scenes: a source scene, one instruction, the scene it asks for.

The Edit counterpart of :mod:`boogu_data.scenes` (issue 27, item 5): the reference image is a
rendered scene, the instruction changes one object, and everything else must stay where it was.
Four operations, each naming its object by colour and shape (unique in the source, so the
instruction has one meaning)::

    recolour  "make the red circle blue"      the object keeps its place and shape
    add       "add a green square"            a new object (a colour-shape pair the source lacks),
                                              placed where the layout's rules allow
    remove    "remove the blue square"
    move      "move the red circle to the left" / "to the right" / "up" / "down"
                                              by :data:`MOVE_UNITS` along that axis

:func:`parse_instruction` reads an instruction back; the verifier (``scene_edit_exact`` /
``scene_edit_dense`` in ``boogu_trainer.rewards.scene_edit``) needs only the instruction and the
reference image, as ``scene_exact`` needs only the caption.

A pair is a :class:`SceneEdit`: the source :class:`~boogu_data.scenes.Scene`, the operation and its
arguments; :meth:`SceneEdit.target` is the edited object list. The sources are drawn from the scene
stream of the same seed and layout (:func:`~boogu_data.scenes.sample_scene`); the split is that of
every colour-shape pair in the source *and* the target (:func:`~boogu_data.scenes.split_of`): no
held-out pair enters a train pair, neither in the reference nor as the edit's result.

Determinism: each split draws from ``random.Random("boogu-scene-edits/{seed}/{split}")``.
"""

from __future__ import annotations

import itertools
import json
import random
import re
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Final

from boogu_data.record import PromptRecord
from boogu_data.scenes import (
    CELL,
    COLOURS,
    GAP,
    GRID,
    GRID_SIZES,
    LAYOUTS,
    MARGIN,
    SHAPES,
    SIZES,
    SPLITS,
    TEST_PAIRS,
    VAL_PAIRS,
    Scene,
    SceneObject,
    check_count,
    render_png,
    sample_scene,
)

__all__ = [
    "DATA_SOURCE",
    "DIRECTIONS",
    "MOVE_UNITS",
    "OPERATIONS",
    "EditInstruction",
    "SceneEdit",
    "generate_edits",
    "iter_edits",
    "parse_instruction",
    "sample_edit",
]

OPERATIONS: Final[dict[str, float]] = {"recolour": 0.3, "add": 0.2, "remove": 0.2, "move": 0.3}
"""The operations and the share of pairs drawn for each."""
DIRECTIONS: Final[dict[str, tuple[int, int]]] = {
    "to the left": (-1, 0),
    "to the right": (1, 0),
    "up": (0, -1),
    "down": (0, 1),
}
"""Move directions as written in the instruction, and their unit step ``(dx, dy)`` (``y`` down)."""
MOVE_UNITS: Final[int] = 16
"""How far a move goes, in scene units (a quarter of the side; two cells of the grid layout)."""
DATA_SOURCE: Final[str] = "boogu/scene_edits"

_C = "|".join(COLOURS)
_S = "|".join(SHAPES)
_RECOLOUR = re.compile(rf"make the ({_C}) ({_S}) ({_C})")
_ADD = re.compile(rf"add an? ({_C}) ({_S})")
_REMOVE = re.compile(rf"remove the ({_C}) ({_S})")
_MOVE = re.compile(rf"move the ({_C}) ({_S}) ({'|'.join(DIRECTIONS)})")
_EXPECTED = (
    "an edit instruction: 'make the red circle blue', 'add a green square', 'remove the blue square' "
    "or 'move the red circle to the left' (or to the right, up, down)"
)


@dataclass(frozen=True, slots=True)
class EditInstruction:
    """What an instruction asks: the operation, the object's colour and shape, and ``new_colour``
    (recolour) or ``direction`` (move, a key of :data:`DIRECTIONS`)."""

    op: str
    colour: str
    shape: str
    new_colour: str | None = None
    direction: str | None = None

    def text(self) -> str:
        if self.op == "recolour":
            return f"make the {self.colour} {self.shape} {self.new_colour}"
        if self.op == "add":
            return f"add a {self.colour} {self.shape}"
        if self.op == "remove":
            return f"remove the {self.colour} {self.shape}"
        return f"move the {self.colour} {self.shape} {self.direction}"


def parse_instruction(text: str) -> EditInstruction:
    """Read an instruction of the grammar in the module docstring (case and a final "." ignored).

    Raises:
        ValueError: ``text`` is not in the grammar (the message quotes it and shows the forms).
    """
    normal = " ".join(text.lower().split()).rstrip(".").strip()
    if match := _RECOLOUR.fullmatch(normal):
        colour, shape, new = match.groups()
        if new == colour:
            raise ValueError(f"not an edit instruction: {text!r} recolours an object to its own colour")
        return EditInstruction("recolour", colour, shape, new_colour=new)
    if match := _ADD.fullmatch(normal):
        return EditInstruction("add", *match.groups())
    if match := _REMOVE.fullmatch(normal):
        return EditInstruction("remove", *match.groups())
    if match := _MOVE.fullmatch(normal):
        colour, shape, direction = match.groups()
        return EditInstruction("move", colour, shape, direction=direction)
    raise ValueError(f"not an edit instruction: {text!r} (expected {_EXPECTED})")


@dataclass(frozen=True, slots=True)
class SceneEdit:
    """A source scene and one edit of it; ``added`` is the new object of an ``add``."""

    source: Scene
    instruction: EditInstruction
    added: SceneObject | None = None

    def target(self) -> tuple[SceneObject, ...]:
        """The objects of the edited scene (the edited object keeps its index; ``add`` appends)."""
        ins = self.instruction
        if ins.op == "add":
            assert self.added is not None
            return (*self.source.objects, self.added)
        index = self.referent()
        objects = list(self.source.objects)
        obj = objects[index]
        if ins.op == "remove":
            del objects[index]
        elif ins.op == "recolour":
            assert ins.new_colour is not None
            objects[index] = SceneObject(obj.shape, ins.new_colour, obj.centre, obj.size)
        else:
            dx, dy = DIRECTIONS[ins.direction or ""]
            shift = MOVE_UNITS / GRID
            objects[index] = SceneObject(
                obj.shape, obj.colour, (obj.centre[0] + dx * shift, obj.centre[1] + dy * shift), obj.size
            )
        return tuple(objects)

    def referent(self) -> int:
        """The index of the source object the instruction names (unique by construction)."""
        ins = self.instruction
        (index,) = [
            i for i, o in enumerate(self.source.objects) if (o.colour, o.shape) == (ins.colour, ins.shape)
        ]
        return index

    def pairs(self) -> frozenset[tuple[str, str]]:
        """Every (colour, shape) pair of the source and the target."""
        return self.source.pairs() | {(o.colour, o.shape) for o in self.target()}

    def to_json(self) -> str:
        """``{"source": scene, "instruction": {...}, "target": [objects]}`` (compact, sorted keys)."""
        ins = self.instruction
        return json.dumps(
            {
                "source": json.loads(self.source.to_json()),
                "instruction": {
                    "op": ins.op,
                    "colour": ins.colour,
                    "shape": ins.shape,
                    "new_colour": ins.new_colour,
                    "direction": ins.direction,
                },
                "target": [
                    {"shape": o.shape, "colour": o.colour, "centre": list(o.centre), "size": o.size}
                    for o in self.target()
                ],
            },
            sort_keys=True,
            separators=(",", ":"),
        )

    def record(self, split: str, index: int, size: int) -> PromptRecord:
        """The pair as an edit row: the instruction, the rendered source as the reference image,
        :meth:`to_json` as ``ground_truth``, ``ability`` ``"image_edit"``."""
        return PromptRecord(
            self.instruction.text(),
            ground_truth=self.to_json(),
            data_source=DATA_SOURCE,
            ability="image_edit",
            ref_image=render_png(self.source, size),
            split=split,
            index=index,
        )


def _fits(obj: SceneObject, others: list[SceneObject], layout: str) -> bool:
    """Whether ``obj`` keeps the layout's margin (grid: on whole cells, one in from the border) and
    the gap to every object of ``others`` (the rules of :mod:`boogu_data.scenes`)."""
    side = round(obj.size * GRID)
    x, y = round(obj.centre[0] * GRID), round(obj.centre[1] * GRID)
    x0, y0 = x - side // 2, y - side // 2
    if layout == "grid":
        inside = all(CELL <= v <= GRID - CELL - side and v % CELL == 0 for v in (x0, y0))
    else:
        inside = all(v - (side + 1) // 2 >= MARGIN and v + (side + 1) // 2 <= GRID - MARGIN for v in (x, y))
    if not inside:
        return False
    for other in others:
        o_side = round(other.size * GRID)
        ox, oy = round(other.centre[0] * GRID), round(other.centre[1] * GRID)
        if abs(x - ox) * 2 < side + o_side + 2 * GAP and abs(y - oy) * 2 < side + o_side + 2 * GAP:
            return False
    return True


def sample_edit(rng: random.Random, layout: str = "free") -> SceneEdit | None:
    """One random edit of one random scene, or None when the drawn edit is impossible there (no
    unique object to name, no free place to add or move to): the caller draws again."""
    source = sample_scene(rng, layout)
    op = rng.choices(list(OPERATIONS), weights=list(OPERATIONS.values()))[0]
    pairs = [(o.colour, o.shape) for o in source.objects]
    unique = [i for i, pair in enumerate(pairs) if pairs.count(pair) == 1]
    if op == "add":
        if len(source.objects) >= 4:
            return None
        colour, shape = rng.choice(COLOURS), rng.choice(SHAPES)
        if (colour, shape) in pairs:
            return None
        sizes = GRID_SIZES if layout == "grid" else SIZES
        side = rng.choice(sizes)
        for _ in range(200):
            if layout == "grid":
                corners = list(range(CELL, GRID - CELL - side + 1, CELL))
                x, y = rng.choice(corners) + side // 2, rng.choice(corners) + side // 2
            else:
                low, high = MARGIN + (side + 1) // 2, GRID - MARGIN - (side + 1) // 2
                x, y = rng.randint(low, high), rng.randint(low, high)
            added = SceneObject(shape, colour, (x / GRID, y / GRID), side / GRID)
            if _fits(added, list(source.objects), layout):
                return SceneEdit(source, EditInstruction("add", colour, shape), added)
        return None
    if not unique:
        return None
    index = rng.choice(unique)
    obj = source.objects[index]
    if op == "remove":
        if len(source.objects) == 1:
            return None  # an empty canvas is no scene
        return SceneEdit(source, EditInstruction("remove", obj.colour, obj.shape))
    if op == "recolour":
        new = rng.choice([c for c in COLOURS if c != obj.colour])
        if (new, obj.shape) in pairs:
            return None  # the result would hold two objects the instruction could not tell apart
        return SceneEdit(source, EditInstruction("recolour", obj.colour, obj.shape, new_colour=new))
    direction = rng.choice(list(DIRECTIONS))
    dx, dy = DIRECTIONS[direction]
    if not all(0 <= c + d * MOVE_UNITS / GRID <= 1 for c, d in zip(obj.centre, (dx, dy), strict=True)):
        return None  # off the canvas
    edit = SceneEdit(source, EditInstruction("move", obj.colour, obj.shape, direction=direction))
    others = [o for i, o in enumerate(source.objects) if i != index]
    return edit if _fits(edit.target()[index], others, layout) else None


def _split(edit: SceneEdit) -> str:
    """The split of every pair the edit shows (see the module docstring)."""
    pairs = edit.pairs()
    if pairs & TEST_PAIRS:
        return "test"
    if pairs & VAL_PAIRS:
        return "val"
    return "train"


def iter_edits(seed: int, split: str, *, layout: str = "free") -> Iterator[SceneEdit]:
    """The endless stream of :func:`generate_edits`, one pair at a time (take what you need)."""
    if split not in SPLITS:
        raise ValueError(f"split must be one of {SPLITS}, got {split!r}")
    if layout not in LAYOUTS:
        raise ValueError(f"layout must be one of {LAYOUTS}, got {layout!r}")
    rng = random.Random(f"boogu-scene-edits/{seed}/{split}")
    while True:
        edit = sample_edit(rng, layout)
        if edit is not None and _split(edit) == split:
            yield edit


def generate_edits(seed: int, split: str, count: int, *, layout: str = "free") -> list[SceneEdit]:
    """``count`` edit pairs of ``split`` from the split's own seeded stream (``layout`` as in
    :func:`boogu_data.scenes.sample_scene`).

    Raises:
        ValueError: ``count`` is not from 0 to :data:`boogu_data.scenes.MAX_COUNT`, or ``split`` or
            ``layout`` is unknown.
    """
    check_count(count, minimum=0)
    return list(itertools.islice(iter_edits(seed, split, layout=layout), count))
