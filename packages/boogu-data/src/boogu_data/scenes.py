"""Procedural scenes: simple coloured shapes on a white canvas, with GenEval-style captions.

The data of issue 27's tiny *pretrained* Boogu: a model small enough to train on a CPU learns to
draw these, and the demo and the algorithm comparison then measure prompt-following with the
``scene_exact`` / ``scene_dense`` verifier (``boogu_trainer.rewards.scene``), as GenEval does for
real models (Ghosh et al. 2023, https://github.com/djghosh13/geneval).

A scene is a :class:`Scene`: a task ``tag``, 1-4 :class:`SceneObject` (shape, colour, centre and
size, as fractions of the image side, so one scene renders at any resolution) and, for ``position``
scenes, the relation of object 0 to object 1. The caption (:meth:`Scene.caption`) and the image
(:func:`render`) both come from it; :func:`parse_caption` reads a caption back, and the verifier
checks an image against the parsed caption.

Caption grammar (lower case; :func:`parse_caption` also takes upper case, a leading "a photo of ",
a trailing "." and "to the left of" / "to the right of")::

    caption  := phrase                                    single_object  "a red circle"
              | phrase " and " phrase                     two_object     "a red circle and a blue square"
              | number " " colour " " shape "s"           counting       "three green triangles"
              | phrase " " relation " " phrase            position       "a red circle left of a blue square"
    phrase   := "a " colour " " shape
    number   := "two" | "three" | "four"
    relation := "left of" | "right of" | "above" | "below"
    colour   := "red" | "green" | "blue" | "yellow"
    shape    := "circle" | "square" | "triangle"

(:func:`parse_caption` also takes any list ``phrase (", " phrase)* " and " phrase``.) Every phrase
names a colour, so every task also tests colour and colour attribution (GenEval's ``colors`` is our
``single_object``, its ``color_attr`` our ``two_object``). A caption describes the *whole* image:
the objects it names and no others (GenEval ignores extra objects outside ``counting``; a closed
world lets the verifier catch an added object).

Geometry: the canvas is 64 units a side (a unit is ``size / 64`` pixels); centres lie on the unit
grid, object sizes (bounding-box sides) are 12, 16 or 20 units, objects keep 2 units from the
border and 4 units between bounding boxes. A triangle points up, its base and height equal to its
size. In a ``position`` scene the two centres differ by at least 16 units along the relation's axis
and by at most half that along the other. Images are drawn without anti-aliasing (hard edges), so
the same scene gives the same pixels on every machine.

Layouts: the above is the ``free`` layout (the default). The ``grid`` layout keeps the captions and
the rules but puts every bounding box on whole :data:`CELL`-unit cells (8 units: one latent cell of
an 8x VAE at 64²), at least one cell in from the border, with sizes :data:`GRID_SIZES` (16 and 24
units). A shape then looks the same in every cell it can occupy, which is what the tiny pretrained
model trains on (a shape at one of 64 sub-cell phases was too much for it; docs/tiny-model.md).

Splits (prompt-level hold-out of colour-shape pairs): a scene that contains a pair of
:data:`TEST_PAIRS` (blue triangle, yellow circle) is a ``test`` scene; else one that contains a pair
of :data:`VAL_PAIRS` (green square) is a ``val`` scene; every other scene is a ``train`` scene. So no
``val`` or ``test`` caption, and no held-out pair, ever occurs in ``train`` (the colours and shapes
of the held-out pairs do, in other pairs): ``val`` and ``test`` measure compositional
generalisation.

Determinism: each split draws from ``random.Random("boogu-scenes/{seed}/{split}")`` (string seeds
hash with SHA-512, the same on every platform and Python version); the same seed, size and counts
give byte-identical files.
"""

from __future__ import annotations

import io
import itertools
import json
import random
import re
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Final, Literal

from PIL import Image, ImageDraw

from boogu_data.images import MAX_IMAGE_PIXELS, SIZE_MULTIPLE
from boogu_data.record import PromptRecord

__all__ = [
    "BACKGROUND",
    "CELL",
    "COLOURS",
    "DATA_SOURCE",
    "GRID_SIZES",
    "LAYOUTS",
    "MARKER",
    "MAX_COUNT",
    "NUMBERS",
    "PALETTE",
    "RELATIONS",
    "SHAPES",
    "SPLITS",
    "TAGS",
    "TEST_PAIRS",
    "VAL_PAIRS",
    "ParsedCaption",
    "Phrase",
    "Scene",
    "SceneObject",
    "check_count",
    "generate_scenes",
    "iter_scenes",
    "parse_caption",
    "render",
    "render_objects",
    "render_png",
    "sample_scene",
    "split_of",
]

