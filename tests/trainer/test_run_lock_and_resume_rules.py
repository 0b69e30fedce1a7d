"""One writer per run folder, taken before anything is loaded and held to the run's last write; and
the one rule for what a resume may change (docs/reliability.md)."""

from __future__ import annotations

import hashlib
import os
import socket
from pathlib import Path

import pytest
import torch
import yaml

from boogu_trainer import checkpoint as ckpt
from boogu_trainer.cli import main
from boogu_trainer.config import (
    RESUME_FREE_KEYS,
    RESUME_NOT_BITWISE_KEYS,
    config_changes,
    config_to_dict,
    load_config,
)
from boogu_trainer.trainer import Trainer


def snapshot(folder: Path) -> dict[str, str]:
    """Every entry under ``folder``: a folder as 'dir', a file as the SHA-256 of its bytes."""
    return {
        str(p.relative_to(folder)): "dir" if p.is_dir() else hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(folder.rglob("*"))
    }


@pytest.fixture
def live_run(tmp_path):
    """A run folder as a live pipelined run leaves it mid-run, its lock held by that run (this process,
    through another open file: flock refuses a second one all the same)."""
    run = tmp_path / "runs" / "run"
    step = run / "checkpoints" / ckpt.step_dir_name(1)
    step.mkdir(parents=True)
    (step / ckpt.COMPLETE).write_text("")
    (run / "logs").mkdir()
    (run / "logs" / "rollout_worker_rank0.log").write_text("worker of the live run\n")
    (run / "metrics.jsonl").write_text('{"step": 1}\n')
    lock = ckpt.RunFolderLock(run)
    lock.acquire()
    yield run
    lock.release()


def nothing_may_load(monkeypatch):
    def refuse(what):
        def fail(*args, **kwargs):
            raise AssertionError(f"the second trainer {what} before it checked the run lock")

        return fail

    monkeypatch.setattr(Trainer, "_read_records", refuse("read the prompts"))
    monkeypatch.setattr(Trainer, "_load_parts", refuse("loaded the model"))
    monkeypatch.setattr(Trainer, "_remote_engine", refuse("started a rollout worker"))


def second_run_args(tmp_path: Path) -> list[str]:
    return [
        f"model.path={tmp_path / 'model'}",  # never read: the lock stops the run first
        "model.device=cpu",
        "rollout.engine=vllm_omni",
        "rollout.pipeline=one_step",
        "resume=auto",
        f"logging.run_dir={tmp_path / 'runs'}",
        "logging.name=run",
        "logging.progress=false",
    ]


def test_a_second_trainer_on_a_live_run_stops_before_loading_and_writes_nothing(
    live_run, tmp_path, monkeypatch
):
    nothing_may_load(monkeypatch)
    before = snapshot(live_run)
    with pytest.raises(ckpt.RunFolderLocked) as refused:
        Trainer(load_config(None, second_run_args(tmp_path)))
    assert f"pid {os.getpid()} on host {socket.gethostname()}" in str(refused.value)
    assert str(live_run) in str(refused.value)
    assert snapshot(live_run) == before


def test_the_cli_on_a_live_run_exits_4_at_once_and_writes_nothing(live_run, tmp_path, monkeypatch, capsys):
    nothing_may_load(monkeypatch)
    before = snapshot(live_run)
    assert main(second_run_args(tmp_path)) == 4
    err = capsys.readouterr().err
    assert "is in use by another run" in err and f"pid {os.getpid()}" in err
    assert snapshot(live_run) == before


def test_a_fresh_run_refused_at_start_up_leaves_no_folder_it_created(tmp_path, monkeypatch):
    # The lock creates the run folder (and its parents); a start-up that fails removes what it made.
    nothing_may_load(monkeypatch)
    args = [a for a in second_run_args(tmp_path) if not a.startswith(("resume=", "logging.run_dir="))]
    with pytest.raises(AssertionError, match="read the prompts"):
        Trainer(load_config(None, [*args, f"logging.run_dir={tmp_path / 'new' / 'runs'}"]))
    assert not (tmp_path / "new").exists()
    (tmp_path / "kept").mkdir()  # a folder that was there stays, only the run folder goes
    with pytest.raises(AssertionError, match="read the prompts"):
        Trainer(load_config(None, [*args, f"logging.run_dir={tmp_path / 'kept'}"]))
    assert list((tmp_path / "kept").iterdir()) == []


def test_the_demo_holds_the_run_lock_through_its_held_out_comparison(tiny_checkpoint, tmp_path, monkeypatch):
    from boogu_trainer import demo

    real = demo.heldout_comparison
    run = tmp_path / "demo"
    seen = []

    def probed(trainer, run_dir):
        try:  # a resume=auto started now must be refused: the comparison is still writing the folder
            ckpt.RunFolderLock(run).acquire()
            seen.append("free")
        except ckpt.RunFolderLocked:
            seen.append("held")
        return real(trainer, run_dir)

    monkeypatch.setattr(demo, "heldout_comparison", probed)
    args = [f"model.path={tiny_checkpoint}", "data.prompts_per_step=2", "data.demo_prompts=8"]
    args += ["algorithm.group_size=2", "sampler.num_steps=3", "sampler.height=32", "sampler.width=32"]
    args += ["eval.every=1", "eval.num_prompts=2", "eval.num_steps=2", "total_steps=1", "preflight=false"]
    args += [f"logging.run_dir={tmp_path}", "logging.progress=false", "logging.sample_every=0"]
    args += ["logging.plot_every=0", "checkpoint.save_every=0"]
    assert main(args) == 0
    assert seen == ["held"]
    assert (run / demo.HELDOUT_JSON).is_file()
    after = ckpt.RunFolderLock(run)
    after.acquire()  # the run has ended: the folder is free again
    after.release()


