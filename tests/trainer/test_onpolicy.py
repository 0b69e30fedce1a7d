"""The on-policy checks keyed to the loss (`boogu_trainer.onpolicy`), and the multi-node start checks.

A recomputation perturbed by less than the old fixed thresholds (1e-3 at run time, 1e-6 x max(1,
|log p|) in the CPU preflight) but more than a tenth of the clip range trips them."""

from __future__ import annotations

import dataclasses
import logging
import socket

import pytest

from boogu_trainer.config import load_config
from boogu_trainer.distributed import MultiNodeError, check_multi_node_env, check_shared_folder
from boogu_trainer.onpolicy import (
    LOGPROB_TOLERANCE,
    logprob_diff_limit,
    logprob_tolerance,
    on_policy_problem,
)
from boogu_trainer.preflight import PreflightError, run_preflight
from boogu_trainer.trainer import Trainer
from tests.trainer.test_loop import small_config


def test_the_limit_is_a_tenth_of_the_clip_unless_set():
    assert logprob_diff_limit(load_config(None, [])) == pytest.approx(1e-5)  # clip_range 1e-4
    guard = load_config(None, ["algorithm.loss=grpo_guard", "algorithm.clip_range=2e-6"])
    assert logprob_diff_limit(guard) == pytest.approx(2e-7)
    # A recipe that sets it keeps its meaning.
    assert logprob_diff_limit(load_config(None, ["rollout.logprob_diff_warn=1e-3"])) == 1e-3
    # DiffusionNFT and AWM never read the rollout's log-probs: nothing of the loss to key to.
    assert (
        logprob_diff_limit(load_config(None, ["algorithm.name=diffusion_nft", "sampler.window_size=0"]))
        is None
    )
    with pytest.raises(Exception, match=r"rollout.logprob_diff_warn=0.0: expected > 0 or null"):
        load_config(None, ["rollout.logprob_diff_warn=0.0"])


def test_problems_are_named_from_the_max_over_ranks():
    config = load_config(None, [])
    assert on_policy_problem(config, {"logprob_diff/step0": 9e-6, "clipfrac_first": 0.0}) is None
    assert "up to 2e-05 (> algorithm.clip_range/10" in on_policy_problem(config, {"logprob_diff/step0": 2e-5})
    assert "0.25 of the first optimizer step's ratios were clipped" in on_policy_problem(
        config, {"logprob_diff/step0": 0.0, "clipfrac_first": 0.25}
    )
    assert on_policy_problem(config, {"logprob_diff/step1": float("nan")}) is not None


def test_one_tolerance_table_by_device_and_dtype():
    assert logprob_tolerance("cpu", "float32") == LOGPROB_TOLERANCE[("cpu", "float32")] == 1e-6
    import torch

    assert logprob_tolerance("cuda", torch.bfloat16) == LOGPROB_TOLERANCE[("cuda", "bfloat16")]
    assert logprob_tolerance("cpu", "float32", own_copy=True) >= 1e-4
    with pytest.raises(ValueError, match="no log-prob tolerance for device 'mps'"):
        logprob_tolerance("mps", "float32")


@pytest.mark.parametrize(
    ("env", "ok"),
    [
        ({}, True),
        ({"WORLD_SIZE": "8", "LOCAL_WORLD_SIZE": "8"}, True),  # one node: loopback is right
        ({"WORLD_SIZE": "16", "LOCAL_WORLD_SIZE": "8", "MASTER_ADDR": "node0"}, True),
        ({"WORLD_SIZE": "16", "LOCAL_WORLD_SIZE": "8", "MASTER_ADDR": "127.0.0.1"}, False),
        ({"WORLD_SIZE": "16", "LOCAL_WORLD_SIZE": "8"}, False),
        ({"NNODES": "2", "MASTER_ADDR": "localhost"}, False),
        ({"NNODES": "2", "MASTER_ADDR": "10.0.0.1"}, True),
    ],
)
def test_several_nodes_need_a_reachable_master_addr(env, ok):
    if ok:
        check_multi_node_env(env)
    else:
        with pytest.raises(MultiNodeError, match=r"MASTER_ADDR=\S+ on several nodes .*NODE_RANK=0"):
            check_multi_node_env(env)