Shape = Literal["circle", "square", "triangle"]
Colour = Literal["red", "green", "blue", "yellow"]
Relation = Literal["left of", "right of", "above", "below"]
Tag = Literal["single_object", "two_object", "counting", "position"]
Split = Literal["train", "val", "test"]

SHAPES: Final[tuple[str, ...]] = ("circle", "square", "triangle")
COLOURS: Final[tuple[str, ...]] = ("red", "green", "blue", "yellow")
PALETTE: Final[dict[str, tuple[int, int, int]]] = {
    # Saturated and far apart (pairwise RGB distance >= 180), and far from the background (>= 240).
    "red": (220, 30, 30),
    "green": (30, 160, 50),
    "blue": (30, 60, 220),
    "yellow": (240, 200, 20),
}
BACKGROUND: Final[tuple[int, int, int]] = (255, 255, 255)
RELATIONS: Final[tuple[str, ...]] = ("left of", "right of", "above", "below")
NUMBERS: Final[dict[str, int]] = {"two": 2, "three": 3, "four": 4}
TAGS: Final[dict[str, float]] = {"single_object": 0.2, "two_object": 0.3, "counting": 0.25, "position": 0.25}
"""Tasks and the share of scenes drawn for each (before the split's rejection)."""
TEST_PAIRS: Final[frozenset[tuple[str, str]]] = frozenset({("blue", "triangle"), ("yellow", "circle")})
"""(colour, shape) pairs that occur in ``test`` scenes only."""
VAL_PAIRS: Final[frozenset[tuple[str, str]]] = frozenset({("green", "square")})
"""(colour, shape) pairs that occur in ``val`` scenes only."""
SPLITS: Final[tuple[str, ...]] = ("train", "val", "test")
DATA_SOURCE: Final[str] = "boogu/scenes"
MARKER: Final[str] = "scenes.json"
"""Every ``boogu-data scenes`` output folder holds it; it marks the folder as replaceable by the command."""
GRID: Final[int] = 64
"""Scene units per image side."""
SIZES: Final[tuple[int, ...]] = (12, 16, 20)
LAYOUTS: Final[tuple[str, ...]] = ("free", "grid")
CELL: Final[int] = 8
"""The ``grid`` layout's cell, in units: one latent cell of an 8x VAE at 64²."""
GRID_SIZES: Final[tuple[int, ...]] = (16, 24)
"""Object sizes of the ``grid`` layout: two and three cells."""
MARGIN: Final[int] = 2
GAP: Final[int] = 4
MIN_SHIFT: Final[int] = 16
DEFAULT_SIZE: Final[int] = 64
DEFAULT_COUNTS: Final[dict[str, int]] = {"train": 2000, "val": 200, "test": 200}
MAX_COUNT: Final[int] = 100_000
"""The most scenes (or edit pairs) of one split that :func:`generate_scenes` draws and ``boogu-data
scenes`` writes: its image names have five digits (``images/<split>/<index:05d>.png``), and the
slowest split's stream (``val``) yields a few hundred scenes a second on one CPU core, so this many
take minutes, not days. A larger count is an error up front rather than a run that never ends."""


@dataclass(frozen=True, slots=True)
class SceneObject:
    """One shape: what it is, its colour, its centre ``(x, y)`` and its bounding-box side.

    Positions and sizes are fractions of the image side (``x`` to the right, ``y`` down).
    """

    shape: str
    colour: str
    centre: tuple[float, float]
    size: float

    def __post_init__(self) -> None:
        if self.shape not in SHAPES:
            raise ValueError(f"shape must be one of {SHAPES}, got {self.shape!r}")
        if self.colour not in COLOURS:
            raise ValueError(f"colour must be one of {COLOURS}, got {self.colour!r}")
        if not (0 < self.size <= 1) or not all(0 <= c <= 1 for c in self.centre):
            raise ValueError(
                f"centre and size must be fractions of the image side, got {self.centre}, {self.size}"
            )

    @property
    def phrase(self) -> str:
        return f"a {self.colour} {self.shape}"


