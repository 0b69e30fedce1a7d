"""The benchmark scripts run: CPU smoke runs at toy sizes (their figures are for real machines)."""

from __future__ import annotations

import json
import math
import runpy
import sys
from pathlib import Path

import pytest

BENCHMARKS = Path(__file__).resolve().parents[1] / "benchmarks"


def run_script(name: str, args: list[str], monkeypatch) -> None:
    monkeypatch.setattr(sys, "argv", [name, *args])
    runpy.run_path(str(BENCHMARKS / name), run_name="__main__")


@pytest.mark.slow
def test_gpu_path_smoke_on_cpu(tmp_path, monkeypatch):
    out = tmp_path / "gpu_path.json"
    run_script(
        "gpu_path.py",
        [
            "--device",
            "cpu",
            "--preset",
            "tiny",
            "--size",
            "64",
            "--text-tokens",
            "16",
            "--batch",
            "1",
            "--rank",
            "4",
            "--repeats",
            "1",
            "--cases",
            "rollout,train,kernels",
            "--json",
            str(out),
        ],
        monkeypatch,
    )
    figures = json.loads(out.read_text())
    assert figures["image_tokens"] == 16 and figures["sample_forwards_per_call"] == 2
    assert set(figures["cases"]) == {"rollout", "train_bf16_lora"}  # fp32 case only for a bf16 model
    assert all(c["mfu"] > 0 and c["tflops_per_s"] > 0 for c in figures["cases"].values())
    # every attention stage of the tiny model was seen; nothing is padded except the text stages
    calls = figures["sdpa_calls"]
    assert sum(calls.values()) >= 5 and all("gqa=True" in k or "mask=yes" in k for k in calls)


@pytest.mark.slow
def test_algorithms_quick(tmp_path, monkeypatch):
    out = tmp_path / "algorithms.json"
    monkeypatch.syspath_prepend(str(BENCHMARKS))  # the script imports its sibling _common
    run_script("algorithms.py", ["--quick", "--json", str(out), "--out", str(tmp_path)], monkeypatch)
    figures = json.loads(out.read_text())
    assert isinstance(figures["target"], float) and math.isfinite(figures["target"])
    algorithms = figures["algorithms"]
    assert set(algorithms) == {
        "flow_grpo",
        "flow_grpo_e2",
        "grpo_guard",
        "diffusion_nft",
        "diffusion_nft_cfg",
        "awm",
    }
    for entry in algorithms.values():
        for key in ("fe_to_target", "wall_to_target_s", "final_reward"):
            values = entry[key]
            assert isinstance(values, list) and len(values) == figures["seeds"] == 1
            assert all(v is None or (isinstance(v, int | float) and v > 0) for v in values)
        assert entry["final_reward"][0] is not None
    assert figures["seed_list"] == [0]
    assert (tmp_path / "algorithms.png").stat().st_size > 0
