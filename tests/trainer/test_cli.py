"""The ``trainer`` command as a user meets it: the start banner, the end-of-run verdict, and bad data
stopped at start-up (not at the step that draws it) with the file and row named."""

from __future__ import annotations

import errno
import os
import re
from pathlib import Path

import pytest

from boogu_data import PromptRecord, write_records
from boogu_trainer.cli import _parse, main
from boogu_trainer.metrics import reward_verdict, summarize_rewards
from boogu_trainer.trainer import Trainer
from tests.trainer.test_data import LONG_PROMPT
from tests.trainer.test_loop import small_config
from tests.trainer.test_sample import safetensors_disk_full


def args(tiny_checkpoint, run_dir, *extra: str) -> list[str]:
    """A tiny run of `trainer` without a recipe (on the scene demo's config) on the random checkpoint,
    the OCR prompts and a reward that model moves."""
    return [
        f"model.path={tiny_checkpoint}",
        "data.demo_set=ocr",
        "data.demo_prompts=64",  # every OCR demo prompt (the scenes demo's 2000 is refused for OCR)
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


# ---- named errors, before anything is written ------------------------------------------------------
OCR_PROMPTS = "data.demo_prompts=8"  # within the OCR prompts that ship


def test_a_rollout_batch_that_cannot_fit_is_refused_before_the_run_folder(tiny_checkpoint, tmp_path, capsys):
    assert main(args(tiny_checkpoint, tmp_path, OCR_PROMPTS, "algorithm.group_size=100000000000")) == 2
    err = capsys.readouterr().err
    assert err.startswith(
        "trainer: config error: algorithm.group_size=100000000000 with data.prompts_per_step=2 on 1 rank(s): "
        "a step rolls out 200000000000 images per rank; 200000000000 images of 32x32 at once need at least"
    )
    assert "more than the" in err and sorted(tmp_path.iterdir()) == []


def test_a_lora_rank_above_every_module_is_refused_naming_the_limit(tiny_checkpoint, tmp_path, capsys):
    assert main(args(tiny_checkpoint, tmp_path, OCR_PROMPTS, "lora.rank=1000000000")) == 2
    err = capsys.readouterr().err
    assert re.search(r"config error: lora\.rank=1000000000: expected at most \d+, the largest min\(in", err)
    assert sorted(tmp_path.iterdir()) == []  # the run folder held only its lock, removed with it


def test_a_run_folder_that_cannot_be_made_is_a_named_error(tiny_checkpoint, tmp_path, capsys):
    blocked = tmp_path / "a_file"
    blocked.write_text("not a folder")
    assert main(args(tiny_checkpoint, blocked, OCR_PROMPTS)) == 4
    err = capsys.readouterr().err
    assert f"cannot create and lock the run folder {blocked / 'mine'}" in err and "Traceback" not in err


def test_a_disk_that_fills_up_during_the_run_is_a_named_error(tiny_checkpoint, tmp_path, monkeypatch, capsys):
    def full(self, *a, **k):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(self.run_dir / "metrics.jsonl"))

    monkeypatch.setattr(Trainer, "train", full)
    assert main(args(tiny_checkpoint, tmp_path, OCR_PROMPTS, "total_steps=1")) == 4
    err = capsys.readouterr().err
    metrics = tmp_path / "mine" / "metrics.jsonl"
    assert f"trainer: error: cannot write {metrics}: No space left on device" in err
    assert "committed checkpoints are intact" in err and "resume=auto" in err


@pytest.mark.parametrize("refused", ["full", "read_only"])
def test_a_checkpoint_write_the_disk_refuses_is_a_named_error(
    refused, tiny_checkpoint, tmp_path, monkeypatch, capsys
):
    # the real loop to its first checkpoint; the disk refuses it as safetensors or the system says so
    if refused == "full":
        monkeypatch.setattr("boogu_trainer.checkpoint.save_file", safetensors_disk_full)
        said = f"cannot write {tmp_path / 'mine' / 'checkpoints'}/.step_000001."
        why = "No space left on device"
    else:

        def read_only(target):
            raise OSError(errno.EROFS, os.strerror(errno.EROFS), str(target))

        monkeypatch.setattr("boogu_trainer.checkpoint.stage_folder", read_only)
        said, why = (
            f"cannot write {tmp_path / 'mine' / 'checkpoints' / 'step_000001'}",
            "Read-only file system",
        )
    code = main(args(tiny_checkpoint, tmp_path, OCR_PROMPTS, "total_steps=1", "checkpoint.save_every=1"))
    err = capsys.readouterr().err
    assert code == 4, err
    assert f"trainer: error: {said}" in err and why in err and "Traceback" not in err
    assert "committed checkpoints are intact" in err and "resume=auto" in err
    assert sorted(p.name for p in (tmp_path / "mine" / "checkpoints").iterdir()) == []  # no staging left


RECIPE = Path(__file__).parents[2] / "examples/flowgrpo_trainer/boogu_image/boogu_image_ocr_lora.yaml"


def test_options_may_follow_the_recipe_and_the_overrides(capsys):
    """As the README writes it: the recipe first, then options, then overrides (or any mix)."""
    for argv in (
        [str(RECIPE), "--plan", "--gpu-memory", "80", "model.device=cuda"],
        ["--plan", "--gpu-memory", "80", str(RECIPE), "model.device=cuda"],
        [str(RECIPE), "model.device=cuda", "--plan", "--gpu-memory", "80"],
    ):
        ns, recipe, overrides = _parse(argv)
        assert (ns.plan, ns.gpu_memory, recipe, overrides) == (True, 80.0, str(RECIPE), ["model.device=cuda"])
    assert main([str(RECIPE), "--print-config", "optim.lr=3e-4"]) == 0
    assert "lr: 0.0003" in capsys.readouterr().out


def test_learners_prints_the_readme_table_from_the_one_list(capsys):
    from boogu_trainer.config import ALGORITHMS, learners_table_markdown

    assert main(["--learners"]) == 0
    out = capsys.readouterr().out
    assert out.strip() == learners_table_markdown().strip()
    rows = [line.split("|")[1].strip().split()[0].strip("`") for line in out.strip().splitlines()[2:]]
    assert list(dict.fromkeys(rows)) == list(ALGORITHMS)  # a row per learner, its variants after it