@dataclass(frozen=True, slots=True)
class Scene:
    """A scene: its task, its objects and (``position`` only) the relation of object 0 to object 1."""

    tag: str
    objects: tuple[SceneObject, ...]
    relation: str | None = None

    def __post_init__(self) -> None:
        if self.tag not in TAGS:
            raise ValueError(f"tag must be one of {tuple(TAGS)}, got {self.tag!r}")
        n = len(self.objects)
        if self.tag == "single_object" and n != 1:
            raise ValueError(f"a single_object scene has 1 object, got {n}")
        if self.tag in ("two_object", "position") and n != 2:
            raise ValueError(f"a {self.tag} scene has 2 objects, got {n}")
        if self.tag == "counting" and (
            n not in NUMBERS.values() or len({(o.colour, o.shape) for o in self.objects}) != 1
        ):
            raise ValueError(f"a counting scene has 2-4 objects of one colour and shape, got {n}")
        if (self.relation is None) != (self.tag != "position"):
            raise ValueError(f"a relation is given for position scenes only, got {self.relation!r}")
        if self.relation is not None and self.relation not in RELATIONS:
            raise ValueError(f"relation must be one of {RELATIONS}, got {self.relation!r}")

    def caption(self) -> str:
        """The scene's caption in the grammar of the module docstring."""
        first = self.objects[0]
        if self.tag == "single_object":
            return first.phrase
        if self.tag == "two_object":
            return f"{first.phrase} and {self.objects[1].phrase}"
        if self.tag == "counting":
            number = next(word for word, n in NUMBERS.items() if n == len(self.objects))
            return f"{number} {first.colour} {first.shape}s"
        return f"{first.phrase} {self.relation} {self.objects[1].phrase}"

    def pairs(self) -> frozenset[tuple[str, str]]:
        """The (colour, shape) pairs in the scene."""
        return frozenset((o.colour, o.shape) for o in self.objects)

    def to_json(self) -> str:
        """Compact JSON with sorted keys (what ``PromptRecord.ground_truth`` holds)."""
        return json.dumps(
            {
                "tag": self.tag,
                "relation": self.relation,
                "objects": [
                    {"shape": o.shape, "colour": o.colour, "centre": list(o.centre), "size": o.size}
                    for o in self.objects
                ],
            },
            sort_keys=True,
            separators=(",", ":"),
        )

    def record(self, split: str, index: int) -> PromptRecord:
        """The scene as a T2I prompt row: caption, spec JSON as ``ground_truth``, the tag as ``ability``."""
        return PromptRecord(
            self.caption(),
            ground_truth=self.to_json(),
            data_source=DATA_SOURCE,
            ability=self.tag,
            split=split,
            index=index,
        )

    @classmethod
    def from_json(cls, text: str) -> Scene:
        """The scene :meth:`to_json` wrote."""
        data = json.loads(text)
        objects = tuple(
            SceneObject(
                o["shape"], o["colour"], (float(o["centre"][0]), float(o["centre"][1])), float(o["size"])
            )
            for o in data["objects"]
        )
        return cls(data["tag"], objects, data["relation"])


# ---------------------------------------------------------------------------------------- captions


@dataclass(frozen=True, slots=True)
class Phrase:
    """``count`` objects of one colour and shape, as a caption asks for them."""

    colour: str
    shape: str
    count: int = 1


@dataclass(frozen=True, slots=True)
class ParsedCaption:
    """What a caption asks for: distinct phrases, and the relation of phrase 0 to phrase 1 (or None)."""

    phrases: tuple[Phrase, ...]
    relation: str | None = None


_C = "|".join(COLOURS)
_S = "|".join(SHAPES)
_PHRASE = re.compile(rf"an? ({_C}) ({_S})")
_COUNTING = re.compile(rf"({'|'.join(NUMBERS)}|[2-4]) ({_C}) ({_S})s")
_POSITION = re.compile(rf"an? ({_C}) ({_S}) (?:to the )?(left of|right of|above|below) an? ({_C}) ({_S})")
_EXPECTED = (
    "a scene caption: 'a red circle', 'a red circle and a blue square', 'three green triangles' or "
    "'a red circle left of a blue square' (colours red/green/blue/yellow, shapes circle/square/triangle)"
)


