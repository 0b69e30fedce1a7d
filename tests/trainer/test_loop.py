"""Short real runs of the trainer on the tiny checkpoint: metrics, checkpoints, resume, failures."""

from __future__ import annotations

import dataclasses
import json
import shutil

import pytest
import torch
from safetensors.torch import load_file

from boogu_trainer import checkpoint as ckpt
from boogu_trainer.checkpoint import CheckpointError, checkpoint_folders, load_checkpoint
from boogu_trainer.config import load_config
from boogu_trainer.onpolicy import LOGPROB_TOLERANCE
from boogu_trainer.trainer import Trainer, TrainingStopped


def small_config(tiny_checkpoint, run_dir, *overrides):
    return load_config(
        None,
        [
            f"model.path={tiny_checkpoint}",
            "model.device=cpu",
            "data.prompts_per_step=2",
            "algorithm.group_size=4",
            "algorithm.mini_batches=2",
            "sampler.num_steps=4",
            "sampler.height=32",
            "sampler.width=32",
            "sampler.guidance_scale=2.0",
            "sampler.noise_level=0.8",
            "sampler.window_size=2",
            "sampler.window_range=[0,3]",
            "lora.rank=4",
            "lora.alpha=8",
            "optim.lr=1e-3",
            "reward.rewards=[{name: demo_brightness}]",
            "total_steps=3",
            "checkpoint.save_every=2",
            "checkpoint.keep_last=2",
            f"logging.run_dir={run_dir}",
            "logging.name=run",
            "logging.sample_every=2",
            "logging.plot_every=2",  # drawn at step 2 and at the last step
            "logging.progress=false",
            "seed=3",
            *overrides,
        ],
    )


def lora_of(trainer):
    from boogu_adapters.lora import lora_state_dict

    return {k: v.detach().clone() for k, v in lora_state_dict(trainer.transformer).items()}


@pytest.fixture(scope="module")
def finished_run(tiny_checkpoint, tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("runs")
    trainer = Trainer(small_config(tiny_checkpoint, run_dir))
    history = trainer.train()
    return trainer, history, run_dir / "run"


def test_run_writes_metrics_samples_curve_and_checkpoints(finished_run):
    trainer, history, run = finished_run
    lines = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in lines] == [1, 2, 3] == [h["step"] for h in history]
    for key in (
        "reward/mean",
        "adv/std",
        "zero_std_ratio",
        "loss",
        "ratio_mean",
        "clipfrac_upper",
        "approx_kl",
        "grad_norm",
        "nfe/rollout_per_image",
        "time/rollout",
        "time/train",
        "images_per_s",
        "peak_memory_gb",
        "perf/tflops",
        "perf/mfu",
        "perf/tflops_per_image",
    ):
        assert all(key in line for line in lines), key
    # Model FLOPs of each step: 8 images x 4 steps x 2 (CFG) rollout forwards, then the update's
    # training forwards (with their backward); MFU against a measured CPU peak is a fraction.
    assert all(r["perf/tflops_rollout"] > 0 and r["perf/tflops_train"] > 0 for r in lines)
    assert all(0 < r["perf/mfu"] < 1 for r in lines)
    # On-policy: before the first update the training log-prob equals the rollout's (bitwise where
    # both forwards hold as many rows; a few ulps on CPUs whose matrix kernels block by row count).
    tol = LOGPROB_TOLERANCE[("cpu", "float32")]  # the on-policy checks' CPU float32 entry
    assert all(r["logprob_diff/step0"] <= tol and r["logprob_diff/step1"] <= tol for r in lines)
    assert all(r["clipfrac_first"] == 0.0 for r in lines)  # the clip acted on nothing on-policy
    assert lines[0]["nfe/rollout_per_image"] == 8  # 4 steps x (positive + negative)
    assert (run / "reward_curve.png").stat().st_size > 1000
    assert sorted(p.name for p in (run / "samples").iterdir()) == ["step_0001.png", "step_0002.png"]
    assert [s for s, _ in checkpoint_folders(run / "checkpoints")] == [2, 3]
    assert trainer.engine.weights_version == 3 and [v for v, _ in trainer.engine.sync_log] == [1, 2, 3]


