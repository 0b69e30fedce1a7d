"""The learners head to head: reward against compute for FlowGRPO, GRPO-Guard, DiffusionNFT and AWM.

On the CPU demo task (the tiny random Boogu checkpoint, 64x64 images, 6 denoising steps, groups of
8 samples, LoRA r8) with the ``demo_target_color`` reward, every algorithm of `ALGORITHMS` runs
with its recommended settings for ``--seeds`` seeds. Each run stops after the step at which its
cumulative forward-equivalents (``cum/fe``: transformer sample-forwards, a forward = 1, a
backward = 2) reach the same budget, so all get the same compute. For each run the benchmark
records, at the first step where the reward smoothed over the last 3 steps (trailing mean of
``reward/mean``) reaches the fixed target, the run's ``cum/fe`` and ``cum/time_s`` (the trainer's
step time, all phases). It prints a table (compute to target, mean ± std over the seeds that
reached it, the final smoothed reward, FE per image per step, the FE ratio to flow_grpo), draws
reward against cumulative FE and against wall time (``--out DIR``/algorithms.png), and with
``--json PATH`` writes::

    {"target": r, "algorithms": {name: {"fe_to_target": [per seed], "wall_to_target_s": [...],
                                        "final_reward": [...]}}, ...}

(null where a seed never reached the target; the curves and the settings in other keys).

    uv run python benchmarks/algorithms.py [--seeds 3] [--first-seed 0] [--budget-fe 12288] [--target 0.8]
        [--algorithms flow_grpo,awm] [--set awm:optim.lr=1e-2] [--stop-at-target] [--out DIR]
        [--json PATH] [--quick]

The default run is 6 learners x 3 seeds: 1124 s in the script on 2 idle CPU cores (2026-12-02).
``--stop-at-target`` ends each run at its first crossing of the target (the figures to the target
only, 3-6x cheaper: for many-seed checks). The table gives each learner's FE ratio to flow_grpo
with a 95% bootstrap interval over seeds.
``--quick`` (CI) runs every algorithm for 3 steps of 1 prompt x 8 samples with one seed (about
20 s) and checks the plumbing only. The rewards are those of each algorithm's own rollouts (its
sampler and CFG scale). Sets ``OMP_WAIT_POLICY=PASSIVE`` unless it is set (see benchmarks/README.md).
"""

from __future__ import annotations

import os

# Before torch loads OpenMP: idle OpenMP threads sleep instead of spinning (see README).
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import argparse
import contextlib
import math
import random
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

from _common import environment, table, write_json

from boogu_trainer.config import demo_config, load_config
from boogu_trainer.trainer import Trainer

TASK: list[str] = [
    "data.prompts_per_step=2",  # 2 prompts x 8 samples per step, the same for every algorithm
    "reward.rewards=[{name: demo_target_color}]",  # mean colour towards orange (255, 128, 0)
]
"""The task, on top of `demo_config()` (tiny checkpoint, 64x64, 6 steps, groups of 8, LoRA r8)."""

ODE_NO_CFG = ["sampler.guidance_scale=1.0", "sampler.window_size=0", "algorithm.mini_batches=1"]

