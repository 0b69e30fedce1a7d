"""The tiny organism's judges: the verifier of the procedural scenes and of the scene edit pairs
(boogu-data), as plain functions of images and records. The trainer's rewards ``scene_exact``,
``scene_dense``, ``scene_graded``, ``scene_edit_exact`` and ``scene_edit_dense``
(`boogu_trainer.rewards.scene`, `boogu_trainer.rewards.scene_edit`) are these functions behind the
reward interface; the pretraining builds (`boogu_tiny.scenes_pretrain`, `boogu_tiny.edit_pretrain`)
score with them directly.

Scenes
------
The prompt's TEXT is parsed (`boogu_data.scenes.parse_caption`, the grammar of
`boogu_data.scenes`), so any caption of the grammar is scored, whether or not the record carries a
scene spec (``ground_truth`` is not read). The image is read in four steps, for a batch at once
where it can:

1. Colour segmentation: each pixel takes the nearest palette colour (`boogu_data.scenes.PALETTE`)
   when its RGB distance to it is below ``colour_threshold`` and below its distance to the white
   background; every other pixel (white or grey background, the outer half of a blurred edge,
   black) is background. A lookup table over RGB quantised to 6 bits a channel does this.
2. Connected components (4-neighbour, same colour) by run-minimum passes along rows and columns
   with pointer jumping, vectorised over the batch (numpy; scipy is not in the lock). Components smaller than ``min_area``
   (a fraction of the image area) are noise and dropped.
3. Shape: a component whose bounding box is more than 1.6 times longer one way than the other is
   no shape of the grammar (``"other"``); else the nearest prototype in (fill ratio of the bounding
   box, fill of its top corner cells, fill of its bottom corner cells), each cell a quarter of the
   side: a square fills everything, a circle about 0.79 and little of its corners, an upward
   triangle half, none of its top corners and most of its bottom ones.
4. The caption's clauses against the objects found (centroids for positions; ``y`` points down).

Clauses: for every phrase of the caption (``count`` objects of one colour and shape), (a) an object
of that shape is present, (b) an object of that colour is present, (c) exactly ``count`` objects of
that colour and shape are present; then (d) the image holds exactly as many objects as the caption
names (the caption describes the whole image, so an extra object is wrong); and for a position
caption (e) some object of phrase 0 and some object of phrase 1 satisfy the relation: ``"left of"``
when the first centroid is left of the second by more than ``margin`` of the image width
(``right of``, ``above``, ``below`` alike). All clauses hold exactly when the objects found are the
caption's multiset and the relation holds.

* ``scene_exact``: 1.0 when every clause holds, else 0.0 (GenEval's per-image correctness).
* ``scene_dense``: the fraction of clauses that hold, in [0, 1] (a graded signal for RL).
* ``scene_graded``: the graded GenEval score that flow_grpo's GenEval recipe trains on (below).

``scene_graded``, the reference's training reward. flow_grpo (github.com/yifan123/flow_grpo,
``flow_grpo/rewards.py``: ``geneval_score``; ``scripts/train_sd3.py`` takes its ``scores`` as the
reward and only logs ``strict_accuracy``) gets it from its reward server, github.com/yifan123/reward-server,
``reward_server/gen_eval.py``: ``evaluate_reward``. GenEval's metadata (github.com/djghosh13/geneval,
``prompts/create_prompts.py``) lists ``include`` requirements, each a detector class with a
``count``, optionally a ``color`` and a ``position`` ``(relation, index of the target requirement)``:
``single_object`` and ``two_object`` name one or two classes (count 1), ``counting`` one class
(count 2-4), ``colors`` one class with a colour, ``color_attr`` two classes with a colour each,
``position`` the target class B then the class A with ``(relation, 0)`` ("an A left of a B"). The
server keeps at most 16 detections a class (``MAX_OBJECTS``) and, per requirement, with ``n`` the
number of detections of its class and ``k`` its count, appends partial scores to one list:

1. ``1 - |k - n| / k``, always (not clipped: negative once ``n > 2k``);
2. if ``n != k``: one ``0`` when the requirement has a colour or a position (neither is checked);
3. else, with a colour: ``1 - |k - m| / k``, ``m`` the detections classified as that colour (so
   ``m / k``); the requirement is met when ``m == k`` (or when it has no colour);
4. then, with a position and the requirement met: ``0`` when the target requirement is not met;
   else ``1`` when every (detection, target detection) pair is in the relation, and ``0, 1`` (two
   entries) when a pair is not: after the loop that appends the ``0`` the server appends the ``1``
   unconditionally, so a failed relation weighs as half a clause with one more entry.

The image's score is the mean of the list (0 for an empty list). ``exclude`` requirements (the
counting task's "not k + 1") are not read by it; GenEval's strict correctness (``n == k``, colours
and relation all right) is what flow_grpo logs as ``strict_accuracy``.

Our captions map onto it with the shape as the detector class and the colour as the classified
attribute: ``single_object`` is GenEval's ``colors``, ``two_object`` its ``color_attr``,
``counting`` its ``counting`` with a colour (steps 1-3 as written), ``position`` its ``position``
with a colour on both requirements (phrase 1 is the target, phrase 0 has the relation). One
extension: GenEval never names one class twice, our grammar does ("a red circle and a blue
circle"), and two requirements over the same detections would both miss (each sees ``n = 2``). So
the phrases of one shape form one requirement: ``k`` their summed counts, ``m`` the objects whose
colour a phrase of the shape asks for, at most as many per colour as asked (the same ``m`` when
one colour is asked); a relation's objects are those of its phrase's colour and shape. Relations are
tested as ``scene_exact`` tests them (centroids, ``margin``), not by GenEval's box rule.

``scene_graded`` next to ``scene_dense``:

* Clauses: per named *shape* the count term and the colour term (no "shape present" or "colour
  present" clause, no whole-image count), the relation term(s); ``scene_dense`` scores per *phrase*
  shape present, colour present and exact count, plus the whole-image count and the relation.
* Range: [-7, 1], not [0, 1]: it is below 0 only when some named shape is drawn more than twice as
  often as asked (``"a red circle"`` with three circles: ``(1 - 2 + 0) / 2 = -0.5``). It is 1
  whenever ``scene_exact`` is 1, and >= ``scene_exact`` whenever it is >= 0.
* Extra objects: an object of a shape the caption does not name (or no shape of the grammar) is not
  read at all, so it neither raises nor lowers the score: the exact image plus such extras scores
  1, as the exact image does (``scene_exact``: 0). An object of a named shape beyond its count
  lowers the count term, zeroes the colour term and drops the relation's target. No image scores
  above 1, the exact image's score, and adding an object never raises the score once every named
  shape has its count. ``scene_dense`` instead rewards an extra object of the wrong pair (it makes
  "shape present" / "colour present" hold while the whole-image count costs only one clause), which
  is how a policy trained on it learns to draw more objects; ``scene_graded`` has no such gradient
  towards extras, but none against extras of unnamed shapes either.

Accuracy (tests/trainer/test_scene_rewards.py, through the rewards): exact 1 on every ground-truth render of 600 scenes at
64² and 128², 99.7% when blurred (sigma = side/64) and noised (sigma 12); exact 0 on every render
with one attribute changed (a colour, a shape, an object removed or added, positions swapped; the
test requires >= 98%). Cost, measured on 2 shared cores: ~40 ms for 64 images at 64², ~120 ms at
128²; images larger than 128 on a side are area-averaged down to at most 128 first.

Scene edits
-----------

An edit is right when the instruction was carried out *and* nothing else changed. The verifier
reads the instruction's text (`boogu_data.scene_edits.parse_instruction`) and the record's reference
image (``ref_image``: the scene before the edit), finds the objects of both images with the scene
verifier's reader (`detect_objects`: palette segmentation, connected
components, shape), and checks the clauses:

* **the instruction** (one clause), against the reference's object of the named colour and shape
  (the referent; an instruction whose referent is missing from the reference, or not unique, is
  bad data: a `VerifyError`, or NaN with ``on_error="nan"``):
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

import functools
import io
import math
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal, get_args

import numpy as np
import torch
import torch.nn.functional as F
from PIL import Image

from boogu_data import PromptRecord
from boogu_data.scene_edits import DIRECTIONS, EditInstruction, parse_instruction
from boogu_data.scenes import BACKGROUND, COLOURS, PALETTE, ParsedCaption, parse_caption

__all__ = [
    "DetectedObject",
    "SceneScore",
    "VerifyError",
    "detect_objects",
    "edit_clauses",
    "graded_terms",
    "referent",
    "scene_clauses",
    "score_edits",
    "score_scenes",
]

OnError = Literal["raise", "nan"]


class VerifyError(ValueError):
    """A row the verifier cannot judge (a caption or instruction outside the grammar, a reference
    image without the object its instruction names); the message names the sample."""


SceneScore = Literal["exact", "dense", "graded"]
"""How `score_scenes` scores an image: ``scene_exact``, ``scene_dense`` or ``scene_graded`` (module docstring)."""

WORK_SIZE = 128
"""Images with a side above this are area-averaged down to it (or less) before they are read."""
CHUNK = 32
"""Images read at a time."""
MAX_ASPECT = 1.6
"""A component whose bounding box is longer than this ratio one way is not a shape of the grammar."""
# (fill of the bounding box, fill of the two top corner cells, fill of the two bottom corner cells),
# measured on hard-edged renders at 64² and 128² (boogu_data.scenes.render).
PROTOTYPES: dict[str, tuple[float, float, float]] = {
    "square": (1.0, 1.0, 1.0),
    "circle": (0.78, 0.28, 0.28),
    "triangle": (0.53, 0.0, 0.8),
}
MAX_PER_SHAPE = 16
"""Objects of one shape counted at most by ``scene_graded`` (the reference server's ``MAX_OBJECTS``
detections per class), which bounds its count term below by ``1 - 15 / 1``."""
_PALETTE = np.array([PALETTE[name] for name in COLOURS], dtype=np.float32)  # (K, 3) RGB in [0, 255]
_BACKGROUND = np.array(BACKGROUND, dtype=np.float32)  # (3,)


@dataclass(frozen=True, slots=True)
class DetectedObject:
    """One object found in an image."""

    colour: str
    shape: str
    """``"circle"``, ``"square"``, ``"triangle"`` or ``"other"``."""
    centroid: tuple[float, float]
    """``(x, y)`` as fractions of the image width and height (``y`` down)."""
    area: float
    """As a fraction of the image area."""


@functools.lru_cache(maxsize=8)
def _colour_table(colour_threshold: float) -> np.ndarray:
    """``(64**3,)`` int8: the palette index (or -1) of every RGB colour quantised to 6 bits a channel.

    A table lookup is ten times faster than distances per pixel; the quantisation (bins of 4 values,
    read at their centre) moves a colour by at most 2.6 in RGB distance.
    """
    levels = np.arange(64, dtype=np.float32) * 4 + 1.5
    rgb = np.stack(np.meshgrid(levels, levels, levels, indexing="ij"), axis=-1).reshape(-1, 3)
    distance = ((rgb[:, None, :] - _PALETTE) ** 2).sum(axis=-1)  # (64**3, K)
    nearest = distance.argmin(axis=1)
    closest = distance[np.arange(nearest.size), nearest]
    # Background: nearer the background colour than any palette colour (so a blurred edge splits
    # half-way), or farther than the threshold from every palette colour (grey, black, noise).
    background = ((rgb - _BACKGROUND) ** 2).sum(axis=-1)
    colour = (closest < colour_threshold**2) & (closest < background)
    return np.where(colour, nearest, -1).astype(np.int8)


def _labels(pixels: np.ndarray, colour_threshold: float) -> np.ndarray:
    """``(B, H, W, 3)`` uint8 -> ``(B, H, W)`` int8: the palette index of each pixel, -1 for background."""
    q = (pixels >> 2).astype(np.int32)
    return _colour_table(colour_threshold)[(q[..., 0] << 12) | (q[..., 1] << 6) | q[..., 2]]


def _run_starts(labels: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Where the runs of equal labels along the last axis of ``labels`` start (flat indices), and their lengths."""
    flat = labels.reshape(-1)
    start = np.empty(flat.size, dtype=bool)
    start[0] = True
    np.not_equal(flat[1:], flat[:-1], out=start[1:])
    start[:: labels.shape[-1]] = True  # every row starts a run
    starts = np.flatnonzero(start)
    return starts, np.diff(np.append(starts, flat.size))