def test_the_lora_changed_and_the_checkpoint_holds_it(finished_run):
    trainer, _, run = finished_run
    saved = load_checkpoint(run / "checkpoints" / "step_000003")
    current = lora_of(trainer)
    assert set(saved.state["learner"]["lora"]) == set(current)
    for k, v in current.items():
        assert torch.equal(saved.state["learner"]["lora"][k], v)
    assert any(k.endswith("lora_B.weight") and v.abs().sum() > 0 for k, v in current.items())
    assert saved.step == 3 and saved.state["trainer"]["step"] == 3


def test_checkpoint_lora_loads_with_peft_and_diffusers(finished_run, tiny_checkpoint):
    from peft import PeftModel

    from boogu_adapters.loading import load_transformer

    trainer, _, run = finished_run
    folder = run / "checkpoints" / "step_000003"
    expected = lora_of(trainer)
    base, _ = load_transformer(
        tiny_checkpoint, kind="native", trust_remote_code=False, dtype=torch.float32, device="cpu"
    )
    peft_model = PeftModel.from_pretrained(base, folder)
    got = {
        k.removeprefix("base_model.model.").replace(".default", ""): v
        for k, v in peft_model.state_dict().items()
        if "lora_" in k
    }
    assert set(got) == set(expected) and all(torch.equal(got[k], expected[k]) for k in expected)

    base2, _ = load_transformer(
        tiny_checkpoint, kind="native", trust_remote_code=False, dtype=torch.float32, device="cpu"
    )
    base2.load_lora_adapter(
        folder, weight_name="adapter_model.safetensors", prefix="base_model.model", adapter_name="rl"
    )
    got2 = {k.replace(".rl", ""): v for k, v in base2.state_dict().items() if "lora_" in k}
    assert set(got2) == set(expected) and all(torch.equal(got2[k], expected[k]) for k in expected)
    raw = load_file(folder / "adapter_model.safetensors")
    assert all(k.startswith("base_model.model.") for k in raw)


def test_resume_auto_continues_exactly(finished_run, tiny_checkpoint, tmp_path):
    trainer, history, _ = finished_run
    # A second run stops at step 2 (its own checkpoint), then resumes to step 3.
    short = Trainer(small_config(tiny_checkpoint, tmp_path, "total_steps=2"))
    short.train()
    short.close()  # the run ends: its folder's lock goes
    resumed = Trainer(small_config(tiny_checkpoint, tmp_path, "resume=auto"))
    assert resumed.resume("auto") is not None and resumed.step == 2
    new_history = resumed.train()
    assert [h["step"] for h in new_history] == [1, 2, 3]
    for k, v in lora_of(trainer).items():
        assert torch.equal(lora_of(resumed)[k], v), k
    assert new_history[-1]["reward/mean"] == history[-1]["reward/mean"]


def test_nonfinite_rewards_skip_then_stop_with_a_checkpoint(tiny_checkpoint, tmp_path):
    cfg = small_config(
        tiny_checkpoint,
        tmp_path,
        "reward.rewards=[{name: 'tests.trainer.reward_fakes:always_nan'}]",
        "reward.max_nonfinite_steps=2",
        "total_steps=5",
    )
    trainer = Trainer(cfg)
    before = lora_of(trainer)
    with pytest.raises(TrainingStopped, match="2 consecutive steps"):
        trainer.train()
    assert trainer.learner.counters["skipped_updates"] == 2
    assert all(torch.equal(v, before[k]) for k, v in lora_of(trainer).items())  # no update happened
    assert [s for s, _ in checkpoint_folders(tmp_path / "run" / "checkpoints")] == [1]


def test_partly_nonfinite_rewards_train_on_the_rest(tiny_checkpoint, tmp_path):
    cfg = small_config(
        tiny_checkpoint,
        tmp_path,
        "reward.rewards=[{name: 'tests.trainer.reward_fakes:half_nan'}]",
        "total_steps=1",
    )
    history = Trainer(cfg).train()
    assert history[0]["nonfinite_rewards"] == 4 and history[0]["nonfinite_reward_samples"] == 4
    assert history[0]["skipped_updates"] == 0 and history[0]["optimizer_steps"] >= 1


