"""The learning curves of the scenes task on one plot: every recipe's held-out gain against compute,
with the supervised ceiling drawn on the same axes.

Each ``--runs NAME=DIR`` is a results folder of ``benchmarks/algorithms.py --task scenes``
(``<learner>_s<seed>.json`` and ``base_s<seed>.json``, one learner per folder); each ``--ceiling
PATH`` a run file of ``benchmarks/ceiling.py``. Nothing is run: the files are read, checked and
drawn. The gain at an evaluation is held-out ``scene_exact`` minus the seed's base on the same
captions and seeds, with its paired per-caption standard error, as the run files hold it. A ceiling
is drawn only beside runs judged on the same images: its base must equal, caption for caption, the
base of the runs of its seed (the same captions, evaluation seeds, steps and CFG), else it is an
error that names both files.

    uv run python benchmarks/curves.py --runs nft_stable=benchmarks/results/scenes/curves/nft_b128_t2_lr5e-4 \\
        [--runs NAME=DIR ...] [--ceiling benchmarks/results/ceiling/ceiling_s0_curves.json ...] \\
        [--out curves.png] [--json PATH]

It prints, per recipe and seed, the gain at each evaluation (the compute in thousands of FE) and,
per recipe, the mean over its seeds at each evaluation index with the standard error over seeds.
"""

from __future__ import annotations

import argparse
import json
import math
import re
import statistics
from pathlib import Path
from typing import Any

from _common import table, write_json

RUN_FILE = re.compile(r"^(?P<learner>[a-z_]+)_s(?P<seed>\d+)\.json$")


def load_runs(folder: Path) -> dict[str, Any]:
    """One results folder: its learner and, per seed, the run's evaluations and the base's verdicts."""
    if not folder.is_dir():
        raise SystemExit(f"error: {folder} is not a results folder of benchmarks/algorithms.py --task scenes")
    learners, seeds = set(), {}
    for path in sorted(folder.glob("*_s*.json")):
        match = RUN_FILE.match(path.name)
        if match is None or match["learner"] == "base":
            continue
        seed = int(match["seed"])
        run = json.loads(path.read_text())["run"]
        base_path = folder / f"base_s{seed}.json"
        if not base_path.is_file():
            raise SystemExit(f"error: {path} has no base file {base_path.name} beside it")
        learners.add(match["learner"])
        seeds[seed] = {
            "file": str(path),
            "base": run["base"],
            "base_gold": json.loads(base_path.read_text())["gold"],
            "evaluations": [
                {k: e[k] for k in ("step", "cum_fe", "gain", "se_gain") if k in e} for e in run["evaluations"]
            ],
        }
    if not seeds:
        raise SystemExit(f"error: {folder} holds no run file (<learner>_s<seed>.json)")
    if len(learners) > 1:
        raise SystemExit(
            f"error: {folder} holds runs of several learners {sorted(learners)}; give one per --runs"
        )
    return {"folder": str(folder), "learner": learners.pop(), "seeds": dict(sorted(seeds.items()))}


