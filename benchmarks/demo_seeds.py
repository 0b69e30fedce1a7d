"""The demo over many seeds: `uv run trainer seed=S` for each seed, and its held-out verdicts as a table.

Each seed is the demo exactly as a user runs it (the `trainer` command without a recipe, so
`scenes_demo_config()`, with ``seed=S`` and the given ``--set`` overrides; or ``--recipe``, a
candidate demo such as ``examples/tiny_scenes/scenes_nft_stable.yaml``, or the Edit demo's
``examples/tiny_scenes/edit_demo.yaml``), launched as its own process into ``--work``/seed_S with
``resume=auto`` (a killed sweep goes on where it stopped: a seed whose run has a checkpoint resumes
bitwise, one without starts again). When a seed's run ends, its
``heldout.json`` (the held-out comparison: base and trained on the same captions and seeds, the
paired standard error), ``metrics.jsonl`` and ``config.yaml`` are copied to ``--results``/seed_S/,
the files committed; a seed with those files is not run again, so the same command loads a finished
sweep and prints its table.

The table: per seed the base, the trained score, their paired difference and its standard error,
and whether the difference is above twice it (the demo's own verdict); then the number of such
seeds, the mean difference over seeds with a 95% t interval, and the training time. The README's
demo section states these figures. ``--against DIR`` (another recipe's sweep on the same seeds)
adds the paired advantage: per seed this sweep's trained score minus the other's, its mean and
standard error over seeds.

    uv run python benchmarks/demo_seeds.py --seeds 300-309 [--jobs 2] [--threads 1]
        [--recipe examples/tiny_scenes/scenes_nft_stable.yaml] [--set KEY=VALUE ...]
        [--against DIR] [--results DIR] [--work DIR] [--no-run] [--json PATH]

``--jobs`` runs that many seeds at once, each with ``--threads`` torch threads (``OMP_NUM_THREADS``;
the figures of a seed depend on its thread count, which the table's files record). Runs' own
folders (images, checkpoints) stay under ``--work`` (default ``runs/demo_seeds``, not committed).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import statistics
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _common import table, write_json_atomic
from algorithms_scenes import mean_interval

from boogu_trainer.demo import paired_summary

KEPT = ("heldout.json", "metrics.jsonl", "config.yaml")
"""A finished seed's files copied into the results folder."""


def parse_seeds(text: str) -> list[int]:
    """``"300-309"`` or ``"0,3,7"`` (or both, comma-separated) -> the seeds, in order, once each."""
    seeds: list[int] = []
    for part in text.split(","):
        part = part.strip()
        first, sep, last = part.partition("-")
        try:
            span = range(int(first), int(last) + 1) if sep else [int(part)]
        except ValueError:
            raise ValueError(f"--seeds: {part!r} is not a seed or a range like 300-309") from None
        if sep and int(last) < int(first):
            raise ValueError(f"--seeds: the range {part!r} is empty")
        seeds += [s for s in span if s not in seeds]
    return seeds


PER_SEED = ("seed=", "logging.run_dir=", "logging.name=", "logging.progress=", "resume=")
"""The arguments `command` sets per seed and folder: not part of a sweep's settings (and refused in
``--set``)."""

REPO = Path(__file__).resolve().parents[1]


def portable(text: str) -> str:
    """``text`` with this checkout's absolute path written relative to it (a results file is
    committed: it must not name a path of the machine that ran it)."""
    return text.replace(f"{REPO}/", "")


def recipe_key(recipe: str | None) -> str | None:
    """How a recipe is named in a sweep's settings: its path relative to the repository when inside
    it (so ``./examples/x.yaml`` and its absolute path are the same recipe), else absolute."""
    if recipe is None:
        return None
    path = Path(recipe).resolve()
    return str(path.relative_to(REPO)) if path.is_relative_to(REPO) else str(path)


def settings_of(argv: Sequence[str], threads: int) -> dict[str, Any]:
    """The recipe, the overrides and the thread count of a `trainer` command line as `command` builds
    it (without the program): what every seed of one table shares (a seed's figures depend on each)."""
    recipe = argv[0] if argv and "=" not in argv[0] else None
    overrides = [a for a in argv if "=" in a and not a.startswith(PER_SEED)]
    return {"recipe": recipe_key(recipe), "overrides": overrides, "threads": threads}


def sweep_settings(args: argparse.Namespace) -> dict[str, Any]:
    return settings_of(command(0, args.work, args.set, args.recipe)[1:], args.threads)


