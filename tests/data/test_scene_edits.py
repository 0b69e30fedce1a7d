"""The scene edit pairs (`boogu_data.scene_edits`): seeded, their instructions in the grammar and
unambiguous, the edit exactly what the instruction says, held-out pairs kept out of train."""

from __future__ import annotations

import io
import json

import numpy as np
import pytest
from PIL import Image

from boogu_data.scene_edits import (
    DIRECTIONS,
    MOVE_UNITS,
    OPERATIONS,
    EditInstruction,
    generate_edits,
    parse_instruction,
)
from boogu_data.scenes import CELL, GRID, TEST_PAIRS, VAL_PAIRS, render

EDITS = {split: generate_edits(3, split, 150, layout="grid") for split in ("train", "val", "test")}


def test_seeded_and_every_operation_drawn():
    assert [e.to_json() for e in generate_edits(3, "train", 150, layout="grid")] == [
        e.to_json() for e in EDITS["train"]
    ]
    assert [e.to_json() for e in generate_edits(4, "train", 20, layout="grid")] != [
        e.to_json() for e in EDITS["train"][:20]
    ]
    for edits in EDITS.values():
        assert {e.instruction.op for e in edits} == set(OPERATIONS)


def test_instructions_read_back_and_bad_ones_are_named():
    for edit in (e for edits in EDITS.values() for e in edits):
        assert parse_instruction(edit.instruction.text()) == edit.instruction
    assert parse_instruction("Move the red circle UP.") == EditInstruction(
        "move", "red", "circle", direction="up"
    )
    with pytest.raises(ValueError, match=r"not an edit instruction: 'paint it black' \(expected an edit"):
        parse_instruction("paint it black")
    with pytest.raises(ValueError, match="to its own colour"):
        parse_instruction("make the red circle red")


def test_the_edit_is_what_the_instruction_says_and_nothing_else():
    shift = MOVE_UNITS / GRID
    for edit in (e for edits in EDITS.values() for e in edits):
        ins, source, target = edit.instruction, list(edit.source.objects), list(edit.target())
        pairs = [(o.colour, o.shape) for o in source]
        if ins.op == "add":
            assert (ins.colour, ins.shape) not in pairs and target[:-1] == source
            assert (target[-1].colour, target[-1].shape) == (ins.colour, ins.shape) and len(target) <= 4
            continue
        assert pairs.count((ins.colour, ins.shape)) == 1  # the instruction names one object
        i = edit.referent()
        others = source[:i] + source[i + 1 :]
        if ins.op == "remove":
            assert target == others and target
            continue
        assert target[:i] + target[i + 1 :] == others
        new, old = target[i], source[i]
        if ins.op == "recolour":
            assert (new.shape, new.centre, new.size) == (old.shape, old.centre, old.size)
            assert new.colour == ins.new_colour != old.colour
            assert [(o.colour, o.shape) for o in target].count((new.colour, new.shape)) == 1
        else:
            dx, dy = DIRECTIONS[ins.direction]
            assert new.centre == pytest.approx((old.centre[0] + dx * shift, old.centre[1] + dy * shift))
        # grid layout: every box on whole cells, inside the border cell
        for obj in target:
            side = round(obj.size * GRID)
            for c in obj.centre:
                corner = round(c * GRID) - side // 2
                assert corner % CELL == 0 and CELL <= corner <= GRID - CELL - side


def test_held_out_pairs_stay_out_of_train_in_source_and_result():
    for edit in EDITS["train"]:
        assert not edit.pairs() & (TEST_PAIRS | VAL_PAIRS)
    for edit in EDITS["val"]:
        assert edit.pairs() & VAL_PAIRS and not edit.pairs() & TEST_PAIRS
    for edit in EDITS["test"]:
        assert edit.pairs() & TEST_PAIRS


def test_record_carries_the_reference_render_and_the_spec():
    edit = EDITS["train"][0]
    record = edit.record("train", 7, 64)
    assert record.instruction == edit.instruction.text() and record.ability == "image_edit"
    assert record.data_source == "boogu/scene_edits" and record.index == 7
    reference = np.asarray(Image.open(io.BytesIO(record.ref_image)).convert("RGB"))
    assert np.array_equal(reference, np.asarray(render(edit.source, 64)))
    spec = json.loads(record.ground_truth)
    assert spec["instruction"]["op"] == edit.instruction.op and len(spec["target"]) == len(edit.target())
