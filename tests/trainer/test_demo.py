"""The demos.

* The demo (``trainer`` with no arguments, ``scenes_demo_config``, and its recipe copy
  ``examples/tiny_scenes/scenes_demo.yaml``): the pretrained tiny model trains on the exact scene
  verifier and is judged by it on held-out captions; its ending (base vs trained, ``heldout.json``
  and the before/after grid) is checked here on the random model, fast. (Its held-out gain, a
  9-minute run, is measured in the README and docs/tiny-model.md, not here.) The reward-hacking
  recipe trains on the dense verifier instead.
* The tests' fast run (``demo_config``: the random checkpoint, a reward it can move): its reward
  rises by more than twice the standard error over its 30 steps. (That a reward falls when the advantage's sign is
  flipped, for every algorithm, is checked in ``test_algorithms.py``.)
"""

from __future__ import annotations

import io
import json
import math
from importlib import resources
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from boogu_data.scenes import TAGS, TEST_PAIRS, VAL_PAIRS, Scene, generate_scenes, parse_caption
from boogu_trainer.config import (
    config_to_dict,
    demo_config,
    load_config,
    scenes_demo_config,
    scenes_edit_demo_config,
    scenes_task_config,
)
from boogu_trainer.data import (
    SCENE_EDITS_SIZE,
    SCENES_LAYOUT,
    SCENES_SEED,
    demo_records,
    scene_caption_held_out,
)
from boogu_trainer.demo import HELDOUT_GRID, HELDOUT_JSON, heldout_comparison, paired_summary
from boogu_trainer.metrics import summarize_rewards
from boogu_trainer.trainer import Trainer


def test_paired_summary_is_the_standard_error_of_the_mean_difference():
    s = paired_summary([0.0, 1.0, 0.0, 1.0], [1.0, 1.0, 0.0, 1.0])
    assert s["prompts"] == 4 and s["base"] == 0.5 and s["trained"] == 0.75 and s["diff"] == 0.25
    # differences 1, 0, 0, 0: sample variance 0.25, so the standard error is sqrt(0.25 / 4).
    assert s["se_diff"] == pytest.approx(0.25)
    assert math.isnan(paired_summary([1.0], [0.0])["se_diff"])
    with pytest.raises(ValueError, match="equal, non-zero lengths"):
        paired_summary([1.0], [])


SCENES = Path(__file__).resolve().parents[2] / "examples" / "tiny_scenes"


def test_the_demo_recipe_is_the_demo_and_the_hacking_recipe_trains_on_the_proxy():
    # `trainer` with no arguments and its recipe copy run the same settings (but the run name).
    demo = config_to_dict(load_config(str(SCENES / "scenes_demo.yaml"), ["logging.name=demo"]))
    assert demo == config_to_dict(scenes_demo_config())
    # the quicker recipe is the scenes task the benchmarks build on
    quick = config_to_dict(load_config(str(SCENES / "scenes_quick.yaml"), ["logging.name=demo"]))
    assert quick == config_to_dict(scenes_task_config())
    for config in (scenes_demo_config(), load_config(str(SCENES / "reward_hacking.yaml"), [])):
        assert config.model.tiny == "scenes" and not config.model.path and config.data.demo_set == "scenes"
        assert not config.data.train_files and not config.data.val_files  # built-in prompts
        assert config.data.demo_eval_split == "heldout"
        assert [r.name for r in config.eval.rewards] == ["scene_exact"]
        assert config.eval.every > 0 and config.total_steps % config.eval.every == 0
        assert config.eval.num_prompts >= 200
    # the demo trains on the gold itself; the testbed on the partial-credit proxy
    assert [r.name for r in scenes_demo_config().reward.rewards] == ["scene_exact"]
    hacking = load_config(str(SCENES / "reward_hacking.yaml"), [])
    assert [r.name for r in hacking.reward.rewards] == ["scene_dense"] and hacking.eval.stop_on_divergence > 0