def load_ceiling(path: Path, recipes: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """A ceiling run file, checked against the runs of its seed: the same base verdicts, caption for
    caption, or the two were not judged on the same images."""
    data = json.loads(path.read_text())
    if data.get("benchmark") != "ceiling":
        raise SystemExit(f"error: {path} is not a run file of benchmarks/ceiling.py")
    seed = int(data["settings"]["seed"])
    judged_with = [r["seeds"][seed]["file"] for r in recipes.values() if seed in r["seeds"]]
    if not judged_with:
        raise SystemExit(f"error: {path} is the ceiling of seed {seed}, and no --runs folder has that seed")
    for recipe in recipes.values():
        run = recipe["seeds"].get(seed)
        if run is not None and run["base_gold"] != data["base_gold"]:
            raise SystemExit(
                f"error: {path} and {run['file']} judge seed {seed}'s base differently "
                f"({data['base']:.4f} against {run['base']:.4f}): not the same held-out images "
                "(benchmarks/ceiling.py --eval-prompts/--eval-steps must match the runs' evaluation)"
            )
    return {
        "file": str(path),
        "seed": seed,
        "base": data["base"],
        "evaluations": [
            {k: e[k] for k in ("step", "cum_fe", "gain", "se_gain")} for e in data["evaluations"]
        ],
    }


def mean_curve(recipe: dict[str, Any]) -> list[dict[str, float]]:
    """The mean over seeds at each evaluation index (as far as every seed has one): mean compute, mean
    gain and the standard error of that mean over seeds (NaN for one seed)."""
    runs = list(recipe["seeds"].values())
    depth = min(len(r["evaluations"]) for r in runs)
    curve = []
    for i in range(depth):
        gains = [r["evaluations"][i]["gain"] for r in runs]
        curve.append(
            {
                "cum_fe": statistics.fmean(r["evaluations"][i]["cum_fe"] for r in runs),
                "gain": statistics.fmean(gains),
                "se_over_seeds": statistics.stdev(gains) / math.sqrt(len(gains))
                if len(gains) > 1
                else math.nan,
                "seeds": len(gains),
            }
        )
    return curve


def report(recipes: dict[str, dict[str, Any]], ceilings: list[dict[str, Any]]) -> None:
    rows = []
    for name, recipe in recipes.items():
        for seed, run in recipe["seeds"].items():
            marks = ", ".join(
                f"{e['cum_fe'] / 1000:.0f}k {e['gain']:+.3f} ({e['se_gain']:.3f})" for e in run["evaluations"]
            )
            rows.append((name, recipe["learner"], str(seed), f"{run['base']:.3f}", marks))
        marks = ", ".join(f"{m['cum_fe'] / 1000:.0f}k {m['gain']:+.3f}" for m in mean_curve(recipe))
        rows.append((name, recipe["learner"], f"mean of {len(recipe['seeds'])}", "", marks))
    for c in ceilings:
        marks = ", ".join(
            f"{e['cum_fe'] / 1000:.0f}k {e['gain']:+.3f} ({e['se_gain']:.3f})" for e in c["evaluations"]
        )
        rows.append(("ceiling (flow matching)", "sft", str(c["seed"]), f"{c['base']:.3f}", marks))
    print(table(rows, ("recipe", "learner", "seed", "base", "gain at each evaluation (se)")))


def plot(recipes: dict[str, dict[str, Any]], ceilings: list[dict[str, Any]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(9, 5.5), dpi=100)
    colours = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    for (name, recipe), colour in zip(recipes.items(), colours * 4):
        for run in recipe["seeds"].values():
            xs = [0.0] + [e["cum_fe"] for e in run["evaluations"]]
            ys = [0.0] + [e["gain"] for e in run["evaluations"]]
            ax.plot(xs, ys, color=colour, alpha=0.3, linewidth=0.8)
        curve = mean_curve(recipe)
        ax.plot(
            [0.0] + [m["cum_fe"] for m in curve],
            [0.0] + [m["gain"] for m in curve],
            color=colour,
            marker="o",
            markersize=4,
            linewidth=2,
            label=f"{name} ({recipe['learner']}, {len(recipe['seeds'])} seed(s))",
        )
    for k, c in enumerate(ceilings):
        ax.errorbar(
            [0.0] + [e["cum_fe"] for e in c["evaluations"]],
            [0.0] + [e["gain"] for e in c["evaluations"]],
            yerr=[0.0] + [e["se_gain"] for e in c["evaluations"]],
            color="black",
            linestyle="--",
            linewidth=1.2,
            capsize=2,
            label="ceiling: flow matching on the prompts' renders" if k == 0 else None,
        )
    ax.axhline(0.0, color="grey", linewidth=0.8)
    ax.set_xlabel("cumulative forward-equivalents")
    ax.set_ylabel("held-out scene_exact minus the base (400 captions)")
    ax.set_title(
        "the tiny pretrained Boogu on scene captions: mean over seeds (thick), each seed (thin)", fontsize=10
    )
    ax.grid(alpha=0.3)
    ax.legend(loc="best", fontsize=8)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, format="png")
    plt.close(fig)
    print(f"plot written to {path}")


def parse_runs(values: list[str]) -> dict[str, Path]:
    runs: dict[str, Path] = {}
    for value in values:
        name, sep, folder = value.partition("=")
        if not sep or not name or not folder:
            raise SystemExit(f"error: --runs expects NAME=DIR, got {value!r}")
        if name in runs:
            raise SystemExit(f"error: --runs names {name!r} twice")
        runs[name] = Path(folder)
    return runs


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--runs", action="append", required=True, help="NAME=DIR, a results folder (repeatable)"
    )
    parser.add_argument("--ceiling", action="append", default=[], help="a ceiling.py run file (repeatable)")
    parser.add_argument("--out", default="/tmp/curves/curves.png", help="the plot (PNG)")
    parser.add_argument("--json", help="also write the curves to this JSON file")
    args = parser.parse_args(argv)
    recipes = {name: load_runs(folder) for name, folder in parse_runs(args.runs).items()}
    ceilings = [load_ceiling(Path(p), recipes) for p in args.ceiling]
    report(recipes, ceilings)
    plot(recipes, ceilings, Path(args.out))
    figures = {
        "benchmark": "curves",
        "recipes": {
            name: {
                "folder": r["folder"],
                "learner": r["learner"],
                "seeds": {
                    s: {k: v for k, v in run.items() if k != "base_gold"} for s, run in r["seeds"].items()
                },
                "mean": mean_curve(r),
            }
            for name, r in recipes.items()
        },
        "ceilings": ceilings,
    }
    write_json(args.json, figures)
    return figures


if __name__ == "__main__":
    main()
