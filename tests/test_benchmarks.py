"""The benchmark scripts run: CPU smoke runs at toy sizes (their figures are for real machines)."""

from __future__ import annotations

import json
import math
import os
import re
import runpy
import shlex
import shutil
import subprocess
import sys
import tarfile
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


def test_gpu_path_keeps_the_finished_cases_when_a_later_one_is_cut_short(tmp_path, monkeypatch):
    """gpu_check.sh's phase timeout kills gpu_path.py wherever it is: the JSON holds every case done
    before (rewritten after each, through a rename), the LoRA on/off/peft figures included. Killed
    here at a named point, the start of the training case."""
    from boogu_adapters.model import BooguImageTransformer2DModel

    def killed(self):
        raise KeyboardInterrupt("killed at the training case")

    monkeypatch.setattr(BooguImageTransformer2DModel, "enable_gradient_checkpointing", killed)
    monkeypatch.syspath_prepend(str(BENCHMARKS))
    out = tmp_path / "gpu_path.json"
    args = ["--device", "cpu", "--preset", "tiny", "--size", "32", "--text-tokens", "8", "--batch", "1"]
    args += ["--rank", "4", "--repeats", "1", "--cases", "rollout,lora,train", "--json", str(out)]
    with pytest.raises(KeyboardInterrupt, match="killed at the training case"):
        run_script("gpu_path.py", args, monkeypatch)
    figures = json.loads(out.read_text())
    assert set(figures["cases"]) == {"rollout", "rollout_adapters_off", "rollout_peft_lora"}
    assert all(row["seconds"] > 0 for row in figures["cases"].values())
    assert set(figures["lora_overhead"]) == {"fused_over_off", "peft_over_off", "peft_over_fused"}
    assert [p.name for p in tmp_path.iterdir()] == ["gpu_path.json"]  # no temporary file left


def test_gpu_benchmarks_draw_their_weights_with_a_generator_of_their_device(monkeypatch):
    """gpu_path.py and gpu_scale.py draw the random weights on the GPU they run on (a CPU draw of the
    released size took ~55 s of each phase's timeout), through the one generator seam."""
    import torch

    monkeypatch.syspath_prepend(str(BENCHMARKS))
    import gpu_path
    import gpu_scale

    from boogu_adapters.model import TINY_CONFIG

    asked = []
    for module in (gpu_path, gpu_scale):
        real = module.make_generator
        monkeypatch.setattr(
            module,
            "make_generator",
            lambda seed, device, real=real: asked.append(device) or real(seed, device),
        )
    gpu_path.build(TINY_CONFIG, torch.device("cpu"), torch.float32, 2)
    gpu_scale.build_transformer(TINY_CONFIG, 2, 64, torch.device("cpu"), torch.float32)
    assert [torch.device(d) for d in asked] == [torch.device("cpu")] * 2


def test_randomize_parameters_draws_on_its_generators_device():
    """On fake CUDA: a CUDA generator fills the CUDA parameters with draws made on CUDA (a draw on the
    CPU from it is what a real GPU refuses, and what RandomOpCheck reports)."""
    import torch

    import boogu_dryrun as dryrun
    from boogu_adapters.model import TINY_CONFIG, BooguImageTransformer2DModel, randomize_parameters
    from boogu_schedule import make_generator

    with dryrun.fake_cuda() as session:
        with torch.device("cuda"), dryrun.cases._skip_initialisers():
            model = BooguImageTransformer2DModel(**TINY_CONFIG)
        generator = make_generator(0, device="cuda")
        randomize_parameters(model, generator)
        assert next(model.parameters()).device.type == "cuda"
    assert session.errors == []


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


# ----------------------------------------------------------------------------------------------
# benchmarks/gpu_check.sh: the one-shot check for a lent GPU machine (one command of at most 600 s)

GPU_CHECK = BENCHMARKS / "gpu_check.sh"
REPO = BENCHMARKS.parent
GPU_CHECK_PHASES = [
    "install",
    "env",
    "gpu_path",
    "e2e_t2i",
    "e2e_edit",
    "gpu_scale",
    "gpu_dryrun",
    "vllm_e2e",
    "vllm_engines",
]
GPU_CHECK_BUDGET_S = 540  # of the device tool's 600 s per command, with room for kill grace and summary


def _fake_repo(root: Path, *, dryrun: bool, wheels: bool = False) -> Path:
    """A repo tree with the real gpu_check.sh and e2e script, two workspace packages and no code:
    the phases' python commands go to a fake interpreter."""
    (root / "benchmarks").mkdir(parents=True)
    shutil.copy(GPU_CHECK, root / "benchmarks" / "gpu_check.sh")
    (root / "tests" / "special_e2e").mkdir(parents=True)
    e2e = REPO / "tests" / "special_e2e" / "run_flowgrpo_boogu_image.sh"
    shutil.copy(e2e, root / "tests" / "special_e2e" / e2e.name)
    for dist in ("pkg-b", "pkg-a"):
        (root / "packages" / dist / "src" / dist.replace("-", "_")).mkdir(parents=True)
    if dryrun:
        (root / "benchmarks" / "gpu_dryrun.py").write_text("")
    if wheels:
        (root / ".whl").mkdir()
        (root / ".whl" / "fake-1.0-py3-none-any.whl").write_text("")
    return root


def _fake_python(path: Path, calls: Path, fail_on: str = "", sleep_on: str = "") -> Path:
    """An interpreter that records its PYTHONPATH and arguments, fails (rc 3) when its arguments
    contain ``fail_on``, and sleeps 60 s when they contain ``sleep_on``."""
    path.write_text(
        "#!/usr/bin/env bash\n"
        f'printf "%s\\t%s\\n" "$PYTHONPATH" "$*" >> {shlex.quote(str(calls))}\n'
        f'if [ -n {shlex.quote(fail_on)} ] && [[ "$*" == *{shlex.quote(fail_on)}* ]]; then exit 3; fi\n'
        f'if [ -n {shlex.quote(sleep_on)} ] && [[ "$*" == *{shlex.quote(sleep_on)}* ]]; then sleep 60; fi\n'
        "exit 0\n"
    )
    path.chmod(0o755)
    return path


