"""``rollout.pipeline=one_step`` in one process: the trainer's side of pipelining (the batch in flight,
its weights version, staleness, timing, checkpoints and the bitwise resume).

The rollout engine here is a `LocalRolloutEngine` on its own copy of the model (built from the
checkpoint again, like the worker loads it), standing in for the vllm-omni worker: it needs the full
LoRA at each sync and samples on the rollout thread while the update changes the trainer's module.
``tests/vllm/test_vllm_engine.py`` runs the same contracts against the real worker process.
"""

from __future__ import annotations

import shutil

import pytest
import torch

from boogu_adapters.components import build_local_engine
from boogu_adapters.lora import lora_state_dict
from boogu_trainer.checkpoint import ROLLOUT_POLICY, checkpoint_folders, load_checkpoint
from boogu_trainer.config import ConfigError
from boogu_trainer.models import load_base_parts, prepare_policy
from boogu_trainer.trainer import Trainer, TrainingStopped
from tests.trainer import reward_fakes
from tests.trainer.test_loop import small_config


class OwnCopyTrainer(Trainer):
    """``rollout.engine=vllm_omni`` served in-process by a local engine on its own copy of the model."""

    def _remote_engine(self):
        cfg = self.config
        parts = load_base_parts(cfg, self.device)
        engine = build_local_engine(
            parts,
            transformer=prepare_policy(parts.transformer, cfg),  # the same seeded LoRA (B = 0)
            max_sequence_length=cfg.model.max_sequence_length,
            cfg_mode=cfg.rollout.cfg_mode,
            device=self.device,
        )
        engine.shares_module = False  # it syncs like a worker: the full LoRA, fingerprint-checked
        return engine


def config(tiny_checkpoint, run_dir, *extra):
    return small_config(
        tiny_checkpoint,
        run_dir,
        "rollout.engine=vllm_omni",
        "rollout.pipeline=one_step",
        "total_steps=3",
        "checkpoint.save_every=1",
        "checkpoint.keep_last=3",
        "optim.lr=1e-2",
        # A user's reward that draws from the global RNGs: scored on the rollout thread, and again on
        # a resume, it must draw the same numbers.
        "reward.rewards=[{name: 'tests.trainer.reward_fakes:brightness_with_global_noise'}]",
        *extra,
    )


def run(tiny_checkpoint, run_dir, *extra):
    trainer = OwnCopyTrainer(config(tiny_checkpoint, run_dir, *extra))
    try:
        return trainer, trainer.train()
    finally:
        trainer.close()


@pytest.fixture(scope="module")
def straight(tiny_checkpoint, tmp_path_factory):
    """A 3-step pipelined run with a checkpoint at every step."""
    folder = tmp_path_factory.mktemp("pipelined")
    trainer, history = run(tiny_checkpoint, folder)
    return folder, {k: v.clone() for k, v in lora_state_dict(trainer.transformer).items()}, history


def test_one_step_trains_on_batches_one_version_stale(straight):
    _, _, history = straight
    assert [h["step"] for h in history] == [1, 2, 3]
    assert [h["weights_version"] for h in history] == [1, 2, 3]  # published after each update
    # Step 1 samples with the base (version 0); step k+1's batch was rolled out while step k's update
    # ran, with version k-1.
    assert [h["rollout/weights_version"] for h in history] == [0, 0, 1]
    assert [h["rollout/staleness"] for h in history] == [0, 1, 1]
    first, later = history[0], history[1:]
    on_policy = [v for k, v in first.items() if k.startswith("logprob_diff/")]
    assert on_policy and max(on_policy) == 0.0  # the first step is on-policy: same weights, same math
    assert not any(k.startswith("staleness/") for k in first)
    for h in later:  # later steps: the ratio against a stale policy, named so
        assert not any(k.startswith("logprob_diff/") for k in h)
        stale = [v for k, v in h.items() if k.startswith("staleness/logprob_diff/")]
        assert stale and max(stale) > 1e-4, h  # lr 1e-2: one update moves the log-probs
    for h in history:
        assert h["time/overlap"] <= min(h["time/rollout_busy"], h["time/train"]) + 1e-6
        assert h["time/worker_idle"] == pytest.approx(h["time/step"] - h["time/rollout_busy"], abs=1e-3)
        assert h["time/trainer_idle"] <= h["time/rollout_wait"] + 1e-6
        assert h["nfe/rollout_per_image"] == 8.0  # 4 steps x 2 (CFG): each batch booked once
    # Step k+1's rollout runs during step k's update; the last step has nothing left to roll out.
    assert history[0]["time/overlap"] > 0.0 and history[1]["time/overlap"] > 0.0
    assert history[2]["time/rollout_busy"] == history[2]["time/overlap"] == 0.0


