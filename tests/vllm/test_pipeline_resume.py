"""``rollout.pipeline=one_step`` with the real rollout worker, killed with SIGKILL and resumed with
``resume=auto``, on 1 and on 2 ranks (``bash tests/vllm/run.sh``).

Each trainer process launches its own worker from the rollout environment (direct backend, CPU).
Killed and resumed must end bitwise equal to a straight pipelined run of 3 steps: LoRA, optimizer
state, every step's reward, staleness and weights versions, and every step's evaluation (each
checkpoint is of an evaluation step, and the reward draws from the global RNGs). The resume rolls the checkpoint's batch
in flight out again in a fresh worker with the weights the checkpoint kept:

* 1 rank, FlowGRPO: killed in step 2 after the update (step 3's rollout in the worker); the resume
  from step 1 regenerates step 2's batch, sampled with version 0 (the base: the worker had no LoRA
  loaded, the resumed one gets the zero-B LoRA).
* 2 ranks (test_pipeline_resume_two_ranks.py, a module of its own so that run.sh's pytest-xdist
  workers run the two at once), DiffusionNFT with a lagging old policy (the worker holds the old
  policy): rank 0 killed in step 3; the resume from step 2 regenerates step 3's batch on each rank's
  worker with version 1.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
from safetensors.torch import load_file

from boogu_trainer.checkpoint import checkpoint_folders
from tests.trainer.test_distributed_and_resume import (
    GLOBAL_RNG_REWARD,
    final_lora,
    overrides,
    run,
    same,
)

pytestmark = pytest.mark.vllm

PIPELINED = [
    "rollout.engine=vllm_omni",
    "rollout.vllm.backend=direct",
    "rollout.vllm.startup_timeout_s=300",
    "rollout.pipeline=one_step",
    "total_steps=3",
    "checkpoint.save_every=1",
    "checkpoint.keep_last=2",
    "optim.lr=1e-2",
    GLOBAL_RNG_REWARD,
    # An evaluation after every step, scored by the same reward: each checkpoint is of an evaluation
    # step, whose reward draws must not move the training rewards' stream (docs/pipelining.md).
    "data.demo_set=scenes",
    "eval.every=1",
    "eval.num_prompts=2",  # also the demo's held-out comparison at the end of each run: keep it short
]


def history(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "run" / "metrics.jsonl").read_text().splitlines()]


def assert_same_run(straight: Path, killed: Path, *, on_policy_check: bool) -> None:
    assert same(final_lora(straight), final_lora(killed))
    (_, a), (_, b) = (checkpoint_folders(d / "run" / "checkpoints")[-1] for d in (straight, killed))
    assert same(load_file(a / "optimizer.safetensors"), load_file(b / "optimizer.safetensors"))
    h, k = history(straight), history(killed)
    assert [m["step"] for m in k] == [1, 2, 3]
    keys = ("reward/mean", "loss", "rollout/weights_version", "rollout/staleness", "weights_version")
    for key in (*keys, "eval/reward/mean"):
        assert [m[key] for m in k] == [m[key] for m in h], key
    assert [m["rollout/staleness"] for m in h] == [0, 1, 1]
    assert [m["rollout/weights_version"] for m in h] == [0, 0, 1]
    assert all(m["time/overlap"] > 0 for m in h[:2]), [m["time/overlap"] for m in h]
    if on_policy_check:  # the first step is on-policy against the worker's log-probs, later ones stale
        first = [v for key, v in h[0].items() if key.startswith("logprob_diff/")]
        assert first and max(first) < 1e-3, h[0]
        assert all(any(key.startswith("staleness/logprob_diff/") for key in m) for m in h[1:])


def test_one_rank_killed_and_resumed_equals_a_straight_pipelined_run(tiny_checkpoint, tmp_path):
    trainer = [sys.executable, "-m", "boogu_trainer"]
    flow_grpo = [*PIPELINED, "algorithm.name=flow_grpo"]
    run([*trainer, *overrides(tiny_checkpoint, tmp_path / "straight", *flow_grpo)], timeout=600)
    killed = [*trainer, *overrides(tiny_checkpoint, tmp_path / "killed", *flow_grpo)]
    run(killed, timeout=600, fault="kill:after_update:2", expect=-9)
    assert [s for s, _ in checkpoint_folders(tmp_path / "killed" / "run" / "checkpoints")] == [1]
    run([*killed, "resume=auto"], timeout=600)
    assert_same_run(tmp_path / "straight", tmp_path / "killed", on_policy_check=True)
