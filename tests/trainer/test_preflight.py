"""Preflight: each check passes on a normal run, leaves nothing behind, and stops a run broken on purpose."""

from __future__ import annotations

import copy
import tempfile

import pytest
import torch

from boogu_adapters.engines import RelabelableEngine
from boogu_adapters.lora import lora_state_dict
from boogu_trainer import checkpoint as ckpt
from boogu_trainer.cli import main
from boogu_trainer.preflight import CHECKS, PreflightError, check_weight_sync, run_preflight
from boogu_trainer.rewards import build_rewards
from boogu_trainer.trainer import Trainer
from tests.trainer.test_loop import small_config


def constant_reward(images, records):
    """A user reward (by import path) that never varies: every advantage would be 0."""
    return torch.full((images.shape[0],), 0.5)


def prompt_only_reward(images, records):
    """A reward that tells prompts apart and rates every image of a prompt alike (a coarse verifier
    on few-step probe images)."""
    return torch.tensor([float(r.index) for r in records])


class FailingVerdict:
    """A pass/fail verifier (``pass_fail``, as scene_exact) that fails every probe image."""

    name = "failing_verdict"
    pass_fail = True

    def __call__(self, images, records):
        return torch.zeros(images.shape[0])


class PassingVerdict(FailingVerdict):
    """A pass/fail verifier that passes every probe image."""

    name = "passing_verdict"

    def __call__(self, images, records):
        return torch.ones(images.shape[0])


def top_partial_credit(images, records):
    """A partial-credit reward at its top score, as scene_edit_dense is on images scene_edit_exact passes."""
    return torch.ones(images.shape[0])


def use_rewards(trainer, config):
    """Give a built trainer another recipe's rewards (the probe's model and data stay)."""
    trainer.config = config
    trainer.rewards = build_rewards(config.reward.rewards)


def lora_of(trainer):
    return {k: v.detach().clone() for k, v in lora_state_dict(trainer.transformer).items()}


def state_of(trainer):
    engine = trainer.engine
    return {
        "lora": lora_of(trainer),
        "grads": [p.grad for p in trainer.learner.params],
        "optimizer": copy.deepcopy(trainer.learner.optimizer.state_dict()),
        "rng": ckpt.rng_state()["torch_cpu"].clone(),
        "data": trainer.data.state_dict(),
        "version": engine.weights_version,
        "sync_log": list(engine.sync_log),
        "samples": engine.stats.samples,
        "counters": dict(trainer.learner.counters),
    }


def assert_same_state(a, b):
    assert set(a["lora"]) == set(b["lora"]) and all(
        torch.equal(a["lora"][k], b["lora"][k]) for k in a["lora"]
    )
    assert all(g is None for g in b["grads"]) and all(g is None for g in a["grads"])
    assert a["optimizer"] == b["optimizer"] == {"state": {}, "param_groups": a["optimizer"]["param_groups"]}
    assert torch.equal(a["rng"], b["rng"])
    for key in ("data", "version", "sync_log", "samples", "counters"):
        assert a[key] == b[key], key


@pytest.fixture(scope="module")
def trainer(tiny_checkpoint, tmp_path_factory):
    return Trainer(small_config(tiny_checkpoint, tmp_path_factory.mktemp("runs"), "total_steps=1"))


def own_copy_engine(trainer):
    """An engine holding its own copy of the transformer (needs_lora_state), like a separate process."""
    engine = copy.copy(trainer.engine)
    engine.transformer = copy.deepcopy(trainer.transformer)
    engine.shares_module = False
    engine.sync_log = []
    engine.stats = copy.deepcopy(trainer.engine.stats)
    return engine


def use_engine(monkeypatch, trainer, engine):
    for owner in (trainer, trainer.rollout, trainer.evaluator):
        monkeypatch.setattr(owner, "engine", engine)