def test_checkpoints_keep_the_batch_in_flight(straight):
    folder, _, _ = straight
    folders = dict(checkpoint_folders(folder / "run" / "checkpoints"))
    assert sorted(folders) == [1, 2, 3]
    # Steps 1 and 2 had the next batch in flight, sampled with versions 0 and 1; step 3, the last,
    # records the batch a step 4 would train on (version 2) without rolling it out.
    assert all((folders[s] / ROLLOUT_POLICY).is_file() for s in (1, 2, 3))
    states = {s: load_checkpoint(f).state for s, f in folders.items()}
    assert [(states[s]["pipeline"]["step"], states[s]["pipeline"]["version"]) for s in (1, 2, 3)] == [
        (1, 0),
        (2, 1),
        (3, 2),
    ]
    # The data position is the one before the batch in flight: what a sync run has after its step.
    assert states[1]["data"] != states[2]["data"]


# An evaluation at every step (the built-in scene captions' held-out prompts) with the global-RNG
# reward, and a checkpoint of the best gold score: the evaluation's reward draws must not move the
# training rewards' stream, or a resume from an evaluation step's checkpoint draws other numbers.
EVALUATED = [
    "data.demo_set=scenes",
    "eval.every=1",
    "eval.num_prompts=2",
    "eval.num_steps=2",
    "checkpoint.keep_best=true",
]


@pytest.fixture(scope="module")
def straight_evaluated(tiny_checkpoint, tmp_path_factory):
    """`straight` with an evaluation at every step."""
    folder = tmp_path_factory.mktemp("pipelined_evaluated")
    trainer, history = run(tiny_checkpoint, folder, *EVALUATED)
    return folder, {k: v.clone() for k, v in lora_state_dict(trainer.transformer).items()}, history


@pytest.mark.parametrize(
    ("straight_run", "resume_from"),
    [("straight", 1), ("straight", 2), ("straight_evaluated", 1)],
    ids=["1", "2", "evaluated-1"],
)
def test_a_resumed_pipelined_run_ends_bitwise_equal(
    request, tiny_checkpoint, tmp_path, straight_run, resume_from
):
    folder, lora, history = request.getfixturevalue(straight_run)
    extra = EVALUATED if straight_run == "straight_evaluated" else []
    shutil.copytree(folder / "run", tmp_path / "run")
    for step, path in checkpoint_folders(tmp_path / "run" / "checkpoints"):
        if step > resume_from:
            shutil.rmtree(path)
    trainer = OwnCopyTrainer(config(tiny_checkpoint, tmp_path, "resume=auto", *extra))
    try:
        assert trainer.resume("auto") is not None and trainer.step == resume_from
        again = trainer.train()
    finally:
        trainer.close()
    assert [h["step"] for h in again] == [1, 2, 3]
    keys = ["reward/mean", "rollout/weights_version", "rollout/staleness"]
    if extra:
        keys.append("eval/reward/mean")
    for key in keys:
        assert [h[key] for h in again] == [h[key] for h in history], key
    for k, v in lora_state_dict(trainer.transformer).items():
        assert torch.equal(v, lora[k]), k


