"""Checkpoints of earlier releases: the committed v0.2 and v0.3 folders (tests/trainer/data/checkpoints,
written by the code of those releases: see its README) are read through the rename table, rewritten
in today's layout with every tensor file byte for byte the same, and a run resumes from them."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from boogu_adapters.lora import from_peft_keys
from boogu_trainer.checkpoint import (
    FORMAT,
    NAMED_FILES,
    RENAMED,
    CheckpointError,
    load_checkpoint,
    verify_checkpoint,
    write_checkpoint,
)
from boogu_trainer.config import demo_config, load_config
from boogu_trainer.trainer import Trainer
from tests.trainer.test_pipeline import OwnCopyTrainer

OLD = Path(__file__).parent / "data" / "checkpoints"
RELEASES = ("v0.2", "v0.3")

# The settings both committed checkpoints were trained with (their README): DiffusionNFT with EMA on the
# tiny random model; the v0.3 one pipelined (`PIPELINED`).
SETTINGS = [
    "model.device=cpu",
    "data.prompts_per_step=2",
    "algorithm.name=diffusion_nft",
    "algorithm.group_size=4",
    "algorithm.mini_batches=1",
    "algorithm.nft.timesteps=2",
    "algorithm.nft.old_decay_rate=0.3",
    "ema.enabled=true",
    "sampler.num_steps=4",
    "sampler.height=32",
    "sampler.width=32",
    "sampler.guidance_scale=1.0",
    "sampler.noise_level=0.8",
    "sampler.window_size=0",
    "lora.rank=4",
    "lora.alpha=8",
    "optim.lr=1e-2",
    "reward.rewards=[{name: demo_brightness}]",
    "logging.name=run",
    "logging.sample_every=0",
    "logging.plot_every=0",
    "logging.progress=false",
    "preflight=false",
    "checkpoint.save_every=1",
]
PIPELINED = {"v0.2": [], "v0.3": ["rollout.engine=vllm_omni", "rollout.pipeline=one_step"]}


def tensor_files(folder: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(folder.glob("*.safetensors"))}


@pytest.mark.parametrize("release", RELEASES)
def test_an_old_checkpoint_reads_through_the_rename_table_and_rewrites_byte_for_byte(release, tmp_path):
    folder = OLD / release
    assert verify_checkpoint(folder) is None  # the committed copy is intact
    flat = json.loads((folder / "trainer_state.json").read_text())
    assert "format" not in flat  # the flat layout, not today's
    saved = load_checkpoint(folder)
    state = saved.state
    assert saved.step == flat["step"] == 2 and saved.run_id == flat["run_id"]
    # Every key of the flat file lands where the table says, with its value.
    for key, path in RENAMED.items():
        if key in flat:
            part = state
            for name in path:
                part = part[name]
            if key == "pipeline":  # plus the weights its batch was sampled with
                part = {k: v for k, v in part.items() if k != "lora"}
            assert part == flat[key], key
    # Every file lands where the table says, with its tensors (peft's prefix dropped where it has one).
    for path, (name, peft) in NAMED_FILES.items():
        part = state
        for key in path[:-1]:
            part = part.get(key) or {}
        if not (folder / name).is_file():
            assert part.get(path[-1]) is None, name
            continue
        if name.endswith(".json"):
            assert part[path[-1]] == json.loads((folder / name).read_text()), name
            continue
        raw = load_file(folder / name)
        expected = from_peft_keys(raw) if peft else raw
        got = part[path[-1]]
        assert got.keys() == expected.keys() and all(torch.equal(got[k], expected[k]) for k in got), name
    assert state["learner"]["old"] and state["learner"]["ema"]  # NFT's old policy, the EMA
    assert (state["pipeline"] is not None) == (release == "v0.3")  # pipelining came in v0.3

    # Written in today's layout: the same tensor files, byte for byte (the golden runs hash them by
    # name), and today's reader gives the same state back.
    out = tmp_path / "rewritten"
    out.mkdir()
    write_checkpoint(out, saved.step, state, run_id=saved.run_id, config_yaml=saved.config_yaml)
    (out / "COMPLETE").write_text(str(saved.step))
    assert tensor_files(out) == tensor_files(folder)
    record = json.loads((out / "trainer_state.json").read_text())
    assert record["format"] == FORMAT and record["state"]["learner"]["old"] == {
        "$tensors": "old_policy.safetensors",
        "peft": True,
    }
    again = load_checkpoint(out).state
    assert_same(again, state)


def assert_same(a, b, where="state"):
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor) and torch.equal(a, b), where
    elif isinstance(a, dict):
        assert isinstance(b, dict) and a.keys() == b.keys(), (where, sorted(a), sorted(b))
        for k in a:
            assert_same(a[k], b[k], f"{where}.{k}")
    else:
        assert a == b, where


@pytest.mark.slow
@pytest.mark.parametrize("release", RELEASES)
def test_a_run_resumes_from_an_old_checkpoint(release, tiny_checkpoint, tmp_path):
    # What a user upgrading does: resume=<the old folder> (the model's folder is another one here).
    # v0.3's run was pipelined: it resumes so, rolling its batch in flight out again.
    run_dir = tmp_path / "runs"
    folder = run_dir / "run" / "checkpoints" / "step_000002"
    shutil.copytree(OLD / release, folder)
    saved = load_checkpoint(folder)
    cfg = load_config(
        None,
        [
            f"model.path={tiny_checkpoint}",
            f"logging.run_dir={run_dir}",
            *SETTINGS,
            *PIPELINED[release],
            "total_steps=3",
            f"resume={folder}",
            "resume_allow_changes=[model.path]",
        ],
        base=demo_config(),
    )
    trainer = (OwnCopyTrainer if PIPELINED[release] else Trainer)(cfg)
    try:
        assert trainer.resume(str(folder)) == folder and trainer.step == 2
        learner, nft = trainer.learner, trainer.learner.algorithm
        lora = learner.full_lora()
        assert all(torch.equal(lora[k], v) for k, v in saved.state["learner"]["lora"].items())
        assert all(torch.equal(nft.old_state()[k], v) for k, v in saved.state["learner"]["old"].items())
        assert all(torch.equal(learner.ema[k], v) for k, v in saved.state["learner"]["ema"].items())
        assert not nft.old_is_current  # it lagged when saved
        assert learner.counters["optimizer_steps"] == 2
        data = dict(saved.state["data"])
        if PIPELINED[release]:  # the batch in flight was rolled out again: its prompts are drawn
            data["cursor"] += 2
        # an old checkpoint has no digest of its prompts: it was checked by their count
        assert "records_sha256" not in data
        assert {k: v for k, v in trainer.data.state_dict().items() if k != "records_sha256"} == data
        trainer.train()
        assert trainer.step == 3 and learner.counters["optimizer_steps"] == 3
        trained = learner.full_lora()
        assert not all(torch.equal(trained[k], v) for k, v in saved.state["learner"]["lora"].items())
    finally:
        trainer.close()
    # Its new checkpoint is in today's layout.
    record = json.loads((run_dir / "run" / "checkpoints" / "step_000003" / "trainer_state.json").read_text())
    assert record["format"] == FORMAT and record["state"]["trainer"]["step"] == 3
    assert len(record["state"]["data"]["records_sha256"]) == 64  # the new one records it


def test_a_trainer_state_of_an_unknown_layout_is_refused_by_name(tmp_path):
    folder = tmp_path / "step_000002"
    shutil.copytree(OLD / "v0.3", folder)
    flat = json.loads((folder / "trainer_state.json").read_text())
    (folder / "trainer_state.json").write_text(json.dumps({**flat, "surprise": 1}))
    with pytest.raises(
        CheckpointError, match=r"trainer_state.json: keys \['surprise'\] are in no known layout"
    ):
        load_checkpoint(folder)
    (folder / "trainer_state.json").write_text(json.dumps({"format": 99, "step": 2, "state": {}}))
    with pytest.raises(CheckpointError, match="format 99; this version reads format 2"):
        load_checkpoint(folder)