def test_passes_and_leaves_everything_as_it_was(trainer):
    before = state_of(trainer)
    report = run_preflight(trainer)
    assert report.passed and [c.name for c in report.checks] == list(CHECKS)
    assert all(c.passed for c in report.checks)
    assert report["lora_targets"].numbers["wrapped"] == 47
    assert report["on_policy_ratio"].numbers["max_abs_logprob_diff"] == 0.0
    g = report["gradients"].numbers
    assert g["ran"] == g["nonzero_grad"] > 0  # T2I probe: the reference-image refiner is not run
    assert report["weight_sync"].numbers["perturbed_diff"] > 0
    assert report["weight_sync"].numbers["restored_diff"] == 0
    assert "preflight passed" in report.render()
    assert_same_state(before, state_of(trainer))


def test_an_engine_that_cannot_be_relabelled_is_not_sync_checked(trainer, monkeypatch):
    assert isinstance(trainer.engine, RelabelableEngine)  # the local engine can be put back

    class Plain:  # generates and syncs, but keeps no sync log and cannot be relabelled
        needs_lora_state, weights_version = True, 0

        def generate(self, request): ...
        def sync_weights(self, version, lora_state=None, *, module=None): ...
        def close(self): ...

    assert not isinstance(Plain(), RelabelableEngine)
    monkeypatch.setattr(trainer, "engine", Plain())
    result = check_weight_sync(trainer, [])
    assert result.passed is None and result.detail == "Plain cannot be put back to its version: not checked"


def test_an_engine_with_its_own_copy_passes_and_is_put_back(trainer, monkeypatch):
    engine = own_copy_engine(trainer)
    use_engine(monkeypatch, trainer, engine)
    report = run_preflight(trainer)
    assert report["weight_sync"].passed and report["weight_sync"].numbers["needs_lora_state"] is True
    assert engine.weights_version == 0 and engine.sync_log == []
    for (k, a), (_, b) in zip(
        sorted(lora_of(trainer).items()), sorted(lora_state_dict(engine.transformer).items())
    ):
        assert torch.equal(a, b), k


def test_a_sync_that_does_nothing_is_a_named_stop(trainer, monkeypatch):
    monkeypatch.setattr(trainer.engine, "sync_weights", lambda version, lora_state=None, *, module=None: None)
    with pytest.raises(PreflightError, match="weights_version=0: the sync did nothing") as info:
        run_preflight(trainer)
    assert info.value.check == "weight_sync"
    assert info.value.report is not None and [c.name for c in info.value.report.failures] == ["weight_sync"]


def test_an_engine_that_records_the_version_but_loads_nothing_is_a_named_stop(trainer, monkeypatch):
    engine = own_copy_engine(trainer)
    use_engine(monkeypatch, trainer, engine)

    def record_only(version, lora_state=None, *, module=None):
        engine._version = version
        engine.sync_log.append((version, "not loaded"))

    monkeypatch.setattr(engine, "sync_weights", record_only)
    before = state_of(trainer)
    with pytest.raises(PreflightError, match="did not change the engine's next rollout") as info:
        run_preflight(trainer)
    assert info.value.check == "weight_sync"
    assert engine.weights_version == 0 and engine.sync_log == []
    assert torch.equal(before["rng"], state_of(trainer)["rng"])


def test_a_recomputed_logprob_that_differs_is_a_named_stop(trainer, monkeypatch):
    real = trainer.learner.recompute.step_stats

    def off_policy(*args, **kwargs):
        stats = real(*args, **kwargs)
        return type(stats)(log_prob=stats.log_prob + 1e-3, mean=stats.mean, std=stats.std)

    monkeypatch.setattr(trainer.learner.recompute, "step_stats", off_policy)
    with pytest.raises(PreflightError, match="ratio is not 1") as info:
        run_preflight(trainer)
    assert info.value.check == "on_policy_ratio"