ALGORITHMS: dict[str, dict[str, Any]] = {
    "flow_grpo": {
        "overrides": [
            "algorithm.name=flow_grpo",
            "algorithm.loss=ppo_clip",
            "optim.lr=3e-3",
            "algorithm.clip_range=1e-3",
        ],
        "why": "the demo recipe (CFG 2, SDE window 2 in [0, 4), 2 mini-batches); lr 5e-3/1e-2 and clip 3e-4/1e-2 did no better",
    },
    "flow_grpo_e2": {
        "overrides": [
            "algorithm.name=flow_grpo",
            "algorithm.loss=ppo_clip",
            "optim.lr=3e-3",
            "algorithm.clip_range=1e-3",
            "algorithm.inner_epochs=2",
        ],
        "why": "flow_grpo with 2 passes over each batch (4 optimizer steps per step): in tuning faster to 0.80 on seeds 0-1, less stable",
    },
    "grpo_guard": {
        "overrides": [
            "algorithm.name=flow_grpo",
            "algorithm.loss=grpo_guard",
            "optim.lr=3e-3",
            "algorithm.clip_range=1e-4",
        ],
        "why": "flow_grpo's rollouts and schedule; clip 1e-4 (~1e-3) beat the suggested 2e-6 and 1e-5, lr 1e-2 did no better",
    },
    "diffusion_nft": {
        "overrides": [
            "algorithm.name=diffusion_nft",
            *ODE_NO_CFG,
            "optim.lr=1e-2",
            "algorithm.nft.timesteps=1",
            "algorithm.nft.beta=1.0",
            "algorithm.nft.old_decay_max=0",
            "algorithm.nft.group_noise=true",
        ],
        "why": "CFG-free ODE rollouts, 1 schedule level, old = current (the reference's decay type 0: no old-policy forwards; the default lag was <= 0.08 here and ~10% more FE to target), one noise per group (fifth session, seeds 0-1: 1872 FE to 0.80 vs 3888 with per-sample noise); with it lr 1.5e-2/2e-2, 2 mini-batches and 2 levels were slower (sixth session, seeds 0-4); lr 1e-2 beat 3e-3/3e-2, uniform [0.5, 1] and 2 inner epochs no better, beta 0.1 = 1.0",
    },
    "diffusion_nft_cfg": {
        "overrides": [
            "algorithm.name=diffusion_nft",
            "sampler.guidance_scale=2.0",  # CFG 2 rollouts (as flow_grpo), still the ODE
            "sampler.window_size=0",
            "algorithm.mini_batches=1",
            "optim.lr=1e-2",
            "algorithm.nft.timesteps=1",
            "algorithm.nft.beta=1.0",
            "algorithm.nft.old_decay_max=0",
            "algorithm.nft.group_noise=true",
            "algorithm.nft.guided=true",
        ],
        "why": "diffusion_nft on the CFG-guided velocity (CFG 2 ODE rollouts, both rows trained): the CFG-free learners level off at 0.85-0.86 (so does flow_grpo without CFG); on seeds 0-1 this reached 0.90 (1728 / 3744 FE to 0.80, 2880 / 4608 to 0.84); untuned otherwise (diffusion_nft's settings)",
    },
    "awm": {
        "overrides": [
            "algorithm.name=awm",
            *ODE_NO_CFG,
            "algorithm.mini_batches=2",
            "optim.lr=5e-3",
            "algorithm.awm.timesteps=1",
        ],
        "why": "CFG-free ODE rollouts, 1 uniform level in [0, 1], 2 optimizer steps per step (as flow_grpo), no old-policy forward (plain AWM, no clip): on seeds 0-1 1872 FE to 0.80 (1976 with the old forward, 3240 with 1 mini-batch at lr 1e-2); one noise per group (2232), 2 levels, sigma in [0.5, 1] and 2 inner epochs no better",
    },
}
"""Each algorithm's recommended settings for this task (on top of `TASK`), with the reason."""

NEW_ALGORITHMS = ("diffusion_nft", "diffusion_nft_cfg", "awm")
"""The forward-process learners (GRPO-Guard and flow_grpo_e2 are FlowGRPO variants)."""

TARGET = 0.8
"""The fixed reward target (smoothed ``reward/mean``)."""
BUDGET_FE = 12288
"""Forward-equivalents per run (all algorithms): 32 flow_grpo steps of 384 (2 x 8 images x 24)."""
THRESHOLDS = (0.76, 0.78, 0.80, 0.82, 0.84)
"""Other targets, for the sensitivity table: how the FE ratio depends on the target chosen."""
SMOOTH = 3
"""The target is judged on the trailing mean of this many steps' ``reward/mean``."""
MAX_STEPS = 1000