def test_built_in_scene_prompts_hold_out_captions_and_colour_shape_pairs():
    train = demo_records(400, "scenes")
    heldout = demo_records(200, "scenes", split="heldout")
    test = demo_records(50, "scenes", split="test")
    assert [r.index for r in train] == list(range(400)) and {r.split for r in heldout} == {"heldout"}
    for record in train + heldout + test:
        parse_caption(record.instruction)  # in the verifier's grammar
        assert Scene.from_json(record.ground_truth).caption() == record.instruction
    # Held-out captions never occur among the training prompts (nor would in a longer run).
    assert all(scene_caption_held_out(r.instruction) for r in heldout)
    assert not any(scene_caption_held_out(r.instruction) for r in train)
    assert not {r.instruction for r in train} & {r.instruction for r in heldout}
    # Every task type is in both; both are train-split scenes (no held-out colour-shape pair).
    assert {r.ability for r in train} == {r.ability for r in heldout} == set(TAGS)
    for record in train + heldout:
        assert not (Scene.from_json(record.ground_truth).pairs() & (TEST_PAIRS | VAL_PAIRS))
    assert all(Scene.from_json(r.ground_truth).pairs() & TEST_PAIRS for r in test)
    # The committed checkpoint's pretraining scenes, in stream order, divided by caption.
    report = json.loads(
        resources.files("boogu_tiny").joinpath("assets/tiny_scenes/pretrain_report.json").read_text()
    )
    assert (report["config"]["seed"], report["config"]["scene_layout"]) == (SCENES_SEED, SCENES_LAYOUT)
    stream = generate_scenes(SCENES_SEED, "train", 600, layout=SCENES_LAYOUT)
    assert [s.to_json() for s in stream if not scene_caption_held_out(s.caption())][:100] == [
        r.ground_truth for r in train[:100]
    ]
    with pytest.raises(ValueError, match="no built-in 'ocr' prompts of split 'test'"):
        demo_records(4, "ocr", split="test")
    with pytest.raises(ValueError, match="no built-in scenes prompts of split 'unseen'"):
        demo_records(4, "scenes", split="unseen")


def test_the_edit_demo_is_its_pre_registered_candidate():
    # The candidate's ten-seed table (benchmarks/README.md) ran edit_demo_partial_credit.yaml; it won,
    # so the demo is those settings: the table describes `trainer edit` only while they stay equal.
    candidate = config_to_dict(load_config(str(SCENES / "edit_demo_partial_credit.yaml"), []))
    demo = config_to_dict(scenes_edit_demo_config())
    assert candidate["logging"]["name"] == "edit_demo_partial_credit"
    assert demo["logging"]["name"] == "edit_demo"
    del candidate["logging"]["name"], demo["logging"]["name"]
    assert candidate == demo


def test_the_edit_demo_recipe_is_the_edit_demo(capsys):
    # `trainer edit` (a built-in recipe by name) and its recipe copy run the same settings: the T2I
    # demo's learner on the edit pairs, with the Edit checkpoint and the edit verifier.
    recipe = config_to_dict(load_config(str(SCENES / "edit_demo.yaml"), []))
    assert recipe == config_to_dict(scenes_edit_demo_config())
    config = scenes_edit_demo_config()
    assert config.model.tiny == "scenes_edit" and not config.model.path
    assert config.data.demo_set == "scene_edits" and not config.data.train_files and not config.data.val_files
    # Trained on the verdict plus its partial credit (weights 1 and 1), judged by the verdict alone.
    assert [(r.name, r.weight) for r in config.reward.rewards] == [
        ("scene_edit_exact", 1.0),
        ("scene_edit_dense", 1.0),
    ]
    assert [r.name for r in config.eval.rewards] == ["scene_edit_exact"]
    assert (
        config.eval.every > 0
        and config.total_steps % config.eval.every == 0
        and config.eval.num_prompts >= 200
    )
    from boogu_trainer.cli import main

    assert main(["edit", "--print-config", "total_steps=3"]) == 0
    printed = capsys.readouterr().out
    assert (
        "tiny: scenes_edit" in printed and "demo_set: scene_edits" in printed and "total_steps: 3" in printed
    )


