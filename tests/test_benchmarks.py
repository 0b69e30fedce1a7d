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
    monkeypatch.syspath_prepend(str(BENCHMARKS))  # the script imports its sibling _common
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


def test_algorithms_stop_at_target_ends_a_run_at_its_first_crossing(monkeypatch):
    monkeypatch.syspath_prepend(str(BENCHMARKS))
    alg = runpy.run_path(str(BENCHMARKS / "algorithms.py"), run_name="algorithms")
    stop, summarise = alg["should_stop"], alg["summarise"]
    rewards = [0.70, 0.78, 0.81, 0.82, 0.83]  # smoothed: -, -, 0.763, 0.803, 0.82
    # without a target only the budget and the step limit stop a run
    assert not any(stop(rewards[:n], 100.0 * n, 1e9, 100, None) for n in range(1, 6))
    assert stop(rewards[:2], 300.0, 300.0, 100, None) and stop(rewards[:2], 1.0, 1e9, 2, None)
    # with one: the first step whose trailing mean of 3 reaches it, not a single high reward
    assert [stop(rewards[:n], 100.0 * n, 1e9, 100, 0.80) for n in range(1, 6)] == [False] * 3 + [True] * 2
    assert not stop([0.9, 0.9], 200.0, 1e9, 100, 0.80)
    curve = {
        "reward": rewards[:4],
        "smoothed": alg["smoothed"](rewards[:4]),
        "cum_fe": [100.0, 200.0, 300.0, 400.0],
        "cum_time_s": [1.0, 2.0, 3.0, 4.0],
        "fe_per_image": 9.0,
        "run_wall_s": 4.0,
        "stopped_at_target": True,
    }
    summary = summarise([curve], 0.80, stop_at_target=True)
    assert summary["fe_to_target"] == [400.0] and summary["steps_to_target"] == [4]
    assert summary["final_reward"] == [None]  # the run ended at the target: no final reward
    assert set(summary["fe_to_thresholds"]) == {"0.76", "0.78", "0.8"}  # none above the target
    full = summarise([{**curve, "stopped_at_target": False}], 0.80)
    assert full["final_reward"] == [pytest.approx(0.8033, abs=1e-4)] and "0.84" in full["fe_to_thresholds"]


def test_algorithms_ratio_interval(monkeypatch):
    monkeypatch.syspath_prepend(str(BENCHMARKS))
    interval = runpy.run_path(str(BENCHMARKS / "algorithms.py"), run_name="algorithms")["ratio_interval"]
    assert interval([2.0, 2.0, 2.0], [4.0, 4.0]) == (0.5, 0.5)  # no spread: the ratio itself
    new, base = [1500.0, 2000.0, 2500.0, 1800.0], [2300.0, 2300.0, 8400.0, 4200.0, 3000.0]
    low, high = interval(new, base)
    point = (sum(new) / len(new)) / (sum(base) / len(base))
    assert low < point < high and low > 0.2 and high < 1.2  # it contains the estimate, not everything
    assert interval(new, base) == (low, high)  # a fixed generator: reproducible
    narrow = interval(new * 10, base * 10)  # ten times the seeds: a narrower interval
    assert low < narrow[0] < point < narrow[1] < high
    assert all(math.isnan(v) for v in interval([1.0], base))