class _BudgetReached(Exception):
    pass


def run_config(name: str, seed: int, run_dir: str, extra: list[str]):
    overrides = [
        *TASK,
        *ALGORITHMS[name]["overrides"],
        *extra,
        "logging.progress=false",
        "logging.sample_every=0",
        "logging.plot_every=0",  # no reward_curve.png redraw after every step (outside the step time anyway)
        "checkpoint.save_every=0",
        "preflight=false",
        f"logging.run_dir={run_dir}",
        f"logging.name={name}_s{seed}",
        f"total_steps={MAX_STEPS + 1}",  # never reached: the run stops on the budget
        f"seed={seed}",
    ]
    return load_config(None, overrides, base=demo_config())


def smoothed(rewards: list[float]) -> list[float | None]:
    """The trailing mean of the last `SMOOTH` rewards at each step (None before `SMOOTH` steps)."""
    return [
        statistics.fmean(rewards[i + 1 - SMOOTH : i + 1]) if i + 1 >= SMOOTH else None
        for i in range(len(rewards))
    ]


def should_stop(
    rewards: list[float], cum_fe: float, budget_fe: float, max_steps: int, stop_at: float | None
) -> bool:
    """Whether a run stops after the step that gave ``rewards[-1]``: the FE budget or ``max_steps``
    is reached, or (``stop_at`` not None) the smoothed reward has just reached ``stop_at``."""
    return cum_fe >= budget_fe or len(rewards) >= max_steps or at_target(rewards, stop_at)


def at_target(rewards: list[float], stop_at: float | None) -> bool:
    """Whether the smoothed reward of the last step reaches ``stop_at`` (never with None)."""
    return stop_at is not None and len(rewards) >= SMOOTH and statistics.fmean(rewards[-SMOOTH:]) >= stop_at


def run_one(
    name: str,
    seed: int,
    run_dir: str,
    budget_fe: float,
    max_steps: int,
    extra: list[str],
    stop_at: float | None = None,
):
    """One run to the FE budget (or ``max_steps``, or with ``stop_at`` the first step whose
    smoothed reward reaches it): its per-step curve."""
    trainer = Trainer(run_config(name, seed, run_dir, extra))
    seen: list[float] = []

    def stop(step: int, record: dict[str, Any]) -> None:
        seen.append(float(record["reward/mean"]))
        if should_stop(seen, record["cum/fe"], budget_fe, max_steps, stop_at):
            raise _BudgetReached

    t0 = time.perf_counter()
    with contextlib.suppress(_BudgetReached):
        trainer.train(progress=stop)
    wall = time.perf_counter() - t0
    history = trainer.metrics.history
    rewards = [float(h["reward/mean"]) for h in history]
    return {
        "reward": rewards,
        "smoothed": smoothed(rewards),
        "cum_fe": [float(h["cum/fe"]) for h in history],
        "cum_time_s": [float(h["cum/time_s"]) for h in history],
        "fe_per_image": statistics.fmean(float(h["fe/total_per_image"]) for h in history),
        "images_per_step": float(history[0]["cum/images"]),
        "run_wall_s": wall,
        # Stopped by --stop-at-target: the curve ends at the target, so it has no final reward.
        "stopped_at_target": at_target(rewards, stop_at),
    }


def first_crossing(curve: dict[str, Any], target: float) -> int | None:
    """The index of the first step whose smoothed reward reaches ``target``."""
    for i, value in enumerate(curve["smoothed"]):
        if value is not None and value >= target:
            return i
    return None