def parse_caption(text: str) -> ParsedCaption:
    """Read a caption of the grammar in the module docstring.

    Raises:
        ValueError: ``text`` is not in the grammar (the message quotes it and shows the forms).
    """
    normal = " ".join(text.lower().split()).rstrip(".").strip()
    normal = normal.removeprefix("a photo of ").removeprefix("an image of ")
    if match := _COUNTING.fullmatch(normal):
        number, colour, shape = match.groups()
        count = NUMBERS.get(number) or int(number)
        return ParsedCaption((Phrase(colour, shape, count),))
    if match := _POSITION.fullmatch(normal):
        c1, s1, relation, c2, s2 = match.groups()
        if (c1, s1) == (c2, s2):
            raise ValueError(f"not a scene caption: {text!r} relates an object to one just like it")
        return ParsedCaption((Phrase(c1, s1), Phrase(c2, s2)), relation)
    parts = re.split(r", and |, | and ", normal)
    found: Counter[tuple[str, str]] = Counter()
    for part in parts:
        match = _PHRASE.fullmatch(part)
        if match is None:
            raise ValueError(f"not a scene caption: {text!r} (expected {_EXPECTED})")
        found[match.groups()] += 1
    # Counter keeps first-seen order, so the phrases follow the caption.
    return ParsedCaption(tuple(Phrase(c, s, n) for (c, s), n in found.items()))


# ---------------------------------------------------------------------------------------- rendering


def _box(obj: SceneObject, size: int) -> tuple[int, int, int, int]:
    """Pixel bounding box ``(x0, y0, x1, y1)``, ``x1``/``y1`` exclusive, of ``obj`` at ``size``."""
    side = max(1, round(obj.size * size))
    x0 = round(obj.centre[0] * size - side / 2)
    y0 = round(obj.centre[1] * size - side / 2)
    return x0, y0, x0 + side, y0 + side


def render(scene: Scene, size: int = DEFAULT_SIZE) -> Image.Image:
    """The scene as a ``size``×``size`` RGB image: hard-edged shapes on :data:`BACKGROUND`."""
    return render_objects(scene.objects, size)


def render_objects(
    objects: tuple[SceneObject, ...] | list[SceneObject], size: int = DEFAULT_SIZE
) -> Image.Image:
    """Any objects (an edited scene's, :mod:`boogu_data.scene_edits`) as :func:`render` draws a scene's."""
    _check_size(size)
    image = Image.new("RGB", (size, size), BACKGROUND)
    draw = ImageDraw.Draw(image)
    for obj in objects:
        x0, y0, x1, y1 = _box(obj, size)
        fill = PALETTE[obj.colour]
        if obj.shape == "square":
            draw.rectangle((x0, y0, x1 - 1, y1 - 1), fill=fill)
        elif obj.shape == "circle":
            draw.ellipse((x0, y0, x1 - 1, y1 - 1), fill=fill)
        else:  # an upward triangle: apex at the top centre, base along the bottom edge
            draw.polygon([((x0 + x1 - 1) / 2, y0), (x0, y1 - 1), (x1 - 1, y1 - 1)], fill=fill)
    return image


def render_png(scene: Scene, size: int = DEFAULT_SIZE) -> bytes:
    """:func:`render` as PNG bytes (no metadata: the same scene gives the same bytes)."""
    return _png(render(scene, size))


def _png(image: Image.Image) -> bytes:
    buffer = io.BytesIO()
    image.save(buffer, format="PNG")
    return buffer.getvalue()


def _check_size(size: int) -> None:
    if (
        isinstance(size, bool)
        or not isinstance(size, int)
        or size < 32
        or size % SIZE_MULTIPLE
        or size * size > MAX_IMAGE_PIXELS
    ):
        raise ValueError(f"--size must be a multiple of {SIZE_MULTIPLE} from 32 to 2048, got {size!r}")


# ---------------------------------------------------------------------------------------- sampling


def split_of(scene: Scene) -> str:
    """``"test"`` if the scene holds a :data:`TEST_PAIRS` pair, else ``"val"`` if it holds a
    :data:`VAL_PAIRS` pair, else ``"train"``."""
    pairs = scene.pairs()
    if pairs & TEST_PAIRS:
        return "test"
    if pairs & VAL_PAIRS:
        return "val"
    return "train"


def _place(rng: random.Random, sizes: list[int], layout: str = "free") -> list[tuple[int, int]] | None:
    """Centres (in units) for boxes of ``sizes`` that keep the margin and the gap, or None."""
    boxes: list[tuple[int, int, int]] = []
    for side in sizes:
        low, high = MARGIN + (side + 1) // 2, GRID - MARGIN - (side + 1) // 2
        corners = list(range(CELL, GRID - CELL - side + 1, CELL))  # grid: boxes on whole cells
        for _ in range(200):
            if layout == "grid":
                x, y = rng.choice(corners) + side // 2, rng.choice(corners) + side // 2
            else:
                x, y = rng.randint(low, high), rng.randint(low, high)
            if all(
                abs(x - bx) * 2 >= side + bs + 2 * GAP or abs(y - by) * 2 >= side + bs + 2 * GAP
                for bx, by, bs in boxes
            ):
                boxes.append((x, y, side))
                break
        else:
            return None
    return [(x, y) for x, y, _ in boxes]