def test_built_in_edit_pairs_hold_out_instructions_and_colour_shape_pairs():
    from boogu_data.scene_edits import generate_edits
    from boogu_tiny.verify import score_edits

    train = demo_records(300, "scene_edits")
    heldout = demo_records(100, "scene_edits", split="heldout")
    test = demo_records(30, "scene_edits", split="test")
    assert [r.index for r in train] == list(range(300)) and {r.split for r in heldout} == {"heldout"}
    assert all(r.ability == "image_edit" and r.ref_image is not None for r in train + heldout + test)
    assert all(scene_caption_held_out(r.instruction) for r in heldout)
    assert not any(scene_caption_held_out(r.instruction) for r in train)
    assert not {r.instruction for r in train} & {r.instruction for r in heldout}
    ops = {json.loads(r.ground_truth)["instruction"]["op"] for r in heldout}
    assert ops == {"recolour", "add", "remove", "move"}
    # The train split's pairs in stream order (the Edit build's), divided by instruction; 64-pixel references.
    stream = generate_edits(SCENES_SEED, "train", 500, layout=SCENES_LAYOUT)
    assert [e.to_json() for e in stream if not scene_caption_held_out(e.instruction.text())][:50] == [
        r.ground_truth for r in train[:50]
    ]
    assert Image.open(io.BytesIO(train[0].ref_image)).size == (SCENE_EDITS_SIZE, SCENE_EDITS_SIZE)
    # The verifier reads them: the reference itself is no edit (nothing changed), so it fails.
    refs = torch.stack(
        [
            torch.from_numpy(np.asarray(Image.open(io.BytesIO(r.ref_image)).convert("RGB")).copy()).permute(
                2, 0, 1
            )
            for r in test
        ]
    )
    assert score_edits(refs, test).sum() == 0
    with pytest.raises(ValueError, match="no built-in scene_edits prompts of split 'unseen'"):
        demo_records(4, "scene_edits", split="unseen")


def _quick_heldout_config(tiny_checkpoint, tmp_path, *extra: str):
    """One fast step on the random tiny model (a reward it moves in one step), evaluated at step 1."""
    return load_config(
        None,
        [
            f"model.path={tiny_checkpoint}",
            "data.prompts_per_step=2",
            "algorithm.group_size=2",
            "sampler.num_steps=3",
            "sampler.window_range=[0,2]",
            "sampler.window_size=1",
            "eval.every=1",
            "eval.num_steps=2",
            "reward.rewards=[{name: demo_brightness}]",  # moves the random model in one step
            "total_steps=1",
            f"logging.run_dir={tmp_path}",
            "logging.progress=false",
            "logging.sample_every=0",
            "logging.plot_every=0",
            "checkpoint.save_every=0",
            *extra,
        ],
        base=demo_config(),
    )


def test_the_held_out_comparison_of_edits_shows_the_reference(tiny_checkpoint, tmp_path):
    """Edit rows: the grid puts each instruction's reference image above its base and trained edits."""
    from boogu_trainer import demo as demo_module

    config = _quick_heldout_config(
        tiny_checkpoint,
        tmp_path,
        "data.demo_set=scene_edits",
        "sampler.image_guidance_scale=1.5",
        "eval.num_prompts=3",
        "eval.rewards=[{name: scene_edit_exact}]",
    )
    grids = []
    real = demo_module.sample_grid

    def spy(images, captions, path, **kwargs):
        grids.append((images, captions))
        return real(images, captions, path, **kwargs)

    trainer = Trainer(config)
    try:
        trainer.train()
        import unittest.mock

        with unittest.mock.patch.object(demo_module, "sample_grid", spy):
            summary = heldout_comparison(trainer, tmp_path / "out")
    finally:
        trainer.close()
    assert summary["prompts"] == 3 and summary["sampler"]["image_guidance_scale"] == 1.5
    ((images, captions),) = grids
    assert (
        images.shape[0] == 9
        and [c.split(" ")[0] for c in captions] == ["reference"] * 3 + ["base"] * 3 + ["trained"] * 3
    )
    records = trainer.evaluator.records
    for i in range(3):
        expected = np.asarray(Image.open(io.BytesIO(records[i].ref_image)).convert("RGB"))
        assert np.array_equal(images[i].permute(1, 2, 0).numpy(), expected)


