"""The learners head to head on the scenes task: held-out verifier score against compute.

``benchmarks/algorithms.py --task scenes`` runs this (the design, pre-registered before its first
measured run, is in benchmarks/README.md, "Algorithms on the scenes task"). The task is the demo's
(`scenes_task_config`): the tiny Boogu pretrained on procedural scenes, 8 train captions x 8 images
per step, CFG-4 rollouts of 10 steps, LoRA r8, trained on ``scene_exact``; ``scene_dense`` is
computed on every rollout at weight 0 (the proxy curve, never trained on). Every learner gets the
same budget of forward-equivalents (``cum/fe``). The gold is ``scene_exact`` on the held-out
captions (``data.demo_eval_split=heldout``, never training prompts), ODE, CFG 4, fixed seeds, the
same images for every learner's base: it is measured with the LoRA off (the base, once per seed)
and at the first step past each quarter of the budget. Per learner it reports the FE and the wall
time (the trainer's step time) to the target (held-out exact >= base + ``TARGET_GAIN`` at an
evaluation), with the FE ratio to flow_grpo and its 95% bootstrap interval over seeds, the final
held-out exact (and its paired difference from the base), and plots the gold against FE and the
proxy and the rollouts' exact per step.

Each finished run is saved as ``--results DIR/<learner>_s<seed>.json`` (and each seed's base as
``base_s<seed>.json``, its trainer's per-step ``metrics.jsonl`` as
``<learner>_s<seed>.metrics.jsonl``): a rerun with the same settings loads them instead of running
again, so a long comparison survives being stopped and continues where it was; a file written
with other settings is an error that names it.

    uv run python benchmarks/algorithms.py --task scenes [--seeds 2] [--first-seed 0]
        [--algorithms flow_grpo,awm] [--set awm:optim.lr=1e-3] [--results DIR] [--out DIR]
        [--json PATH] [--quick]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

from _common import environment, table, write_json

from boogu_adapters.lora import adapters_disabled
from boogu_data.atomic import atomic_write_text
from boogu_trainer.config import config_to_dict, load_config, scenes_task_config
from boogu_trainer.demo import paired_summary
from boogu_trainer.trainer import Trainer

EVAL_PROMPTS = 200
EVAL_STEPS = 10
TASK: list[str] = [
    # the training reward is the demo's; the proxy is scored on every rollout and logged only
    "reward.rewards=[{name: scene_exact}, {name: scene_dense, weight: 0}]",
    "eval.rewards=[{name: scene_exact}]",
    f"eval.num_prompts={EVAL_PROMPTS}",
    f"eval.num_steps={EVAL_STEPS}",
    "eval.every=100000",  # the evaluator is built; this script calls it at the budget's quarters
]
"""The task, on top of `scenes_task_config()` (every learner's rollouts are CFG 4, 10 steps)."""

SDE = ["sampler.noise_level=0.8", "sampler.window_size=2", "sampler.window_range=[0,6]"]

ALGORITHMS: dict[str, dict[str, Any]] = {
    "flow_grpo": {
        "overrides": [
            "algorithm.name=flow_grpo",
            "algorithm.loss=ppo_clip",
            *SDE,
            "algorithm.clip_range=1e-3",
            "algorithm.mini_batches=2",
            "optim.lr=1e-3",
        ],
        "why": "the demo task's FlowGRPO (SDE window 2 in [0, 6), noise 0.8, clip 1e-3, 2 mini-batches) on CFG-4 rollouts, which it trains through; lr 1e-3 by the tuning rule (mean final held-out exact 0.220 vs 0.203 at 3e-4, seeds 0-1)",
    },
    "grpo_guard": {
        "overrides": [
            "algorithm.name=flow_grpo",
            "algorithm.loss=grpo_guard",
            *SDE,
            "algorithm.clip_range=1e-4",
            "algorithm.mini_batches=2",
            "optim.lr=1e-3",
        ],
        "why": "flow_grpo's rollouts and schedule with RatioNorm and the demo task's clip 1e-4; lr 1e-3 by the tuning rule (0.233 vs 0.215)",
    },
    "diffusion_nft": {
        "overrides": ["algorithm.name=diffusion_nft", "optim.lr=1e-3"],
        "why": "the demo's settings (CFG-4 ODE rollouts, the conditional velocity trained, 1 level, common noise per group, old = current); lr 1e-3 by the tuning rule (0.310 vs 0.248)",
    },
    "awm": {
        "overrides": [
            "algorithm.name=awm",
            "algorithm.awm.timesteps=1",
            "algorithm.awm.guided=false",
            "algorithm.mini_batches=2",
            "optim.lr=3e-4",
        ],
        "why": "the demo task's AWM (1 uniform level, per-sample noise, 2 mini-batches, no clip) on CFG-4 ODE rollouts, the conditional velocity trained; lr 3e-4 by the tuning rule (0.285 vs 0.145: at 1e-3 seed 0 collapsed to 0.010 at the last evaluation)",
    },
}
"""Each learner's settings on this task (on top of `TASK`), with the reason. The lr is the tuning
grid's choice (benchmarks/README.md, tuning on seeds 0-1 of 2026-12-05), the rest fixed before any run."""

NEW_ALGORITHMS = ("diffusion_nft", "awm")
BUDGET_FE = 44160
"""Forward-equivalents per run: the demo's 30 DiffusionNFT steps (64 images x 23 FE)."""
QUARTERS = 4
"""Evaluations per run by default (``--evaluations``): at the first step whose cum/fe reaches k/4 of
the budget."""
TARGET_GAIN = 0.04
"""The target: held-out exact >= this run's seed's base + TARGET_GAIN at an evaluation."""
THRESHOLDS = (0.02, 0.04, 0.06, 0.08)
"""Gains over the base for the sensitivity table."""


def run_config(name: str, seed: int, run_dir: str, extra: list[str]):
    overrides = [
        *TASK,
        *ALGORITHMS[name]["overrides"],
        *extra,
        "logging.progress=false",
        "logging.sample_every=0",
        "logging.plot_every=0",
        "checkpoint.save_every=0",
        "preflight=false",
        f"logging.run_dir={run_dir}",
        f"logging.name={name}_s{seed}",
        "total_steps=100000",  # never reached: the run stops on the budget
        f"seed={seed}",
    ]
    return load_config(None, overrides, base=scenes_task_config())


class _Done(Exception):
    pass


def _evaluation(trainer: Trainer, step: int) -> list[float]:
    """Each held-out caption's gold score at this point (the evaluation is deterministic for a seed)."""
    return [float(p["gold"]) for p in trainer.evaluator.evaluate(step=step).prompts]


def run_one(
    name: str,
    seed: int,
    run_dir: str,
    budget_fe: float,
    extra: list[str],
    base_file: Path,
    points: int = QUARTERS,
) -> dict:
    """One run to the budget with ``points`` evaluations (at each k/points of it); the base evaluation
    of its seed is read from ``base_file`` or made (LoRA off, before any update) and written there."""
    trainer = Trainer(run_config(name, seed, run_dir, extra))
    try:
        if base_file.is_file():
            base = json.loads(base_file.read_text())["gold"]
        else:
            t0 = time.perf_counter()
            with adapters_disabled(trainer.transformer):
                base = _evaluation(trainer, 0)
            atomic_write_text(
                base_file, json.dumps({"seed": seed, "gold": base, "eval_s": time.perf_counter() - t0})
            )
        marks = [budget_fe * (k + 1) / points for k in range(points)]
        evaluations: list[dict[str, Any]] = []
        eval_s = 0.0

        def after_step(step: int, record: dict[str, Any]) -> None:
            nonlocal eval_s
            if len(evaluations) < points and record["cum/fe"] >= marks[len(evaluations)]:
                t0 = time.perf_counter()
                gold = _evaluation(trainer, step)
                summary = paired_summary(base, gold)
                entry = {
                    "step": step,
                    "cum_fe": float(record["cum/fe"]),
                    "cum_time_s": float(record["cum/time_s"]),
                    "gold": summary["trained"],
                    "gain": summary["diff"],
                    "se_gain": summary["se_diff"],
                }
                if trainer.learner.ema is not None:
                    # The same captions and seeds judged with the run's EMA weights (ema.enabled): the
                    # training is the same run, so the two are paired caption by caption.
                    with trainer.learner.ema_weights():
                        ema_gold = _evaluation(trainer, step)
                    ema = paired_summary(base, ema_gold)
                    over_trained = paired_summary(gold, ema_gold)
                    entry.update(
                        ema_gold=ema["trained"],
                        ema_gain=ema["diff"],
                        ema_se_gain=ema["se_diff"],
                        ema_minus_trained=over_trained["diff"],
                        ema_minus_trained_se=over_trained["se_diff"],
                    )
                eval_s += time.perf_counter() - t0
                evaluations.append(entry)
            if len(evaluations) == points:
                raise _Done

        t0 = time.perf_counter()
        with contextlib.suppress(_Done):
            trainer.train(progress=after_step)
        wall = time.perf_counter() - t0
        history = trainer.metrics.history
    finally:
        trainer.close()
    return {
        "base": statistics.fmean(base),
        "evaluations": evaluations,
        "reward": [float(h["reward/mean"]) for h in history],
        "proxy": [float(h.get("scene_dense/mean", math.nan)) for h in history],
        "cum_fe": [float(h["cum/fe"]) for h in history],
        "cum_time_s": [float(h["cum/time_s"]) for h in history],
        "fe_per_image": statistics.fmean(float(h["fe/total_per_image"]) for h in history),
        "run_wall_s": wall,
        "eval_wall_s": eval_s,
    }


def first_reaching(run: dict[str, Any], gain: float) -> dict[str, Any] | None:
    return next((e for e in run["evaluations"] if e["gain"] >= gain), None)


def summarise(runs: list[dict[str, Any]]) -> dict[str, Any]:
    hits = [first_reaching(r, TARGET_GAIN) for r in runs]
    return {
        "fe_to_target": [None if h is None else h["cum_fe"] for h in hits],
        "wall_to_target_s": [None if h is None else h["cum_time_s"] for h in hits],
        "base": [r["base"] for r in runs],
        "final_gold": [r["evaluations"][-1]["gold"] for r in runs],
        "final_gain": [r["evaluations"][-1]["gain"] for r in runs],
        "final_se_gain": [r["evaluations"][-1]["se_gain"] for r in runs],
        "fe_per_image_per_step": statistics.fmean(r["fe_per_image"] for r in runs),
        "steps": [len(r["reward"]) for r in runs],
        "fe_to_gain": {
            f"{g:g}": [None if (h := first_reaching(r, g)) is None else h["cum_fe"] for r in runs]
            for g in THRESHOLDS
        },
    }


def mean_interval(values: list[float]) -> str:
    """Mean and a 95% interval (t-based: mean ± t * sd / sqrt(n)) over seeds."""
    if not values:
        return "-"
    mean = statistics.fmean(values)
    if len(values) < 2:
        return f"{mean:+.3f}"
    half = _T95.get(len(values) - 1, 1.96) * statistics.stdev(values) / math.sqrt(len(values))
    return f"{mean:+.3f} ({mean - half:+.3f} to {mean + half:+.3f})"


_T95 = {1: 12.71, 2: 4.30, 3: 3.18, 4: 2.78, 5: 2.57, 6: 2.45, 7: 2.36, 8: 2.31, 9: 2.26, 10: 2.23, 11: 2.20}
"""Student t quantiles (0.975) by degrees of freedom."""


def print_table(summary: dict[str, dict[str, Any]], seeds: int, ratio_interval, mean_std) -> None:
    base = [v for v in summary.get("flow_grpo", {}).get("fe_to_target", []) if v is not None]
    rows = []
    for name, s in summary.items():
        got = [v for v in s["fe_to_target"] if v is not None]
        ratio = "-"
        if got and base and name != "flow_grpo":
            low, high = ratio_interval(got, base)
            ratio = f"{statistics.fmean(got) / statistics.fmean(base):.2f}"
            ratio += "" if math.isnan(low) else f" ({low:.2f}-{high:.2f})"
            s["fe_ratio_vs_flow_grpo"] = {
                "mean_ratio": statistics.fmean(got) / statistics.fmean(base),
                "interval_95": None if math.isnan(low) else [low, high],
            }
        rows.append(
            (
                name,
                f"{len(got)}/{seeds}",
                mean_std(s["fe_to_target"]),
                mean_std(s["wall_to_target_s"], "{:.0f}"),
                f"{statistics.fmean(s['base']):.3f}",
                f"{statistics.fmean(s['final_gold']):.3f}",
                mean_interval(s["final_gain"]),
                f"{s['fe_per_image_per_step']:.1f}",
                ratio,
            )
        )
    header = (
        "algorithm",
        f"reached +{TARGET_GAIN:g}",
        "FE to target",
        "wall s to target",
        "base exact",
        "final exact",
        "final gain (95% interval)",
        "FE/image/step",
        "FE ratio vs flow_grpo (95% interval)",
    )
    print(table(rows, header))
    rows = []
    for name, s in summary.items():
        cells = []
        for values in s["fe_to_gain"].values():
            got = [v for v in values if v is not None]
            cells.append(f"{statistics.fmean(got):.0f} ({len(got)}/{seeds})" if got else f"- (0/{seeds})")
        rows.append((name, *cells))
    print(table(rows, ("mean FE to a gain of", *(f"+{g:g}" for g in THRESHOLDS))))


def print_curves(runs: dict[str, list[dict[str, Any]]]) -> None:
    """The held-out gain at each evaluation, mean over seeds with the se of that mean (from each seed's
    paired per-caption se), and the same for the EMA weights where the runs kept one."""
    rows = []
    for name, group in runs.items():
        points = min(len(r["evaluations"]) for r in group)
        for k in range(points):
            evals = [r["evaluations"][k] for r in group]
            n = len(evals)
            cells = [name if k == 0 else "", f"{statistics.fmean(e['cum_fe'] for e in evals):.0f}"]
            for key in ("gain", "ema_gain"):
                if all(key in e for e in evals):
                    mean = statistics.fmean(e[key] for e in evals)
                    se = math.sqrt(sum(e[f"{key[:-4]}se_gain"] ** 2 for e in evals)) / n
                    per_seed = " ".join(f"{e[key]:+.3f}" for e in evals)
                    cells.append(f"{mean:+.3f} ({se:.3f}) [{per_seed}]")
                else:
                    cells.append("-")
            rows.append(tuple(cells))
    print(table(rows, ("algorithm", "mean cum FE", "gain, mean (se) [per seed]", "EMA weights' gain")))


def plot(runs: dict[str, list[dict[str, Any]]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(17, 4.5), dpi=100)
    colours = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    for (name, group), colour in zip(runs.items(), colours):
        for k, r in enumerate(group):
            label = name if k == 0 else None
            xs = [0.0] + [e["cum_fe"] for e in r["evaluations"]]
            ys = [0.0] + [e["gain"] for e in r["evaluations"]]
            axes[0].plot(xs, ys, color=colour, marker="o", markersize=3, alpha=0.6, label=label)
            axes[1].plot(r["cum_fe"], r["proxy"], color=colour, alpha=0.5, linewidth=0.8, label=label)
            axes[2].plot(r["cum_fe"], r["reward"], color=colour, alpha=0.5, linewidth=0.8, label=label)
    axes[0].axhline(TARGET_GAIN, color="black", linestyle="--", linewidth=1, label="target")
    axes[0].axhline(0.0, color="grey", linewidth=0.8)
    titles = (
        "gold: held-out scene_exact minus the base",
        "proxy: scene_dense of the rollouts (not trained on)",
        "scene_exact of the rollouts (the training reward)",
    )
    for ax, title in zip(axes, titles):
        ax.set_title(title, fontsize=10)
        ax.set_xlabel("cumulative forward-equivalents")
        ax.grid(alpha=0.3)
    axes[0].legend(loc="best", fontsize=8)
    fig.suptitle("the tiny pretrained Boogu on scene captions: one line per learner and seed")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, format="png")
    plt.close(fig)
    print(f"plot written to {path}")


def same_settings(saved: Any, now: Any, base: Any = None) -> bool:
    """Whether a run file's settings are these. A config key added since the file was written (absent
    from it) counts as the same when it has the value of the demo's config: the run could not have set
    it, and that value leaves the run as it was (e.g. ``rollout.pipeline: off``)."""
    if base is None:
        base = {"config": config_to_dict(scenes_task_config())}
    if isinstance(saved, dict) and isinstance(now, dict):
        if set(saved) - set(now):
            return False
        for key, value in now.items():
            sub = base.get(key) if isinstance(base, dict) else None
            if key not in saved:
                if value != sub:
                    return False
            elif not same_settings(saved[key], value, sub):
                return False
        return True
    return saved == now


def main(args: argparse.Namespace, extra: dict[str, list[str]], ratio_interval, mean_std) -> None:
    """``algorithms.py --task scenes``: ``args`` are algorithms.py's (seeds, first_seed, out, json,
    quick, results), ``extra`` the ``--set`` overrides by learner."""
    names = list(extra)
    budget = args.budget_fe
    points = getattr(args, "evaluations", None) or QUARTERS
    results = Path(args.results).expanduser()
    results.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    runs: dict[str, list[dict[str, Any]]] = {}
    for name in names:
        runs[name] = []
        for seed in range(args.first_seed, args.first_seed + args.seeds):
            settings = {
                "config": config_to_dict(run_config(name, seed, "runs", extra[name])),
                "budget_fe": budget,
                "quarters": points,  # the number of evaluations (the key of the first run files)
            }
            path = results / f"{name}_s{seed}.json"
            if path.is_file():
                saved = json.loads(path.read_text())
                if not same_settings(saved["settings"], json.loads(json.dumps(settings))):
                    raise SystemExit(
                        f"{path} was written with other settings (config, budget or evaluations): "
                        "remove it or give another --results folder"
                    )
                run = saved["run"]
                print(f"{name} seed {seed}: loaded from {path}", flush=True)
            else:
                with tempfile.TemporaryDirectory() as tmp:  # the trainer's run folder: not kept...
                    run = run_one(
                        name, seed, tmp, budget, extra[name], results / f"base_s{seed}.json", points
                    )
                    # ... but its per-step instruments (clip fraction, KL, grad norm, zero-std share)
                    metrics = Path(tmp) / f"{name}_s{seed}" / "metrics.jsonl"
                    atomic_write_text(results / f"{name}_s{seed}.metrics.jsonl", metrics.read_text())
                atomic_write_text(path, json.dumps({"settings": settings, "run": run}))
            runs[name].append(run)
            last = run["evaluations"][-1]
            print(
                f"{name} seed {seed}: {len(run['reward'])} steps, cum/fe {run['cum_fe'][-1]:.0f}, "
                f"held-out exact {run['base']:.3f} -> "
                + " -> ".join(f"{e['gold']:.3f}" for e in run["evaluations"])
                + f" (final gain {last['gain']:+.3f}, se {last['se_gain']:.3f}; "
                f"{run['run_wall_s']:.0f} s, of which evaluations {run['eval_wall_s']:.0f} s)",
                flush=True,
            )
            if "ema_gold" in last:
                print(
                    f"  EMA weights: {run['base']:.3f} -> "
                    + " -> ".join(f"{e['ema_gold']:.3f}" for e in run["evaluations"])
                    + f" (final gain {last['ema_gain']:+.3f}, se {last['ema_se_gain']:.3f}; EMA minus "
                    f"trained {last['ema_minus_trained']:+.3f}, se {last['ema_minus_trained_se']:.3f})",
                    flush=True,
                )
    total = time.perf_counter() - t0
    summary = {name: summarise(group) for name, group in runs.items()}
    print()
    evaluation = run_config(names[0], args.first_seed, "runs", extra[names[0]]).eval
    print(
        f"target: held-out scene_exact >= base + {TARGET_GAIN:g} at an evaluation ({evaluation.num_prompts} "
        f"captions, ODE {evaluation.num_steps} steps, CFG 4; at each 1/{points} of the budget of {budget:.0f} FE), "
        f"{args.seeds} seed(s) from {args.first_seed}"
    )
    print_table(summary, args.seeds, ratio_interval, mean_std)
    print_curves(runs)
    for name in names:
        print(f"  {name}: {' '.join(ALGORITHMS[name]['overrides'] + extra[name])}")
        print(f"    ({ALGORITHMS[name]['why']})")
    print(f"total wall time {total:.0f} s (runs loaded from {results} take none)")
    plot(runs, Path(args.out) / "algorithms_scenes.png")
    write_json(
        args.json,
        {
            "task": "scenes",
            "target_gain": TARGET_GAIN,
            "budget_fe": budget,
            "seeds": args.seeds,
            "seed_list": list(range(args.first_seed, args.first_seed + args.seeds)),
            "evaluation": {
                "prompts": evaluation.num_prompts,
                "num_steps": evaluation.num_steps,
                "points": points,
            },
            "algorithms": summary,
            "task_overrides": TASK,
            "settings": {n: {**ALGORITHMS[n], "extra": extra[n]} for n in names},
            "runs": runs,
            "total_wall_s": total,
            "environment": environment(),
        },
    )
