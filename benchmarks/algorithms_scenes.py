"""The learners head to head on the scenes task: held-out verifier score against compute.

``benchmarks/algorithms.py --task scenes`` runs this (each design, pre-registered before its first
measured run, is in benchmarks/README.md: "Algorithms on the scenes task" for the first regime, "The
learners head to head in the new regime" for the second). The task is the demo's
(`scenes_task_config`): the tiny Boogu pretrained on procedural scenes, train captions, CFG-4 judge
of 10 ODE steps, LoRA r8, trained on ``scene_exact``; ``scene_dense`` is computed on every rollout at
weight 0 (the proxy curve, never trained on). Every recipe gets the same budget of
forward-equivalents (``cum/fe``). The gold is ``scene_exact`` on the held-out captions
(``data.demo_eval_split=heldout``, never training prompts), ODE, CFG 4, fixed seeds, the same images
for every recipe's base: it is measured with the LoRA off (the base, once per seed) and at the first
step past each k/N of the budget. Per recipe it reports the FE and the wall time (the trainer's step
time) to the target (held-out exact >= base + ``TARGET_GAIN`` at an evaluation), with the FE ratio
to flow_grpo and its 95% bootstrap interval over seeds, the median FE to the target (runs that never
reach it count as beyond the budget), the final held-out exact (and its paired difference from the
base), the final gain's paired difference from flow_grpo's on the same seeds, and plots the gold
against FE (each seed, and the mean over seeds with its se) and the proxy and the rollouts' exact per
step. Then the v2 design's figures 3-5 and its reading: each run's verdict (learns / flat / falls:
its final gain beyond 2 paired se), the paired difference of every pair of recipes (separated when
its 95% t interval excludes zero), each recipe's per-step instruments by thirds of its runs (from
their ``metrics.jsonl``) and at the base (its ``gradient_check.py`` file), and which tier-1 recipe
the README recommends by the design's rule (interim below `READ_AT_SEEDS` seeds).

Two regimes (``--regime``), each a set of recipes with its budget and evaluations:

* ``v2`` (the default; issues 44-45): 132480 FE, 6 evaluations on 400 held-out captions, each learner
  at the recipe the curves found best for it (`RECIPES`: 128 images per step, lr 3e-4 for the
  FlowGRPO family and AWM, DiffusionNFT's demo recipe), plus MixGRPO's progressive window,
  DanceGRPO's SDE and AWM's fast-but-unstable recipe.
* ``v1`` (issue 27, the first comparison): 44160 FE, 4 evaluations on 200 captions, 64 images per
  step, lr tuned on seeds 0-1 (`ALGORITHMS`). Its committed tables load with ``--regime v1``.

Each finished run is saved as ``--results DIR/<recipe>_s<seed>.json`` (and each seed's base as
``base_s<seed>.json``, its trainer's per-step ``metrics.jsonl`` as
``<recipe>_s<seed>.metrics.jsonl``): a rerun with the same settings loads them instead of running
again, so a long comparison survives being stopped and continues where it was; a file written
with other settings is an error that names it.

    uv run python benchmarks/algorithms.py --task scenes [--regime v2] [--seeds 2] [--first-seed 0]
        [--algorithms flow_grpo,awm] [--set awm:optim.lr=1e-3] [--results DIR] [--out DIR]
        [--json PATH] [--quick]
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import itertools
import json
import math
import shutil
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
"""v1's forward-equivalents per run: the demo's 30 DiffusionNFT steps (64 images x 23 FE)."""
QUARTERS = 4
"""v1's evaluations per run (``--evaluations``): at the first step whose cum/fe reaches k/4 of the
budget."""

COMMON_V2 = [
    "data.prompts_per_step=8",
    "algorithm.group_size=16",
    "algorithm.std_scope=batch",
    "algorithm.adv_clip=5",
    "optim.lr=3e-4",
    "optim.weight_decay=1e-4",
]
"""The shipped recipes' regime on the tiny model (benchmarks/README.md, the curves, part 3): the
10B recipes' 32 prompts x 16 images become 8 x 16, 128 images per step, batch-normalised advantages
clipped at 5, lr 3e-4."""
FGRPO_V2 = [
    "sampler.noise_level=1.2",
    "sampler.window_size=2",
    "sampler.window_range=[0,5]",
    "sampler.window_scope=group",
    "algorithm.clip_range=1e-4",
    "algorithm.kl_coef=0",
    "algorithm.mini_batches=2",
]
"""flow_grpo's reference recipe: a window of 2 SDE steps drawn in [0, 5) per group, noise 1.2, clip 1e-4."""
JUDGE_V2 = ["eval.num_prompts=400", "eval.guidance_scale=4"]
"""v2's judge: 400 held-out captions at CFG 4 whatever the rollouts' CFG."""

