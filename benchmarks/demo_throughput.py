"""Images per second of the CPU demo (``uv run trainer``), with this change's savings off and on.

Times the scenes task's training steps (the demo's when measured: ``Trainer.train`` on
``scenes_task_config()``: 8 captions x 8 images, 64x64, 10 CFG-4 steps, DiffusionNFT with a LoRA)
and its ending, the held-out evaluation
(20 steps, LoRA on and then off, as ``boogu_trainer.demo.heldout_comparison`` runs it), in two sides:

* ``before``: the same code with every saving switched off: each prompt batch encoded on every call
  (``QwenPromptEncoder`` without its cache), the caption embedder and context refiner run at every
  denoising step (``LocalRolloutEngine.cache_text_path=False``), glibc's default ``malloc`` (no
  ``boogu_trainer.host_memory.keep_freed_host_memory``), the reward curve redrawn every step
  (``logging.plot_every=1``, the demo's setting before);
* ``after``: as ``uv run trainer`` runs now.

A step's time is the wall time from the end of the previous step to the end of this one, outputs
included (metrics, reward curve, sample grid and checkpoint at step 10); the first step is a
warm-up and is not timed. Each repetition of a side runs in a fresh process (the ``malloc`` setting
cannot be undone inside one), sides alternating before/after/after/before/... so that load from
other processes on a shared machine falls on both; the ratio is the after side's images/s over the
before side's (mean step times over all its processes). It also prints each side's CPU time per
image (user + system, all threads; page faults are system time), whose ratio moves much less when
other processes take the cores. Both sides must end with bitwise equal LoRA weights, step rewards
and evaluation scores: the script checks that and fails (exit 1) when they differ.

    uv run python benchmarks/demo_throughput.py [--rounds 2] [--steps 10] [--eval-prompts 64]
        [--threads 0] [--quick] [--json out.json]

The default run takes about 8 minutes on 2 free cores (4 processes of ~2 minutes); ``--quick`` (one
round, one timed step of a 2 x 4 batch, 4 evaluation prompts) is the smoke test's size.
"""

from __future__ import annotations

import os

# Before torch loads OpenMP, as the trainer's CLI does (see benchmarks/README.md).
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import argparse
import contextlib
import hashlib
import json
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

SIDES = ("before", "after")
QUICK_OVERRIDES = ["data.prompts_per_step=2", "algorithm.group_size=4"]
"""``--quick``: a 2 x 4 batch instead of the demo's 8 x 8 (a smoke test, not a measurement)."""


class _Stop(Exception):
    pass


# ----------------------------------------------------------------------------------------------
# One side, in its own process


def run_side(side: str, steps: int, eval_prompts: int, threads: int, extra: list[str]) -> dict[str, Any]:
    """Warm-up step + ``steps`` timed demo steps, then the held-out evaluation of ``eval_prompts``."""
    kept = False
    if side == "after":
        from boogu_trainer.host_memory import keep_freed_host_memory

        kept = keep_freed_host_memory()  # first, as the CLI does before the model loads
    import torch

    if threads:
        torch.set_num_threads(threads)
    from _common import environment

    from boogu_adapters.lora import adapters_disabled, lora_state_dict
    from boogu_trainer.config import load_config, scenes_task_config
    from boogu_trainer.metrics import plot_reward_curve
    from boogu_trainer.trainer import Trainer

    with tempfile.TemporaryDirectory(prefix="demo-throughput-") as tmp:
        # matplotlib's import and first draw (~2 s), once per run: out of the timed steps on both sides
        # (the before side draws at step 1, the warm-up; the after side would pay it at step 5).
        plot_reward_curve([{"step": 1, "reward/mean": 0.0}], Path(tmp) / "warm.png", ["reward"])
        overrides = [
            f"logging.run_dir={tmp}",
            "logging.progress=false",
            "preflight=false",  # once per run, before the first step: not a step's cost
            *(["logging.plot_every=1"] if side == "before" else []),
            *extra,
        ]
        config = load_config(None, overrides, base=scenes_task_config())
        t0 = time.perf_counter()
        trainer = Trainer(config)
        build_s = time.perf_counter() - t0
        engine = trainer.local_engine
        if side == "before":
            engine.cache_text_path = False
            engine.encode_prompts.cache = None
        ends: list[float] = []
        cpu_ends: list[float] = []
        records: list[dict[str, Any]] = []
        engine_seconds: list[dict[str, float]] = []

        def progress(step: int, record: dict[str, Any]) -> None:
            ends.append(time.perf_counter())
            cpu_ends.append(_cpu_seconds())
            records.append(record)
            engine_seconds.append(dict(engine.stats.seconds))
            if step == steps + 1:
                raise _Stop

        start, cpu_start = time.perf_counter(), _cpu_seconds()
        with contextlib.suppress(_Stop):
            trainer.train(progress=progress)
        walls = [b - a for a, b in zip([start, *ends], ends)]
        cpus = [b - a for a, b in zip([cpu_start, *cpu_ends], cpu_ends)]
        lora = lora_state_dict(trainer.transformer)
        digest = hashlib.sha256()
        for key in sorted(lora):
            digest.update(key.encode() + lora[key].float().contiguous().numpy().tobytes())
        # The demo's ending: the held-out set sampled with the LoRA on (the last step's evaluation),
        # then off (the base), same prompts and seeds.
        trainer.evaluator.records = trainer.evaluator.records[:eval_prompts]
        t0 = time.perf_counter()
        trained = trainer.evaluator.evaluate(step=trainer.step)
        with adapters_disabled(trainer.transformer):
            base = trainer.evaluator.evaluate(step=0)
        eval_s = time.perf_counter() - t0
        trainer.close()
    timed = slice(1, None)  # step 1 is the warm-up
    split = [_split(r, w, a, b) for r, w, a, b in zip(records, walls, [{}, *engine_seconds], engine_seconds)]
    images = records[0]["samples"]
    return {
        "side": side,
        "environment": environment(),
        "malloc_kept": kept,
        "build_s": build_s,
        "warmup_s": walls[0],
        "step_walls_s": walls[timed],
        "step_cpu_s": cpus[timed],
        "images_per_step": images,
        "images_per_s": images * len(walls[timed]) / sum(walls[timed]),
        "cpu_s_per_image": sum(cpus[timed]) / (images * len(cpus[timed])),
        "split_s": {k: statistics.fmean(s[k] for s in split[timed]) for k in split[0]},
        "eval_s": eval_s,
        "eval_images": 2 * len(trained.prompts),
        "eval_images_per_s": 2 * len(trained.prompts) / eval_s,
        "peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,  # KiB on Linux
        "results": {
            "lora_sha256": digest.hexdigest(),
            "rewards": [float(r["reward/mean"]) for r in records],
            "eval_trained": [float(p["gold"]) for p in trained.prompts],
            "eval_base": [float(p["gold"]) for p in base.prompts],
        },
    }