def test_ema_follows_the_lora_and_is_checkpointed(tiny_checkpoint, tmp_path):
    cfg = small_config(tiny_checkpoint, tmp_path, "ema.enabled=true", "ema.decay=0.5", "total_steps=1")
    trainer = Trainer(cfg)
    initial = lora_of(trainer)
    trainer.train()
    final = lora_of(trainer)
    for k in final:
        torch.testing.assert_close(trainer.learner.ema[k], 0.5 * initial[k] + 0.5 * final[k])
    saved = load_checkpoint(tmp_path / "run" / "checkpoints" / "step_000001")
    assert saved.state["learner"]["ema"] is not None and all(
        torch.equal(saved.state["learner"]["ema"][k], trainer.learner.ema[k]) for k in final
    )
    # An evaluation judges the EMA weights (ema.evaluate, the default), and the trained ones are put
    # back bitwise after it; the EMA differs from them here (decay 0.5 over one update).
    seen = []

    def judged(step):
        seen.append(lora_of(trainer))
        raise KeyboardInterrupt  # leave _evaluate at once, as an interrupted evaluation would

    trainer.evaluator.evaluate = judged
    with pytest.raises(KeyboardInterrupt):
        trainer._evaluate()
    assert all(torch.equal(seen[0][k], trainer.learner.ema[k].to(final[k].dtype)) for k in final)
    assert any(not torch.equal(seen[0][k], final[k]) for k in final)
    assert all(torch.equal(v, final[k]) for k, v in lora_of(trainer).items())
    ema_off = dataclasses.replace(trainer.config.ema, evaluate=False)
    trainer.config = dataclasses.replace(trainer.config, ema=ema_off)
    with pytest.raises(KeyboardInterrupt):
        trainer._evaluate()
    assert all(torch.equal(seen[1][k], final[k]) for k in final)


def test_metrics_count_forwards_and_encodings_per_step(finished_run):
    _, history, _ = finished_run
    for record in history:
        # Counted by a hook on the transformer: 4 steps x (positive + negative) rows per image in the
        # rollout; 2 window steps x 2 rows in training (KL off).
        assert record["nfe/rollout_per_image"] == 8.0
        assert record["nfe/train_per_image"] == 4.0
        # Per step, not cumulative: each prompt encoded once for its group; one shared negative.
        assert record["prompt_encodings_per_prompt"] == 1.0 and record["negative_encodings"] == 1


def test_resume_with_a_changed_lr_is_refused_unless_opted_in(finished_run, tiny_checkpoint, tmp_path):
    _, _, run = finished_run
    shutil.copytree(run, tmp_path / "run")
    changed = small_config(tiny_checkpoint, tmp_path, "resume=auto", "optim.lr=5e-4", "total_steps=4")
    trainer = Trainer(changed)
    with pytest.raises(CheckpointError, match=r"optim\.lr: 0\.001 \(checkpoint\) -> 0\.0005"):
        trainer.resume("auto")
    trainer.close()  # it holds the run folder's lock from its start
    allowed = small_config(
        tiny_checkpoint,
        tmp_path,
        "resume=auto",
        "optim.lr=5e-4",
        "total_steps=4",
        "resume_allow_changes=[optim.lr]",
    )
    trainer = Trainer(allowed)
    assert trainer.resume("auto") is not None and trainer.step == 3
    assert [g["lr"] for g in trainer.learner.optimizer.param_groups] == [5e-4]
    trainer.train()
    saved = load_checkpoint(tmp_path / "run" / "checkpoints" / "step_000004")
    assert (
        "lr: 0.0005" in saved.config_yaml and "lr: 0.0005" in (tmp_path / "run" / "config.yaml").read_text()
    )
    assert saved.state["learner"]["optimizer_meta"]["param_groups"][0]["lr"] == 5e-4


def test_the_data_state_names_its_prompts_by_content_and_order():
    """The sampler's state records a digest of its prompts: the same prompts give the same digest
    (their split and row index train nothing), another order, text or reference image another; a
    state of other prompts is refused by count, and at the same count by digest unless accepted; a
    state written before the digest existed is checked by its count."""
    from boogu_data import PromptRecord
    from boogu_trainer.data import PromptSampler

    records = [PromptRecord(instruction=f"a sign that says {i}", ground_truth=str(i)) for i in range(4)]
    base = PromptSampler(records, 2, seed=0)
    state = base.state_dict()
    assert len(state["records_sha256"]) == 64
    same = [dataclasses.replace(r, split="val", index=7) for r in records]
    assert PromptSampler(same, 2).records_sha256 == base.records_sha256
    others = {
        "order": records[::-1],
        "text": [dataclasses.replace(records[0], instruction="a sign that says 9"), *records[1:]],
        "truth": [dataclasses.replace(records[0], ground_truth="9"), *records[1:]],
        "image": [dataclasses.replace(records[0], ref_image=b"\x89PNG"), *records[1:]],
    }
    for what, changed in others.items():
        sampler = PromptSampler(changed, 2, seed=0)
        assert sampler.records_sha256 != base.records_sha256, what
        with pytest.raises(
            ValueError, match=r"prompts are not these .*resume_allow_changes=\[data\.train_files\]"
        ):
            sampler.load_state_dict(state)
        sampler.load_state_dict({**state, "cursor": 2}, accept_other_prompts=True)
        assert sampler.cursor == 2, what
    with pytest.raises(ValueError, match="had 4 prompts, this one has 3"):
        PromptSampler(records[:3], 2).load_state_dict(state, accept_other_prompts=True)
    old = {k: v for k, v in state.items() if k != "records_sha256"}  # a checkpoint of v0.3
    PromptSampler(others["text"], 2).load_state_dict(old)