def summarise(curves: list[dict[str, Any]], target: float, stop_at_target: bool = False) -> dict[str, Any]:
    # Runs stopped at the target say nothing about the higher thresholds.
    thresholds = [r for r in THRESHOLDS if not stop_at_target or r <= target]
    hits = [first_crossing(c, target) for c in curves]
    final = [
        None
        if c.get("stopped_at_target")
        else next((v for v in reversed(c["smoothed"]) if v is not None), c["reward"][-1])
        for c in curves
    ]
    return {
        "fe_to_target": [None if i is None else c["cum_fe"][i] for c, i in zip(curves, hits)],
        "wall_to_target_s": [None if i is None else c["cum_time_s"][i] for c, i in zip(curves, hits)],
        "steps_to_target": [None if i is None else i + 1 for i in hits],
        "final_reward": final,
        "initial_reward": [c["reward"][0] for c in curves],
        "steps": [len(c["reward"]) for c in curves],
        "fe_per_image_per_step": statistics.fmean(c["fe_per_image"] for c in curves),
        "run_wall_s": [c["run_wall_s"] for c in curves],
        "fe_to_thresholds": {
            f"{r:g}": [None if (i := first_crossing(c, r)) is None else c["cum_fe"][i] for c in curves]
            for r in thresholds
        },
    }


def ratio_interval(
    values: list[float], base: list[float], resamples: int = 10000, level: float = 0.95
) -> tuple[float, float]:
    """A percentile bootstrap interval for ``mean(values) / mean(base)``: both lists (per-seed FE
    to target) resampled with replacement, independently (the learners' seeds are not paired),
    with a fixed generator so that the figure is reproducible. ``(nan, nan)`` for one seed."""
    if len(values) < 2 or len(base) < 2:
        return math.nan, math.nan
    rng = random.Random(0)
    ratios = sorted(
        statistics.fmean(rng.choices(values, k=len(values)))
        / statistics.fmean(rng.choices(base, k=len(base)))
        for _ in range(resamples)
    )
    tail = (1 - level) / 2
    return ratios[int(tail * resamples)], ratios[min(resamples - 1, int((1 - tail) * resamples))]


def mean_std(values: list[float | None], fmt: str = "{:.0f}") -> str:
    got = [v for v in values if v is not None]
    if not got:
        return "-"
    if len(got) == 1:
        return fmt.format(got[0])
    return f"{fmt.format(statistics.fmean(got))} ± {fmt.format(statistics.stdev(got))}"


def add_ratios(summary: dict[str, dict[str, Any]]) -> None:
    """Each learner's ``fe_ratio_vs_flow_grpo``: ``{"mean_ratio", "interval_95"}`` (the ratio of the
    mean FE to target over the seeds that reached it, and its `ratio_interval`, None for one seed);
    flow_grpo's is 1 with no interval. Left out where either side has no seed that reached it."""
    base = [v for v in summary.get("flow_grpo", {}).get("fe_to_target", []) if v is not None]
    for name, s in summary.items():
        got = [v for v in s["fe_to_target"] if v is not None]
        if not (got and base):
            continue
        low, high = ratio_interval(got, base) if name != "flow_grpo" else (math.nan, math.nan)
        s["fe_ratio_vs_flow_grpo"] = {
            "mean_ratio": statistics.fmean(got) / statistics.fmean(base),
            "interval_95": None if math.isnan(low) else [low, high],
        }


def print_table(summary: dict[str, dict[str, Any]], seeds: int) -> None:
    rows = []
    for name, s in summary.items():
        r = s.get("fe_ratio_vs_flow_grpo")
        ratio = "-" if r is None else f"{r['mean_ratio']:.2f}"
        if r is not None and r["interval_95"] is not None:
            ratio += " ({:.2f}-{:.2f})".format(*r["interval_95"])
        rows.append(
            (
                name,
                f"{sum(v is not None for v in s['fe_to_target'])}/{seeds}",
                mean_std(s["fe_to_target"]),
                mean_std(s["wall_to_target_s"], "{:.1f}"),
                mean_std(s["steps_to_target"], "{:.1f}"),
                mean_std(s["initial_reward"], "{:.3f}"),
                mean_std(s["final_reward"], "{:.3f}"),
                f"{s['fe_per_image_per_step']:.1f}",
                ratio,
            )
        )
    header = (
        "algorithm",
        "reached",
        "FE to target",
        "wall s to target",
        "steps to target",
        "initial reward",
        "final reward",
        "FE/image/step",
        "FE ratio vs flow_grpo (95% interval)",
    )
    print(table(rows, header))


