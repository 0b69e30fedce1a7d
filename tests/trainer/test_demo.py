"""The built-in demo learns: its reward rises by more than twice the standard error, and falls
when the advantage sign is flipped (the check that the sign convention is not silently wrong)."""

from __future__ import annotations

import json

import pytest

from boogu_trainer.config import demo_config, load_config
from boogu_trainer.loop import Trainer
from boogu_trainer.metrics import summarize_rewards


@pytest.mark.slow
@pytest.mark.parametrize("sign", [1, -1])
def test_demo_reward_moves_with_the_advantage_sign(sign, tiny_checkpoint, tmp_path):
    config = load_config(
        None,
        [
            f"model.path={tiny_checkpoint}",
            f"algorithm.advantage_sign={sign}",
            f"logging.run_dir={tmp_path}",
            "logging.progress=false",
            "logging.sample_every=0",
            "checkpoint.save_every=0",
        ],
        base=demo_config(),
    )
    trainer = Trainer(config)
    history = trainer.train()
    assert len(history) == config.total_steps
    lines = [json.loads(line) for line in (trainer.run_dir / "metrics.jsonl").read_text().splitlines()]
    assert len(lines) == config.total_steps
    assert all(0 < r["perf/mfu"] < 1 and r["perf/tflops_per_image"] > 0 for r in lines)
    s = summarize_rewards(history)
    assert s["window"] == 5
    if sign > 0:
        assert s["gain"] > 2 * s["stderr"], s
    else:
        assert -s["gain"] > 2 * s["stderr"], s
