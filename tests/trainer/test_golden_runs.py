"""No number changes: fixed-seed 4-step runs of every algorithm (and edit rows) end with the recorded
weights, optimizer and EMA, bitwise (`tests/trainer/golden_runs.py`)."""

from __future__ import annotations

import json

import pytest

from tests.trainer.golden_runs import CASES, GOLDEN, machine, run_case

RECORDED = json.loads(GOLDEN.read_text())


def test_every_case_is_recorded():
    assert set(RECORDED["cases"]) == set(CASES)
    for name, hashes in RECORDED["cases"].items():
        assert {"adapter_model.safetensors", "optimizer.safetensors", "ema.safetensors"} <= set(hashes), name
    assert "old_policy.safetensors" in RECORDED["cases"]["diffusion_nft"]


@pytest.mark.slow
@pytest.mark.parametrize("name", list(CASES))
def test_a_fixed_seed_run_ends_with_the_recorded_weights(name, tiny_checkpoint, tmp_path):
    if RECORDED["machine"] != machine():
        pytest.skip(f"the hashes were recorded on {RECORDED['machine']}, this is {machine()}")
    assert run_case(name, tiny_checkpoint, tmp_path) == RECORDED["cases"][name], (
        f"{name}: the final checkpoint differs from the one recorded before; if the change means to move a "
        "number, re-record with `python -m tests.trainer.golden_runs --record` and say why"
    )