# ---- what a resume may change -------------------------------------------------------------------
def changes(old_args, new_args, **kwargs):
    return config_changes(
        config_to_dict(load_config(None, old_args)), config_to_dict(load_config(None, new_args)), **kwargs
    )


def test_resume_accepts_changes_that_cannot_change_the_numbers(tmp_path, monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)  # model.device=auto is the CPU here
    model = tmp_path / "model"
    model.mkdir()
    vllm = ["rollout.engine=vllm_omni", "rollout.pipeline=one_step"]
    old = [f"model.path={model}", "model.device=cpu", *vllm]
    harmless = [
        f"model.path={model}/",  # a trailing slash
        f"model.path={model}/./",
        "model.device=auto",  # resolves to cpu here
        "rollout.vllm.url=http://127.0.0.1:8000",  # where the worker runs, how long it may take
        "rollout.vllm.devices='4,5'",
        "rollout.vllm.startup_timeout_s=60",
        "rollout.vllm.request_timeout_s=60",
        "rollout.logprob_diff_warn=0.5",  # a warning threshold
        "reward.max_nonfinite_steps=7",  # a stop rule
        "model.tiny_path=/elsewhere",  # unused: model.path is set
        "model.tiny_scenes_path=/elsewhere",
        "model.tiny=scenes",
    ]
    for change in harmless:
        assert changes(old, [*old, change]) == [], change
    # ~ is expanded before comparing
    monkeypatch.setenv("HOME", str(tmp_path))
    assert changes([*old, f"model.path={model}"], [*old, "model.path=~/model"]) == []
    # With the local engine the whole rollout.vllm section is unused.
    local = ["model.device=cpu"]
    assert changes(local, [*local, "rollout.vllm.dtype=bfloat16", "rollout.vllm.backend=omni"]) == []
    # With the tiny random checkpoint, the scenes checkpoint's folder is unused, and the other way round.
    assert changes(local, [*local, "model.tiny_scenes_path=/x"]) == []
    scenes = [*local, "model.tiny=scenes"]
    assert changes(scenes, [*scenes, "model.tiny_path=/x"]) == []
    assert set(RESUME_NOT_BITWISE_KEYS) <= set(RESUME_FREE_KEYS)


def test_model_dtype_auto_is_resolved_on_the_configs_own_device(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    # On a CUDA machine a CPU run's 'auto' is float32, as the run computed it.
    assert changes(["model.device=cpu"], ["model.device=cpu", "model.dtype=float32"]) == []
    assert changes(["model.device=cpu"], ["model.device=cpu", "model.dtype=bfloat16"]) == [
        ("model.dtype", "auto", "bfloat16")
    ]


def test_resume_refuses_real_differences_naming_key_values_and_the_opt_in(tmp_path, monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    a, b = tmp_path / "a", tmp_path / "b"
    a.mkdir(), b.mkdir()
    vllm = ["rollout.engine=vllm_omni", "rollout.pipeline=one_step"]
    old = [f"model.path={a}", "model.device=cpu", *vllm]
    refused = {
        f"model.path={b}/": ("model.path", str(a), f"{b}/"),
        "rollout.vllm.dtype=bfloat16": ("rollout.vllm.dtype", "auto", "bfloat16"),
        "rollout.vllm.backend=direct": ("rollout.vllm.backend", "auto", "direct"),
        "rollout.vllm.python=/other/python": ("rollout.vllm.python", None, "/other/python"),
    }
    for change, expected in refused.items():
        assert changes(old, [*old, change]) == [expected], change
        assert changes(old, [*old, change], allowed=[expected[0]]) == [], change
    # A key removed from a free-form mapping is a change too (the worker no longer gets it), unless
    # the mapping is unused by both runs (the local engine).
    eager = "rollout.vllm.engine_args={enforce_eager: true, seed: 3}"
    assert changes([*old, eager], [*old, "rollout.vllm.engine_args={seed: 3}"]) == [
        ("rollout.vllm.engine_args.enforce_eager", True, "(not set)")
    ]
    assert changes([*old[:2], eager], old[:2]) == []
    # A CPU run on CUDA: model.dtype=auto then means another dtype too, and says which.
    assert changes(old[:2], [*old[:2], "model.device=cuda"]) == [
        ("model.dtype", "auto (as float32)", "auto (as bfloat16)"),
        ("model.device", "cpu", "cuda"),
    ]
    # The tiny random checkpoint's folder is the model when model.path is empty.
    assert changes(["model.device=cpu"], ["model.device=cpu", "model.tiny_path=/x"]) == [
        ("model.tiny_path", "~/models/tiny-random/Boogu-Image", "/x")
    ]
    saved = yaml.safe_dump(config_to_dict(load_config(None, old)))
    with pytest.raises(ckpt.CheckpointError) as error:
        ckpt.check_resume_config(
            saved, load_config(None, [*old, f"model.path={b}"]), tmp_path / "step_000001"
        )
    message = str(error.value)
    assert f"model.path: '{a}' (checkpoint) -> '{b}' (now)" in message
    assert "resume_allow_changes=[model.path]" in message and "docs/reliability.md" in message
