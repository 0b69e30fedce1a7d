"""Evaluation that catches reward hacking: per-reward balance metrics, held-out gold rewards,
``checkpoint.keep_best`` (``checkpoints/best.json``) and ``eval.stop_on_divergence``."""

from __future__ import annotations

import json
import logging
import math

import pytest
import torch
import yaml

from boogu_data import PromptRecord, write_records
from boogu_trainer.checkpoint import (
    Checkpointer,
    checkpoint_folders,
    load_checkpoint,
)
from boogu_trainer.config import load_config
from boogu_trainer.distributed import DistEnv
from boogu_trainer.evaluation import GoldTracker
from boogu_trainer.scoring import reward_metrics
from boogu_trainer.trainer import Trainer, TrainingStopped
from tests.trainer.test_loop import small_config

HERE = "tests.trainer.test_eval_gold"


# ---- rewards whose values are known in advance (one instance per built WeightedRewards) -------------
class Scheduled:
    """Call ``c`` scores every image ``values[min(c, len - 1)]``: a gold score with a known course."""

    def __init__(self, values):
        self.values = list(values)
        self.calls = 0

    def __call__(self, images, records):
        value = self.values[min(self.calls, len(self.values) - 1)]
        self.calls += 1
        return torch.full((images.shape[0],), float(value))


class Rising:
    """A training reward that rises by 1 on every call, whatever the images (with a small spread
    within the batch, so that groups are not constant)."""

    def __init__(self):
        self.calls = 0

    def __call__(self, images, records):
        self.calls += 1
        return self.calls + 0.01 * torch.arange(images.shape[0], dtype=torch.float32)


# ---- metrics without a model ------------------------------------------------------------------------
def test_reward_metrics_per_reward_balance_and_correlation():
    group_id = torch.tensor([0, 0, 1, 1, 2, 2])
    a = torch.tensor([1.0, 2.0, 3.0, 3.0, 5.0, 6.0])  # group 1 constant
    b = -2 * a + 1  # perfectly anti-correlated with a
    c = torch.tensor([0.0, 0.0, 1.0, 1.0, float("nan"), 2.0])  # every group constant (NaN ignored)
    m = reward_metrics({"reward": a + b, "a": a, "b": b, "c": c}, group_id=group_id)
    assert m["a/mean"] == pytest.approx(float(a.mean()))
    assert m["a/std"] == pytest.approx(float(a.std(unbiased=False)))
    assert m["a/zero_std_share"] == pytest.approx(1 / 3)
    assert m["c/zero_std_share"] == 1.0
    assert m["reward_corr/a~b"] == pytest.approx(-1.0)
    assert m["reward_corr/a~c"] == pytest.approx(
        float(torch.corrcoef(torch.stack([a[[0, 1, 2, 3, 5]], c[[0, 1, 2, 3, 5]]]))[0, 1])
    )
    assert set(k for k in m if k.startswith("reward_corr/")) == {
        "reward_corr/a~b",
        "reward_corr/a~c",
        "reward_corr/b~c",
    }
    one = reward_metrics({"reward": a, "a": a}, group_id=group_id)
    assert not any(k.startswith("reward_corr/") for k in one)
    assert math.isnan(reward_metrics({"x": torch.ones(3), "y": torch.arange(3.0)})["reward_corr/x~y"])


def test_gold_tracker_best_and_divergence_streak():
    t = GoldTracker(k=2)
    course = [(1.0, 0.5), (2.0, 0.4), (2.5, 0.6), (3.0, 0.5), (4.0, 0.3)]  # (train, gold) per evaluation
    verdicts = []
    for i, (train, gold) in enumerate(course):
        t.observe_step(train)
        verdicts.append(t.evaluation(i + 1, gold, f"step_{i + 1:06d}"))
    assert [v.new_best for v in verdicts] == [True, False, True, False, False]
    assert [v.diverging for v in verdicts] == [False, False, False, False, True]
    assert t.best == {"step": 3, "gold": 0.6, "folder": "step_000003"}
    assert (
        "2.5000 -> 3.0000 -> 4.0000" in verdicts[-1].message
        and "0.6000 -> 0.5000 -> 0.3000" in verdicts[-1].message
    )
    again = GoldTracker(k=2)
    again.load_state_dict(json.loads(json.dumps(t.state_dict())))
    assert again.state_dict() == t.state_dict()