def test_the_held_out_comparison_scores_the_base_with_the_lora_off(tiny_checkpoint, tmp_path):
    """On the random tiny model (fast): 'base' is the evaluation of the model before any update (LoRA
    switched off, bit for bit), 'trained' the one after; the files are written."""
    config = _quick_heldout_config(
        tiny_checkpoint,
        tmp_path,
        "data.demo_set=scenes",
        "eval.num_prompts=4",
        "eval.rewards=[{name: scene_exact}]",
        "optim.lr=0.05",
    )
    trainer = Trainer(config)
    try:
        before = trainer.evaluator.evaluate(step=0)
        trainer.train()
        summary = heldout_comparison(trainer, tmp_path / "out")
    finally:
        trainer.close()
    assert (
        summary["prompts"] == 4 and summary["step"] == 1 and summary["gold_rewards"] == {"scene_exact": 1.0}
    )
    assert summary["sampler"] == {
        "num_steps": 2,
        "guidance_scale": 2.0,
        "image_guidance_scale": 1.0,
        "seed": 0,
        "kind": "ode",
    }
    written = json.loads((tmp_path / "out" / HELDOUT_JSON).read_text())
    assert written == json.loads(json.dumps(summary))
    assert (tmp_path / "out" / HELDOUT_GRID).stat().st_size > 0
    # The base images are the pre-training images exactly; the trained ones moved.
    base_again = json.loads((tmp_path / "out" / HELDOUT_JSON).read_text())["base"]
    assert base_again == pytest.approx(before.gold)
    with_lora = trainer.evaluator.evaluate(step=1)
    assert not torch.equal(with_lora.images, before.images)
    # 'trained' reused the run's own evaluation of step 1 (eval.every=1), which is this sampling.
    assert trainer.last_evaluation is not None and trainer.last_evaluation.step == 1
    assert torch.equal(trainer.last_evaluation.images, with_lora.images)
    assert summary["trained"] == pytest.approx(with_lora.gold)


@pytest.mark.slow
def test_demo_reward_rises(tiny_checkpoint, tmp_path):
    config = load_config(
        None,
        [
            f"model.path={tiny_checkpoint}",
            f"logging.run_dir={tmp_path}",
            "logging.progress=false",
            "logging.sample_every=0",
            "logging.plot_every=0",
            "checkpoint.save_every=0",
        ],
        base=demo_config(),
    )
    trainer = Trainer(config)
    history = trainer.train()
    assert len(history) == config.total_steps
    lines = [json.loads(line) for line in (trainer.run_dir / "metrics.jsonl").read_text().splitlines()]
    assert len(lines) == config.total_steps
    assert not (trainer.run_dir / "reward_curve.png").exists()  # logging.plot_every=0: never drawn
    assert all(0 < r["perf/mfu"] < 1 and r["perf/tflops_per_image"] > 0 for r in lines)
    s = summarize_rewards(history)
    assert s["window"] == 5
    assert s["gain"] > 2 * s["stderr"], s
    # The compute accounting of every step: forward-equivalents by phase and the run's totals.
    assert all(r["fe/total_per_image"] == r["fe/rollout_per_image"] + r["fe/train_per_image"] for r in lines)
    assert lines[-1]["cum/images"] == config.total_steps * 32 and lines[-1]["cum/fe"] > 0
