"""The built-in demo learns: its reward rises by more than twice the standard error over its 30
steps. (That it falls when the advantage's sign is flipped, for every algorithm, is checked in
``test_algorithms.py`` on a few steps and a paired evaluation, far cheaper than a second demo.)"""

from __future__ import annotations

import json

import pytest

from boogu_trainer.config import demo_config, load_config
from boogu_trainer.metrics import summarize_rewards
from boogu_trainer.trainer import Trainer


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