def test_resume_over_other_prompts_is_refused_unless_opted_in(
    finished_run, tiny_checkpoint, tmp_path, caplog
):
    # The same config over prompts edited in place (the same file names, the same count): the
    # checkpoint's data position would index other rows, so the resume is refused before anything
    # is loaded, naming the folder and the opt-in.
    from boogu_trainer.data import PromptSampler

    _, _, run = finished_run
    shutil.copytree(run, tmp_path / "run")

    def edited(trainer):
        records = [
            dataclasses.replace(r, instruction=r.instruction + " (edited)") for r in trainer.data.records
        ]
        trainer.data = PromptSampler(records, trainer.data.batch_size, seed=trainer.data.seed)

    trainer = Trainer(small_config(tiny_checkpoint, tmp_path, "resume=auto", "total_steps=4"))
    edited(trainer)
    with pytest.raises(
        CheckpointError, match=r"resume=auto \(.*step_000003\): the checkpoint's \d+ prompts are not these"
    ):
        trainer.resume("auto")
    assert trainer.step == 0  # nothing was loaded
    trainer.close()
    allowed = small_config(
        tiny_checkpoint, tmp_path, "resume=auto", "total_steps=4", "resume_allow_changes=[data.train_files]"
    )
    trainer = Trainer(allowed)
    edited(trainer)
    with caplog.at_level("WARNING"):
        assert trainer.resume("auto") is not None and trainer.step == 3
    assert "saved over other prompts" in caplog.text
    trainer.close()


def test_nonfinite_weights_stop_the_run_with_the_last_good_weights(tiny_checkpoint, tmp_path):
    # A finite lr whose Adam steps overflow float32 turns the LoRA into inf on the first update (set
    # behind the config's back: optim.lr refuses values above 1).
    trainer = Trainer(small_config(tiny_checkpoint, tmp_path, "total_steps=3"))
    for group in trainer.learner.optimizer.param_groups:
        group["lr"] = 3e37
    before = lora_of(trainer)
    with pytest.raises(TrainingStopped, match="non-finite"):
        trainer.train()
    after = lora_of(trainer)
    assert all(torch.equal(after[k], before[k]) for k in before)  # the bad update was undone
    ((step, folder),) = checkpoint_folders(tmp_path / "run" / "checkpoints")
    saved = load_checkpoint(folder)
    assert step == 0 and all(torch.isfinite(v).all() for v in saved.state["learner"]["lora"].values())
    assert all(torch.equal(saved.state["learner"]["lora"][k], before[k]) for k in before)


