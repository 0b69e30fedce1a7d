"""``benchmarks/pipeline.py --quick`` with the rollout worker (``bash tests/vllm/run.sh``): the sync and
the pipelined demo runs, their step times, overlap and idle times, and the figures it writes."""

from __future__ import annotations

import json
import runpy
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.vllm

BENCHMARKS = Path(__file__).resolve().parents[2] / "benchmarks"


def test_pipeline_benchmark_quick(tmp_path, monkeypatch):
    out = tmp_path / "pipeline.json"
    monkeypatch.syspath_prepend(str(BENCHMARKS))
    monkeypatch.setattr(sys, "argv", ["pipeline.py", "--quick", "--json", str(out)])
    monkeypatch.setenv("OMP_NUM_THREADS", "1")  # the script sets it for its workers; restored after
    with pytest.raises(SystemExit) as done:
        runpy.run_path(str(BENCHMARKS / "pipeline.py"), run_name="__main__")
    assert done.value.code == 0
    figures = json.loads(out.read_text())
    sync, pipelined = figures["runs"]
    assert (sync["mode"], pipelined["mode"]) == ("off", "one_step")
    assert sync["steps"] == pipelined["steps"] == 3
    assert sync["overlap_s"] == 0.0 < pipelined["overlap_s"]  # step k+1's rollout ran during step k's update
    assert 0 < figures["step_time_ratio"] == pytest.approx(pipelined["step_s"] / sync["step_s"])
    for run in (sync, pipelined):
        assert run["images_per_s"] > 0 and len(run["reward"]) == 3
        assert all(step["time/step"] > 0 for step in run["per_step"])
    assert figures["gpu_model"]["speedup_pipelined_over_sync"] > 1
