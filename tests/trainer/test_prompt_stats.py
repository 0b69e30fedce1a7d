"""Per-prompt reward statistics (`trainer RECIPE --prompt-stats PATH`) and the training-prompt filter
that reads them (``data.prompt_stats``): what is measured, what is kept, and every bad file refused by
name before a model loads."""

from __future__ import annotations

import json
import os
import tempfile
from dataclasses import replace

import pytest

from boogu_data import PromptRecord
from boogu_schedule import derive_seed
from boogu_trainer.cli import main
from boogu_trainer.config import ConfigError, load_config, scenes_demo_config
from boogu_trainer.data import PromptSampler, demo_records
from boogu_trainer.prompt_stats import (
    FORMAT,
    filter_records,
    measure_prompt_stats,
    prompt_key,
    read_prompt_stats,
)
from boogu_trainer.trainer import Trainer
from tests.trainer.test_loop import small_config

CLI = ["model.device=cpu", "sampler.height=32", "sampler.width=32", "sampler.num_steps=3"]
CLI += ["lora.rank=4", "lora.alpha=8", "data.prompts_per_step=3", "algorithm.group_size=2"]
CLI += ["data.demo_set=ocr", "data.demo_prompts=8", "eval.every=0", "eval.rewards=[]"]
CLI += ["reward.rewards=[{name: demo_brightness}, {name: demo_brightness, label: half, weight: 0.5}]"]


def test_a_prompt_key_is_its_text_negative_and_reference():
    record = PromptRecord(instruction="a red circle", negative="blurry", ref_image=b"\x89PNG1")
    same = PromptRecord(
        instruction="a red circle", negative="blurry", ref_image=b"\x89PNG1", index=7, split="x"
    )
    assert prompt_key(record) == prompt_key(same)  # position and split are not the prompt
    others = [
        replace(record, instruction="a red square"),
        replace(record, negative=""),
        replace(record, ref_image=b"\x89PNG2"),
        replace(record, ref_image=None),
        # the parts are length-prefixed: moving a byte across the boundary is another prompt
        replace(record, instruction="a red circl", negative="eblurry"),
    ]
    keys = {prompt_key(r) for r in others}
    assert len(keys) == len(others) and prompt_key(record) not in keys


def test_prompt_stats_measures_each_training_prompt_before_any_update(
    tiny_checkpoint, tmp_path, capsys, monkeypatch
):
    temp = tmp_path / "temp"
    temp.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(temp))
    out = tmp_path / "stats" / "ocr.json"
    args = [f"model.path={tiny_checkpoint}", *CLI, f"logging.run_dir={tmp_path}", "logging.name=run"]
    # A recipe that already filters is measured on every prompt: the file measures what it filters.
    args += [f"data.prompt_stats={tmp_path / 'absent.json'}"]
    assert main([*args, "--prompt-stats", str(out), "--samples", "3", "--prompts", "5"]) == 0
    printed = capsys.readouterr().out
    stats = json.loads(out.read_text())
    assert stats["format"] == FORMAT and stats["samples"] == 3 and stats["seed"] == 0
    assert stats["rewards"] == {"demo_brightness": 1.0, "half": 0.5}
    assert stats["sampler"]["num_steps"] == 3 and stats["sampler"]["height"] == 32
    records = demo_records(5, "ocr")
    assert [r["key"] for r in stats["prompts"]] == [prompt_key(r) for r in records]
    assert [r["prompt"] for r in stats["prompts"]] == [r.instruction for r in records]
    assert f"{out}: 5 prompts x 3 samples" in printed
    assert not (tmp_path / "run").exists() and list(temp.iterdir()) == []  # nothing else written
    assert [p.name for p in out.parent.iterdir()] == ["ocr.json"]  # the partial file is gone
    umask = os.umask(0)
    os.umask(umask)
    assert out.stat().st_mode & 0o777 == 0o666 & ~umask  # readable as any file the user writes

    # The figures are the recipe's rollouts of each prompt (the demo's settings under the overrides,
    # as `trainer` without a recipe loads them), 3 samples each, with the noise of "prompt_stats".
    config = load_config(None, args[:-1], base=scenes_demo_config())
    trainer = Trainer(config, lock=False)
    try:
        for call, start in enumerate((0, 3)):
            batch = trainer.data.records[start : start + 3]
            request = replace(
                trainer.rollout.request(batch, group_offset=0, step=0),
                group_size=3,
                seed=derive_seed(0, "prompt_stats", call),
            )
            images = trainer.engine.generate(request).images
            scores = trainer.rewards(images, [r for r in batch for _ in range(3)])
            total = scores.total.reshape(len(batch), 3)
            half = scores.per_reward["half"].reshape(len(batch), 3)
            for i, row in enumerate(stats["prompts"][start : start + 3]):
                assert row["mean"] == pytest.approx(float(total[i].mean()), abs=1e-6)
                assert row["std"] == pytest.approx(float(total[i].std(unbiased=False)), abs=1e-6)
                assert row["per_reward"]["half"] == pytest.approx(float(half[i].mean()), abs=1e-6)
    finally:
        trainer.close()
    assert any(row["std"] > 0 for row in stats["prompts"])  # the brightness of 3 samples differs

    # Killed after its first engine call, the measurement goes on from its partial file and ends
    # where an uninterrupted one does; a partial file of other settings is refused, not mixed in.
    trainer = Trainer(config, lock=False)
    partial = tmp_path / "resume" / "ocr.json.partial"

    class Killed(Exception):
        pass

    def kill_after_first_call(done, total):
        if done == 3:
            raise Killed

    try:
        with pytest.raises(Killed):
            measure_prompt_stats(trainer, samples=3, limit=5, progress=kill_after_first_call, partial=partial)
        assert [r["key"] for r in json.loads(partial.read_text())["prompts"]] == [
            r["key"] for r in stats["prompts"][:3]
        ]
        calls = []
        resumed = measure_prompt_stats(
            trainer, samples=3, limit=5, progress=lambda d, t: calls.append(d), partial=partial
        )
        assert calls == [5] and resumed == stats  # one call left; the same file content
        with pytest.raises(ValueError, match=r"other settings \(samples\); remove it"):
            measure_prompt_stats(trainer, samples=2, limit=5, partial=partial)
    finally:
        trainer.close()

    # Refused up front: options without --prompt-stats, too few samples.
    assert main([*args, "--samples", "3"]) == 2
    assert main([*args, "--prompt-stats", str(tmp_path / "x.json"), "--samples", "1"]) == 2
    assert "need >= 2 samples" in capsys.readouterr().err
    assert not (tmp_path / "x.json").exists()