def test_pruning_spares_the_best_and_a_resume_restores_the_pointer(tmp_path):
    cfg = load_config(
        None,
        [
            f"logging.run_dir={tmp_path}",
            "logging.name=run",
            "checkpoint.keep_last=1",
            "checkpoint.keep_best=true",
            "eval.every=1",  # keep_best acts on evaluations: it needs both
            "data.val_files=[val.parquet]",
        ],
    )
    c = Checkpointer(cfg, DistEnv())

    def contents(step):
        return {
            "learner": {
                "lora": {"blocks.0.to_q.lora_A.weight": torch.full((2, 3), float(step))},
                "lora_config": {"r": 2},
                "optimizer_tensors": {"p::exp_avg": torch.zeros(2, 3)},
                "optimizer_meta": {"param_groups": [], "names": ["p"]},
            },
            "trainer": {"step": step},
        }

    c.mark_best(1, 0.7, c.save(1, contents(1)))
    c.save(2, contents(2))
    assert [s for s, _ in checkpoint_folders(c.root)] == [1, 2]
    c.save(3, contents(3))
    assert [s for s, _ in checkpoint_folders(c.root)] == [1, 3]  # keep_last=1 plus the best
    c.mark_best(3, 0.9)
    assert [s for s, _ in checkpoint_folders(c.root)] == [3]  # the old best is pruned once replaced
    assert (
        c.best() == {"step": 3, "gold": 0.9, "folder": "step_000003"}
        and c.best_folder() == c.root / "step_000003"
    )
    c.restore_best(None)  # resumed from a state that had no best yet
    assert c.best() is None


# ---- the trainer on the tiny checkpoint -------------------------------------------------------------
def _val_file(tmp_path):
    path = tmp_path / "val.parquet"
    write_records(
        [
            PromptRecord(instruction=t, ground_truth="x", index=i)
            for i, t in enumerate(["a red cat", "a blue sign"])
        ],
        path,
    )
    return path


def _config(tiny_checkpoint, tmp_path, *overrides):
    return small_config(
        tiny_checkpoint,
        tmp_path,
        f"data.val_files=[{_val_file(tmp_path)}]",
        "eval.every=1",
        "eval.num_steps=2",
        "eval.num_prompts=2",
        "algorithm.group_size=2",
        "logging.sample_every=0",
        "logging.plot_every=0",
        *overrides,
    )


def test_keep_best_follows_the_gold_score(tiny_checkpoint, tmp_path):
    gold = [0.2, 0.5, 0.3, 0.1]  # evaluations at steps 1..4: the best is step 2's
    cfg = _config(
        tiny_checkpoint,
        tmp_path,
        "total_steps=4",
        "checkpoint.save_every=0",
        "checkpoint.keep_last=1",
        "checkpoint.keep_best=true",
        "reward.rewards=[{name: demo_brightness}, {name: demo_contrast, weight: 0.5}]",
        f"eval.rewards=[{{name: '{HERE}:Scheduled', label: gold, kwargs: {{values: {gold}}}}}]",
    )
    trainer = Trainer(cfg)
    bests = []
    trainer.train(progress=lambda step, rec: bests.append(trainer.checkpointer.best()["step"]))
    run = trainer.run_dir
    assert bests == [1, 2, 2, 2]
    assert [s for s, _ in checkpoint_folders(run / "checkpoints")] == [2, 4]  # keep_last=1 + the best
    best = json.loads((run / "checkpoints" / "best.json").read_text())
    assert best == {"step": 2, "gold": 0.5, "folder": "step_000002"}
    assert load_checkpoint(run / "checkpoints" / "step_000002").state["gold"]["best"]["step"] == 2
    assert load_checkpoint(run / "checkpoints" / "step_000004").state["gold"]["best"]["gold"] == 0.5

    lines = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r["eval/gold"] for r in lines] == pytest.approx(gold)
    assert [r["eval/gold/mean"] for r in lines] == pytest.approx(gold)
    for key in (
        "eval/reward/mean",
        "demo_brightness/zero_std_share",
        "demo_contrast/std",
        "reward_corr/demo_brightness~demo_contrast",
    ):
        assert all(key in r for r in lines), key
    step2 = run / "eval" / "step_000002"
    assert sorted(p.name for p in step2.iterdir()) == [
        "grid.png",
        "prompt_000.png",
        "prompt_001.png",
        "scores.json",
    ]
    scores = json.loads((step2 / "scores.json").read_text())
    assert [p["prompt"] for p in scores["prompts"]] == ["a red cat", "a blue sign"]
    assert all(
        p["gold"] == 0.5 and set(p["scores"]) == {"gold", "demo_brightness", "demo_contrast"}
        for p in scores["prompts"]
    )
    from PIL import Image

    assert Image.open(step2 / "grid.png").size == (2 * 128, 2 * (128 + 46))  # before above after