def test_a_module_without_gradient_is_a_named_stop(trainer):
    _, param = next(
        (n, p)
        for n, p in trainer.transformer.named_parameters()
        if "single_stream_layers.0.attn.to_q.lora_B" in n
    )
    param.requires_grad_(False)  # its lora_A gets no gradient either while lora_B is 0
    try:
        with pytest.raises(PreflightError, match="1 of 40 adapted modules") as info:
            run_preflight(trainer)
    finally:
        param.requires_grad_(True)
    assert info.value.check == "gradients" and "single_stream_layers.0.attn.to_q" in str(info.value)


def test_a_block_type_without_adapted_modules_is_a_named_stop(tiny_checkpoint, tmp_path):
    trainer = Trainer(small_config(tiny_checkpoint, tmp_path, "lora.target_modules=[img_to_q]"))
    with pytest.raises(
        PreflightError, match=r"adapts no module of the block type\(s\) \['context_refiner'"
    ) as info:
        run_preflight(trainer)  # only the double-stream blocks have an img_to_q
    assert info.value.check == "lora_targets" and "attn.to_q" in str(info.value)


def test_targets_matching_nothing_are_a_named_stop(tiny_checkpoint, tmp_path):
    with pytest.raises(PreflightError, match="matches no module of the transformer") as info:
        Trainer(small_config(tiny_checkpoint, tmp_path, "lora.target_modules=[nonexistent]"))
    assert info.value.check == "lora_targets" and "attn.to_q" in str(info.value)


def test_a_constant_reward_is_a_named_stop_before_any_output(tiny_checkpoint, tmp_path):
    config = small_config(
        tiny_checkpoint, tmp_path, "reward.rewards=[{name: 'tests.trainer.test_preflight:constant_reward'}]"
    )
    trainer = Trainer(config)
    with pytest.raises(
        PreflightError, match=r"do not vary within or across any of the probe's 2 groups"
    ) as info:
        trainer.train()
    assert info.value.check == "reward_spread" and "constant_reward" in str(info.value)
    # Stopped before the run folder was written: it holds only the lock this live trainer took first
    # (docs/reliability.md, one writer per run folder), which close() removes with the folder.
    assert [p.name for p in (tmp_path / "run").iterdir()] == [".lock"]
    # preflight=false skips it: the run trains (on zero advantages) as before.
    trainer.config = small_config(
        tiny_checkpoint,
        tmp_path,
        "reward.rewards=[{name: 'tests.trainer.test_preflight:constant_reward'}]",
        "preflight=false",
        "total_steps=1",
        "logging.sample_every=0",
        "logging.plot_every=0",
    )
    history = trainer.train()
    assert len(history) == 1 and trainer.preflight_report is None


def test_a_reward_that_varies_only_across_prompts_passes_with_a_note(tiny_checkpoint, tmp_path):
    trainer = Trainer(
        small_config(
            tiny_checkpoint,
            tmp_path,
            "reward.rewards=[{name: 'tests.trainer.test_preflight:prompt_only_reward'}]",
        )
    )
    try:
        report = run_preflight(trainer)
    finally:
        trainer.close()
    check = next(c for c in report.checks if c.name == "reward_spread")
    assert check.passed and "within none of its 2 groups" in check.detail, check


def test_a_pass_fail_reward_failing_every_probe_image_is_noted_not_a_stop(tiny_checkpoint, tmp_path):
    # A verdict the base earns 26% of the time fails all 4 probe images a third of the time: a sparse
    # reward, not a broken one. The same zeros from a reward that does not declare itself pass/fail
    # stop the run (the test above); a pass/fail reward beside a weighted graded one is checked.
    trainer = Trainer(
        small_config(
            tiny_checkpoint,
            tmp_path,
            "reward.rewards=[{name: 'tests.trainer.test_preflight:FailingVerdict'}]",
        )
    )
    try:
        report = run_preflight(trainer)
        check = next(c for c in report.checks if c.name == "reward_spread")
        assert report.passed and check.passed is None, check
        assert (
            "reward(s) ['tests.trainer.test_preflight:FailingVerdict'] gave all 4 probe images the verdict 0"
            in (check.detail)
        )
        use_rewards(
            trainer,
            small_config(
                tiny_checkpoint,
                tmp_path,
                "reward.rewards=[{name: 'tests.trainer.test_preflight:FailingVerdict'}, "
                "{name: 'tests.trainer.test_preflight:constant_reward', weight: 0.5}]",
            ),
        )
        with pytest.raises(PreflightError, match="do not vary within or across"):
            run_preflight(trainer)
    finally:
        trainer.close()


