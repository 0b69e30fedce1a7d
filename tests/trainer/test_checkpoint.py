"""Checkpoints without a model: verification and fallback, pruning by run, atomic re-saves, stale
temporaries, the fresh-run folder rule and the resume config check."""

from __future__ import annotations

import hashlib
import json
import logging
import os
import subprocess
from pathlib import Path

import pytest
import torch
import yaml

import boogu_data.atomic as atomic
from boogu_trainer.checkpoint import (
    Checkpointer,
    CheckpointError,
    check_resume_config,
    checkpoint_folders,
    load_checkpoint,
    resolve_run_folder,
    step_dir_name,
    verify_checkpoint,
)
from boogu_trainer.config import config_to_dict, load_config
from boogu_trainer.distributed import DistEnv
from tests.data.helpers import read_only_storage


def config(tmp_path: Path, *overrides: str):
    return load_config(None, [f"logging.run_dir={tmp_path}", "logging.name=run", *overrides])


def contents(value: float, run_id: str, step: int = 1) -> dict:
    """A trainer state by component, as `Trainer.state_dict` gives it (a minimal one)."""
    return {
        "trainer": {"step": step, "nonfinite_streak": 0, "weights_version": step, "world_size": 1},
        "learner": {
            "lora": {"blocks.0.to_q.lora_A.weight": torch.full((2, 3), value)},
            "lora_config": {"r": 2},
            "optimizer_tensors": {"p::exp_avg": torch.full((2, 3), value / 2)},
            "optimizer_meta": {"param_groups": [], "names": ["p"]},
            "ema": None,
            "counters": {"optimizer_steps": step},
        },
        "data": {"cursor": 0},
        "gold": None,
        "totals": {},
        "pipeline": None,
        "rng": None,
    }


def checkpointer(cfg, run_id: str) -> Checkpointer:
    c = Checkpointer(cfg, DistEnv())
    c.run_id = run_id
    return c


def tree_digest(folder: Path) -> dict[str, str]:
    return {
        str(p.relative_to(folder)): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(folder.rglob("*"))
        if p.is_file()
    }


def test_save_verify_load_round_trip(tmp_path):
    cfg = config(tmp_path)
    folder = checkpointer(cfg, "a").save(3, contents(1.5, "a", 3))
    assert folder.name == step_dir_name(3) and verify_checkpoint(folder) is None
    manifest = json.loads((folder / "manifest.json").read_text())
    assert {"adapter_model.safetensors", "optimizer.safetensors", "trainer_state.json"} <= set(manifest)
    loaded = load_checkpoint(folder)
    assert torch.equal(
        loaded.state["learner"]["lora"]["blocks.0.to_q.lora_A.weight"], torch.full((2, 3), 1.5)
    )
    assert loaded.run_id == "a" and loaded.step == 3


def test_a_truncated_latest_checkpoint_falls_back_to_the_newest_intact_one(tmp_path, caplog, capsys):
    cfg = config(tmp_path)
    saver = checkpointer(cfg, "a")
    good = saver.save(1, contents(1.0, "a", 1))
    bad = saver.save(2, contents(2.0, "a", 2))
    weights = bad / "adapter_model.safetensors"
    weights.write_bytes(weights.read_bytes()[:-7])  # a copy cut short
    assert "adapter_model.safetensors" in verify_checkpoint(bad)
    with caplog.at_level(logging.WARNING, logger="boogu_trainer"):
        assert saver.find("auto") == good
    assert str(bad) in caplog.text and str(bad) in capsys.readouterr().out
    assert f"checkpoint {bad} is broken" in caplog.text and f"using {good} instead" in caplog.text
    with pytest.raises(CheckpointError, match="not an intact checkpoint"):
        saver.find(str(bad))
    # Same size, different bytes: the hash catches it.
    raw = bytearray((good / "optimizer.safetensors").read_bytes())
    raw[-1] ^= 0xFF
    (good / "optimizer.safetensors").write_bytes(bytes(raw))
    assert "SHA-256" in verify_checkpoint(good)
    assert saver.find("auto") is None