def _components(labels: np.ndarray) -> np.ndarray:
    """``(B, H, W)`` palette labels -> ``(B, H, W)`` component ids (the smallest flat pixel index of
    the component; ``B*H*W`` for background). 4-neighbours of the same label connect.

    Each pass gives every run of equal labels along a row, then along a column, the smallest id in
    it, then follows every id twice (pointer jumping: an id is a pixel of the same component with a
    smaller id). A convex shape is done in two passes; the loop ends when a pass changes nothing.
    """
    size = labels.size
    dtype = np.int32 if size < 2**31 - 1 else np.int64
    foreground = (labels >= 0).reshape(-1)
    ids = np.where(foreground, np.arange(size, dtype=dtype), dtype(size)).reshape(labels.shape)
    columns = np.ascontiguousarray(labels.transpose(0, 2, 1))
    row_runs, column_runs = _run_starts(labels), _run_starts(columns)
    while True:
        new = np.repeat(np.minimum.reduceat(ids.reshape(-1), row_runs[0]), row_runs[1]).reshape(labels.shape)
        new = np.ascontiguousarray(new.transpose(0, 2, 1))
        new = np.repeat(np.minimum.reduceat(new.reshape(-1), column_runs[0]), column_runs[1])
        new = np.ascontiguousarray(new.reshape(columns.shape).transpose(0, 2, 1))
        flat = new.reshape(-1)
        for _ in range(2):
            flat[foreground] = flat[flat[foreground]]
        if np.array_equal(new, ids):
            return ids
        ids = new