@pytest.mark.parametrize("broken_step", [1, 2])
def test_a_nonfinite_stop_without_a_committed_checkpoint_writes_that_step_and_resumes(
    tiny_checkpoint, tmp_path, monkeypatch, broken_step
):
    # The reward breaks in step k + 1 and reward.max_nonfinite_steps=1 stops the run; with
    # save_every=2 no step k was committed, so the stop writes it. It must be step k's state (weights
    # version k, the data position, global RNG states and counters before step k + 1), not the stop's:
    # a resume once the reward is repaired then ends bitwise equal to a run whose reward never broke.
    # k = 0 too: the checkpoint then holds the base weights, which a fresh engine holds as version 0.
    from tests.trainer import reward_fakes

    common = [
        "total_steps=2",
        "checkpoint.save_every=2",
        "reward.max_nonfinite_steps=1",
        "preflight=false",  # its step would be the reward's first call
        "logging.sample_every=0",
        "logging.plot_every=0",
    ]
    noisy = "reward.rewards=[{name: 'tests.trainer.reward_fakes:brightness_with_global_noise'}]"
    straight = Trainer(small_config(tiny_checkpoint, tmp_path / "straight", noisy, *common))
    history = straight.train()
    straight.close()
    breaking = "reward.rewards=[{name: 'tests.trainer.reward_fakes:global_noise_then_nan'}]"
    monkeypatch.setattr(reward_fakes, "NAN_FROM_CALL", broken_step)
    monkeypatch.setattr(reward_fakes, "calls", 0)
    stopped = Trainer(small_config(tiny_checkpoint, tmp_path / "stopped", breaking, *common))
    with pytest.raises(TrainingStopped, match="1 consecutive steps") as error:
        stopped.train()
    stopped.close()
    ((step, folder),) = checkpoint_folders(tmp_path / "stopped" / "run" / "checkpoints")
    assert step == broken_step - 1 and str(folder) in str(error.value)
    assert load_checkpoint(folder).state["trainer"]["weights_version"] == step
    monkeypatch.setattr(reward_fakes, "NAN_FROM_CALL", None)
    resumed = Trainer(small_config(tiny_checkpoint, tmp_path / "stopped", breaking, *common, "resume=auto"))
    try:
        assert resumed.resume("auto") == folder and resumed.step == step
        again = resumed.train()
    finally:
        resumed.close()
    for key in ("reward/mean", "weights_version", "nonfinite_reward_samples", "skipped_updates"):
        assert [h[key] for h in again] == [h[key] for h in history], key
    a, b = lora_of(straight), lora_of(resumed)
    assert all(torch.equal(a[k], b[k]) for k in a)


def _files(folder):
    return {p.name: p.read_bytes() for p in sorted(folder.iterdir())}


def test_a_stop_mid_step_keeps_the_committed_checkpoint_of_the_step_before(tiny_checkpoint, tmp_path):
    # Step 1 is committed; in step 2 the update makes the LoRA non-finite (the lr is raised to
    # overflow after step 1), is undone, and the run stops with a checkpoint. By then the data position,
    # the RNG, the counters and AdamW's moments belong to step 2: writing them as step 1 would replace
    # the committed state with one that no straight run ever had.
    cfg = small_config(tiny_checkpoint, tmp_path / "a", "checkpoint.save_every=1", "total_steps=3")
    step1 = tmp_path / "a" / "run" / "checkpoints" / "step_000001"
    committed = tmp_path / "committed" / "step_000001"

    def after_step(step, record):
        if step == 1:
            shutil.copytree(step1, committed)
            for group in trainer.learner.optimizer.param_groups:
                group["lr"] = 3e37

    trainer = Trainer(cfg)
    with pytest.raises(TrainingStopped, match="non-finite") as stopped:
        trainer.train(progress=after_step)
    assert trainer.learner.counters["optimizer_steps"] > 2  # step 2's update ran and was undone
    assert str(step1) in str(stopped.value)
    assert _files(step1) == _files(committed)
    assert [s for s, _ in checkpoint_folders(step1.parent)] == [1]

    def resumed(folder, run_dir):
        t = Trainer(small_config(tiny_checkpoint, run_dir, f"resume={folder}", "total_steps=2"))
        assert t.resume(str(folder)) is not None and t.step == 1
        return t, t.train()

    after, after_history = resumed(step1, tmp_path / "b")
    before, before_history = resumed(committed, tmp_path / "c")
    assert after_history[-1]["reward/mean"] == before_history[-1]["reward/mean"]
    a, b = lora_of(after), lora_of(before)
    assert all(torch.equal(a[k], b[k]) for k in a)


def test_inner_epochs_take_one_optimizer_step_per_mini_batch_and_epoch(tiny_checkpoint, tmp_path):
    one = Trainer(small_config(tiny_checkpoint, tmp_path / "a", "total_steps=1", "checkpoint.save_every=0"))
    two = Trainer(
        small_config(
            tiny_checkpoint,
            tmp_path / "b",
            "total_steps=1",
            "checkpoint.save_every=0",
            "algorithm.inner_epochs=2",
        )
    )
    h1, h2 = one.train(), two.train()
    assert h1[0]["optimizer_steps"] == 2 and h2[0]["optimizer_steps"] == 4
    assert h2[0]["nfe/train_per_image"] == 2 * h1[0]["nfe/train_per_image"]
    assert h2[0]["logprob_diff/step0"] == 0.0  # measured before the first update
    a, b = lora_of(one), lora_of(two)
    assert any(not torch.equal(a[k], b[k]) for k in a)


