"""The ``trainer`` command as a user meets it: the start banner, the end-of-run verdict, and bad data
stopped at start-up (not at the step that draws it) with the file and row named."""

from __future__ import annotations

import pytest

from boogu_data import PromptRecord, write_records
from boogu_trainer.cli import main
from boogu_trainer.metrics import reward_verdict, summarize_rewards
from boogu_trainer.trainer import Trainer
from tests.trainer.test_data import LONG_PROMPT
from tests.trainer.test_loop import small_config


def args(tiny_checkpoint, run_dir, *extra: str) -> list[str]:
    """A tiny run of `trainer` without a recipe (on the scene demo's config) on the random checkpoint,
    the OCR prompts and a reward that model moves."""
    return [
        f"model.path={tiny_checkpoint}",
        "data.demo_set=ocr",
        "reward.rewards=[{name: demo_brightness}]",
        "eval.every=0",
        "eval.rewards=[]",
        "data.prompts_per_step=2",
        "algorithm.group_size=2",
        "sampler.num_steps=3",
        "sampler.height=32",
        "sampler.width=32",
        "sampler.window_range=[0,2]",
        "sampler.window_size=1",
        "lora.rank=2",
        "lora.alpha=4",
        f"logging.run_dir={run_dir}",
        "logging.progress=false",
        "logging.sample_every=0",
        "logging.plot_every=0",
        "logging.name=mine",
        *extra,
    ]


def test_banner_and_verdict_of_a_one_step_run(tiny_checkpoint, tmp_path, capsys):
    assert main(args(tiny_checkpoint, tmp_path, "total_steps=1")) == 0
    out = capsys.readouterr().out
    banner = out.splitlines()[0]
    assert "demo" not in banner and str(tiny_checkpoint) in banner and "built-in prompts" in banner
    assert "too few steps to tell" in out and "2 x std err" not in out
    # The same command again is a fresh run: it must not touch the first run's folder.
    assert main(args(tiny_checkpoint, tmp_path, "total_steps=1")) == 0
    assert "already used" in capsys.readouterr().out and (tmp_path / "mine_1" / "metrics.jsonl").is_file()


def test_verdict_needs_two_steps_per_window():
    one = summarize_rewards([{"reward/mean": 0.5}])
    assert "too few steps" in reward_verdict(one)
    many = summarize_rewards([{"reward/mean": v} for v in (0.1, 0.2, 0.1, 0.2, 0.8, 0.9, 0.8, 0.9, 0.9, 0.8)])
    assert many["window"] == 5 and reward_verdict(many).endswith(": up")


def test_an_over_long_prompt_stops_the_trainer_at_start_up_naming_file_and_row(tiny_checkpoint, tmp_path):
    data = tmp_path / "train.parquet"
    rows = [
        PromptRecord(instruction=t, ground_truth="x", index=i) for i, t in enumerate(["a", "b", LONG_PROMPT])
    ]
    write_records(rows, data)
    cfg = small_config(tiny_checkpoint, tmp_path, f"data.train_files=[{data}]")
    with pytest.raises(ValueError, match=rf"{data} row 2: .* model\.max_sequence_length=1280"):
        Trainer(cfg)