def _shapes(fill: np.ndarray, top: np.ndarray, bottom: np.ndarray, aspect: np.ndarray) -> list[str]:
    """The shape of each component from its features (module docstring, step 3)."""
    features = np.stack([fill, np.minimum(top, 1.0), np.minimum(bottom, 1.0)], axis=1)  # (N, 3)
    names = list(PROTOTYPES)
    prototypes = np.array([PROTOTYPES[name] for name in names], dtype=np.float64)  # (P, 3)
    nearest = ((features[:, None, :] - prototypes) ** 2).sum(axis=-1).argmin(axis=1)
    return [
        "other" if a > MAX_ASPECT else names[k]
        for k, a in zip(nearest.tolist(), aspect.tolist(), strict=True)
    ]


def detect_objects(
    images: torch.Tensor, *, colour_threshold: float = 120.0, min_area: float = 0.004
) -> list[list[DetectedObject]]:
    """The objects in each ``(3, H, W)`` uint8 image of a ``(B, 3, H, W)`` batch (see the module docstring)."""
    if images.shape[0] > CHUNK:  # chunks keep the component passes' arrays in cache
        return [
            found
            for start in range(0, images.shape[0], CHUNK)
            for found in detect_objects(
                images[start : start + CHUNK], colour_threshold=colour_threshold, min_area=min_area
            )
        ]
    images = images.detach().cpu()
    batch, height, width = images.shape[0], images.shape[-2], images.shape[-1]
    if max(height, width) > WORK_SIZE:
        factor = math.ceil(max(height, width) / WORK_SIZE)
        images = F.avg_pool2d(images.to(torch.float32), factor).round().to(torch.uint8)
        height, width = images.shape[-2:]
    labels = _labels(np.ascontiguousarray(images.permute(0, 2, 3, 1).numpy()), colour_threshold)
    ids = _components(labels).reshape(-1)
    found: list[list[DetectedObject]] = [[] for _ in range(batch)]
    pixels = np.flatnonzero(labels.reshape(-1) >= 0)  # flat indices of foreground pixels, ascending
    if pixels.size == 0:
        return found
    # Group the foreground pixels by component: (sorted) component of each pixel, run starts, sizes.
    order = np.argsort(ids[pixels], kind="stable")
    pixels = pixels[order]
    component = ids[pixels]
    starts = np.flatnonzero(np.r_[True, component[1:] != component[:-1]])
    area = np.diff(np.r_[starts, component.size])
    ys, xs = (pixels // width) % height, pixels % width
    x0, x1 = np.minimum.reduceat(xs, starts), np.maximum.reduceat(xs, starts) + 1
    y0, y1 = np.minimum.reduceat(ys, starts), np.maximum.reduceat(ys, starts) + 1
    w, h = (x1 - x0).astype(np.float64), (y1 - y0).astype(np.float64)
    # Each pixel's position inside its component's bounding box, in (0, 1).
    u = (xs - np.repeat(x0, area) + 0.5) / np.repeat(w, area)
    v = (ys - np.repeat(y0, area) + 0.5) / np.repeat(h, area)
    side = (u < 0.25) | (u > 0.75)
    cell = 2 * (w / 4) * (h / 4)  # the area of two corner cells, in pixels
    top = np.add.reduceat((side & (v < 0.25)).astype(np.int64), starts) / cell
    bottom = np.add.reduceat((side & (v > 0.75)).astype(np.int64), starts) / cell
    keep = area >= max(1.0, min_area * height * width)
    shapes = _shapes(
        (area / (w * h))[keep], top[keep], bottom[keep], (np.maximum(w, h) / np.minimum(w, h))[keep]
    )
    cx = (np.add.reduceat(xs, starts) / area + 0.5) / width
    cy = (np.add.reduceat(ys, starts) / area + 0.5) / height
    first = pixels[starts]
    for k, shape in zip(np.flatnonzero(keep).tolist(), shapes, strict=True):
        found[int(first[k]) // (height * width)].append(
            DetectedObject(
                COLOURS[int(labels.reshape(-1)[first[k]])],
                shape,
                (float(cx[k]), float(cy[k])),
                float(area[k]) / (height * width),
            )
        )
    return found


def _holds(a: DetectedObject, relation: str, b: DetectedObject, margin: float) -> bool:
    dx = b.centroid[0] - a.centroid[0]  # > 0: a is left of b
    dy = b.centroid[1] - a.centroid[1]  # > 0: a is above b (y points down)
    return {"left of": dx, "right of": -dx, "above": dy, "below": -dy}[relation] > margin


def scene_clauses(
    caption: ParsedCaption, objects: Sequence[DetectedObject], margin: float = 0.05
) -> list[bool]:
    """Whether each clause of ``caption`` holds for ``objects`` (the module docstring lists them)."""
    clauses = []
    for phrase in caption.phrases:
        clauses.append(any(o.shape == phrase.shape for o in objects))
        clauses.append(any(o.colour == phrase.colour for o in objects))
        matching = sum(1 for o in objects if (o.colour, o.shape) == (phrase.colour, phrase.shape))
        clauses.append(matching == phrase.count)
    clauses.append(len(objects) == sum(phrase.count for phrase in caption.phrases))
    if caption.relation is not None:
        first, second = caption.phrases[0], caption.phrases[1]
        a = [o for o in objects if (o.colour, o.shape) == (first.colour, first.shape)]
        b = [o for o in objects if (o.colour, o.shape) == (second.colour, second.shape)]
        clauses.append(any(_holds(p, caption.relation, q, margin) for p in a for q in b))
    return clauses


def graded_terms(
    caption: ParsedCaption, objects: Sequence[DetectedObject], margin: float = 0.05
) -> list[float]:
    """The partial scores whose mean is ``scene_graded`` (the module docstring gives the reference's
    rules and how our captions map onto them): per named shape a count term and a colour term, then
    for a position caption the relation's term(s)."""
    asked: dict[str, Counter[str]] = {}  # shape -> colour -> count, in caption order
    for phrase in caption.phrases:
        asked.setdefault(phrase.shape, Counter())[phrase.colour] += phrase.count
    terms: list[float] = []
    met: dict[str, bool] = {}
    for shape, colours in asked.items():
        k = sum(colours.values())
        found = Counter(o.colour for o in objects if o.shape == shape)
        n = min(found.total(), MAX_PER_SHAPE)
        terms.append(1 - abs(k - n) / k)
        if n != k:
            terms.append(0.0)  # one zero stands for the colour and the relation, neither checked
            met[shape] = False
            continue
        m = sum(min(count, found[colour]) for colour, count in colours.items())
        terms.append(1 - abs(k - m) / k)
        met[shape] = m == k
    if caption.relation is not None:
        first, second = caption.phrases[0], caption.phrases[1]
        if met[first.shape]:
            if not met[second.shape]:
                terms.append(0.0)  # no target
            else:
                a = [o for o in objects if (o.colour, o.shape) == (first.colour, first.shape)]
                b = [o for o in objects if (o.colour, o.shape) == (second.colour, second.shape)]
                holds = all(_holds(p, caption.relation, q, margin) for p in a for q in b)
                # The reference appends 1 after its pair loop even when the loop appended a 0.
                terms.extend([1.0] if holds else [0.0, 1.0])
    return terms


def score_scenes(
    images: torch.Tensor,
    records: Sequence[PromptRecord],
    score: SceneScore = "exact",
    *,
    colour_threshold: float = 120.0,
    min_area: float = 0.004,
    margin: float = 0.05,
    on_error: OnError = "raise",
) -> torch.Tensor:
    """The ``(B,)`` float32 scores of ``(B, 3, H, W)`` uint8 ``images`` against their records'
    captions: ``"exact"`` (1 when every clause holds), ``"dense"`` (the fraction that hold) or
    ``"graded"`` (GenEval's training reward; the module docstring).

    Raises:
        VerifyError: a caption outside the grammar (``on_error="raise"``; ``"nan"`` scores it NaN).
    """
    if score not in get_args(SceneScore):
        raise ValueError(f"score must be one of {get_args(SceneScore)}, got {score!r}")
    captions: list[ParsedCaption | None] = []
    for i, record in enumerate(records):
        try:
            captions.append(parse_caption(record.instruction))
        except ValueError as error:
            if on_error == "raise":
                raise VerifyError(f"sample {i}: {error}") from None
            captions.append(None)
    detected = detect_objects(images, colour_threshold=colour_threshold, min_area=min_area)
    scores = []
    for caption, objects in zip(captions, detected, strict=True):
        if caption is None:
            scores.append(float("nan"))
        elif score == "graded":
            terms = graded_terms(caption, objects, margin)
            scores.append(sum(terms) / len(terms))
        else:
            clauses = scene_clauses(caption, objects, margin)
            scores.append(sum(clauses) / len(clauses) if score == "dense" else float(all(clauses)))
    return torch.tensor(scores, dtype=torch.float32)


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


def score_edits(
    images: torch.Tensor,
    records: Sequence[PromptRecord],
    *,
    dense: bool = False,
    tolerance: float = 0.06,
    min_move: float = 0.125,
    colour_threshold: float = 120.0,
    min_area: float = 0.004,
    on_error: OnError = "raise",
) -> torch.Tensor:
    """The ``(B,)`` float32 scores of edited ``(B, 3, H, W)`` uint8 ``images`` against their records'
    instructions and reference images (``ref_image``): 1 when every clause holds (``dense``: the
    fraction that hold; the module docstring).

    Raises:
        VerifyError: an instruction outside the grammar, a record without a readable reference, or a
            reference without the object its instruction names (``on_error="raise"``; ``"nan"``
            scores it NaN).
    """
    height, width = images.shape[-2:]
    instructions: list[EditInstruction | None] = []
    references = []
    for i, record in enumerate(records):
        try:  # both or neither: a row whose reference cannot be read keeps no instruction
            instruction, reference = parse_instruction(record.instruction), _decode(record, height, width)
        except (ValueError, OSError) as error:
            if on_error == "raise":
                raise VerifyError(f"sample {i}: {error}") from None
            instructions.append(None)
            references.append(torch.full((3, height, width), 255, dtype=torch.uint8))
            continue
        instructions.append(instruction)
        references.append(reference)
    options = {"colour_threshold": colour_threshold, "min_area": min_area}
    sources = detect_objects(torch.stack(references), **options)
    outputs = detect_objects(images, **options)
    scores = []
    for i, (instruction, source, output) in enumerate(zip(instructions, sources, outputs, strict=True)):
        if instruction is None:
            scores.append(float("nan"))
            continue
        try:
            clauses = edit_clauses(instruction, source, output, tolerance=tolerance, min_move=min_move)
        except ValueError as error:
            if on_error == "raise":
                raise VerifyError(f"sample {i}: {error}") from None
            scores.append(float("nan"))
            continue
        scores.append(sum(clauses) / len(clauses) if dense else float(all(clauses)))
    return torch.tensor(scores, dtype=torch.float32)
