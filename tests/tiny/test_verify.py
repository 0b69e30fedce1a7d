"""The organism's verifier as the pretraining builds call it (`boogu_tiny.verify.score_scenes` and
`score_edits`, no reward registry): the same scores as the trainer's rewards, and a row it cannot
judge is a `VerifyError` naming the sample, or NaN with ``on_error="nan"``."""

from __future__ import annotations

import dataclasses
import math

import numpy as np
import pytest
import torch

from boogu_data import PromptRecord
from boogu_data.scene_edits import generate_edits
from boogu_data.scenes import generate_scenes, render, render_objects
from boogu_tiny.verify import VerifyError, score_edits, score_scenes
from boogu_trainer.rewards import build_reward


def _batch(images) -> torch.Tensor:
    return torch.stack([torch.from_numpy(np.asarray(image).copy()).permute(2, 0, 1) for image in images])


def test_scene_scores_are_the_rewards_and_a_bad_caption_is_named():
    scenes = generate_scenes(3, "train", 24)
    records = [PromptRecord(s.caption()) for s in scenes]
    # Half the images drawn for the next caption: wrong for most, so the scores are not all one value.
    images = _batch([render(s, 64) for s in scenes[:12]] + [render(s, 64) for s in scenes[13:] + scenes[:1]])
    for score in ("exact", "dense", "graded"):
        ours = score_scenes(images, records, score)
        assert torch.equal(ours, build_reward(f"scene_{score}")(images, records)), score
    assert score_scenes(images, records, "exact")[:12].tolist() == [1.0] * 12
    assert score_scenes(images, records, "exact")[12:].sum() < 12
    bad = [*records[:2], PromptRecord("draw a cat"), *records[3:]]
    with pytest.raises(VerifyError, match="sample 2: "):
        score_scenes(images, bad)
    lenient = score_scenes(images, bad, on_error="nan")
    assert math.isnan(lenient[2].item()) and lenient[0].item() == 1.0
    with pytest.raises(ValueError, match="score must be one of"):
        score_scenes(images, records, "strict")


def test_edit_scores_are_the_rewards_and_a_bad_row_is_named():
    edits = generate_edits(4, "train", 16)
    records = [e.record("train", i, 64) for i, e in enumerate(edits)]
    done = _batch([render_objects(e.target(), 64) for e in edits])
    undone = _batch([render_objects(e.source.objects, 64) for e in edits])
    assert score_edits(done, records).tolist() == [1.0] * len(edits)
    assert score_edits(undone, records).sum() == 0
    for dense in (False, True):
        reward = build_reward("scene_edit_dense" if dense else "scene_edit_exact")
        assert torch.equal(score_edits(undone, records, dense=dense), reward(undone, records))
    bad = [dataclasses.replace(records[0], ref_image=None), *records[1:]]
    with pytest.raises(VerifyError, match="sample 0: the record has no reference image"):
        score_edits(done, bad)
    lenient = score_edits(done, bad, on_error="nan")
    assert math.isnan(lenient[0].item()) and lenient[1:].tolist() == [1.0] * (len(edits) - 1)
