"""No number changes: fixed-seed 4-step runs of every algorithm (and edit rows) end with the recorded
weights, optimizer and EMA, bitwise (`tests/trainer/golden_runs.py`)."""

from __future__ import annotations

import pytest

from tests.trainer.golden_runs import CASES, machine, recorded_here, recordings, run_case


def test_every_case_is_recorded():
    assert recordings(), "no recording"
    for recording in recordings():
        assert set(recording["cases"]) == set(CASES), recording["machine"]
        for name, hashes in recording["cases"].items():
            assert {"adapter_model.safetensors", "optimizer.safetensors", "ema.safetensors"} <= set(hashes), (
                name
            )
        assert "old_policy.safetensors" in recording["cases"]["diffusion_nft"]


@pytest.mark.slow
@pytest.mark.parametrize("name", list(CASES))
def test_a_fixed_seed_run_ends_with_the_recorded_weights(name, tiny_checkpoint, tmp_path):
    recorded = recorded_here()
    if recorded is None:
        pytest.skip(f"recorded on {[r['machine'] for r in recordings()]}, this is {machine()}")
    assert run_case(name, tiny_checkpoint, tmp_path) == recorded["cases"][name], (
        f"{name}: the final checkpoint differs from the one recorded before; if the change means to move a "
        "number, re-record with `python -m tests.trainer.golden_runs --record` and say why"
    )