def _relation(a: tuple[int, int], b: tuple[int, int]) -> str | None:
    """The relation of centre ``a`` to centre ``b`` when it is clear (module docstring), else None."""
    dx, dy = b[0] - a[0], b[1] - a[1]
    if abs(dx) >= MIN_SHIFT and 2 * abs(dy) <= abs(dx):
        return "left of" if dx > 0 else "right of"
    if abs(dy) >= MIN_SHIFT and 2 * abs(dx) <= abs(dy):
        return "above" if dy > 0 else "below"
    return None


def sample_scene(rng: random.Random, layout: str = "free") -> Scene:
    """One random scene (any split): a tag by :data:`TAGS`, then its objects and layout.

    ``layout`` ``"free"`` puts centres anywhere on the unit grid, with sizes :data:`SIZES`;
    ``"grid"`` puts every bounding box on whole :data:`CELL`-unit cells, one cell in from the border,
    with sizes :data:`GRID_SIZES`. Same captions, far fewer distinct images: a shape's pixels are
    the same in every cell, which is what lets the tiny transformer learn shapes (docs/tiny-model.md).
    """
    if layout not in LAYOUTS:
        raise ValueError(f"layout must be one of {LAYOUTS}, got {layout!r}")
    sizes_of = SIZES if layout == "free" else GRID_SIZES
    tag = rng.choices(list(TAGS), weights=list(TAGS.values()))[0]
    while True:
        if tag == "counting":
            count = rng.randint(2, 4)
            kinds = [(rng.choice(COLOURS), rng.choice(SHAPES))] * count
            # Four objects of the largest size rarely fit; keep them small.
            sizes = [rng.choice(sizes_of[:2] if count == 4 else sizes_of) for _ in kinds]
        else:
            n = 1 if tag == "single_object" else 2
            kinds = [(rng.choice(COLOURS), rng.choice(SHAPES)) for _ in range(n)]
            if n == 2 and kinds[0] == kinds[1]:
                continue  # two identical phrases are a counting caption
            sizes = [rng.choice(sizes_of) for _ in kinds]
        centres = _place(rng, sizes, layout)
        if centres is None:
            continue
        relation = None
        if tag == "position":
            relation = _relation(centres[0], centres[1])
            if relation is None:
                continue
        objects = tuple(
            SceneObject(shape, colour, (x / GRID, y / GRID), side / GRID)
            for (colour, shape), (x, y), side in zip(kinds, centres, sizes, strict=True)
        )
        return Scene(tag, objects, relation)


def check_count(count: int, name: str = "count", *, minimum: int = 1) -> None:
    """Refuse a scene count that is not an int from ``minimum`` to :data:`MAX_COUNT` (``name``: the
    option or key to name in the message)."""
    if isinstance(count, bool) or not isinstance(count, int) or not minimum <= count <= MAX_COUNT:
        raise ValueError(
            f"{name} must be an int from {minimum} to {MAX_COUNT} (the most scenes of one split that "
            f"boogu-data draws: image names have five digits), got {count!r}"
        )


def iter_scenes(
    seed: int, split: str, *, layout: str = "free", keep: Callable[[Scene], bool] | None = None
) -> Iterator[Scene]:
    """The endless stream of :func:`generate_scenes`, one scene at a time (take what you need)."""
    if split not in SPLITS:
        raise ValueError(f"split must be one of {SPLITS}, got {split!r}")
    rng = random.Random(f"boogu-scenes/{seed}/{split}")
    while True:
        scene = sample_scene(rng, layout)
        if split_of(scene) == split and (keep is None or keep(scene)):
            yield scene


def generate_scenes(
    seed: int, split: str, count: int, *, layout: str = "free", keep: Callable[[Scene], bool] | None = None
) -> list[Scene]:
    """``count`` scenes of ``split`` (:func:`split_of`), drawn from the split's own seeded stream
    (``layout``: see :func:`sample_scene`); with ``keep``, only the stream's scenes it accepts (a
    subset of the same stream, in order).

    Raises:
        ValueError: ``count`` is not from 0 to :data:`MAX_COUNT`, or ``split`` is unknown.
    """
    check_count(count, minimum=0)
    return list(itertools.islice(iter_scenes(seed, split, layout=layout, keep=keep), count))


# ---------------------------------------------------------------------------------------- writing