def test_sinks_are_closed_and_live_on_rank_zero_only(tiny_checkpoint, tmp_path, monkeypatch):
    from boogu_trainer import trainer as trainer_module
    from boogu_trainer.metrics import MetricsLogger

    closed = []

    class Recording(MetricsLogger):
        def close(self):
            closed.append(self.is_main)
            super().close()

    monkeypatch.setattr(trainer_module, "MetricsLogger", Recording)
    Trainer(small_config(tiny_checkpoint, tmp_path, "total_steps=1")).train()
    assert closed == [True]
    silent = MetricsLogger(tmp_path / "rank1", is_main=False, tensorboard=True, wandb=True)
    silent.truncate_to(0)
    silent.log({"step": 1, "reward/mean": 0.5})
    silent.close()
    assert not (tmp_path / "rank1").exists()


def test_the_trainer_draws_nothing_from_the_global_rngs(tiny_checkpoint, tmp_path, monkeypatch):
    # Its streams are explicit generators: a user's reward drawing from torch's, numpy's or Python's
    # global RNG sees the same stream whatever the trainer did first (the matmul probe included).
    from boogu_trainer import perf

    monkeypatch.setattr(perf, "_MEASURED", {})
    trainer = Trainer(small_config(tiny_checkpoint, tmp_path, "total_steps=1", "checkpoint.save_every=0"))
    before = ckpt.rng_state()
    trainer.train()
    after = ckpt.rng_state()
    assert set(before) == set(after) and all(torch.equal(before[k], after[k]) for k in before)
    assert perf._MEASURED  # the probe ran in this step


def test_global_rng_states_round_trip_per_rank():
    import random

    import numpy as np

    ckpt.seed_global_rngs(5)
    torch.rand(3), np.random.rand(3), random.random(), random.gauss(0, 1), np.random.randn()
    ranks = [ckpt.rng_state()]
    expected = (torch.rand(4), np.random.rand(4), random.random(), random.gauss(0, 1), np.random.randn())
    random.seed(9)
    ranks.append(ckpt.rng_state())  # rank 1's streams are elsewhere
    saved = ckpt.rng_states_of_ranks(ranks)
    ckpt.seed_global_rngs(123)
    ckpt.set_rng_state(ckpt.rng_state_of_rank(saved, 0))
    got = (torch.rand(4), np.random.rand(4), random.random(), random.gauss(0, 1), np.random.randn())
    assert torch.equal(got[0], expected[0]) and np.array_equal(got[1], expected[1])
    assert got[2:] == expected[2:]
    assert ckpt.rng_state_of_rank(saved, 2) is None  # saved by two ranks
    legacy = {"torch_cpu": torch.get_rng_state()}  # a checkpoint before v0.3: one state for all ranks
    assert ckpt.rng_state_of_rank(legacy, 3) == legacy


