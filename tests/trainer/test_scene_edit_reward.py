"""The scene edit verifier (`scene_edit_exact`, `scene_edit_dense`): the edited scene passes, the
unedited one and every render with one thing wrong fail, and it builds and errs like every reward."""

from __future__ import annotations

import dataclasses
import math

import numpy as np
import pytest
import torch

from boogu_data import PromptRecord
from boogu_data.scene_edits import DIRECTIONS, MOVE_UNITS, SceneEdit, generate_edits
from boogu_data.scenes import COLOURS, GRID, SceneObject, render_objects
from boogu_trainer.rewards import RewardError, build_reward, build_rewards, validate_reward_spec

EXACT, DENSE = build_reward("scene_edit_exact"), build_reward("scene_edit_dense")
# 600 pairs: both layouts, all three splits, every operation.
EDITS = [
    e
    for layout in ("grid", "free")
    for split in ("train", "val", "test")
    for e in generate_edits(5, split, 100, layout=layout)
]


def batch(objects_list, size: int) -> torch.Tensor:
    return torch.stack(
        [torch.from_numpy(np.asarray(render_objects(o, size)).copy()).permute(2, 0, 1) for o in objects_list]
    )


def records(edits: list[SceneEdit], size: int) -> list[PromptRecord]:
    return [e.record("train", i, size) for i, e in enumerate(edits)]


@pytest.mark.parametrize("size", [64, 128])
def test_the_edited_scene_passes_and_the_unedited_one_fails(size):
    recs = records(EDITS, size)
    assert EXACT(batch([e.target() for e in EDITS], size), recs).tolist() == [1.0] * len(EDITS)
    assert DENSE(batch([e.target() for e in EDITS], size), recs).tolist() == [1.0] * len(EDITS)
    unedited = EXACT(batch([e.source.objects for e in EDITS], size), recs)
    assert unedited.sum().item() == 0  # returning the reference is never the edit
    dense = DENSE(batch([e.source.objects for e in EDITS], size), recs)
    assert ((dense > 0) & (dense < 1)).float().mean() > 0.9  # the kept objects earn partial credit


def _moved(obj: SceneObject, dx: int, dy: int) -> SceneObject:
    shift = MOVE_UNITS / GRID
    x = min(max(obj.centre[0] + dx * shift, 0.0), 1.0)
    y = min(max(obj.centre[1] + dy * shift, 0.0), 1.0)
    return dataclasses.replace(obj, centre=(x, y))


def wrong_variants(edit: SceneEdit) -> dict[str, tuple[SceneObject, ...]]:
    """The edited scene with one thing wrong (those that apply to this edit)."""
    ins, target = edit.instruction, list(edit.target())
    out: dict[str, tuple[SceneObject, ...]] = {}
    keep = [i for i in range(len(target)) if i != _index(edit, target)]
    if keep:  # another object moved away by a quarter of the side (it is not where it was)
        i = keep[0]
        other = target[i]
        dx = -1 if other.centre[0] > 0.5 else 1
        out["another object moved"] = tuple(_moved(o, dx, 0) if j == i else o for j, o in enumerate(target))
    if ins.op == "recolour":
        wrong = next(c for c in COLOURS if c not in (ins.colour, ins.new_colour))
        i = edit.referent()
        out["the wrong colour"] = tuple(
            dataclasses.replace(o, colour=wrong) if j == i else o for j, o in enumerate(target)
        )
    if ins.op == "move":
        dx, dy = DIRECTIONS[ins.direction]
        i = edit.referent()
        out["moved the other way"] = tuple(
            _moved(o, -2 * dx, -2 * dy) if j == i else o for j, o in enumerate(target)
        )
    if ins.op == "remove":
        out["removed one more"] = tuple(target[1:])
    if ins.op == "add":
        out["added nothing"] = tuple(target[:-1])
    return out


def _index(edit: SceneEdit, target: list[SceneObject]) -> int:
    """The edited object's index in the target (-1 for remove: it is gone)."""
    if edit.instruction.op == "add":
        return len(target) - 1
    return -1 if edit.instruction.op == "remove" else edit.referent()


def test_one_thing_wrong_fails():
    cases = [(edit, name, objects) for edit in EDITS for name, objects in wrong_variants(edit).items()]
    assert len({name for _, name, _ in cases}) == 5 and len(cases) > 600
    scores = EXACT(
        batch([objects for _, _, objects in cases], 64), [e.record("train", 0, 64) for e, _, _ in cases]
    )
    passed = [
        f"{e.instruction.text()}: {name}" for (e, name, _), s in zip(cases, scores.tolist()) if s != 0.0
    ]
    assert not passed, passed[:10]  # (the issue asks >= 98%; all 1105 fail)


def test_builds_from_the_registry_and_names_bad_input():
    assert build_rewards([{"name": "scene_edit_exact"}]).terms[0][2].pass_fail
    assert not DENSE.pass_fail
    with pytest.raises(ValueError, match=r"tolerance must be a number in \(0.0, 0.5\), got 2"):
        validate_reward_spec("scene_edit_exact", {"tolerance": 2})
    edit = next(e for e in EDITS if e.instruction.op == "move")
    image = batch([edit.target()], 64)
    record = edit.record("train", 0, 64)
    with pytest.raises(
        RewardError, match=r"'scene_edit_exact', sample 0: not an edit instruction: 'draw a cat'"
    ):
        EXACT(image, [dataclasses.replace(record, instruction="draw a cat")])
    absent = next(c for c in COLOURS if (c, edit.instruction.shape) not in edit.source.pairs())
    bad = dataclasses.replace(record, instruction=f"remove the {absent} {edit.instruction.shape}")
    with pytest.raises(RewardError, match=rf"holds 0 {absent} {edit.instruction.shape}\(s\)"):
        EXACT(image, [bad])
    with pytest.raises(RewardError, match="no reference image"):
        EXACT(image, [dataclasses.replace(record, ref_image=None)])
    lenient = build_reward("scene_edit_exact", on_error="nan")
    scores = lenient(torch.cat([image, image]), [bad, record])
    assert math.isnan(scores[0].item()) and scores[1].item() == 1.0


def test_the_edits_command_output_loads_and_scores_one(tmp_path):
    from PIL import Image

    from boogu_data.cli import main as boogu_data
    from boogu_trainer.data import load_sourced_records

    out = tmp_path / "edits"
    argv = ["scenes", "--edits", "--layout", "grid", "--output-dir", str(out), "--count", "24"]
    assert boogu_data([*argv, "--val-count", "4", "--test-count", "4"]) == 0
    loaded, _ = load_sourced_records([str(out / "train.parquet"), str(out / "val.parquet")])
    assert len(loaded) == 28 and all(r.ref_image and r.ability == "image_edit" for r in loaded)
    targets = [Image.open(out / "images" / r.split / f"{r.index:05d}.png").convert("RGB") for r in loaded]
    images = torch.stack([torch.from_numpy(np.asarray(t).copy()).permute(2, 0, 1) for t in targets])
    assert EXACT(images, loaded).tolist() == [1.0] * 28