class TwoNodes:
    """Rank 0 of a 2-rank job whose rank 1 does (or does not) see rank 0's files."""

    rank, world_size, is_main = 0, 2, True

    def __init__(self, other_sees: bool):
        self.other_sees = other_sees

    def broadcast_object(self, obj, name):
        return obj

    def gather_objects(self, obj, name):
        return [obj, (self.other_sees and obj[0], "node1")]


def test_a_run_folder_every_node_must_see(tmp_path):
    check_shared_folder(tmp_path, TwoNodes(other_sees=True))
    with pytest.raises(
        MultiNodeError, match=r"logging.run_dir=.*: rank 1 on node1 cannot see a file rank 0 wrote"
    ):
        check_shared_folder(tmp_path, TwoNodes(other_sees=False), wait_s=0.0)
    assert list(tmp_path.iterdir()) == []  # the token file is removed either way
    assert socket.gethostname()  # the name each rank reports


def perturbed(trainer, monkeypatch, delta: float) -> None:
    """The learner's recomputed log-probs moved by ``delta``, as other kernels or row counts would."""
    real = trainer.learner.recompute.step_stats

    def step_stats(*args, **kwargs):
        stats = real(*args, **kwargs)
        return dataclasses.replace(stats, log_prob=stats.log_prob + delta)

    monkeypatch.setattr(trainer.learner.recompute, "step_stats", step_stats)


@pytest.fixture(scope="module")
def trainer(tiny_checkpoint, tmp_path_factory):
    config = small_config(
        tiny_checkpoint,
        tmp_path_factory.mktemp("runs"),
        "total_steps=1",
        "logging.sample_every=0",
        "logging.plot_every=0",
        "algorithm.mini_batches=1",
    )
    with Trainer(config) as t:
        yield t


def test_the_preflight_fails_on_a_difference_the_clip_would_act_on(trainer, monkeypatch):
    # 5e-7: inside the CPU float32 kernels' 1e-6, above GRPO-Guard's clip_range/10 = 2e-7.
    perturbed(trainer, monkeypatch, 5e-7)
    assert run_preflight(trainer, raise_on_failure=False)["on_policy_ratio"].passed  # clip_range 1e-4
    algorithm = dataclasses.replace(trainer.config.algorithm, loss="grpo_guard", clip_range=2e-6)
    monkeypatch.setattr(trainer, "config", dataclasses.replace(trainer.config, algorithm=algorithm))
    monkeypatch.setattr(trainer.learner.algorithm, "config", algorithm)
    with pytest.raises(PreflightError, match=r"above algorithm.clip_range/10 = 2e-06/10 = 2e-07") as info:
        run_preflight(trainer)
    assert info.value.check == "on_policy_ratio"
    numbers = info.value.report["on_policy_ratio"].numbers
    assert numbers["max_abs_logprob_diff"] == pytest.approx(5e-7, rel=0.2) and numbers["tolerance"] == 2e-7


def test_a_step_whose_first_update_is_off_by_more_than_a_tenth_of_the_clip_warns(
    trainer, monkeypatch, caplog
):
    perturbed(trainer, monkeypatch, 2e-5)  # 1/5 of clip_range 1e-4; the old 1e-3 warning said nothing
    with caplog.at_level(logging.WARNING, logger="boogu_trainer"):
        metrics = trainer.train_step().metrics
    trainer.step += 1  # as `Trainer.train` counts it: the next sync is a newer version
    assert metrics["logprob_diff/step0"] == pytest.approx(2e-5, rel=0.05) and metrics["clipfrac_first"] == 0.0
    assert (
        "not on-policy at the first optimizer step" in caplog.text
        and "algorithm.clip_range/10" in caplog.text
    )
    caplog.clear()
    perturbed(trainer, monkeypatch, 2e-4)  # beyond the clip: every ratio of the first step is clipped
    with caplog.at_level(logging.WARNING, logger="boogu_trainer"):
        metrics = trainer.train_step().metrics
    assert metrics["clipfrac_first"] == 1.0
    assert "1 of the first optimizer step's ratios were clipped" in caplog.text