def _cpu_seconds() -> float:
    """CPU time of this process, all threads, user + system (page faults are system time)."""
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def _split(record: dict[str, Any], wall: float, before: dict[str, float], after: dict[str, float]) -> dict:
    """Where one step's wall time went: the trainer's phase timers and the engine's own clocks."""

    def engine(key: str) -> float:
        return after.get(key, 0.0) - before.get(key, 0.0)

    encode, transformer, decode = engine("encode"), engine("transformer"), engine("decode")
    return {
        "prompt encoding": encode,
        "rollout transformer": transformer,
        "VAE decode": decode,
        "reward + rollout rest": record["time/rollout"] - encode - transformer - decode,
        "update": record["time/train"],
        "weight sync": record["time/sync"],
        "outputs (metrics, plot, grid, checkpoint)": wall - record["time/step"],
        "step": wall,
    }


# ----------------------------------------------------------------------------------------------
# The comparison


def order(rounds: int) -> list[str]:
    """before, after, after, before, before, after, ...: each side as often first as second."""
    pairs = [SIDES if r % 2 == 0 else SIDES[::-1] for r in range(rounds)]
    return [side for pair in pairs for side in pair]


def child(side: str, args: argparse.Namespace, out: Path) -> dict[str, Any]:
    command = [
        sys.executable,
        str(Path(__file__).resolve()),
        "--side",
        side,
        "--steps",
        str(args.steps),
        "--eval-prompts",
        str(args.eval_prompts),
        "--threads",
        str(args.threads),
        "--child-json",
        str(out),
    ]
    if args.quick:
        command.append("--quick")
    subprocess.run(command, check=True, cwd=Path(__file__).resolve().parent)
    return json.loads(out.read_text())


def summarise(runs: list[dict[str, Any]]) -> dict[str, Any]:
    by_side = {side: [r for r in runs if r["side"] == side] for side in SIDES}
    sides = {}
    for side, rs in by_side.items():
        walls = [w for r in rs for w in r["step_walls_s"]]
        cpu = [c for r in rs for c in r["step_cpu_s"]]
        sides[side] = {
            "step_s": statistics.fmean(walls),
            "step_s_per_run": [statistics.fmean(r["step_walls_s"]) for r in rs],
            "images_per_s": rs[0]["images_per_step"] / statistics.fmean(walls),
            "cpu_s_per_image": statistics.fmean(cpu) / rs[0]["images_per_step"],
            "eval_images_per_s": sum(r["eval_images"] for r in rs) / sum(r["eval_s"] for r in rs),
            "split_s": {k: statistics.fmean(r["split_s"][k] for r in rs) for k in rs[0]["split_s"]},
            "warmup_s": statistics.fmean(r["warmup_s"] for r in rs),
            "peak_rss_mb": max(r["peak_rss_mb"] for r in rs),
        }
    results = [json.dumps(r["results"], sort_keys=True) for r in runs]
    return {
        "sides": sides,
        "ratio": sides["after"]["images_per_s"] / sides["before"]["images_per_s"],
        "cpu_ratio": sides["before"]["cpu_s_per_image"] / sides["after"]["cpu_s_per_image"],
        "eval_ratio": sides["after"]["eval_images_per_s"] / sides["before"]["eval_images_per_s"],
        "results_bitwise_equal": len(set(results)) == 1,
        "lora_sha256": runs[0]["results"]["lora_sha256"],
    }