def test_a_finished_pipelined_run_extended_equals_a_longer_straight_run(straight, tiny_checkpoint, tmp_path):
    """``total_steps`` may grow on a resume: the last step's checkpoint keeps the batch the next step
    would train on (not rolled out: its weights, data position and RNG states), so step 3 of a 2-step
    run extended to 3 trains, like a straight 3-step run's, on a batch sampled with version 1."""
    _, lora, history = straight
    run(tiny_checkpoint, tmp_path, "total_steps=2")
    (_, last), *_ = reversed(checkpoint_folders(tmp_path / "run" / "checkpoints"))
    assert (last / ROLLOUT_POLICY).is_file()  # version 1, which the next step samples with
    trainer = OwnCopyTrainer(config(tiny_checkpoint, tmp_path, "resume=auto"))  # total_steps=3
    try:
        assert trainer.resume("auto") == last and trainer.step == 2
        again = trainer.train()
    finally:
        trainer.close()
    for key in ("rollout/weights_version", "rollout/staleness", "reward/mean"):
        assert [h[key] for h in again] == [h[key] for h in history], key
    for k, v in lora_state_dict(trainer.transformer).items():
        assert torch.equal(v, lora[k]), k


@pytest.mark.parametrize("broken_step", [1, 2])
def test_a_nonfinite_stop_without_a_committed_checkpoint_resumes_like_a_straight_run(
    straight, tiny_checkpoint, tmp_path, monkeypatch, broken_step
):
    """The reward breaks in step k + 1 and ``reward.max_nonfinite_steps=1`` stops the run there; with
    ``checkpoint.save_every=2`` no checkpoint of step k was committed, so the stop writes it. It is
    step k's state, not the stop's: weights version k, and the batch step k + 1 trains on (sampled
    with version k - 1, or the base; its data position and RNG states). Once the reward is repaired,
    ``resume=auto`` goes on like the straight run, bitwise."""
    _, lora, history = straight
    # Call k + 1 scores step k + 1's batch (rolled out in step k; the first, in step 1).
    monkeypatch.setattr(reward_fakes, "NAN_FROM_CALL", broken_step)
    monkeypatch.setattr(reward_fakes, "calls", 0)
    broken = [
        "reward.rewards=[{name: 'tests.trainer.reward_fakes:global_noise_then_nan'}]",
        "reward.max_nonfinite_steps=1",
        "checkpoint.save_every=2",
        "preflight=false",  # its step would be the reward's first call
    ]
    with pytest.raises(TrainingStopped, match="1 consecutive steps") as stopped:
        run(tiny_checkpoint, tmp_path, *broken)
    ((step, folder),) = checkpoint_folders(tmp_path / "run" / "checkpoints")
    assert step == broken_step - 1 and str(folder) in str(stopped.value)
    state = load_checkpoint(folder).state
    assert state["trainer"]["weights_version"] == step
    assert (state["pipeline"]["step"], state["pipeline"]["version"]) == (step, max(step - 1, 0))
    monkeypatch.setattr(reward_fakes, "NAN_FROM_CALL", None)
    trainer = OwnCopyTrainer(config(tiny_checkpoint, tmp_path, "resume=auto", *broken))
    try:
        assert trainer.resume("auto") == folder and trainer.step == step
        again = trainer.train()
    finally:
        trainer.close()
    for key in ("reward/mean", "rollout/weights_version", "weights_version", "nonfinite_reward_samples"):
        assert [h[key] for h in again] == [h[key] for h in history], key
    for k, v in lora_state_dict(trainer.transformer).items():
        assert torch.equal(v, lora[k]), k


def test_pipeline_needs_an_engine_with_its_own_copy(tiny_checkpoint, tmp_path):
    with pytest.raises(
        ConfigError, match=r"rollout.pipeline='one_step': expected 'off' with rollout.engine=local"
    ):
        small_config(tiny_checkpoint, tmp_path, "rollout.pipeline=one_step")