def test_pruning_keeps_this_runs_newest_and_never_touches_another_runs(tmp_path):
    cfg = config(tmp_path, "checkpoint.keep_last=2")
    older = checkpointer(cfg, "older-run")
    for step in (10, 11):
        older.save(step, contents(float(step), "older-run", step))
    mine = checkpointer(cfg, "this-run")
    for step in (1, 2, 3):
        mine.save(step, contents(float(step), "this-run", step))
    assert [s for s, _ in checkpoint_folders(cfg.run_path / "checkpoints")] == [2, 3, 10, 11]


def test_resaving_a_step_is_atomic_even_if_killed_between_the_renames(tmp_path, monkeypatch):
    cfg = config(tmp_path, "checkpoint.keep_last=1")
    saver = checkpointer(cfg, "a")
    saver.save(5, contents(1.0, "a", 5))
    calls = {"n": 0}
    real = os.replace

    def dies_on_second_rename(src, dst):
        calls["n"] += 1
        if calls["n"] == 2:  # the old folder is retired, the new one not yet in place
            raise KeyboardInterrupt("killed")
        return real(src, dst)

    monkeypatch.setattr(atomic.os, "replace", dies_on_second_rename)
    with pytest.raises(KeyboardInterrupt):
        saver.save(5, contents(2.0, "a", 5))
    monkeypatch.setattr(atomic.os, "replace", real)
    # A later listing puts the old complete checkpoint back: nothing was lost.
    (found,) = checkpoint_folders(cfg.run_path / "checkpoints")
    assert found[0] == 5 and verify_checkpoint(found[1]) is None
    assert torch.equal(
        load_checkpoint(found[1]).state["learner"]["lora"]["blocks.0.to_q.lora_A.weight"],
        torch.full((2, 3), 1.0),
    )
    # And an uninterrupted re-save replaces it.
    saver.save(5, contents(3.0, "a", 5))
    (found,) = checkpoint_folders(cfg.run_path / "checkpoints")
    assert torch.equal(
        load_checkpoint(found[1]).state["learner"]["lora"]["blocks.0.to_q.lora_A.weight"],
        torch.full((2, 3), 3.0),
    )


def test_a_live_writers_staging_folder_is_not_treated_as_stale(tmp_path, monkeypatch):
    root = tmp_path / "run" / "checkpoints"
    root.mkdir(parents=True)
    live = subprocess.Popen(["sleep", "60"])
    dead = subprocess.Popen(["true"])
    dead.wait()
    try:
        staged = []
        for proc in (live, dead):  # staging folders as those processes would have named them
            monkeypatch.setattr(atomic.os, "getpid", lambda pid=proc.pid: pid)
            staged.append(atomic.stage_folder(root / step_dir_name(4)))
        monkeypatch.undo()
        checkpoint_folders(root)
        assert staged[0].exists() and not staged[1].exists()
    finally:
        live.kill()
        live.wait()


def test_resume_reads_read_only_storage_past_a_dead_writers_temporary(tmp_path, monkeypatch, caplog):
    saver = checkpointer(config(tmp_path), "a")
    good = saver.save(1, contents(1.0, "a", 1))
    dead = subprocess.Popen(["true"])
    dead.wait()
    monkeypatch.setattr(atomic.os, "getpid", lambda: dead.pid)
    staging = atomic.stage_folder(saver.root / step_dir_name(2))
    monkeypatch.undo()
    (staging / "adapter_model.safetensors").write_bytes(b"half")
    with read_only_storage(saver.root, monkeypatch), caplog.at_level(logging.WARNING):
        assert saver.find("auto") == good
    assert staging.is_dir() and f"cannot remove {staging}" in caplog.text