def finished(results: Path, seed: int, settings: dict[str, Any] | None = None) -> dict[str, Any] | None:
    """A seed's held-out verdict from the results folder, or None when it has not been run. With
    ``settings``, a seed run with other settings is refused (a table holds one recipe)."""
    folder = results / f"seed_{seed}"
    if not all((folder / name).is_file() for name in (*KEPT, "run.json")):
        return None
    if settings is not None:
        record = json.loads((folder / "run.json").read_text())
        theirs = settings_of(record["command"], record["threads"])
        if theirs != settings:
            raise SystemExit(
                f"{folder / 'run.json'} was written with other settings ({theirs}) than this command's "
                f"({settings}): pass another --results, or the same --recipe, --set and --threads"
            )
    return json.loads((folder / "heldout.json").read_text())


def command(seed: int, work: Path, overrides: Sequence[str], recipe: str | None = None) -> list[str]:
    """The `trainer` command line of one seed: the demo (no recipe) or ``recipe``, resumable into its
    own folder."""
    trainer = Path(sys.executable).with_name("trainer")
    return [
        str(trainer),
        *([str(Path(recipe).resolve())] if recipe else []),
        f"seed={seed}",
        f"logging.run_dir={work}",
        f"logging.name=seed_{seed}",
        "logging.progress=false",
        "resume=auto",
        *overrides,
    ]


def launch(seed: int, args: argparse.Namespace) -> subprocess.Popen:
    """Start (or resume) one seed's run. Its folder under ``--work`` records the settings it was
    started with: a folder of another sweep's settings is refused, not resumed into (``resume=auto``
    would continue it, and keys a resume may change, such as ``total_steps``, would pass silently)."""
    run = args.work / f"seed_{seed}"
    stamp = args.work / f"seed_{seed}.settings.json"
    resumed = run.exists() and any((run / "checkpoints").glob("step_*"))
    if resumed:
        theirs = json.loads(stamp.read_text()) if stamp.is_file() else None
        if theirs != sweep_settings(args):
            raise SystemExit(
                f"{run} holds a run of other settings ({theirs or 'not recorded'}) than this command's "
                f"({sweep_settings(args)}): pass another --work, or delete that folder"
            )
    elif run.exists():
        shutil.rmtree(run)  # killed before its first checkpoint: nothing to resume from
    args.work.mkdir(parents=True, exist_ok=True)
    stamp.write_text(json.dumps(sweep_settings(args)) + "\n")
    log = open(args.work / f"seed_{seed}.log", "a")  # noqa: SIM115 (closed with the process below)
    env = {**os.environ, "OMP_NUM_THREADS": str(args.threads), "OMP_WAIT_POLICY": "PASSIVE"}
    argv = command(seed, args.work, args.set, args.recipe)
    print(
        f"seed {seed}: {'resumed' if resumed else 'started'} ({' '.join(argv)}; log {log.name})", flush=True
    )
    process = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, env=env)
    process.log = log  # type: ignore[attr-defined]
    process.started = time.perf_counter()  # type: ignore[attr-defined]
    process.resumed = resumed  # type: ignore[attr-defined]
    return process


def record_launch(seed: int, args: argparse.Namespace, process: subprocess.Popen) -> list[dict[str, Any]]:
    """Append this launch (its wall time, whether it resumed, its exit code) to the seed's launches
    under ``--work``; all of them so far."""
    path = args.work / f"seed_{seed}.launches.json"
    launches = json.loads(path.read_text()) if path.is_file() else []
    launches.append(
        {
            "wall_s": time.perf_counter() - process.started,  # type: ignore[attr-defined]
            "resumed": process.resumed,  # type: ignore[attr-defined]
            "returncode": process.returncode,
        }
    )
    path.write_text(json.dumps(launches, indent=2) + "\n")
    return launches


def collect(seed: int, args: argparse.Namespace, launches: list[dict[str, Any]]) -> None:
    """Copy a finished run's files into the results folder (each file whole, the folder last), with
    ``run.json``: the command, the thread count, and the launches it took (a seed launched once,
    not resumed, is the one whose ``wall_s`` is a whole run's time)."""
    run = args.work / f"seed_{seed}"
    missing = [name for name in KEPT if not (run / name).is_file()]
    if missing:
        raise RuntimeError(f"the run in {run} ended without {', '.join(missing)}")
    staging = args.results / f".seed_{seed}.partial"
    shutil.rmtree(staging, ignore_errors=True)
    staging.mkdir(parents=True)
    for name in KEPT:  # committed files: paths inside the repository written relative to it
        (staging / name).write_text(portable((run / name).read_text()))
    record = {
        "command": [portable(a) for a in command(seed, args.work, args.set, args.recipe)[1:]],
        "threads": args.threads,
        "jobs": args.jobs,
        "wall_s": sum(launch["wall_s"] for launch in launches),
        "launches": launches,
    }
    (staging / "run.json").write_text(json.dumps(record, indent=2) + "\n")
    staging.replace(args.results / f"seed_{seed}")