def print_summary(summary: dict[str, Any], runs: list[dict[str, Any]], args: argparse.Namespace) -> None:
    from _common import table

    before, after = summary["sides"]["before"], summary["sides"]["after"]
    env = runs[0]["environment"]
    print(
        f"== demo throughput: {runs[0]['images_per_step']} images/step, {args.steps} timed step(s) per run, "
        f"{len(runs) // 2} run(s) per side, {env['threads']} torch thread(s), {env['cpus']} CPUs, "
        f"load average at the first start {env['load_avg_1min']:.2f} =="
    )
    rows = [
        (
            f"{r['side']} (run {i + 1})",
            " ".join(f"{w:.1f}" for w in r["step_walls_s"]),
            f"{r['images_per_s']:.2f}",
            f"{r['cpu_s_per_image']:.3f}",
            f"{r['eval_images_per_s']:.2f}",
            f"{r['environment']['load_avg_1min']:.2f}",
        )
        for i, r in enumerate(runs)
    ]
    header = ("process", "step walls (s)", "images/s", "CPU s/image", "eval images/s", "load at start")
    print(table(rows, header))
    keys = list(before["split_s"])
    print(
        table(
            [(k, f"{before['split_s'][k]:.3f}", f"{after['split_s'][k]:.3f}") for k in keys],
            ("mean per timed step (s)", "before", "after"),
        )
    )
    print(
        f"training: before {before['step_s']:.2f} s/step ({before['images_per_s']:.2f} images/s), after "
        f"{after['step_s']:.2f} s/step ({after['images_per_s']:.2f} images/s): ratio {summary['ratio']:.2f}x"
    )
    print(
        f"training CPU time (all threads, user + system): before {before['cpu_s_per_image']:.3f} s/image, "
        f"after {after['cpu_s_per_image']:.3f} s/image: ratio {summary['cpu_ratio']:.2f}x (less sensitive "
        "to other processes' load than the wall time)"
    )
    print(
        f"evaluation (LoRA on + off): before {before['eval_images_per_s']:.2f} images/s, after "
        f"{after['eval_images_per_s']:.2f} images/s: ratio {summary['eval_ratio']:.2f}x"
    )
    print(
        f"peak resident memory: before {before['peak_rss_mb']:.0f} MiB, after {after['peak_rss_mb']:.0f} MiB"
    )
    print(
        "results (LoRA weights, step rewards, evaluation scores) bitwise equal on both sides: "
        + ("yes" if summary["results_bitwise_equal"] else "NO")
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--rounds", type=int, default=2, help="before/after process pairs (alternating order)"
    )
    parser.add_argument(
        "--steps", type=int, default=10, help="timed training steps per process, after 1 warm-up"
    )
    parser.add_argument(
        "--eval-prompts", type=int, default=64, help="held-out prompts evaluated (LoRA on and off)"
    )
    parser.add_argument("--threads", type=int, default=0, help="torch CPU threads (0: torch's default)")
    parser.add_argument(
        "--quick", action="store_true", help="1 round, 1 step of a 2 x 4 batch, 4 prompts (smoke test)"
    )
    parser.add_argument("--json", help="also write the figures to this JSON file")
    parser.add_argument("--side", choices=SIDES, help=argparse.SUPPRESS)  # internal: run one side
    parser.add_argument("--child-json", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.quick:
        args.rounds, args.steps, args.eval_prompts = 1, 1, 4
    if args.rounds < 1 or args.steps < 1 or args.eval_prompts < 1:
        parser.error("--rounds, --steps and --eval-prompts must be >= 1")
    if args.side is not None:
        extra = QUICK_OVERRIDES if args.quick else []
        figures = run_side(args.side, args.steps, args.eval_prompts, args.threads, extra)
        Path(args.child_json).write_text(json.dumps(figures))
        return

    runs = []
    with tempfile.TemporaryDirectory(prefix="demo-throughput-") as tmp:
        for i, side in enumerate(order(args.rounds)):
            print(f"[{i + 1}/{2 * args.rounds}] {side} ...", flush=True)
            runs.append(child(side, args, Path(tmp) / f"{i}.json"))
    summary = summarise(runs)
    print_summary(summary, runs, args)
    from _common import write_json

    write_json(
        args.json,
        {
            "settings": {k: v for k, v in vars(args).items() if k not in ("side", "child_json", "json")},
            **summary,
            "runs": runs,
        },
    )
    if not summary["results_bitwise_equal"]:
        sys.exit("the two sides' results differ: a saving changed a number")


if __name__ == "__main__":
    main()