@pytest.mark.parametrize("action", ["warn", "stop"])
def test_a_forced_divergence_warns_or_stops_with_a_checkpoint(tiny_checkpoint, tmp_path, caplog, action):
    # The training reward rises on every call; the gold score falls at every evaluation.
    cfg = _config(
        tiny_checkpoint,
        tmp_path,
        "total_steps=4",
        "checkpoint.save_every=0",
        f"reward.rewards=[{{name: '{HERE}:Rising'}}]",
        f"eval.rewards=[{{name: '{HERE}:Scheduled', label: gold, kwargs: {{values: [0.9, 0.8, 0.7, 0.6]}}}}]",
        "eval.stop_on_divergence=2",
        f"eval.divergence_action={action}",
    )
    trainer = Trainer(cfg)
    with caplog.at_level(logging.WARNING, logger="boogu_trainer"):
        if action == "stop":
            with pytest.raises(
                TrainingStopped, match=r"gold evaluation score fell \(0\.9000 -> 0\.8000 -> 0\.7000\)"
            ):
                trainer.train()
        else:
            trainer.train()
    warnings = [r.getMessage() for r in caplog.records if "gold evaluation score fell" in r.getMessage()]
    assert len(warnings) == (1 if action == "stop" else 2)  # at the 3rd evaluation (and the 4th)
    assert trainer.step == (3 if action == "stop" else 4)
    steps = [s for s, _ in checkpoint_folders(trainer.run_dir / "checkpoints")]
    assert steps == ([3] if action == "stop" else [4])
    if action == "stop":
        state = load_checkpoint(trainer.run_dir / "checkpoints" / "step_000003").state["gold"]
        assert state["streak"] == 2 and [e["gold"] for e in state["evals"]] == pytest.approx([0.9, 0.8, 0.7])
        cfg2 = yaml.safe_load((trainer.run_dir / "config.yaml").read_text())
        assert cfg2["eval"]["divergence_action"] == "stop"


def test_the_evaluation_samples_at_its_own_guidance_scale(tiny_checkpoint, tmp_path):
    """CFG-free rollouts (sampler.guidance_scale=1) judged at the usual CFG (eval.guidance_scale):
    every rollout request has no CFG, every evaluation request the evaluation's, and the images
    equal a CFG-2 run's evaluation of the same weights."""
    cfg = _config(tiny_checkpoint, tmp_path, "sampler.guidance_scale=1.0", "eval.guidance_scale=2.0")
    trainer = Trainer(cfg)
    seen = []
    generate = trainer.engine.generate

    def spy(request):
        seen.append((request.decode, request.guidance_scale, request.num_steps))
        return generate(request)

    trainer.engine.generate = spy
    try:
        assert trainer.evaluator.guidance_scale == 2.0
        own = trainer.evaluator.evaluate(step=0)
        trainer.train_step()
    finally:
        trainer.close()
    assert seen[0] == (True, 2.0, 2)  # the evaluation: eval.num_steps, eval.guidance_scale
    assert all(g == 1.0 for _, g, steps in seen[1:] if steps == 4)  # the rollouts: sampler's
    assert any(steps == 4 for _, _, steps in seen[1:])
    (tmp_path / "plain").mkdir()
    plain = Trainer(_config(tiny_checkpoint, tmp_path / "plain", "sampler.guidance_scale=2.0"))
    try:
        reference = plain.evaluator.evaluate(step=0)
    finally:
        plain.close()
    assert torch.equal(own.images, reference.images)