def run_missing(seeds: list[int], args: argparse.Namespace) -> None:
    todo = [s for s in seeds if finished(args.results, s, sweep_settings(args)) is None]
    running: dict[int, subprocess.Popen] = {}
    failed: list[int] = []
    try:
        while todo or running:
            while todo and len(running) < args.jobs:
                seed = todo.pop(0)
                running[seed] = launch(seed, args)
            time.sleep(2)
            for seed, process in list(running.items()):
                if process.poll() is None:
                    continue
                process.log.close()  # type: ignore[attr-defined]
                del running[seed]
                launches = record_launch(seed, args, process)
                log = args.work / f"seed_{seed}.log"
                if process.returncode != 0:
                    print(f"seed {seed}: trainer exited {process.returncode}; see {log}", flush=True)
                    failed.append(seed)
                    continue
                try:
                    collect(seed, args, launches)
                except RuntimeError as error:
                    print(f"seed {seed}: {error}; see {log}", flush=True)
                    failed.append(seed)
                    continue
                verdict = finished(args.results, seed)
                assert verdict is not None
                print(
                    f"seed {seed}: done, base {verdict['base']:.3f} -> trained {verdict['trained']:.3f}",
                    flush=True,
                )
    finally:
        for process in running.values():  # interrupted: no run outlives the sweep that started it
            process.terminate()
            process.wait()
            process.log.close()  # type: ignore[attr-defined]
    if failed:
        raise SystemExit(f"seeds {failed} failed; rerun the same command to retry them")


def summarise(seeds: list[int], results: Path, settings: dict[str, Any] | None) -> dict[str, Any]:
    rows = []
    for seed in seeds:
        verdict = finished(results, seed, settings)
        if verdict is None:
            continue
        metrics = [
            json.loads(line)
            for line in (results / f"seed_{seed}" / "metrics.jsonl").read_text().splitlines()
            if line
        ]
        rows.append(
            {
                "seed": seed,
                "prompts": verdict["prompts"],
                "base": verdict["base"],
                "trained": verdict["trained"],
                "diff": verdict["diff"],
                "se_diff": verdict["se_diff"],
                "above_2se": verdict["diff"] > 2 * verdict["se_diff"],
                "below_2se": verdict["diff"] < -2 * verdict["se_diff"],
                "steps": len(metrics),
                "cum_fe": metrics[-1].get("cum/fe") if metrics else None,
                "train_time_s": metrics[-1].get("cum/time_s") if metrics else None,
                "run": json.loads((results / f"seed_{seed}" / "run.json").read_text()),
            }
        )
    diffs = [r["diff"] for r in rows]
    return {
        "benchmark": "demo_seeds",
        "seeds": [r["seed"] for r in rows],
        "missing": [s for s in seeds if s not in {r["seed"] for r in rows}],
        "rows": rows,
        "above_2se": sum(r["above_2se"] for r in rows),
        "below_2se": sum(r["below_2se"] for r in rows),
        "mean_diff": statistics.fmean(diffs) if diffs else None,
        "se_mean_diff": statistics.stdev(diffs) / math.sqrt(len(diffs)) if len(diffs) > 1 else None,
        "mean_interval": mean_interval(diffs),
    }


def print_summary(summary: dict[str, Any]) -> None:
    rows = [
        (
            str(r["seed"]),
            f"{r['base']:.3f}",
            f"{r['trained']:.3f}",
            f"{r['diff']:+.3f}",
            f"{r['se_diff']:.3f}",
            "yes" if r["above_2se"] else ("LOSS" if r["below_2se"] else "no"),
            f"{r['train_time_s']:.0f}" if r["train_time_s"] is not None else "-",
        )
        for r in summary["rows"]
    ]
    print(table(rows, ("seed", "base", "trained", "difference", "se", "> 2 se", "training s")))
    n = len(summary["rows"])
    if n:
        prompts = {r["prompts"] for r in summary["rows"]}
        print(
            f"{summary['above_2se']} of {n} seeds gain by more than twice their standard error, "
            f"{summary['below_2se']} lose by more; mean difference over seeds {summary['mean_interval']} "
            f"(95% t interval), held-out prompts per seed {', '.join(map(str, sorted(prompts)))}"
        )
    if summary["missing"]:
        print(f"not run yet: seeds {summary['missing']}")