def test_a_second_writer_of_a_live_run_folder_is_refused_naming_the_holder(tiny_checkpoint, tmp_path):
    import os
    import socket

    first = Trainer(small_config(tiny_checkpoint, tmp_path, "total_steps=2", "checkpoint.save_every=1"))
    refused = []

    def start_a_second_run(step, record):
        # While the first run lives (a killed job's ranks still finishing): a resume=auto of it is
        # refused by its constructor, before it loads anything (tests/trainer/test_run_lock_and_resume_rules.py).
        if step == 1:
            with pytest.raises(ckpt.RunFolderLocked) as error:
                Trainer(small_config(tiny_checkpoint, tmp_path, "resume=auto"))
            refused.append(str(error.value))

    first.train(start_a_second_run)
    assert refused and f"pid {os.getpid()} on host {socket.gethostname()}" in refused[0]
    assert str(tmp_path / "run") in refused[0]
    lines = (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()
    assert [json.loads(line)["step"] for line in lines] == [1, 2]  # one writer
    # The lock lives as long as the run, not only its steps: what follows them (the demo's held-out
    # comparison) writes the folder too. Once the run is closed, the folder can be resumed.
    with pytest.raises(ckpt.RunFolderLocked):
        Trainer(small_config(tiny_checkpoint, tmp_path, "resume=auto"))
    first.close()
    after = Trainer(small_config(tiny_checkpoint, tmp_path, "resume=auto"))
    assert after.resume("auto") is not None and after.step == 2
    after.close()


def test_resume_says_when_an_accepted_change_ends_bitwise_equality(
    finished_run, tiny_checkpoint, tmp_path, caplog
):
    _, _, run = finished_run
    shutil.copytree(run, tmp_path / "run")
    same = Trainer(small_config(tiny_checkpoint, tmp_path, "resume=auto"))
    with caplog.at_level("WARNING", logger="boogu_trainer"):
        assert same.resume("auto") is not None
    assert "bitwise" not in caplog.text
    same.close()  # it holds the run folder's lock
    changed = small_config(tiny_checkpoint, tmp_path, "resume=auto", "algorithm.train_micro_batch_size=2")
    with caplog.at_level("WARNING", logger="boogu_trainer"):
        assert Trainer(changed).resume("auto") is not None
    assert "algorithm.train_micro_batch_size changed from 0" in caplog.text
    assert "no longer bitwise equal" in caplog.text


def test_too_few_prompts_are_refused_before_the_model_loads(tiny_checkpoint, tmp_path, monkeypatch):
    from boogu_data import PromptRecord, write_records
    from boogu_trainer.config import ConfigError

    data = tmp_path / "train.parquet"
    write_records([PromptRecord(instruction="a red circle", index=0)], data)

    def no_model(self):
        raise AssertionError("the model was loaded before the data were checked")

    monkeypatch.setattr(Trainer, "_load_parts", no_model)
    cfg = small_config(tiny_checkpoint, tmp_path, f"data.train_files=[{data}]", "preflight=false")
    with pytest.raises(ConfigError, match=r"data\.prompts_per_step=2: .* hold only 1"):
        Trainer(cfg)
    missing = small_config(tiny_checkpoint, tmp_path, f"data.val_files=[{tmp_path / 'nope.parquet'}]")
    with pytest.raises(ConfigError, match=r"data\.val_files=.*nope\.parquet"):
        Trainer(missing)
    assert not (tmp_path / "run").exists()


def test_replacing_the_training_prompts_reaches_the_steps(tiny_checkpoint, tmp_path):
    """`Trainer.data` is the one sampler the steps draw from and the checkpoint records: a sampler
    assigned after the trainer is built (the GPU dry run's edit rows, a benchmark's prompts) is the
    one the next step rolls out. Before, the batch source kept the sampler it was built with, so the
    dry run's edit cases silently rolled out its T2I demo prompts."""
    import io

    from PIL import Image

    from boogu_data import PromptRecord
    from boogu_trainer.data import PromptSampler

    def reference(shade: int) -> bytes:
        buffer = io.BytesIO()
        Image.new("RGB", (32, 32), (shade, shade, shade)).save(buffer, format="PNG")
        return buffer.getvalue()

    trainer = Trainer(small_config(tiny_checkpoint, tmp_path, "total_steps=1"))
    edits = [
        PromptRecord(instruction=f"make it brighter {i}", ref_image=reference(40 * i + 20)) for i in range(4)
    ]
    trainer.data = PromptSampler(edits, 2, shuffle=False, seed=0)
    assert trainer.batches.data is trainer.data
    stats = trainer.engine.stats
    assert stats.reference_images_encoded == 0
    trainer.train_step()
    trainer.close()
    assert stats.reference_images_encoded == 2  # the step's two prompts were the edit rows
    # and the sampler the checkpoint records is the one the step drew from
    assert trainer.data.state_dict()["cursor"] == 2 and trainer.data.state_dict()["num_records"] == 4


def test_the_pipelined_batch_source_takes_new_prompts_only_with_nothing_in_flight():
    from types import SimpleNamespace

    from boogu_trainer.batches import OneStepBatches

    old, new = SimpleNamespace(name="old"), SimpleNamespace(name="new")
    dist = SimpleNamespace(shard=lambda n: (0, n))
    batches = OneStepBatches(
        None, old, dist, torch.device("cpu"), engine_version=lambda: 0, rollout_weights=dict
    )
    batches.use_data(new)
    assert batches.data is new and batches.pipe.data is new  # the thread that rolls out draws from it
    batches.pipe.in_flight = object()  # a batch drawn from `new` is being rolled out
    with pytest.raises(RuntimeError, match="in flight"):
        batches.use_data(old)
    assert batches.data is new and batches.pipe.data is new