RECIPES: dict[str, dict[str, Any]] = {
    "flow_grpo": {
        "overrides": [*ALGORITHMS["flow_grpo"]["overrides"], *COMMON_V2, *FGRPO_V2],
        "tier": 1,
        "gradient": "fgrpo_ref",
        "why": "the shipped FlowGRPO recipe (examples/flowgrpo_trainer's settings at 8 x 16 images): SDE window 2 in [0, 5) per group, noise 1.2, clip 1e-4, no KL, lr 3e-4, 2 mini-batches; the best found by the curves' rule (the curves, part 4 (b))",
    },
    "grpo_guard": {
        "overrides": [
            *ALGORITHMS["grpo_guard"]["overrides"],
            *COMMON_V2,
            *FGRPO_V2,
            "algorithm.clip_range=2e-6",
        ],
        "tier": 1,
        "gradient": "guard_ref",
        "why": "flow_grpo's recipe with RatioNorm and verl-omni's clip 2e-6; the best found by the curves' rule",
    },
    "diffusion_nft": {
        "overrides": [
            *ALGORITHMS["diffusion_nft"]["overrides"],
            "algorithm.nft.timesteps=2",
            "data.prompts_per_step=16",
            "optim.lr=5e-4",
        ],
        "tier": 1,
        "gradient": "demo_stable",
        "why": "the demo's recipe (examples/tiny_scenes/scenes_demo.yaml): CFG-4 ODE rollouts, 16 x 8 images, 2 levels per image, common noise per group, old = current, lr 5e-4; the best found (the curves, parts 1-2)",
    },
    "awm": {
        "overrides": [
            *ALGORITHMS["awm"]["overrides"],
            *COMMON_V2,
            "sampler.guidance_scale=1",
            "algorithm.awm.timesteps=4",
            "algorithm.awm.time_sampling=uniform",
            "algorithm.awm.sigma_range=[0,0.7]",
            "algorithm.awm.clip_range=null",
            "algorithm.kl_coef=1e-4",
            "algorithm.mini_batches=1",
        ],
        "tier": 1,
        "gradient": "awm_ref",
        "why": "the shipped AWM recipe (Flow-Factory's published config at 8 x 16 images): CFG-free ODE rollouts, 4 uniform levels in sigma [0, 0.7], KL 1e-4, lr 3e-4, one mini-batch; the best three-seed final gain of AWM's recipes at this budget (the curves, part 4 (a)-(b))",
    },
    "mixgrpo": {
        "overrides": [
            *ALGORITHMS["flow_grpo"]["overrides"],
            *COMMON_V2,
            *FGRPO_V2,
            "sampler.window_kind=progressive",
            "sampler.window_every=9",
        ],
        "tier": 2,
        "gradient": "mixgrpo",
        "why": "MixGRPO's progressive window on flow_grpo's recipe: the 2-step window slides from the noisiest step to step 3 of [0, 5), one position every 9 steps (the budget's ~35 steps sweep it once)",
    },
    "dancegrpo": {
        "overrides": [
            *ALGORITHMS["flow_grpo"]["overrides"],
            *COMMON_V2,
            *FGRPO_V2,
            "sampler.sampler=dance_sde",
            "sampler.noise_level=0.3",
        ],
        "tier": 2,
        "gradient": "dancegrpo",
        "why": "DanceGRPO's SDE kernel (eta 0.3, its published value) in flow_grpo's window-2 recipe: the kernel changed and nothing else",
    },
    "awm_fast": {
        "overrides": [*ALGORITHMS["awm"]["overrides"]],
        "tier": 2,
        "gradient": "awm",
        "why": "AWM's best recipe by the curves' rule at ~44k FE (the first comparison's: CFG-4 ODE rollouts, 1 uniform level, 8 x 8 images, 2 mini-batches, lr 3e-4): the fastest riser, which fell on 2 of 3 seeds by 133k FE (the curves, part 4 (b))",
    },
}
"""v2's recipes (on top of `TASK` and `JUDGE_V2`): each learner at the recipe the curves found best
for it (benchmarks/README.md, the curves, parts 1-4), MixGRPO's and DanceGRPO's sampling on
flow_grpo's, and AWM's fast recipe. The EMA weights are not judged (``ema.enabled`` is off): it
changes no update, and judging them doubled the evaluations' cost in the curves."""


@dataclasses.dataclass(frozen=True)
class Regime:
    recipes: dict[str, dict[str, Any]]
    budget_fe: float
    evaluations: int
    judge: tuple[str, ...] = ()
    """Overrides after each recipe's: the evaluation every recipe of the regime is judged by."""