def write_stats(path, spreads):
    rows = [
        {"key": key, "prompt": "", "mean": 0.5, "std": std, "per_reward": {}} for key, std in spreads.items()
    ]
    path.write_text(json.dumps({"format": FORMAT, "samples": 4, "prompts": rows}))
    return path


def test_data_prompt_stats_trains_only_on_prompts_whose_samples_differed(tiny_checkpoint, tmp_path):
    records = demo_records(8, "ocr")
    spreads = {
        prompt_key(r): std for r, std in zip(records, [0.0, 0.2, 0.0, 0.05, None, 0.3, 0.0, 0.1], strict=True)
    }
    stats = write_stats(tmp_path / "stats.json", spreads)
    trainer = Trainer(
        small_config(tiny_checkpoint, tmp_path / "runs", "data.demo_prompts=8", f"data.prompt_stats={stats}"),
        lock=False,
    )
    try:
        assert trainer.data.records == [records[i] for i in (1, 3, 5, 7)]
        # a resume checks the filtered prompts: their count and their digest
        assert trainer.data.state_dict()["num_records"] == 4
        assert (
            trainer.data.records_sha256 == PromptSampler([records[i] for i in (1, 3, 5, 7)], 1).records_sha256
        )
    finally:
        trainer.close()
    kept, sources = filter_records(records, [f"row {i}" for i in range(8)], str(stats), 0.08)
    assert kept == [records[i] for i in (1, 5, 7)] and sources == ["row 1", "row 5", "row 7"]


@pytest.mark.parametrize(
    "content, message",
    [
        (None, "does not exist; write it with `trainer RECIPE --prompt-stats"),
        ("{not json", "is not a prompt statistics file"),
        ('{"format": "other/1", "prompts": []}', "format 'other/1', expected 'boogu-prompt-stats/1'"),
        (json.dumps({"format": FORMAT, "prompts": {}}), "'prompts' must be a list"),
        (json.dumps({"format": FORMAT, "prompts": [{"std": 0.1}]}), "prompts[0] needs a 'key'"),
        (
            json.dumps({"format": FORMAT, "prompts": [{"key": "k", "std": "high"}]}),
            "prompts[0].std is 'high'",
        ),
    ],
)
def test_a_bad_prompt_stats_file_is_refused_by_name(tmp_path, content, message):
    path = tmp_path / "stats.json"
    if content is not None:
        path.write_text(content)
    with pytest.raises(ValueError, match=r"stats\.json") as info:
        read_prompt_stats(path)
    assert message in str(info.value)


def test_prompt_stats_that_miss_a_prompt_or_keep_too_few_are_refused_by_name(tiny_checkpoint, tmp_path):
    records = demo_records(6, "ocr")
    stats = write_stats(tmp_path / "part.json", {prompt_key(r): 0.1 for r in records[:5]})
    with pytest.raises(
        ConfigError, match=r"data.prompt_stats=.*part.json.*no statistics for built-in ocr prompt train 5"
    ):
        Trainer(
            small_config(tiny_checkpoint, tmp_path / "a", "data.demo_prompts=6", f"data.prompt_stats={stats}")
        )
    flat = write_stats(tmp_path / "flat.json", {prompt_key(r): 0.0 for r in records})
    with pytest.raises(ConfigError, match=r"none of the 6 training prompts has a reward spread above 0\.0"):
        Trainer(
            small_config(tiny_checkpoint, tmp_path / "b", "data.demo_prompts=6", f"data.prompt_stats={flat}")
        )
    one = write_stats(tmp_path / "one.json", {prompt_key(r): float(i == 2) for i, r in enumerate(records)})
    with pytest.raises(ConfigError, match=r"those with a spread in .*one.json\) hold only 1; a step needs 2"):
        Trainer(
            small_config(tiny_checkpoint, tmp_path / "c", "data.demo_prompts=6", f"data.prompt_stats={one}")
        )
    with pytest.raises(ConfigError, match=r"data\.prompt_stats_min_std"):
        small_config(tiny_checkpoint, tmp_path / "d", "data.prompt_stats_min_std=-1")
    # Refused before anything is written: no run folder is left with files in it.
    assert not any(p.is_file() for d in "abc" for p in (tmp_path / d).rglob("*"))
