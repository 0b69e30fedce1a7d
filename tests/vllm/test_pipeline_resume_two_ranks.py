"""``rollout.pipeline=one_step`` on 2 ranks, each with its own rollout worker, killed and resumed
(``bash tests/vllm/run.sh``; the contract and the 1-rank case: test_pipeline_resume.py)."""

from __future__ import annotations

import pytest

from boogu_trainer.checkpoint import checkpoint_folders
from tests.trainer.test_distributed_and_resume import NFT_LAGGING, overrides, run, torchrun
from tests.vllm.test_pipeline_resume import PIPELINED, assert_same_run

pytestmark = pytest.mark.vllm


def test_two_ranks_killed_and_resumed_equal_a_straight_pipelined_run(tiny_checkpoint, tmp_path):
    nft = [*PIPELINED, *NFT_LAGGING]
    run(torchrun(*overrides(tiny_checkpoint, tmp_path / "straight", *nft)), timeout=600)
    killed = torchrun(*overrides(tiny_checkpoint, tmp_path / "killed", *nft))
    # Rank 0 dies in step 3 after its update; torchrun then stops rank 1, each worker its trainer.
    run(killed, timeout=600, fault="kill:after_update:3@0", expect=1)
    assert [s for s, _ in checkpoint_folders(tmp_path / "killed" / "run" / "checkpoints")] == [1, 2]
    run([*killed, "resume=auto"], timeout=600)
    assert_same_run(tmp_path / "straight", tmp_path / "killed", on_policy_check=False)