def print_thresholds(summary: dict[str, dict[str, Any]], seeds: int) -> None:
    """Mean FE to each of `THRESHOLDS` (seeds that reached it) and its ratio to flow_grpo's."""
    base = summary.get("flow_grpo", {}).get("fe_to_thresholds", {})
    rows = []
    for name, s in summary.items():
        cells = []
        for key, values in s["fe_to_thresholds"].items():
            got = [v for v in values if v is not None]
            ref = [v for v in base.get(key, []) if v is not None]
            if not got:
                cells.append(f"- (0/{seeds})")
                continue
            ratio = (
                f" {statistics.fmean(got) / statistics.fmean(ref):.2f}x"
                if ref and name != "flow_grpo"
                else ""
            )
            cells.append(f"{statistics.fmean(got):.0f}{ratio} ({len(got)}/{seeds})")
        rows.append((name, *cells))
    keys = next(iter(summary.values()))["fe_to_thresholds"] if summary else {}
    print(table(rows, ("mean FE to reward", *(f">= {r}" for r in keys))))


def plot(curves: dict[str, list[dict[str, Any]]], target: float, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(12, 4.5), dpi=100, sharey=True)
    colours = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    for (name, runs), colour in zip(curves.items(), colours):
        for k, c in enumerate(runs):
            label = name if k == 0 else None
            for ax, x in zip(axes, (c["cum_fe"], c["cum_time_s"])):
                ax.plot(x, c["reward"], color=colour, alpha=0.15, linewidth=0.8)
                pts = [(xi, yi) for xi, yi in zip(x, c["smoothed"]) if yi is not None]
                if pts:
                    ax.plot(*zip(*pts), color=colour, linewidth=1.5, label=label)
    for ax, xlabel in zip(axes, ("cumulative forward-equivalents", "cumulative step time (s)")):
        ax.axhline(target, color="black", linestyle="--", linewidth=1, label="target")
        ax.set_xlabel(xlabel)
        ax.grid(alpha=0.3)
    axes[0].set_ylabel(f"reward (thin: per step; thick: mean of last {SMOOTH})")
    axes[0].legend(loc="lower right")
    fig.suptitle("demo_target_color on the tiny random checkpoint: one line per algorithm and seed")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, format="png")
    plt.close(fig)
    print(f"plot written to {path}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--seeds", type=int, default=3, help="seeds per algorithm (first-seed, first-seed + 1, ...)"
    )
    parser.add_argument("--first-seed", type=int, default=0, help="the first seed (held-out seeds: 5 and up)")
    parser.add_argument("--budget-fe", type=float, default=BUDGET_FE, help="cum/fe at which a run stops")
    parser.add_argument("--max-steps", type=int, default=MAX_STEPS, help="at most this many steps per run")
    parser.add_argument("--target", type=float, default=TARGET, help="the reward target (smoothed)")
    parser.add_argument(
        "--task",
        choices=("demo", "scenes"),
        default="demo",
        help="demo: demo_target_color on the tiny random checkpoint (this file); scenes: held-out "
        "scene_exact on the tiny pretrained one (algorithms_scenes.py)",
    )
    parser.add_argument(
        "--algorithms",
        default=None,
        help="comma-separated subset of the task's learners (demo: "
        + ", ".join(ALGORITHMS)
        + "; scenes: the regime's recipes, algorithms_scenes.RECIPES and .ALGORITHMS)",
    )
    parser.add_argument(
        "--results",
        default=None,
        help="scenes: the folder of finished runs, loaded instead of rerun (default /tmp/algbench_scenes; "
        "--quick: a temporary folder)",
    )
    parser.add_argument(
        "--load-only",
        action="store_true",
        help="scenes: a table of finished runs only: every run asked for must be in --results (the "
        "missing ones are listed and nothing is trained)",
    )
    parser.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="NAME:KEY=VALUE",
        help="an extra config override for one algorithm (NAME) or all (*), for tuning; repeatable",
    )
    parser.add_argument(
        "--evaluations",
        type=int,
        default=None,
        help="scenes: held-out evaluations per run, at each k/N of the budget (default: the regime's, "
        "v2 6, v1 4)",
    )
    parser.add_argument(
        "--regime",
        choices=("v1", "v2"),
        default=None,
        help="scenes: the recipes, budget and evaluations (v2, the default: 132480 FE, 6 evaluations on "
        "400 captions, each learner's best recipe found; v1: the first comparison's, 44160 FE, 4 on 200)",
    )
    parser.add_argument(
        "--keep-checkpoint",
        action="store_true",
        help="scenes: keep each new run's trainer checkpoint of its last step as "
        "RESULTS/<recipe>_s<seed>.checkpoint/ (for gradient_check.py --resume); runs loaded from "
        "RESULTS are not trained again, so they get none",
    )
    parser.add_argument("--out", default="/tmp/algbench", help="folder for algorithms.png")
    parser.add_argument("--json", help="also write the figures to this JSON file")
    parser.add_argument(
        "--stop-at-target",
        action="store_true",
        help="end each run at the step where it reaches the target (FE to target only: no final reward, "
        "no higher thresholds; the runs are deterministic, so the figures to the target are unchanged)",
    )
    parser.add_argument("--quick", action="store_true", help="CI smoke run: 1 seed, 3 steps per algorithm")
    args = parser.parse_args()
    learners = ALGORITHMS
    if args.evaluations is not None and (args.task != "scenes" or args.evaluations < 1):
        parser.error("--evaluations: a positive count, with --task scenes only")
    if args.regime is not None and args.task != "scenes":
        parser.error("--regime: with --task scenes only")
    if args.keep_checkpoint and args.task != "scenes":
        parser.error("--keep-checkpoint: with --task scenes only")
    if args.load_only and (args.task != "scenes" or args.quick):
        parser.error("--load-only: with --task scenes and without --quick")
    if args.task == "scenes":
        import algorithms_scenes

        args.regime = args.regime or algorithms_scenes.DEFAULT_REGIME
        regime = algorithms_scenes.REGIMES[args.regime]
        learners = regime.recipes
        if args.budget_fe == BUDGET_FE:
            args.budget_fe = regime.budget_fe
        if args.evaluations is None:
            args.evaluations = regime.evaluations
    if args.quick:  # the plumbing only: 1 seed, 1 prompt x 8 samples, 3 steps
        args.seeds, args.max_steps = 1, 3
        args.budget_fe = min(args.budget_fe, 576 if args.task == "demo" else 600)
        # one prompt group is one mini-batch (more would be refused: algorithm.mini_batches <= groups)
        args.set = ["*:data.prompts_per_step=1", "*:algorithm.mini_batches=1", *args.set]
        if args.task == "scenes":  # 4 held-out captions, 2 denoising steps per evaluation
            args.set = ["*:eval.num_prompts=4", "*:eval.num_steps=2", *args.set]
    names = [n.strip() for n in (args.algorithms or ",".join(learners)).split(",") if n.strip()]
    unknown = [n for n in names if n not in learners]
    if unknown:
        parser.error(f"unknown algorithms {unknown} for --task {args.task}; choose from {list(learners)}")
    extra: dict[str, list[str]] = {n: [] for n in names}
    for item in args.set:
        who, sep, override = item.partition(":")
        if not sep or (who != "*" and who not in learners):
            parser.error(f"--set {item!r}: expected NAME:KEY=VALUE with NAME in {list(learners)} or *")
        for n in names if who == "*" else [who]:
            extra.setdefault(n, []).append(override)
    if args.task == "scenes":
        if args.quick and args.results is None:
            with tempfile.TemporaryDirectory() as tmp:
                args.results = tmp
                algorithms_scenes.main(args, extra, ratio_interval, mean_std)
        else:
            args.results = args.results or "/tmp/algbench_scenes"
            algorithms_scenes.main(args, extra, ratio_interval, mean_std)
        return

    t0 = time.perf_counter()
    curves: dict[str, list[dict[str, Any]]] = {}
    with tempfile.TemporaryDirectory() as tmp:
        for name in names:
            curves[name] = []
            for seed in range(args.first_seed, args.first_seed + args.seeds):
                c = run_one(
                    name,
                    seed,
                    tmp,
                    args.budget_fe,
                    args.max_steps,
                    extra.get(name, []),
                    args.target if args.stop_at_target else None,
                )
                curves[name].append(c)
                hit = first_crossing(c, args.target)
                print(
                    f"{name} seed {seed}: {len(c['reward'])} steps, cum/fe {c['cum_fe'][-1]:.0f}, "
                    f"reward {c['reward'][0]:.3f} -> {c['reward'][-1]:.3f}, "
                    f"target {'at step ' + str(hit + 1) if hit is not None else 'not reached'} "
                    f"({c['run_wall_s']:.0f} s)",
                    flush=True,
                )
    total = time.perf_counter() - t0
    summary = {name: summarise(runs, args.target, args.stop_at_target) for name, runs in curves.items()}
    add_ratios(summary)

    print()
    print(
        f"target {args.target} (trailing mean of {SMOOTH} steps' reward/mean), budget {args.budget_fe:.0f} FE "
        f"per run, {args.seeds} seed(s); FE = transformer forward-equivalents (forward 1, backward 2), "
        "wall = the trainer's step time"
        + ("; each run stopped at the target (--stop-at-target)" if args.stop_at_target else "")
    )
    print_table(summary, args.seeds)
    print()
    print_thresholds(summary, args.seeds)
    for name in names:
        print(f"  {name}: {' '.join(ALGORITHMS[name]['overrides'] + extra.get(name, []))}")
        print(f"    ({ALGORITHMS[name]['why']})")
    print(f"total wall time {total:.0f} s")
    plot(curves, args.target, Path(args.out) / "algorithms.png")

    reached = {n: [v for v in s["fe_to_target"] if v is not None] for n, s in summary.items()}
    base = statistics.fmean(reached["flow_grpo"]) if reached.get("flow_grpo") else math.nan
    new = {n: statistics.fmean(v) for n, v in reached.items() if n in NEW_ALGORITHMS and v}
    best = min(new, key=new.get) if new else None
    if best is not None and math.isfinite(base):
        interval = summary[best]["fe_ratio_vs_flow_grpo"]["interval_95"]
        print(
            f"best new algorithm: {best}, FE to target {new[best] / base:.2f}x flow_grpo's"
            + (
                ""
                if interval is None
                else " (95% bootstrap interval over seeds {:.2f}-{:.2f})".format(*interval)
            )
        )
        baselines = {n: statistics.fmean(v) for n, v in reached.items() if n.startswith("flow_grpo") and v}
        strongest = min(baselines, key=baselines.get)
        print(f"  and {new[best] / baselines[strongest]:.2f}x the best FlowGRPO variant's ({strongest})")
    write_json(
        args.json,
        {
            "target": args.target,
            "algorithms": summary,
            "budget_fe": args.budget_fe,
            "seeds": args.seeds,
            "seed_list": list(range(args.first_seed, args.first_seed + args.seeds)),
            "stop_at_target": args.stop_at_target,
            "smooth_steps": SMOOTH,
            "task": TASK,
            "settings": {n: {**ALGORITHMS[n], "extra": extra.get(n, [])} for n in names},
            "curves": curves,
            "total_wall_s": total,
            "environment": environment(),
        },
    )


if __name__ == "__main__":
    main()