REGIMES = {
    "v1": Regime(ALGORITHMS, BUDGET_FE, QUARTERS),
    "v2": Regime(RECIPES, 132480, 6, tuple(JUDGE_V2)),
}
"""``--regime``: v2 the default (issues 44-45), v1 the first comparison's (issue 27)."""
DEFAULT_REGIME = "v2"
TARGET_GAIN = 0.04
"""The target: held-out exact >= this run's seed's base + TARGET_GAIN at an evaluation."""
THRESHOLDS = (0.02, 0.04, 0.06, 0.08, 0.10)
"""Gains over the base for the sensitivity table."""


def run_config(name: str, seed: int, run_dir: str, extra: list[str], regime: str = DEFAULT_REGIME):
    """Recipe ``name`` of ``regime`` for ``seed``, with ``extra`` overrides last."""
    r = REGIMES[regime]
    overrides = [
        *TASK,
        *r.recipes[name]["overrides"],
        *r.judge,
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


def _judge(trainer: Trainer) -> dict[str, Any]:
    """What a held-out evaluation depends on besides the weights: its captions, steps, CFG and seed."""
    e = trainer.evaluator
    return {
        "prompts": len(e.records),
        "num_steps": e.eval_config.num_steps,
        "guidance_scale": e.guidance_scale,
        "seed": e.seed,
    }


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
    regime: str = DEFAULT_REGIME,
    keep_checkpoint: Path | None = None,
) -> dict:
    """One run to the budget with ``points`` evaluations (at each k/points of it); the base evaluation
    of its seed is read from ``base_file`` or made (LoRA off, before any update) and written there.
    ``keep_checkpoint``: the trainer's checkpoint of the last step is copied to this folder (the
    instruments' ``gradient_check.py --resume`` reads it)."""
    trainer = Trainer(run_config(name, seed, run_dir, extra, regime))
    try:
        judge = _judge(trainer)
        if base_file.is_file():
            saved = json.loads(base_file.read_text())
            base = saved["gold"]
            # a base judged otherwise (another caption count, steps or CFG) pairs with nothing here;
            # the first files kept no judge: their caption count is what they can be checked by
            if saved.get("judge", judge) != judge or len(base) != judge["prompts"]:
                raise SystemExit(
                    f"{base_file} is another judge's base ({saved.get('judge', {'prompts': len(base)})}, "
                    f"this run's {judge}): give another --results folder"
                )
        else:
            t0 = time.perf_counter()
            with adapters_disabled(trainer.transformer):
                base = _evaluation(trainer, 0)
            atomic_write_text(
                base_file,
                json.dumps({"seed": seed, "gold": base, "eval_s": time.perf_counter() - t0, "judge": judge}),
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
        if keep_checkpoint is not None:
            saved = trainer.save()  # the run's own checkpoint of its last step (its config inside)
            if keep_checkpoint.exists():
                shutil.rmtree(keep_checkpoint)
            shutil.copytree(saved, keep_checkpoint)
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


def median_fe(values: list[float | None]) -> float | None:
    """The median FE to a target over seeds, a run that never reached it counting as beyond the
    budget (larger than any that did); None when the median run did not reach it."""
    ranked = sorted(math.inf if v is None else v for v in values)
    if not ranked:
        return None
    n = len(ranked)
    middle = ranked[n // 2] if n % 2 else (ranked[n // 2 - 1] + ranked[n // 2]) / 2
    return None if math.isinf(middle) else middle


def summarise(runs: list[dict[str, Any]]) -> dict[str, Any]:
    hits = [first_reaching(r, TARGET_GAIN) for r in runs]
    out = {
        "fe_to_target": [None if h is None else h["cum_fe"] for h in hits],
        "median_fe_to_target": median_fe([None if h is None else h["cum_fe"] for h in hits]),
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
    out["verdicts"] = verdicts(out)
    return out


def t_interval(values: list[float]) -> tuple[float, float, float]:
    """Mean and its 95% t interval over seeds (mean ± t * sd / sqrt(n)); the bounds are nan for one
    value."""
    mean = statistics.fmean(values)
    if len(values) < 2:
        return mean, math.nan, math.nan
    half = _T95.get(len(values) - 1, 1.96) * statistics.stdev(values) / math.sqrt(len(values))
    return mean, mean - half, mean + half


def mean_interval(values: list[float]) -> str:
    """Mean and a 95% interval (t-based: mean ± t * sd / sqrt(n)) over seeds."""
    if not values:
        return "-"
    mean, low, high = t_interval(values)
    if math.isnan(low):
        return f"{mean:+.3f}"
    return f"{mean:+.3f} ({low:+.3f} to {high:+.3f})"


_T95 = {1: 12.71, 2: 4.30, 3: 3.18, 4: 2.78, 5: 2.57, 6: 2.45, 7: 2.36, 8: 2.31, 9: 2.26, 10: 2.23, 11: 2.20}
"""Student t quantiles (0.975) by degrees of freedom."""

READ_AT_SEEDS = 10
"""The v2 design reads its table at ten seeds (benchmarks/README.md): a table of fewer is interim."""

GRADIENT_RESULTS = Path(__file__).resolve().parent / "results" / "gradient"
"""gradient_check.py's committed results: a v2 recipe's ``gradient`` names its file here."""

INSTRUMENTS = (
    ("scene_exact/mean", "rollouts' exact"),
    ("reward/zero_std_share", "no spread"),
    ("clipfrac", "clip fraction"),
    ("kl_ref", "kl_ref"),
    ("grad_norm", "grad norm"),
)
"""The per-step metrics reported by thirds of each run (key in ``metrics.jsonl``, column name)."""


def run_verdict(gain: float, se: float) -> str:
    """A run *learns* when its final gain is above twice its paired se, *falls* when it is below minus
    twice it, and is *flat* otherwise."""
    return "learns" if gain > 2 * se else "falls" if gain < -2 * se else "flat"


def verdicts(s: dict[str, Any]) -> dict[str, Any]:
    """A recipe's `run_verdict` per seed and their counts, from its `summarise` figures."""
    per_seed = [run_verdict(g, se) for g, se in zip(s["final_gain"], s["final_se_gain"], strict=True)]
    return {"per_seed": per_seed, **{v: per_seed.count(v) for v in ("learns", "flat", "falls")}}


def pairwise(summary: dict[str, dict[str, Any]]) -> list[dict[str, Any]]:
    """The paired difference of the final gains on the same seeds for every pair of recipes (the one
    with the higher mean first), with its 95% t interval: the two are *separated* when it excludes
    zero. Every recipe of a table runs the same seeds in the same order."""
    ranked = sorted(summary, key=lambda n: -statistics.fmean(summary[n]["final_gain"]))
    pairs = []
    for i, higher in enumerate(ranked):
        for lower in ranked[i + 1 :]:
            differences = [
                a - b
                for a, b in zip(summary[higher]["final_gain"], summary[lower]["final_gain"], strict=True)
            ]
            mean, low, high = t_interval(differences)
            pairs.append(
                {
                    "higher": higher,
                    "lower": lower,
                    "difference": mean,
                    "interval_95": None if math.isnan(low) else [low, high],
                    "separated": not math.isnan(low) and (low > 0 or high < 0),
                }
            )
    return pairs


def choice(summary: dict[str, dict[str, Any]], pairs: list[dict[str, Any]], tier1: list[str]) -> dict | None:
    """The design's reading for the README: among the tier-1 recipes, the one with the highest mean
    final gain is *recommended* when it is separated from every other tier-1 recipe; the tier-1 recipes
    not separated from it are its *equals*. None without two tier-1 recipes."""
    tier1 = [n for n in tier1 if n in summary]
    if len(tier1) < 2:
        return None
    best = max(tier1, key=lambda n: statistics.fmean(summary[n]["final_gain"]))
    separated = {frozenset((p["higher"], p["lower"])): p["separated"] for p in pairs}
    equals = [n for n in tier1 if n != best and not separated[frozenset((best, n))]]
    return {"best": best, "recommended": None if equals else best, "equals": equals}


def run_instruments(path: Path) -> dict[str, list[float | None]]:
    """One run's per-step metrics (the trainer's ``metrics.jsonl``, one record per step): the mean of
    each of `INSTRUMENTS` over each third of its steps (None where the learner does not log it)."""
    records = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    bounds = [round(k * len(records) / 3) for k in range(4)]
    out: dict[str, list[float | None]] = {}
    for key, _ in INSTRUMENTS:
        thirds: list[float | None] = []
        for start, stop in itertools.pairwise(bounds):
            values = [
                float(r[key]) for r in records[start:stop] if r.get(key) is not None and math.isfinite(r[key])
            ]
            thirds.append(statistics.fmean(values) if values else None)
        out[key] = thirds
    return out


def mean_instruments(runs: list[dict[str, list[float | None]]]) -> dict[str, list[float | None]]:
    """Each instrument's thirds, mean over the runs (`run_instruments`) that logged it."""
    out: dict[str, list[float | None]] = {}
    for key, _ in INSTRUMENTS:
        thirds: list[float | None] = []
        for k in range(3):
            values = [r[key][k] for r in runs if r[key][k] is not None]
            thirds.append(statistics.fmean(values) if values else None)
        out[key] = thirds
    return out


def gradient_figures(recipe: dict[str, Any]) -> dict[str, Any] | None:
    """gradient_check.py's figures for a recipe at the base (the file its ``gradient`` names, under
    `GRADIENT_RESULTS`): groups with no spread, images for a cosine of 1/2, the uphill margin at each
    step size and whether one passes (> 2 se). None for a recipe without one (v1's)."""
    file = recipe.get("gradient")
    if file is None:
        return None
    path = GRADIENT_RESULTS / f"{file}.json"
    g = json.loads(path.read_text())
    steps = g.get("uphill", {}).get("steps", [])
    return {
        "file": path.relative_to(GRADIENT_RESULTS.parents[2]).as_posix(),
        "seed": g["seed"],
        "images": g["rollouts"]["images"],
        "zero_spread_groups": g["rollouts"]["zero_spread_groups"],
        "images_for_cosine_half": g["images_for_cosine_half"],
        "uphill": [
            {k: s[k] for k in ("eps", "margin", "margin_se", "margin_in_se", "uphill")} for s in steps
        ],
        "passes": any(s["uphill"] for s in steps),
    }


def print_reading(
    summary: dict[str, dict[str, Any]],
    pairs: list[dict[str, Any]],
    instruments: dict[str, dict[str, list[float | None]]],
    gradients: dict[str, dict[str, Any] | None],
    reading: dict[str, Any] | None,
    seeds: int,
) -> None:
    """The design's figures 3-5 and its reading: runs that learn, every pair's paired difference, the
    instruments by thirds and at the base, and the choice for the README."""
    rows = [
        (name, f"{v['learns']}", f"{v['flat']}", f"{v['falls']}", " ".join(v["per_seed"]))
        for name, v in ((n, s["verdicts"]) for n, s in summary.items())
    ]
    print(table(rows, ("runs (final gain vs 2 paired se)", "learns", "flat", "falls", "per seed")))
    rows = []
    for p in pairs:
        interval = "-" if p["interval_95"] is None else "{:+.3f} to {:+.3f}".format(*p["interval_95"])
        rows.append(
            (
                f"{p['higher']} - {p['lower']}",
                f"{p['difference']:+.3f}",
                interval,
                "yes" if p["separated"] else "no",
            )
        )
    print(table(rows, ("final gain, same seeds", "difference", "95% t interval", "separated")))

    def cell(thirds: list[float | None], fmt: str) -> str:
        return (
            "-"
            if all(v is None for v in thirds)
            else ", ".join("-" if v is None else fmt.format(v) for v in thirds)
        )

    rows = []
    for name, values in instruments.items():
        rows.append((name, *(cell(values[key], "{:.3g}") for key, _ in INSTRUMENTS)))
    print(table(rows, ("by thirds of the run, mean over seeds", *(label for _, label in INSTRUMENTS))))
    rows = []
    for name, g in gradients.items():
        if g is None:
            rows.append((name, "-", "-", "-", "-", "-"))
            continue
        uphill = "; ".join(
            f"eps {u['eps']:g}: {u['margin']:+.3f} ({u['margin_in_se']:+.1f} se)" for u in g["uphill"]
        )
        rows.append(
            (
                name,
                g["file"],
                f"{g['zero_spread_groups']:.0%}",
                f"~{g['images_for_cosine_half']:.0f}"
                if math.isfinite(g["images_for_cosine_half"])
                else "never",
                uphill or "-",
                "passes" if g["passes"] else "does not pass",
            )
        )
    print(
        table(
            rows,
            (
                "at the base (gradient_check.py)",
                "file",
                "no spread",
                "images for a cosine of 1/2",
                "uphill margin",
                "uphill > 2 se",
            ),
        )
    )
    if reading is not None:
        interim = (
            ""
            if seeds >= READ_AT_SEEDS
            else f" (interim: {seeds} seed(s); the design reads at {READ_AT_SEEDS})"
        )
        if reading["recommended"] is not None:
            verdict = f"{reading['recommended']} is recommended as the default: separated from every other tier-1 recipe"
        else:
            verdict = (
                f"{reading['best']} has the highest mean final gain, not separated from "
                + ", ".join(reading["equals"])
                + " (its equals)"
            )
        print(f"the design's reading of tier 1{interim}: {verdict}")


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
                "-" if s["median_fe_to_target"] is None else f"{s['median_fe_to_target']:.0f}",
            )
        )
    header = (
        "algorithm",
        f"reached +{TARGET_GAIN:g}",
        "FE to target (runs that reached it)",
        "wall s to target",
        "base exact",
        "final exact",
        "final gain (95% interval)",
        "FE/image/step",
        "FE ratio vs flow_grpo (95% interval)",
        "median FE to target (all runs)",
    )
    print(table(rows, header))
    reference = summary.get("flow_grpo", {}).get("final_gain")
    rows = []
    ranked = sorted(summary, key=lambda n: -statistics.fmean(summary[n]["final_gain"]))
    for rank, name in enumerate(ranked, start=1):
        s = summary[name]
        cells = [str(rank), name, mean_interval(s["final_gain"])]
        if reference is not None and name != "flow_grpo" and len(reference) == len(s["final_gain"]):
            # paired by seed: every recipe runs the same seeds in the same order
            differences = [a - b for a, b in zip(s["final_gain"], reference, strict=True)]
            s["final_gain_minus_flow_grpo"] = differences
            cells.append(mean_interval(differences))
        else:
            cells.append("-")
        rows.append(tuple(cells))
    print(table(rows, ("rank", "algorithm", "final gain (95% t interval)", "minus flow_grpo's, same seeds")))
    rows = []
    for name, s in summary.items():
        cells = []
        for values in s["fe_to_gain"].values():
            got = [v for v in values if v is not None]
            cells.append(f"{statistics.fmean(got):.0f} ({len(got)}/{seeds})" if got else f"- (0/{seeds})")
        rows.append((name, *cells))
    print(table(rows, ("mean FE to a gain of", *(f"+{g:g}" for g in THRESHOLDS))))


def mean_gain_curve(
    group: list[dict[str, Any]], key: str = "gain"
) -> tuple[list[float], list[float], list[float]] | None:
    """A recipe's held-out gain (``key``: ``gain``, or ``ema_gain`` for its EMA weights) at each
    evaluation, mean over its seeds: (cum FE, gain, the se of that mean from each seed's paired
    per-caption se), with the base (0, 0, 0) first; None when a run has no such gain."""
    points = min(len(r["evaluations"]) for r in group)
    xs, ys, ses = [0.0], [0.0], [0.0]
    for k in range(points):
        evals = [r["evaluations"][k] for r in group]
        if not all(key in e for e in evals):
            return None
        xs.append(statistics.fmean(e["cum_fe"] for e in evals))
        ys.append(statistics.fmean(e[key] for e in evals))
        ses.append(math.sqrt(sum(e[f"{key[:-4]}se_gain"] ** 2 for e in evals)) / len(evals))
    return xs, ys, ses


def print_curves(runs: dict[str, list[dict[str, Any]]]) -> None:
    """The held-out gain at each evaluation, mean over seeds with the se of that mean (from each seed's
    paired per-caption se), and the same for the EMA weights where the runs kept one."""
    rows = []
    for name, group in runs.items():
        curves = {key: mean_gain_curve(group, key) for key in ("gain", "ema_gain")}
        for k, fe in enumerate(curves["gain"][0][1:]):
            cells = [name if k == 0 else "", f"{fe:.0f}"]
            for key, curve in curves.items():
                if curve is None:
                    cells.append("-")
                    continue
                per_seed = " ".join(f"{r['evaluations'][k][key]:+.3f}" for r in group)
                cells.append(f"{curve[1][k + 1]:+.3f} ({curve[2][k + 1]:.3f}) [{per_seed}]")
            rows.append(tuple(cells))
    print(table(rows, ("algorithm", "mean cum FE", "gain, mean (se) [per seed]", "EMA weights' gain")))


def readme_markdown(figures: dict[str, Any]) -> str:
    """The README's head-to-head table ("Choosing an algorithm") from a table command's summary JSON
    (``--json``): per recipe its tier, mean final gain with its 95% t interval, the paired difference
    from flow_grpo's, the runs that learn / stay flat / fall, the runs that reached the target, the
    median FE to it and the FE ratio to flow_grpo; then the design's reading. Generated, so that the
    README follows the committed runs (tests/trainer/test_readme.py)."""
    settings, seeds = figures["settings"], figures["seeds"]
    target = f"+{figures['target_gain']:g}"
    rows = []
    for name, s in sorted(
        figures["algorithms"].items(), key=lambda kv: -statistics.fmean(kv[1]["final_gain"])
    ):
        minus = s.get("final_gain_minus_flow_grpo")
        ratio = s.get("fe_ratio_vs_flow_grpo")
        ratio_cell = "-" if ratio is None else f"{ratio['mean_ratio']:.2f}x"
        if name == "flow_grpo" and any(x is not None for x in s["fe_to_target"]):
            ratio_cell = "1x (the reference)"
        if ratio is not None and ratio["interval_95"] is not None:
            ratio_cell += " ({:.2f}-{:.2f})".format(*ratio["interval_95"])
        v = s["verdicts"]
        reached = sum(x is not None for x in s["fe_to_target"])
        median = s["median_fe_to_target"]
        rows.append(
            f"| `{name}` | {settings[name].get('tier', '-')} | {mean_interval(s['final_gain'])} | "
            f"{'-' if minus is None else mean_interval(minus)} | {v['learns']} / {v['flat']} / {v['falls']} | "
            f"{reached}/{seeds} | {'-' if median is None else f'{median:.0f}'} | {ratio_cell} |"
        )
    lines = [
        f"| recipe | tier | final held-out gain (95% t interval) | minus flow_grpo's, same seeds | runs "
        f"learn / flat / fall | reached {target} | median FE to {target} | FE to {target} vs flow_grpo "
        "(95% bootstrap) |",
        "|---|---|---|---|---|---|---|---|",
        *rows,
    ]
    reading = figures.get("reading")
    if reading is not None:
        interim = " (interim)" if reading["interim"] else ""
        if reading["recommended"] is not None:
            said = f"`{reading['recommended']}` is the recommended default: separated from every other tier-1 recipe"
        else:
            said = (
                f"`{reading['best']}` has the highest mean final gain and is not separated from "
                + ", ".join(f"`{n}`" for n in reading["equals"])
            )
        lines += ["", f"By the design's rule, over {seeds} seeds{interim}: {said}."]
    return "\n".join(lines) + "\n"


SMOOTH_STEPS = 5
"""The plot's per-step panels draw each recipe's mean over seeds as a trailing mean of this many steps."""


def mean_step_curve(group: list[dict[str, Any]], key: str) -> tuple[list[float], list[float]]:
    """A per-step series (``reward`` or ``proxy``), mean over seeds step by step (to the shortest
    run), as a trailing mean of `SMOOTH_STEPS` steps, against the mean cum FE."""
    steps = min(len(r[key]) for r in group)
    fe = [statistics.fmean(r["cum_fe"][i] for r in group) for i in range(steps)]
    mean = [statistics.fmean(r[key][i] for r in group) for i in range(steps)]
    smooth = [statistics.fmean(mean[max(0, i + 1 - SMOOTH_STEPS) : i + 1]) for i in range(steps)]
    return fe, smooth


def plot(runs: dict[str, list[dict[str, Any]]], path: Path) -> None:
    """Three panels against cumulative FE: the held-out gain (each seed thin, the mean over seeds thick
    with +-1 se), the rollouts' proxy and their training reward (each seed thin, the mean over seeds
    smoothed over `SMOOTH_STEPS` steps thick)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(17, 4.8), dpi=100)
    colours = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    seeds = max((len(g) for g in runs.values()), default=0)
    for (name, group), colour in zip(runs.items(), colours):
        for r in group:
            xs = [0.0] + [e["cum_fe"] for e in r["evaluations"]]
            ys = [0.0] + [e["gain"] for e in r["evaluations"]]
            axes[0].plot(xs, ys, color=colour, alpha=0.2, linewidth=0.8)
            axes[1].plot(r["cum_fe"], r["proxy"], color=colour, alpha=0.12, linewidth=0.6)
            axes[2].plot(r["cum_fe"], r["reward"], color=colour, alpha=0.12, linewidth=0.6)
        xs, ys, ses = mean_gain_curve(group)
        label = f"{name} ({len(group)} seed{'s' if len(group) != 1 else ''})"
        axes[0].errorbar(
            xs, ys, yerr=ses, color=colour, marker="o", markersize=4, linewidth=2, capsize=3, label=label
        )
        for ax, key in ((axes[1], "proxy"), (axes[2], "reward")):
            ax.plot(*mean_step_curve(group, key), color=colour, linewidth=2, label=label)
    axes[0].axhline(TARGET_GAIN, color="black", linestyle="--", linewidth=1, label="target")
    axes[0].axhline(0.0, color="grey", linewidth=0.8)
    titles = (
        "gold: held-out scene_exact minus the base (mean ± se; thin: each seed)",
        f"proxy: scene_dense of the rollouts (not trained on; mean of {SMOOTH_STEPS} steps)",
        f"scene_exact of the rollouts (the training reward; mean of {SMOOTH_STEPS} steps)",
    )
    for ax, title in zip(axes, titles):
        ax.set_title(title, fontsize=10)
        ax.set_xlabel("cumulative forward-equivalents")
        ax.grid(alpha=0.3)
    axes[0].legend(loc="best", fontsize=8)
    fig.suptitle(
        f"the tiny pretrained Boogu on scene captions: each learner's mean over seeds (up to {seeds}) and each seed"
    )
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, format="png")
    plt.close(fig)
    print(f"plot written to {path}")


WARN_ONLY = {("config", "rollout", "logprob_diff_warn")}
"""Settings that only decide a warning (with the preflight off, as in every run here): a run file
written before their default changed is the same run."""


def same_settings(saved: Any, now: Any, base: Any = None, path: tuple[str, ...] = ()) -> bool:
    """Whether a run file's settings are these. A config key added since the file was written (absent
    from it) counts as the same when it has the value of the demo's config: the run could not have set
    it, and that value leaves the run as it was (e.g. ``rollout.pipeline: off``). `WARN_ONLY` keys
    are not compared."""
    if path in WARN_ONLY:
        return True
    if base is None:
        base = {"config": config_to_dict(scenes_task_config())}
    if isinstance(saved, dict) and isinstance(now, dict):
        if set(saved) - set(now):
            return False
        for key, value in now.items():
            sub = base.get(key) if isinstance(base, dict) else None
            if (*path, key) in WARN_ONLY:
                continue
            if key not in saved:
                if value != sub:
                    return False
            elif not same_settings(saved[key], value, sub, (*path, key)):
                return False
        return True
    return saved == now


def main(args: argparse.Namespace, extra: dict[str, list[str]], ratio_interval, mean_std) -> None:
    """``algorithms.py --task scenes``: ``args`` are algorithms.py's (seeds, first_seed, out, json,
    quick, results), ``extra`` the ``--set`` overrides by learner."""
    names = list(extra)
    regime = args.regime
    budget = args.budget_fe
    points = args.evaluations
    results = Path(args.results).expanduser()
    results.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    seeds = range(args.first_seed, args.first_seed + args.seeds)
    missing = [
        f"{name}_s{seed}.json"
        for name in names
        for seed in seeds
        if not (results / f"{name}_s{seed}.json").is_file()
    ]
    if getattr(args, "load_only", False) and missing:
        raise SystemExit(
            f"--load-only: {len(missing)} of the {len(names) * len(seeds)} runs asked for are not in "
            f"{results}: {', '.join(missing)}; nothing was trained (ask for the seeds and recipes done, or "
            "drop --load-only to run them)"
        )
    runs: dict[str, list[dict[str, Any]]] = {}
    logged: dict[str, list[dict[str, list[float | None]]]] = {}
    for name in names:
        runs[name] = []
        logged[name] = []
        for seed in seeds:
            settings = {
                "config": config_to_dict(run_config(name, seed, "runs", extra[name], regime)),
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
                        name,
                        seed,
                        tmp,
                        budget,
                        extra[name],
                        results / f"base_s{seed}.json",
                        points,
                        regime,
                        results / f"{name}_s{seed}.checkpoint" if args.keep_checkpoint else None,
                    )
                    # ... but its per-step instruments (clip fraction, KL, grad norm, zero-std share)
                    metrics = Path(tmp) / f"{name}_s{seed}" / "metrics.jsonl"
                    atomic_write_text(results / f"{name}_s{seed}.metrics.jsonl", metrics.read_text())
                atomic_write_text(path, json.dumps({"settings": settings, "run": run}))
            runs[name].append(run)
            metrics = results / f"{name}_s{seed}.metrics.jsonl"
            if metrics.is_file():
                logged[name].append(run_instruments(metrics))
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
    evaluation = run_config(names[0], args.first_seed, "runs", extra[names[0]], regime).eval
    print(
        f"target: held-out scene_exact >= base + {TARGET_GAIN:g} at an evaluation ({evaluation.num_prompts} "
        f"captions, ODE {evaluation.num_steps} steps, CFG 4; at each 1/{points} of the budget of {budget:.0f} FE), "
        f"{args.seeds} seed(s) from {args.first_seed}"
    )
    print_table(summary, args.seeds, ratio_interval, mean_std)
    print_curves(runs)
    recipes = REGIMES[regime].recipes
    pairs = pairwise(summary)
    for name in names:
        summary[name]["instruments"] = mean_instruments(logged[name]) if logged[name] else None
        summary[name]["gradient"] = gradient_figures(recipes[name])
    reading = choice(summary, pairs, [n for n in names if recipes[n].get("tier") == 1])
    print_reading(
        summary,
        pairs,
        {n: s["instruments"] for n, s in summary.items() if s["instruments"] is not None},
        {n: s["gradient"] for n, s in summary.items()},
        reading,
        args.seeds,
    )
    for name in names:
        print(f"  {name}: {' '.join(recipes[name]['overrides'] + list(REGIMES[regime].judge) + extra[name])}")
        print(f"    ({recipes[name]['why']})")
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
            "pairs": pairs,
            "reading": None if reading is None else {**reading, "interim": args.seeds < READ_AT_SEEDS},
            "task_overrides": TASK,
            "regime": regime,
            "settings": {
                n: {**recipes[n], "judge": list(REGIMES[regime].judge), "extra": extra[n]} for n in names
            },
            "runs": runs,
            "total_wall_s": total,
            "environment": environment(),
        },
    )