def _run_gpu_check(repo: Path, out: Path, env: dict[str, str], timeout: float) -> subprocess.CompletedProcess:
    inherited = {k: v for k, v in os.environ.items() if not k.startswith("BOOGU_GPU_CHECK_")}
    env = {**inherited, "OUT": str(out), **env}
    return subprocess.run(
        ["bash", str(repo / "benchmarks" / "gpu_check.sh")],
        cwd=repo,
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def _phases(out: Path) -> dict[str, dict]:
    summary = json.loads((out / "summary.json").read_text())
    names = [p["name"] for p in summary["phases"]]
    assert names == GPU_CHECK_PHASES, names
    return {p["name"]: p for p in summary["phases"]}


def test_gpu_check_a_failing_phase_does_not_stop_the_later_ones(tmp_path):
    repo = _fake_repo(tmp_path / "repo", dryrun=True)
    calls = tmp_path / "calls.tsv"
    python = _fake_python(tmp_path / "python", calls, fail_on="gpu_path.py", sleep_on="gpu_scale.py")
    env = {
        "BOOGU_GPU_CHECK_DEVICE": "cpu",
        "BOOGU_GPU_CHECK_PYTHON": str(python),
        "BOOGU_GPU_CHECK_TIMEOUT_SCALE": "0.1",  # gpu_scale's 130 s -> 13 s: its 60 s sleep times out
        "BOOGU_GPU_CHECK_DRYRUN_ARGS": "--cases flow_grpo-t2i",
        "PYTHONPATH": "/caller/path",
    }
    result = _run_gpu_check(repo, tmp_path / "out", env, timeout=60)
    assert result.returncode == 1, result.stdout + result.stderr
    phases = _phases(tmp_path / "out")
    # gpu_path failed, gpu_scale timed out, and every phase after each ran and passed
    assert phases["gpu_path"]["ok"] is False and phases["gpu_path"]["rc"] == 3
    assert phases["gpu_scale"]["ok"] is False and phases["gpu_scale"]["timed_out"] is True
    assert phases["gpu_scale"]["rc"] == 124 and phases["gpu_scale"]["seconds"] < 30
    for name in ("env", "e2e_t2i", "e2e_edit", "gpu_dryrun"):
        assert phases[name]["ok"] is True and phases[name]["skipped"] is False and phases[name]["rc"] == 0, (
            name
        )
    for name in ("install", "vllm_e2e", "vllm_engines"):  # no wheels to install, no vllm on CPU
        assert phases[name]["skipped"] is True and phases[name]["ok"] is True, name
    with tarfile.open(tmp_path / "out" / "logs.tar.gz") as logs:
        logged = {Path(m).name for m in logs.getnames() if m.endswith(".log")}
    assert logged == {p["log"] for p in phases.values() if not p["skipped"]}
    # every python command ran with exactly the workspace's src folders, then the caller's path,
    # and took its device from BOOGU_GPU_CHECK_DEVICE
    rows = [line.split("\t", 1) for line in calls.read_text().splitlines()]
    srcs = ":".join(str(repo / "packages" / d / "src") for d in ("pkg-a", "pkg-b"))
    assert {path for path, _ in rows} == {f"{srcs}:/caller/path"}
    commands = [args for _, args in rows]
    for script in ("gpu_path.py", "gpu_scale.py"):
        (args,) = [a for a in commands if script in a]
        assert "--device cpu" in args and "--preset tiny" in args, args
    (args,) = [a for a in commands if "gpu_dryrun.py" in a]
    assert "--preset tiny --world-size 1 --json" in args and args.endswith("--cases flow_grpo-t2i"), args
    assert sum("-m boogu_trainer " in a for a in commands) == 2  # the two e2e runs


def test_gpu_check_on_cuda_fits_the_budget_and_skips_a_missing_dryrun(tmp_path):
    repo = _fake_repo(tmp_path / "repo", dryrun=False, wheels=True)
    calls = tmp_path / "calls.tsv"
    python = _fake_python(tmp_path / "python", calls)
    vllm = _fake_python(tmp_path / "vllm-python", tmp_path / "vllm-calls.tsv")
    env = {
        "BOOGU_GPU_CHECK_DEVICE": "cuda",
        "BOOGU_GPU_CHECK_PYTHON": str(python),
        "BOOGU_VLLM_PYTHON": str(vllm),
        "PYTHONPATH": "",
    }
    result = _run_gpu_check(repo, tmp_path / "out", env, timeout=60)
    assert result.returncode == 0, result.stdout + result.stderr
    phases = _phases(tmp_path / "out")
    assert phases["gpu_dryrun"]["skipped"] is True and "does not exist" in phases["gpu_dryrun"]["reason"]
    ran = [p for p in phases.values() if not p["skipped"]]
    assert [p["name"] for p in ran] == [n for n in GPU_CHECK_PHASES if n != "gpu_dryrun"]
    summary = json.loads((tmp_path / "out" / "summary.json").read_text())
    assert summary["timeout_scale"] == 1 and summary["ok"] is True
    # every phase that can run, the dry run included, within the budget of one 600 s command
    dryrun_timeout = 60
    assert sum(p["timeout_s"] for p in ran) + dryrun_timeout <= GPU_CHECK_BUDGET_S == summary["budget_s"]
    rows = [line.split("\t", 1) for line in calls.read_text().splitlines()]
    srcs = ":".join(str(repo / "packages" / d / "src") for d in ("pkg-a", "pkg-b"))
    (install,) = [args for _, args in rows if "pip install" in args]
    assert "--no-index" in install and "--target /tmp/site" in install
    assert {path for path, args in rows if "pip install" not in args} == {f"{srcs}:/tmp/site"}
    for script in ("gpu_path.py", "gpu_scale.py", "rollout_engines.py"):
        (args,) = [a for _, a in rows if script in a]
        assert "--device cuda" in args, args
    assert "--preset released" in next(a for _, a in rows if "gpu_scale.py" in a)
    assert any("rollout.engine=vllm_omni" in line for line in calls.read_text().splitlines())


def test_gpu_check_refuses_an_unknown_phase_or_device(tmp_path):
    repo = _fake_repo(tmp_path / "repo", dryrun=False)
    for env, message in (
        ({"BOOGU_GPU_CHECK_PHASES": "env,gpu_pth"}, "unknown phase 'gpu_pth'"),
        ({"BOOGU_GPU_CHECK_DEVICE": "gpu"}, "must be cuda or cpu, got 'gpu'"),
        ({"BOOGU_GPU_CHECK_TIMEOUT_SCALE": "-1"}, "positive number, got '-1'"),
    ):
        result = _run_gpu_check(repo, tmp_path / "out", env, timeout=30)
        assert result.returncode == 2 and message in result.stderr, (env, result.stderr)
    # a timeout raised past the budget is refused before any phase runs
    script = repo / "benchmarks" / "gpu_check.sh"
    text = script.read_text()
    assert text.count("[gpu_path]=120 ") == 1
    script.write_text(text.replace("[gpu_path]=120 ", "[gpu_path]=200 "))
    result = _run_gpu_check(repo, tmp_path / "out", {}, timeout=30)
    assert result.returncode == 2 and "sum to 620 s, over the budget of 540 s" in result.stderr, result.stderr


@pytest.mark.slow
def test_gpu_check_cpu_rehearsal(tmp_path):
    """The check on CPU at the tiny preset, as it runs on the GPU machine, the dry run's one tiny case
    included. Its two e2e phases are left out: they run tests/special_e2e's script with the same MODE
    and NUM_GPUS=0 as test_e2e[t2i-1] and test_e2e[edit-1] do, so here they would only repeat those
    (about 2 CPU-minutes); the phase's arguments are checked in the fake-repo tests above."""
    out = tmp_path / "out"
    env = {
        "BOOGU_GPU_CHECK_PHASES": "install,env,gpu_path,gpu_scale,gpu_dryrun,vllm_e2e,vllm_engines",
        "BOOGU_GPU_CHECK_DEVICE": "cpu",
        "BOOGU_GPU_CHECK_PYTHON": sys.executable,
        "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "2"),
    }
    result = _run_gpu_check(REPO, out, env, timeout=900)
    phases = _phases(out)
    assert result.returncode == 0 and all(p["ok"] for p in phases.values()), result.stdout[-6000:]
    ran = {n for n, p in phases.items() if not p["skipped"]}
    assert ran == {"env", "gpu_path", "gpu_scale", "gpu_dryrun"}
    dry = json.loads((out / "gpu_dryrun.json").read_text())
    assert dry["preset"] == "tiny" and dry["cases"]["flow_grpo-edit"]["ok"] is True
    scale = json.loads((out / "gpu_scale.json").read_text())
    # the step-time split is the trainer's own time/ phases
    assert {"time/rollout", "time/train", "time/sync"} <= set(scale["split_s"])
    assert scale["preset"] == "tiny" and scale["images_per_s"] > 0 and scale["nfe_train_per_image"] > 0
    path_figures = json.loads((out / "gpu_path.json").read_text())
    assert set(path_figures["cases"]) == {
        "rollout",
        "rollout_adapters_off",
        "rollout_peft_lora",
        "train_bf16_lora",
    }
    assert path_figures["lora_overhead"]["fused_over_off"] > 0


@pytest.mark.slow
def test_algorithms_scenes_quick_and_resumed(tmp_path, monkeypatch, capsys):
    out, results = tmp_path / "scenes.json", tmp_path / "results"
    monkeypatch.syspath_prepend(str(BENCHMARKS))
    common = [
        "--task",
        "scenes",
        "--regime",
        "v1",
        "--quick",
        "--results",
        str(results),
        "--out",
        str(tmp_path),
    ]
    run_script("algorithms.py", [*common, "--json", str(out)], monkeypatch)
    figures = json.loads(out.read_text())
    assert figures["task"] == "scenes" and figures["seed_list"] == [0] and figures["regime"] == "v1"
    assert set(figures["algorithms"]) == {"flow_grpo", "grpo_guard", "diffusion_nft", "awm"}
    for name, runs in figures["runs"].items():
        (run,) = runs
        marks = [figures["budget_fe"] * (k + 1) / 4 for k in range(4)]
        # one evaluation at the first step past each quarter of the budget, the same base for all
        assert [e["cum_fe"] >= m for e, m in zip(run["evaluations"], marks, strict=True)] == [True] * 4
        assert run["base"] == figures["runs"]["flow_grpo"][0]["base"]
        assert all(0.0 <= e["gold"] <= 1.0 for e in run["evaluations"]), name
        assert all(0.0 <= v <= 1.0 for v in run["proxy"]) and len(run["proxy"]) == len(run["reward"])
        summary = figures["algorithms"][name]
        assert summary["final_gold"] == [run["evaluations"][-1]["gold"]]
        assert summary["final_gain"] == [pytest.approx(run["evaluations"][-1]["gold"] - run["base"])]
        # the design's figures 4-5: the run's verdict, and its instruments by thirds of its (2-3) steps
        assert sum(summary["verdicts"][v] for v in ("learns", "flat", "falls")) == 1, name
        assert summary["instruments"]["grad_norm"][-1] is not None, name  # read from its metrics.jsonl
        assert summary["gradient"] is None, name  # v1's recipes name no gradient_check file
    assert len(figures["pairs"]) == 6 and figures["reading"] is None  # v1 has no tiers
    assert (tmp_path / "algorithms_scenes.png").stat().st_size > 0
    assert {p.name for p in results.iterdir()} >= {"base_s0.json", "awm_s0.json", "flow_grpo_s0.json"}
    figures_base = figures["runs"]["flow_grpo"][0]["base"]
    # each run's per-step instruments are kept beside its run file, one record per step
    for name, runs in figures["runs"].items():
        records = [
            json.loads(line) for line in (results / f"{name}_s0.metrics.jsonl").read_text().splitlines()
        ]
        assert [r["cum/fe"] for r in records] == runs[0]["cum_fe"] and "grad_norm" in records[0], name
    capsys.readouterr()
    # the same command loads the finished runs; another setting for one of them is refused by name
    run_script("algorithms.py", [*common, "--algorithms", "awm"], monkeypatch)
    assert "awm seed 0: loaded from" in capsys.readouterr().out
    # a table of finished runs only: a run not in the folder is named and nothing trains
    no_quick = [a for a in common if a != "--quick"]
    with pytest.raises(
        SystemExit, match=r"--load-only: 1 of the 2 runs .* awm_s1\.json; nothing was trained"
    ):
        run_script(
            "algorithms.py", [*no_quick, "--algorithms", "awm", "--seeds", "2", "--load-only"], monkeypatch
        )
    assert not (results / "awm_s1.json").exists() and not (results / "base_s1.json").exists()
    with pytest.raises(SystemExit, match=r"awm_s0\.json was written with other settings"):
        run_script(
            "algorithms.py", [*common, "--algorithms", "awm", "--set", "awm:optim.lr=5e-4"], monkeypatch
        )
    # v2 (the default regime): a recipe by name, its six evaluations, the same seed's base reused
    # (the same judge in --quick); a base judged on other captions is refused by name
    v2 = ["--task", "scenes", "--quick", "--results", str(results), "--out", str(tmp_path)]
    run_script(
        "algorithms.py",
        [*v2, "--algorithms", "mixgrpo", "--keep-checkpoint", "--json", str(out)],
        monkeypatch,
    )
    figures = json.loads(out.read_text())
    assert figures["regime"] == "v2" and set(figures["algorithms"]) == {"mixgrpo"}
    assert figures["algorithms"]["mixgrpo"]["gradient"]["file"] == "benchmarks/results/gradient/mixgrpo.json"
    (run,) = figures["runs"]["mixgrpo"]
    assert len(run["evaluations"]) == 6 and run["base"] == figures_base
    # --keep-checkpoint: the trainer's own, intact checkpoint of the run's last step, beside its file
    from boogu_trainer.checkpoint import verify_checkpoint

    kept = results / "mixgrpo_s0.checkpoint"
    assert verify_checkpoint(kept) is None
    assert json.loads((kept / "trainer_state.json").read_text())["step"] == len(run["reward"])
    config = json.loads((results / "mixgrpo_s0.json").read_text())["settings"]["config"]
    assert config["sampler"]["window_kind"] == "progressive" and config["eval"]["guidance_scale"] == 4.0
    with pytest.raises(SystemExit, match=r"base_s0\.json is another judge's base"):
        run_script(
            "algorithms.py",
            [*v2, "--algorithms", "dancegrpo", "--set", "dancegrpo:eval.num_prompts=3"],
            monkeypatch,
        )


def test_algorithms_scenes_target_is_the_first_evaluation_with_the_gain(monkeypatch):
    monkeypatch.syspath_prepend(str(BENCHMARKS))
    scenes = runpy.run_path(str(BENCHMARKS / "algorithms_scenes.py"), run_name="algorithms_scenes")
    evaluations = [
        {"cum_fe": 100.0 * k, "cum_time_s": 1.0 * k, "gold": g, "gain": g - 0.25, "se_gain": 0.02}
        for k, g in enumerate((0.28, 0.30, 0.26, 0.32), start=1)
    ]
    run = {"base": 0.25, "evaluations": evaluations, "reward": [0.3] * 4, "fe_per_image": 23.0}
    s = scenes["summarise"]([run, {**run, "evaluations": [{**e, "gain": 0.0} for e in evaluations]}])
    assert s["fe_to_target"] == [200.0, None] and s["wall_to_target_s"] == [2.0, None]  # +0.05 at 200
    assert s["fe_to_gain"]["0.02"] == [100.0, None] and s["fe_to_gain"]["0.06"] == [400.0, None]
    assert s["fe_to_gain"]["0.08"] == [None, None]
    assert s["final_gold"] == [0.32, 0.32] and s["final_gain"] == [pytest.approx(0.07), 0.0]


def test_pipeline_gpu_model_of_the_reference_recipe(monkeypatch):
    """benchmarks/pipeline.py's GPU model: the reference recipe's FLOPs (flops.py's figures), sync =
    rollout + training + sync, pipelined = the slower phase + sync, colocated on all the GPUs."""
    monkeypatch.syspath_prepend(str(BENCHMARKS))
    module = runpy.run_path(str(BENCHMARKS / "pipeline.py"), run_name="pipeline")
    args = (
        module["main"]
        .__globals__["argparse"]
        .Namespace(
            trainer_gpus=4, rollout_gpus=4, train_mfu=0.35, rollout_mfu=0.40, sync_s=1.0, peak_tflops=989.4
        )
    )
    model = module["gpu_model"](args)
    a = model["assumptions"]
    assert a["rollout_tflops_per_image"] == pytest.approx(1495.596, abs=1e-3)  # flops.py's table
    assert a["train_tflops_per_image"] == pytest.approx(951.174, abs=1e-3)
    r = 512 * 1495.596e12 / (4 * 989.4e12 * 0.40)
    t = 512 * 951.174e12 / (4 * 989.4e12 * 0.35)
    assert model["rollout_s"] == pytest.approx(r, rel=1e-6) and model["train_s"] == pytest.approx(t, rel=1e-6)
    assert model["sync_step_s"] == pytest.approx(r + t + 1.0, rel=1e-6)
    assert model["pipelined_step_s"] == pytest.approx(max(r, t) + 1.0, rel=1e-6)
    assert model["speedup_pipelined_over_sync"] == pytest.approx((r + t + 1) / (max(r, t) + 1), rel=1e-6)
    # The same 8 GPUs colocated keep every GPU busy: no split of 4 + 4 beats it at these MFUs.
    assert model["colocated_step_s"] < model["pipelined_step_s"] < model["sync_step_s"]


def test_algorithms_scenes_regimes_are_the_committed_runs_settings(monkeypatch):
    """Each regime's recipes resolve to the configs its committed run files were written with: v1's to
    the first comparison's held-out runs, v2's to the curves of issue 44 that chose them (their EMA,
    which changes no update, off; DiffusionNFT's judge's CFG written out). So the defaults are what
    was measured, and the committed tables load with the documented commands."""
    monkeypatch.syspath_prepend(str(BENCHMARKS))
    scenes = runpy.run_path(str(BENCHMARKS / "algorithms_scenes.py"), run_name="algorithms_scenes")
    from boogu_trainer.config import config_to_dict

    results = BENCHMARKS / "results" / "scenes"

    def settings(regime, name, seed):
        config = config_to_dict(scenes["run_config"](name, seed, "runs", [], regime))
        r = scenes["REGIMES"][regime]
        return json.loads(json.dumps({"config": config, "budget_fe": r.budget_fe, "quarters": r.evaluations}))

    for name in ("flow_grpo", "grpo_guard", "diffusion_nft", "awm"):
        saved = json.loads((results / "heldout" / f"{name}_s100.json").read_text())["settings"]
        assert scenes["same_settings"](saved, settings("v1", name, 100)), name
    curves = {"flow_grpo": "fgrpo_ref", "grpo_guard": "guard_ref", "awm": "awm_ref"}
    curves |= {"diffusion_nft": "nft_b128_t2_lr5e-4", "awm_fast": "awm_best"}
    for name, folder in curves.items():
        learner = "awm" if name == "awm_fast" else name
        saved = json.loads((results / "curves" / folder / f"{learner}_s1.json").read_text())["settings"]
        saved["config"]["ema"]["enabled"] = False
        if saved["config"]["eval"]["guidance_scale"] is None:
            saved["config"]["eval"]["guidance_scale"] = saved["config"]["sampler"]["guidance_scale"]
        now = settings("v2", name, 1)
        saved["config"]["logging"]["name"] = now["config"]["logging"]["name"]  # the file's recipe name
        assert scenes["same_settings"](saved, now), name
    # the recipes that are new in v2 differ from flow_grpo's in their sampling only
    flow = settings("v2", "flow_grpo", 1)["config"]
    for name, key, value in (
        ("mixgrpo", "window_kind", "progressive"),
        ("dancegrpo", "sampler", "dance_sde"),
    ):
        config = settings("v2", name, 1)["config"]
        assert config["sampler"][key] == value and config["algorithm"] == flow["algorithm"], name
        assert {k: v for k, v in config.items() if k not in ("sampler", "logging")} == {
            k: v for k, v in flow.items() if k not in ("sampler", "logging")
        }


def test_algorithms_scenes_median_fe_counts_runs_that_never_reached_it():
    scenes = runpy.run_path(str(BENCHMARKS / "algorithms_scenes.py"), run_name="algorithms_scenes")
    median = scenes["median_fe"]
    assert median([100.0, None, 300.0]) == 300.0  # the unreached run ranks above every reached one
    assert median([100.0, None, None]) is None and median([]) is None
    assert median([100.0, 200.0, None, 400.0]) == 300.0


def test_algorithms_scenes_reading_pairs_verdicts_and_choice(monkeypatch):
    """The design's figures 3-4 and its reading: a run learns / falls beyond 2 paired se; every pair's
    paired difference on the same seeds, separated when its t interval excludes zero; the tier-1 best is
    recommended only when separated from every other tier-1 recipe, else named with its equals."""
    monkeypatch.syspath_prepend(str(BENCHMARKS))
    scenes = runpy.run_path(str(BENCHMARKS / "algorithms_scenes.py"), run_name="algorithms_scenes")
    assert [scenes["run_verdict"](g, 0.01) for g in (0.021, 0.02, -0.02, -0.021)] == [
        "learns",
        "flat",
        "flat",
        "falls",
    ]
    summary = {
        "a": {"final_gain": [0.10, 0.12, 0.11], "final_se_gain": [0.02, 0.02, 0.02]},
        "b": {"final_gain": [0.01, 0.03, 0.00], "final_se_gain": [0.01, 0.01, 0.01]},
        "c": {"final_gain": [0.02, 0.00, 0.04], "final_se_gain": [0.01, 0.01, 0.01]},
    }
    assert scenes["verdicts"](summary["b"]) == {
        "per_seed": ["flat", "learns", "flat"],
        "learns": 1,
        "flat": 2,
        "falls": 0,
    }
    pairs = scenes["pairwise"](summary)
    assert [(p["higher"], p["lower"]) for p in pairs] == [("a", "c"), ("a", "b"), ("c", "b")]
    a_b = pairs[1]
    assert a_b["difference"] == pytest.approx(0.0966667, abs=1e-6)
    # differences 0.09, 0.09, 0.11: sd 0.011547, t(2) 4.30
    half = 4.30 * 0.011547005 / 3**0.5
    assert a_b["interval_95"] == pytest.approx([0.0966667 - half, 0.0966667 + half], abs=1e-6)
    assert a_b["separated"] and not pairs[2]["separated"]  # c - b: +0.02, -0.03, +0.04
    assert scenes["choice"](summary, pairs, ["a", "b", "c"]) == {
        "best": "a",
        "recommended": "a",
        "equals": [],
    }
    assert scenes["choice"](summary, pairs, ["b", "c"]) == {"best": "c", "recommended": None, "equals": ["b"]}
    assert scenes["choice"](summary, pairs, ["a"]) is None  # nothing to separate from
    one_seed = {n: {**s, "final_gain": s["final_gain"][:1]} for n, s in summary.items()}
    assert not any(p["separated"] for p in scenes["pairwise"](one_seed))  # no interval, no separation


def test_algorithms_scenes_readme_table_follows_the_summary(monkeypatch):
    """The README's head-to-head table is generated from the summary JSON: recipes ranked by mean
    final gain, each cell from its figures, and the design's reading said as the rule says it."""
    monkeypatch.syspath_prepend(str(BENCHMARKS))
    scenes = runpy.run_path(str(BENCHMARKS / "algorithms_scenes.py"), run_name="algorithms_scenes")

    def recipe(gains, reached, **more):
        return {
            "final_gain": gains,
            "verdicts": {"learns": 1, "flat": 1, "falls": 0},
            "fe_to_target": reached,
            "median_fe_to_target": None,
            **more,
        }

    figures = {
        "seeds": 2,
        "target_gain": 0.04,
        "settings": {"flow_grpo": {"tier": 1}, "diffusion_nft": {"tier": 1}, "mixgrpo": {"tier": 2}},
        "algorithms": {
            "flow_grpo": recipe([0.01, 0.03], [None, 90000.0]),
            "mixgrpo": recipe([0.0, 0.02], [None, None], final_gain_minus_flow_grpo=[-0.01, -0.01]),
            "diffusion_nft": recipe(
                [0.10, 0.12],
                [40000.0, 50000.0],
                median_fe_to_target=45000.0,
                final_gain_minus_flow_grpo=[0.09, 0.09],
                fe_ratio_vs_flow_grpo={"mean_ratio": 0.5, "interval_95": [0.4, 0.6]},
            ),
        },
        "reading": {"best": "diffusion_nft", "recommended": None, "equals": ["flow_grpo"], "interim": True},
    }
    lines = scenes["readme_markdown"](figures).splitlines()
    assert lines[0].startswith("| recipe | tier | final held-out gain (95% t interval) |")
    # t(1) = 12.71: +0.110 +- 12.71 * 0.01414 / sqrt(2)
    assert lines[2] == (
        "| `diffusion_nft` | 1 | +0.110 (-0.017 to +0.237) | +0.090 (+0.090 to +0.090) | 1 / 1 / 0 | 2/2 | "
        "45000 | 0.50x (0.40-0.60) |"
    )
    assert lines[3].startswith("| `flow_grpo` | 1 | +0.020") and lines[3].endswith(
        "| 1/2 | - | 1x (the reference) |"
    )
    assert lines[4].startswith("| `mixgrpo` | 2 | +0.010") and lines[4].endswith("| 0/2 | - | - |")
    assert lines[-1] == (
        "By the design's rule, over 2 seeds (interim): `diffusion_nft` has the highest mean final gain "
        "and is not separated from `flow_grpo`."
    )
    figures["reading"] = {
        "best": "diffusion_nft",
        "recommended": "diffusion_nft",
        "equals": [],
        "interim": False,
    }
    assert scenes["readme_markdown"](figures).splitlines()[-1] == (
        "By the design's rule, over 2 seeds: `diffusion_nft` is the recommended default: separated from "
        "every other tier-1 recipe."
    )


def test_algorithms_scenes_instruments_by_thirds_and_at_the_base(tmp_path, monkeypatch):
    """Figure 5: each run's metrics.jsonl by thirds of its steps (a key a learner does not log is
    None, a non-finite value is skipped), mean over the runs; and every v2 recipe's committed
    gradient_check file, as the design names them."""
    monkeypatch.syspath_prepend(str(BENCHMARKS))
    scenes = runpy.run_path(str(BENCHMARKS / "algorithms_scenes.py"), run_name="algorithms_scenes")
    records = [{"step": i + 1, "grad_norm": float(i), "clipfrac": 0.5} for i in range(7)]
    records[6]["grad_norm"] = float("nan")
    path = tmp_path / "run.metrics.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    one = scenes["run_instruments"](path)
    # 7 steps: thirds of steps 1-2, 3-5, 6-7 (round(7/3) = 2, round(14/3) = 5); step 7's nan skipped
    assert one["grad_norm"] == [0.5, 3.0, 5.0] and one["clipfrac"] == [0.5, 0.5, 0.5]
    assert one["kl_ref"] == [None, None, None]
    other = {**one, "grad_norm": [1.5, 1.0, None]}
    assert scenes["mean_instruments"]([one, other])["grad_norm"] == [1.0, 2.0, 5.0]
    design = {
        "flow_grpo": "fgrpo_ref",
        "grpo_guard": "guard_ref",
        "diffusion_nft": "demo_stable",
        "awm": "awm_ref",
        "mixgrpo": "mixgrpo",
        "dancegrpo": "dancegrpo",
        "awm_fast": "awm",
    }
    recipes = scenes["RECIPES"]
    assert {n: r["gradient"] for n, r in recipes.items()} == design
    assert [n for n, r in recipes.items() if r["tier"] == 1] == [
        "flow_grpo",
        "grpo_guard",
        "diffusion_nft",
        "awm",
    ]
    for name, recipe in recipes.items():
        g = scenes["gradient_figures"](recipe)
        saved = json.loads((BENCHMARKS / "results" / "gradient" / f"{design[name]}.json").read_text())
        assert g["file"] == f"benchmarks/results/gradient/{design[name]}.json", name
        assert g["zero_spread_groups"] == saved["rollouts"]["zero_spread_groups"] and g["seed"] == 0, name
        assert g["passes"] == any(s["margin"] > 2 * s["margin_se"] for s in saved["uphill"]["steps"]), name
    assert scenes["gradient_figures"](scenes["ALGORITHMS"]["flow_grpo"]) is None  # v1 named none


def test_algorithms_scenes_run_files_survive_a_config_key_added_later(monkeypatch):
    """A run file written before a config key existed still loads when the key has the demo config's
    value (the run behaved that way); any other difference is refused."""
    monkeypatch.syspath_prepend(str(BENCHMARKS))
    same = runpy.run_path(str(BENCHMARKS / "algorithms_scenes.py"), run_name="algorithms_scenes")[
        "same_settings"
    ]
    from boogu_trainer.config import config_to_dict, scenes_task_config

    now = {"config": config_to_dict(scenes_task_config()), "budget_fe": 44160, "quarters": 4}
    old = json.loads(json.dumps(now))
    del old["config"]["rollout"]["pipeline"]  # written before rollout.pipeline existed
    assert same(old, now)
    later = json.loads(json.dumps(now))
    later["config"]["rollout"]["pipeline"] = "one_step"
    assert not same(old, later)  # the new key set to something the old run did not do
    changed = json.loads(json.dumps(now))
    changed["config"]["optim"]["lr"] = 1.0
    assert not same(old, changed) and not same(now, changed)
    assert not same({**now, "extra": 1}, now)  # a key the file has and the settings lost
    warned = json.loads(json.dumps(now))
    warned["config"]["rollout"]["logprob_diff_warn"] = 0.001  # a warning's threshold: the same run
    assert same(warned, now)


# ----------------------------------------------------------------------------------------------
# benchmarks/ceiling.py: supervised flow matching of the demo's LoRA on the RL prompts' renders


@pytest.mark.slow
def test_ceiling_quick(tmp_path, monkeypatch):
    out = tmp_path / "ceiling.json"
    monkeypatch.syspath_prepend(str(BENCHMARKS))  # the script imports its sibling _common
    run_script("ceiling.py", ["--quick", "--eval-steps", "3", "--json", str(out)], monkeypatch)
    figures = json.loads(out.read_text())
    settings = figures["settings"]
    assert (
        settings["config"]["eval"]["num_steps"] == 3
    )  # --eval-steps: the judge of the curves it sits beside
    assert settings["budget_fe"] == 96 and settings["fe_marks"] == [24, 48, 72, 96] and settings["batch"] == 8
    assert settings["lr"] == "0.001" and settings["config"]["lora"]["rank"] == 8  # the demo's lr and LoRA
    assert figures["records"] == 64 and figures["eval_prompts"] == 4 == len(figures["base_gold"])
    # the trainer's FE rule: 8 rows x (forward 1 + backward 2) per step, one evaluation per mark
    assert figures["curve"]["cum_fe"] == [24, 48, 72, 96]
    assert [(e["mark_fe"], e["step"], e["cum_fe"]) for e in figures["evaluations"]] == [
        (24, 1, 24),
        (48, 2, 48),
        (72, 3, 72),
        (96, 4, 96),
    ]
    assert all(0 < loss < 10 for loss in figures["curve"]["loss"])
    for e in figures["evaluations"]:
        assert 0.0 <= e["gold"] <= 1.0 and len(e["prompts_gold"]) == 4
        assert e["gain"] == pytest.approx(e["gold"] - figures["base"], abs=1e-3)  # 4-decimal JSON


@pytest.mark.slow
def test_ceiling_trains_on_the_rl_prompts_through_the_trainers_encoder(tmp_path, monkeypatch):
    monkeypatch.syspath_prepend(str(BENCHMARKS))
    ceiling = runpy.run_path(str(BENCHMARKS / "ceiling.py"), run_name="ceiling")
    import torch

    from boogu_adapters.lora import adapters_disabled
    from boogu_data.scenes import Scene
    from boogu_tiny.scenes_pretrain import (
        draw_flow_batch,
        encode_captions,
        flow_matching_loss,
        training_sigmas,
    )
    from boogu_trainer.trainer import Trainer

    trainer = Trainer(ceiling["run_config"](0, str(tmp_path), None, True))
    try:
        records = trainer.data.records
        data = ceiling["training_set"](trainer)
        assert data.latents.shape[0] == len(records) == 64 and data.hidden.shape[0] == 65
        assert all(Scene.from_json(r.ground_truth).caption() == r.instruction for r in records)
        # the trainer's prompt encoder and the pretraining's caption encoding give the same features
        captions = [r.instruction for r in records[:5]]
        hidden, mask = encode_captions(trainer.parts, captions)  # its last row: the empty negative
        for i in (*range(5), -1):
            n = int(mask[i].sum())
            assert int(data.mask[i].sum()) == n
            torch.testing.assert_close(data.hidden[i, :n], hidden[i, :n], atol=1e-5, rtol=1e-5)
        # the demo's LoRA at its init (B = 0) leaves the base's loss exactly as it was
        batch = draw_flow_batch(
            data.latents,
            4,
            training_sigmas(trainer.parts.schedule_config),
            0.5,
            64,
            torch.Generator().manual_seed(0),
        )
        freqs = trainer.local_engine.freqs_cis
        with torch.no_grad():
            lora = flow_matching_loss(trainer.transformer, batch, data.hidden, data.mask, freqs)
            with adapters_disabled(trainer.transformer):
                base = flow_matching_loss(trainer.transformer, batch, data.hidden, data.mask, freqs)
        assert lora.dtype == torch.float32 and float(lora) == float(base) > 0
    finally:
        trainer.close()


def test_ceiling_fe_marks(monkeypatch):
    monkeypatch.syspath_prepend(str(BENCHMARKS))
    marks = runpy.run_path(str(BENCHMARKS / "ceiling.py"), run_name="ceiling")["fe_marks"]
    assert marks(None, 44160.0) == [11040.0, 22080.0, 33120.0, 44160.0]
    assert marks("1000,2000", 5000.0) == [1000.0, 2000.0, 5000.0]  # the budget is always evaluated
    for bad in ("2000,1000", "0,1000", "1000,9000", "1000,1000", ""):
        with pytest.raises(ValueError, match="--fe-marks"):
            marks(bad, 5000.0)


def test_curves_reads_the_committed_runs_and_draws_a_ceiling_only_beside_the_same_images(
    tmp_path, monkeypatch, capsys
):
    monkeypatch.syspath_prepend(str(BENCHMARKS))
    curves = runpy.run_path(str(BENCHMARKS / "curves.py"), run_name="curves")
    stable = BENCHMARKS / "results" / "scenes" / "curves" / "nft_b128_t2_lr5e-4"
    figures = curves["main"](
        ["--runs", f"stable={stable}", "--out", str(tmp_path / "c.png"), "--json", str(tmp_path / "c.json")]
    )
    recipe = figures["recipes"]["stable"]
    assert recipe["learner"] == "diffusion_nft" and sorted(recipe["seeds"]) == [0, 1, 2]
    # benchmarks/README.md, "The curves, part 2": the last marks +0.080, +0.128, +0.135, mean +0.114
    assert [round(recipe["seeds"][s]["evaluations"][-1]["gain"], 3) for s in (0, 1, 2)] == [
        0.08,
        0.128,
        0.135,
    ]
    assert round(recipe["mean"][-1]["gain"], 3) == 0.114 and recipe["mean"][-1]["seeds"] == 3
    assert (tmp_path / "c.png").stat().st_size > 0 and json.loads((tmp_path / "c.json").read_text())[
        "recipes"
    ]
    # A ceiling judged on other images (the committed one: ODE 20 steps, the runs': 10) is refused...
    committed = BENCHMARKS / "results" / "ceiling" / "ceiling_s0.json"
    with pytest.raises(
        SystemExit, match=r"ceiling_s0\.json and .*diffusion_nft_s0\.json judge seed 0's base differently"
    ):
        curves["main"](
            ["--runs", f"stable={stable}", "--ceiling", str(committed), "--out", str(tmp_path / "c.png")]
        )
    # ... one with the runs' base verdicts is drawn and reported.
    ceiling = json.loads(committed.read_text())
    ceiling["base_gold"] = json.loads((stable / "base_s0.json").read_text())["gold"]
    (tmp_path / "ceiling.json").write_text(json.dumps(ceiling))
    figures = curves["main"](
        [
            "--runs",
            f"stable={stable}",
            "--ceiling",
            str(tmp_path / "ceiling.json"),
            "--out",
            str(tmp_path / "c.png"),
        ]
    )
    assert [e["gain"] for e in figures["ceilings"][0]["evaluations"]] == [
        e["gain"] for e in ceiling["evaluations"]
    ]
    assert "ceiling (flow matching)" in capsys.readouterr().out
    for bad, message in (
        (["--runs", "stable"], "NAME=DIR"),
        (["--runs", f"a={tmp_path}"], "holds no run file"),
    ):
        with pytest.raises(SystemExit, match=message):
            curves["main"](bad)


# ----------------------------------------------------------------------------------------------
# benchmarks/demo_throughput.py: the CPU demo's images/s with this package's savings off and on


@pytest.mark.slow
def test_demo_throughput_quick(tmp_path, monkeypatch):
    out = tmp_path / "demo_throughput.json"
    monkeypatch.syspath_prepend(str(BENCHMARKS))  # the script imports its sibling _common
    run_script("demo_throughput.py", ["--quick", "--json", str(out)], monkeypatch)
    figures = json.loads(out.read_text())
    # one process per side, each a warm-up and one timed step of the quick 2 x 4 batch
    assert [r["side"] for r in figures["runs"]] == ["before", "after"]
    assert figures["runs"][1]["malloc_kept"] and not figures["runs"][0]["malloc_kept"]
    assert all(r["images_per_step"] == 8 and len(r["step_walls_s"]) == 1 for r in figures["runs"])
    # the savings changed no number: same LoRA weights, step rewards and evaluation scores
    assert figures["results_bitwise_equal"] is True
    assert figures["runs"][0]["results"] == figures["runs"][1]["results"]
    assert len(figures["runs"][0]["results"]["eval_base"]) == 4
    for side in ("before", "after"):
        numbers = figures["sides"][side]
        assert numbers["images_per_s"] > 0 and numbers["eval_images_per_s"] > 0
        split = numbers["split_s"]
        assert split["rollout transformer"] > 0 and split["update"] > 0
        assert split["step"] >= split["rollout transformer"] + split["update"]
    assert figures["ratio"] == pytest.approx(
        figures["sides"]["after"]["images_per_s"] / figures["sides"]["before"]["images_per_s"], rel=1e-3
    )
    assert figures["cpu_ratio"] == pytest.approx(
        figures["sides"]["before"]["cpu_s_per_image"] / figures["sides"]["after"]["cpu_s_per_image"], rel=1e-3
    )
    assert all(len(r["step_cpu_s"]) == 1 and r["step_cpu_s"][0] > 0 for r in figures["runs"])


def test_demo_throughput_alternates_the_sides(monkeypatch):
    monkeypatch.syspath_prepend(str(BENCHMARKS))
    order = runpy.run_path(str(BENCHMARKS / "demo_throughput.py"), run_name="demo_throughput")["order"]
    assert order(1) == ["before", "after"]
    assert order(3) == ["before", "after", "after", "before", "before", "after"]


@pytest.mark.slow
def test_demo_seeds_runs_each_seed_once_and_loads_a_finished_sweep(
    tmp_path, monkeypatch, capsys, tiny_checkpoint
):
    # the demo's command per seed (here on the random model, 2 steps), its held-out verdict kept
    results, work = tmp_path / "results", tmp_path / "work"
    overrides = [
        f"model.path={tiny_checkpoint}",
        "total_steps=2",
        "data.prompts_per_step=2",
        "algorithm.group_size=2",
        "sampler.num_steps=2",
        "eval.every=2",
        "eval.num_prompts=4",
        "eval.num_steps=2",
        "checkpoint.save_every=1",
    ]
    common = ["--seeds", "3", "--threads", "1", "--results", str(results), "--work", str(work)]
    common += [f"--set={o}" for o in overrides]
    monkeypatch.syspath_prepend(str(BENCHMARKS))
    run_script("demo_seeds.py", common, monkeypatch)
    assert "seed 3: done" in capsys.readouterr().out
    kept = results / "seed_3"
    assert {p.name for p in kept.iterdir()} == {"heldout.json", "metrics.jsonl", "config.yaml", "run.json"}
    verdict = json.loads((kept / "heldout.json").read_text())
    assert verdict["prompts"] == 4 and "seed: 3" in (kept / "config.yaml").read_text()
    assert len((kept / "metrics.jsonl").read_text().splitlines()) == 2
    summary = json.loads((results / "summary.json").read_text())
    assert summary["seeds"] == [3] and summary["rows"][0]["diff"] == pytest.approx(verdict["diff"])
    assert summary["settings"] == {"recipe": None, "overrides": overrides, "threads": 1}
    assert [launch["resumed"] for launch in summary["rows"][0]["run"]["launches"]] == [False]
    # the same command runs nothing and prints the same table; other settings are refused by file
    (work / "seed_3").rename(work / "gone")
    run_script("demo_seeds.py", common, monkeypatch)
    out = capsys.readouterr().out
    assert "started" not in out and f"{verdict['diff']:+.3f}" in out
    assert not (work / "seed_3").exists()
    with pytest.raises(SystemExit, match=r"seed_3/run\.json was written with other settings"):
        run_script("demo_seeds.py", [*common, "--set=optim.lr=5e-4"], monkeypatch)
    with pytest.raises(SystemExit, match=r"seed_3/run\.json was written with other settings"):
        run_script("demo_seeds.py", [*common, "--threads", "2"], monkeypatch)
    # another sweep on the same seed: the trained scores paired; another evaluation refused
    other = tmp_path / "other"
    shutil.copytree(results, other)
    verdict["trained"] -= 0.25
    (other / "seed_3" / "heldout.json").write_text(json.dumps(verdict))
    capsys.readouterr()
    run_script("demo_seeds.py", [*common, "--no-run", "--against", str(other)], monkeypatch)
    assert re.search(r"^3\s+\+0\.250$", capsys.readouterr().out, re.MULTILINE)
    assert json.loads((results / "summary.json").read_text())["against"]["pairs"] == [
        {"seed": 3, "advantage": pytest.approx(0.25)}
    ]
    verdict["base"] += 0.5
    (other / "seed_3" / "heldout.json").write_text(json.dumps(verdict))
    with pytest.raises(SystemExit, match="seed 3: the two sweeps' bases differ"):
        run_script("demo_seeds.py", [*common, "--no-run", "--against", str(other)], monkeypatch)
    # a work folder of other settings is not resumed into; per-seed keys are the sweep's own
    (results / "seed_3").rename(results / "moved")
    (work / "gone").rename(work / "seed_3")
    with pytest.raises(SystemExit, match=r"work/seed_3 holds a run of other settings"):
        run_script("demo_seeds.py", [*common, "--set=total_steps=3"], monkeypatch)
    with pytest.raises(SystemExit):
        run_script("demo_seeds.py", [*common, "--set=seed=5"], monkeypatch)
    assert "the sweep sets seed for each seed itself" in capsys.readouterr().err


def test_demo_seeds_writes_paths_in_the_checkout_relative_to_it(monkeypatch):
    monkeypatch.syspath_prepend(str(BENCHMARKS))
    import demo_seeds

    repo = demo_seeds.REPO
    assert repo == BENCHMARKS.parent
    text = f"run_dir: {repo}/runs/demo_seeds\nrecipe: {repo}/examples/x.yaml\nother: /elsewhere/y"
    assert (
        demo_seeds.portable(text) == "run_dir: runs/demo_seeds\nrecipe: examples/x.yaml\nother: /elsewhere/y"
    )
    # a recipe named by its committed relative path is the same recipe as by its absolute one
    assert demo_seeds.recipe_key("examples/tiny_scenes/scenes_demo.yaml") == demo_seeds.recipe_key(
        str(repo / "examples/tiny_scenes/scenes_demo.yaml")
    )


def test_edit_guidance_quick(tmp_path, monkeypatch, capsys):
    """The image-guidance check on the committed Edit checkpoint, at a smoke test's size: every
    setting is scored, the first is the reference of the paired differences (0 to itself)."""
    out = tmp_path / "edit_guidance.json"
    run_script(
        "edit_guidance.py",
        [
            "--prompts",
            "4",
            "--steps",
            "2",
            "--chunk",
            "3",
            "--settings",
            "4:1,4:2",
            "--checkpoint",
            str(_edit_checkpoint(tmp_path)),
            "--json",
            str(out),
        ],
        monkeypatch,
    )
    report = json.loads(out.read_text())
    first, second = report["settings"]
    assert (first["guidance_scale"], first["image_guidance_scale"]) == (4.0, 1.0)
    assert (second["guidance_scale"], second["image_guidance_scale"]) == (4.0, 2.0)
    assert first["diff_vs_first"] == 0.0 and report["prompts"] == 4
    assert all(0.0 <= s["scene_edit_exact"] <= 1.0 for s in report["settings"])
    assert "vs first" in capsys.readouterr().out
    with pytest.raises(SystemExit):
        run_script("edit_guidance.py", ["--settings", "4:0.5"], monkeypatch)


def _edit_checkpoint(tmp_path: Path) -> Path:
    from boogu_tiny.checkpoints import ensure_trained_edit_checkpoint

    return ensure_trained_edit_checkpoint(tmp_path / "edit" / "Boogu-Image")


def test_benchmarks_readme_head_to_head_seed_tables_are_the_run_files():
    """benchmarks/README.md's per-seed tables of the head-to-head ("Seeds so far"): each recipe's
    held-out gain at every evaluation and its final gain (se) are its committed run file's, and the
    seed's base is its base file's, not figures copied by hand."""
    import re

    text = (BENCHMARKS / "README.md").read_text(encoding="utf-8")
    start = text.index("### Seeds so far")
    section = text[start : text.index("\n## ", start)]
    results = BENCHMARKS / "results" / "scenes" / "h2h"
    checked = 0
    for table_start in [m.start() for m in re.finditer(r"^\| recipe \| held-out gain at", section, re.M)]:
        before = section[:table_start]
        seed = int(re.findall(r"[Ss]eed (5\d\d)", before)[-1])  # the paragraph above names it
        base = re.findall(r"base\s+(0\.\d{3})", before.rsplit("\n\n", 2)[-2])
        saved_base = json.loads((results / f"base_s{seed}.json").read_text())["gold"]
        assert base == [f"{sum(saved_base) / len(saved_base):.3f}"], seed
        rows = section[table_start : section.index("\n\n", table_start)].splitlines()[2:]
        for row in rows:
            cells = [c.strip() for c in row.split("|")[1:-1]]
            recipe = cells[0].split("`")[1]
            run = json.loads((results / f"{recipe}_s{seed}.json").read_text())["run"]
            evaluations = run["evaluations"]
            gains = ", ".join(f"{e['gain']:+.3f}".replace("-0.000", "+0.000") for e in evaluations)
            assert cells[1] == gains, (seed, recipe)
            last = evaluations[-1]
            if cells[2]:
                assert cells[2] == f"{last['gain']:+.3f} ({last['se_gain']:.3f})", (seed, recipe)
            checked += 1
    assert checked >= 4 * 6 + 3 * 3  # tier 1 on 500-505, tier 2 on 500-502