def compare(summary: dict[str, Any], other: dict[str, Any]) -> dict[str, Any]:
    """Seed by seed, this sweep's trained score minus ``other``'s (another recipe's sweep on the same
    seeds: the same held-out captions, evaluation seeds and base, so the difference pairs the two
    trained models on the same images), with its mean over seeds, the standard error over seeds
    (`boogu_trainer.demo.paired_summary` over seeds) and a 95% t interval. A seed whose two bases
    differ was evaluated differently: refused."""
    theirs = {r["seed"]: r for r in other["rows"]}
    pairs = []
    for row in summary["rows"]:
        them = theirs.get(row["seed"])
        if them is None:
            continue
        if them["base"] != row["base"] or them["prompts"] != row["prompts"]:
            raise SystemExit(
                f"seed {row['seed']}: the two sweeps' bases differ ({row['base']} on {row['prompts']} prompts vs "
                f"{them['base']} on {them['prompts']}): not the same evaluation, so not a paired comparison"
            )
        pairs.append({"seed": row["seed"], "advantage": row["trained"] - them["trained"]})
    values = [p["advantage"] for p in pairs]
    paired = (
        paired_summary(
            [theirs[p["seed"]]["trained"] for p in pairs],
            [row["trained"] for row in summary["rows"] if row["seed"] in theirs],
        )
        if pairs
        else None
    )
    return {
        "pairs": pairs,
        "mean": paired["diff"] if paired else None,
        "se": paired["se_diff"] if paired and len(pairs) > 1 else None,
        "mean_interval": mean_interval(values),
    }


def print_comparison(comparison: dict[str, Any], against: Path) -> None:
    pairs = comparison["pairs"]
    print(f"against {against} (trained minus its trained score, same seed):")
    print(table([(str(p["seed"]), f"{p['advantage']:+.3f}") for p in pairs], ("seed", "advantage")))
    if comparison["se"] is not None:
        ratio = f"{comparison['mean'] / comparison['se']:+.1f} se" if comparison["se"] > 0 else "no spread"
        print(
            f"mean advantage {comparison['mean_interval']} (95% t interval), se over {len(pairs)} seeds "
            f"{comparison['se']:.3f}: {ratio}"
        )


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--recipe",
        help="run this recipe instead of the demo (its held-out comparison on built-in scene captions or edit instructions)",
    )
    parser.add_argument(
        "--seeds", default="300-309", help="seeds, e.g. 300-309 or 0,3,7 (default %(default)s)"
    )
    parser.add_argument("--jobs", type=int, default=1, help="seeds run at once (default %(default)s)")
    parser.add_argument("--threads", type=int, default=2, help="torch threads per run (default %(default)s)")
    parser.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="a config override for every seed (repeatable)",
    )
    parser.add_argument(
        "--results",
        type=Path,
        default=Path(__file__).resolve().parent / "results" / "demo_seeds",
        help="where each finished seed's files go (default %(default)s)",
    )
    parser.add_argument(
        "--work",
        type=Path,
        default=Path("runs") / "demo_seeds",
        help="the runs' own folders (default %(default)s)",
    )
    parser.add_argument(
        "--against",
        type=Path,
        help="another sweep's results folder (the same seeds, another recipe): print the paired advantage",
    )
    parser.add_argument(
        "--no-run", action="store_true", help="only load the finished seeds and print their table"
    )
    parser.add_argument(
        "--json", help="also write the table to this JSON file (default: RESULTS/summary.json)"
    )
    args = parser.parse_args(argv)
    try:
        args.seeds = parse_seeds(args.seeds)
    except ValueError as error:
        parser.error(str(error))
    if args.jobs < 1 or args.threads < 1:
        parser.error("--jobs and --threads must be >= 1")
    for item in args.set:
        if "=" not in item:
            parser.error(f"--set {item!r}: expected KEY=VALUE")
        if item.startswith(PER_SEED):
            parser.error(f"--set {item!r}: the sweep sets {item.partition('=')[0]} for each seed itself")
    if args.recipe is not None and not Path(args.recipe).is_file():
        parser.error(f"--recipe {args.recipe}: no such file")
    args.work = args.work.resolve()
    return args


def main(argv: Sequence[str] | None = None) -> None:
    args = parse_args(argv)
    if not args.no_run:
        run_missing(args.seeds, args)
    summary = summarise(args.seeds, args.results, sweep_settings(args))
    summary["settings"] = sweep_settings(args)
    print_summary(summary)
    if args.against is not None:  # its seeds' own files, whatever its summary.json last covered
        other = summarise(args.seeds, args.against, settings=None)
        summary["against"] = {"results": str(args.against), **compare(summary, other)}
        print_comparison(summary["against"], args.against)
    if summary["rows"]:
        write_json_atomic(str(args.json or args.results / "summary.json"), summary)


if __name__ == "__main__":
    main()