def test_a_fresh_run_moves_away_from_a_used_folder_and_leaves_it_untouched(tmp_path):
    cfg = config(tmp_path)
    same, note = resolve_run_folder(cfg, DistEnv())
    assert same.run_path == cfg.run_path and note is None
    cfg.run_path.mkdir(parents=True)
    (cfg.run_path / "metrics.jsonl").write_text('{"step": 1}\n')
    before = tree_digest(cfg.run_path)
    moved, note = resolve_run_folder(cfg, DistEnv())
    assert moved.logging.name == "run_1" and "already used" in note
    (tmp_path / "run_1").mkdir()
    (tmp_path / "run_1" / "x").write_text("")
    assert resolve_run_folder(cfg, DistEnv())[0].logging.name == "run_2"
    resumed = load_config(None, [f"logging.run_dir={tmp_path}", "logging.name=run", "resume=auto"])
    assert resolve_run_folder(resumed, DistEnv())[0].run_path == cfg.run_path  # no checkpoint anywhere
    # resume=auto continues the newest run of that name that has a checkpoint.
    checkpointer(moved, "b").save(1, contents(1.0, "b"))
    newest, note = resolve_run_folder(resumed, DistEnv())
    assert newest.logging.name == "run_1" and "resuming" in note
    assert tree_digest(cfg.run_path) == before


def test_resume_refuses_a_changed_past_unless_opted_in(tmp_path):
    old = config(tmp_path, "optim.lr=3e-4", "seed=1")
    saved = yaml.safe_dump(config_to_dict(old))
    free = config(tmp_path, "optim.lr=3e-4", "seed=1", "total_steps=900", "logging.sample_every=1")
    check_resume_config(saved, free, tmp_path)  # the future may change
    changed = config(tmp_path, "optim.lr=1e-4", "seed=2", "algorithm.group_size=8")
    with pytest.raises(CheckpointError) as err:
        check_resume_config(saved, changed, tmp_path)
    text = str(err.value)
    for needle in (
        "optim.lr: 0.0003",
        "-> 0.0001",
        "seed: 1",
        "algorithm.group_size: 16",
        "resume_allow_changes=",
    ):
        assert needle in text, (needle, text)
    allowed = config(
        tmp_path,
        "optim.lr=1e-4",
        "seed=2",
        "algorithm.group_size=8",
        "resume_allow_changes=[optim.lr,seed,algorithm.group_size]",
    )
    check_resume_config(saved, allowed, tmp_path)
    partly = config(tmp_path, "optim.lr=1e-4", "seed=2", "resume_allow_changes=[optim]")
    with pytest.raises(CheckpointError, match="seed") as err:
        check_resume_config(saved, partly, tmp_path)
    assert "optim.lr" not in str(err.value)


def test_a_checkpoint_fsyncs_each_file_exactly_once(tmp_path, monkeypatch):
    # One home for durability: `boogu_data.atomic.commit_folder` fsyncs the staged files; the writer
    # does not fsync them a second time. A second fsync loop coming back fails here.
    synced: dict[str, int] = {}
    real_fsync = os.fsync

    def counting_fsync(fd: int) -> None:
        path = os.readlink(f"/proc/self/fd/{fd}")
        if os.path.isfile(path):
            name = os.path.basename(path)
            synced[name] = synced.get(name, 0) + 1
        real_fsync(fd)

    monkeypatch.setattr(os, "fsync", counting_fsync)
    folder = checkpointer(config(tmp_path), "a").save(1, contents(1.0, "a"))
    files = sorted(p.name for p in folder.iterdir() if p.is_file())
    assert sorted(synced) == files and set(synced.values()) == {1}, synced


def test_seeded_global_rngs_draw_the_same_numbers_and_leave_the_outer_stream_as_it_was():
    # An evaluation scores under it (Evaluator.evaluate): a reward drawing from the global RNGs there
    # must neither move training's stream (a checkpoint keeps that) nor depend on when it runs.
    import random

    import numpy as np

    from boogu_trainer.checkpoint import seed_global_rngs, seeded_global_rngs

    def draws():
        return torch.rand(3).tolist(), float(np.random.rand()), random.random()

    seed_global_rngs(5)
    draws()
    expected = draws()
    seed_global_rngs(5)
    draws()
    with seeded_global_rngs(9):
        first = draws()
    assert draws() == expected
    with seeded_global_rngs(9):
        assert draws() == first
    seed_global_rngs(9)
    assert draws() == first