def test_every_probe_image_passing_its_verdict_is_noted_with_a_partial_credit_reward_beside(
    tiny_checkpoint, tmp_path
):
    # The Edit demo's exact-plus-partial-credit reward (scene_edit_exact + scene_edit_dense) on a base
    # that edits all 4 probe images right: both rewards are at their top, rightly. Beside failing
    # verdicts the partial credit must vary (the test above): there it is the only signal.
    rewards = (
        "reward.rewards=[{name: 'tests.trainer.test_preflight:PassingVerdict'}, "
        "{name: 'tests.trainer.test_preflight:top_partial_credit'}]"
    )
    trainer = Trainer(small_config(tiny_checkpoint, tmp_path, rewards))
    try:
        report = run_preflight(trainer)
        check = next(c for c in report.checks if c.name == "reward_spread")
        assert report.passed and check.passed is None, check
        assert check.numbers["max_group_std"] == 0 and check.numbers["reward_mean"] == 2.0
        assert (
            "reward(s) ['tests.trainer.test_preflight:PassingVerdict'] gave all 4 probe images the verdict 1, "
            "and ['tests.trainer.test_preflight:top_partial_credit'] a constant beside it" in check.detail
        )
        # Two verdicts and nothing graded: each gave all 4 images one verdict (1 and 0), noted as one
        # verdict alone is.
        use_rewards(
            trainer,
            small_config(
                tiny_checkpoint,
                tmp_path,
                "reward.rewards=[{name: 'tests.trainer.test_preflight:PassingVerdict'}, "
                "{name: 'tests.trainer.test_preflight:FailingVerdict', label: failing}]",
            ),
        )
        check = next(c for c in run_preflight(trainer).checks if c.name == "reward_spread")
        assert check.passed is None and "the verdict 0/1 (" in check.detail, check
    finally:
        trainer.close()


def test_a_run_with_preflight_trains_exactly_like_one_without(tiny_checkpoint, tmp_path):
    runs = {}
    for flag in ("true", "false"):
        t = Trainer(
            small_config(
                tiny_checkpoint,
                tmp_path / flag,
                f"preflight={flag}",
                "total_steps=1",
                "logging.sample_every=0",
                "logging.plot_every=0",
            )
        )
        history = t.train()
        runs[flag] = (lora_of(t), history[0]["reward/mean"], t.engine.sync_log, t.preflight_report)
    (a, ra, la, report), (b, rb, lb, none) = runs["true"], runs["false"]
    assert report is not None and report.passed and none is None
    assert ra == rb and la == lb and all(torch.equal(a[k], b[k]) for k in a)


def test_cli_preflight_runs_only_the_checks(tiny_checkpoint, tmp_path, capsys, monkeypatch):
    temp = tmp_path / "temp"
    temp.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(temp))
    args = [f"model.path={tiny_checkpoint}", "model.device=cpu", "sampler.height=32", "sampler.width=32"]
    args += ["lora.rank=4", "lora.alpha=8", "data.prompts_per_step=2", "algorithm.group_size=2"]
    args += ["sampler.num_steps=4", f"logging.run_dir={tmp_path}", "logging.name=run"]
    assert main(["--preflight", *args]) == 0
    out = capsys.readouterr().out
    assert "preflight passed" in out and "[ok  ] weight_sync" in out
    assert not (tmp_path / "run").exists()
    assert main(["--preflight", *args, "lora.target_modules=[nonexistent]"]) == 1
    assert "preflight check 'lora_targets' failed" in capsys.readouterr().err
    assert list(temp.iterdir()) == []  # no temporary folder left behind, passed or failed
