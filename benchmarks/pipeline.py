"""Sync vs pipelined steps (``rollout.pipeline=off`` vs ``one_step``) with the rollout worker, and a
model of the GPU speedup for the reference recipe.

    uv run python benchmarks/pipeline.py [--steps 30] [--seeds 3] [--first-seed 0] [--json F]
        [--trainer-gpus 4] [--rollout-gpus 4] [--train-mfu 0.35] [--rollout-mfu 0.40] [--sync-s 1.0]
        [--quick]

**Measured (CPU).** For each seed, the demo run (``trainer`` with no arguments: the tiny pretrained
Boogu on the scene captions, DiffusionNFT on ``scene_exact``) with ``rollout.engine=vllm_omni`` (a
worker launched from the rollout environment, ``packages/boogu-vllm``, direct backend), once with
``rollout.pipeline=off`` and once with ``one_step``, in this one process, one after the other. The
trainer and its worker get one thread each (``OMP_NUM_THREADS=1``), so on a 2-core machine each has a
core of its own in both modes; held-out evaluation is off. Reported per mode: the mean ``time/step``
over all the steps (a pipelined run's first step waits for two rollouts and its last has none to
wait for: only whole runs compare), images/s, the overlap and each side's idle time, and the demo
reward (the mean of ``reward/mean`` over the last quarter of the steps). ``step_time_ratio`` is
pipelined / sync over all seeds; the reward difference is pipelined - sync with its standard error
over seeds.

**Modelled (GPU).** One step of the reference recipe (examples/flowgrpo_trainer/boogu_image/
boogu_image_ocr_lora.yaml: 32 prompts x 16 images at 1024², 10 steps with CFG, a 2-step window)
costs ``R`` rollout and ``T`` training FLOPs per image (``flops.per_image_flops``). With ``N`` trainer
and ``M`` rollout GPUs of peak ``P`` at the stated MFUs, ``t_r = B R / (M P mfu_r)``,
``t_t = B T / (N P mfu_t)``; sync steps take ``t_r + t_t + t_sync``, pipelined ones
``max(t_r, t_t) + t_sync``; for reference, the same N + M GPUs colocated (every GPU rolls out, then
trains) take ``B (R / mfu_r + T / mfu_t) / ((N + M) P)``. The assumptions are printed with the result.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

os.environ["OMP_NUM_THREADS"] = "1"  # the trainer and the worker it launches: one core each
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import torch
from flops import per_image_flops

from boogu_trainer.config import load_config, scenes_task_config
from boogu_trainer.trainer import Trainer

MODES = ("off", "one_step")


# --quick (the CI smoke): the same runs on a batch of 2 prompts x 4 images and 4 denoising steps, so
# that the two worker launches, not the rollouts, are most of its time.
QUICK = ["data.prompts_per_step=2", "algorithm.group_size=4", "sampler.num_steps=4"]


def run_config(mode: str, seed: int, steps: int, run_dir: str, quick: bool = False):
    """The demo's config with the worker engine and the given pipeline mode."""
    overrides = [
        "rollout.engine=vllm_omni",
        "rollout.vllm.backend=direct",
        f"rollout.pipeline={mode}",
        f"total_steps={steps}",
        f"seed={seed}",
        "eval.every=0",
        "eval.rewards=[]",
        "checkpoint.save_every=0",
        "preflight=false",
        "logging.progress=false",
        "logging.sample_every=0",
        "logging.plot_every=0",
        f"logging.run_dir={run_dir}",
        f"logging.name={mode}_s{seed}",
        *(QUICK if quick else []),
    ]
    return load_config(None, overrides, base=scenes_task_config())


def measure(mode: str, seed: int, steps: int, run_dir: str, quick: bool = False) -> dict[str, Any]:
    trainer = Trainer(run_config(mode, seed, steps, run_dir, quick))
    t0 = time.perf_counter()
    try:
        history = trainer.train()
    finally:
        trainer.close()
    wall = time.perf_counter() - t0
    quarter = history[-max(1, len(history) // 4) :]

    def mean(key: str, rows=history) -> float:
        return sum(float(h.get(key, 0.0)) for h in rows) / len(rows)

    pipelined = mode == "one_step"
    timing = ("time/step", "time/rollout", "time/rollout_wait", "time/train", "time/sync", "time/overlap")
    return {
        "mode": mode,
        "seed": seed,
        "steps": len(history),
        "wall_s": wall,
        "step_s": mean("time/step"),
        "images_per_s": sum(h["samples"] for h in history) / sum(h["time/step"] for h in history),
        "train_s": mean("time/train"),
        "overlap_s": mean("time/overlap"),
        # Sync: the trainer idles while the worker rolls out, the worker while the trainer updates.
        "trainer_idle_s": mean("time/trainer_idle") if pipelined else mean("time/rollout"),
        "worker_idle_s": mean("time/worker_idle") if pipelined else mean("time/step") - mean("time/rollout"),
        "reward_last_quarter": mean("reward/mean", quarter),
        "reward": [float(h["reward/mean"]) for h in history],
        "per_step": [{k: float(h[k]) for k in timing if k in h} for h in history],
    }


def gpu_model(args: argparse.Namespace) -> dict[str, Any]:
    rollout, train = per_image_flops()  # the reference recipe
    images = 32 * 16
    peak = args.peak_tflops * 1e12
    t_r = images * rollout / (args.rollout_gpus * peak * args.rollout_mfu)
    t_t = images * train / (args.trainer_gpus * peak * args.train_mfu)
    sync = t_r + t_t + args.sync_s
    pipelined = max(t_r, t_t) + args.sync_s
    colocated = (
        images
        * (rollout / args.rollout_mfu + train / args.train_mfu)
        / ((args.trainer_gpus + args.rollout_gpus) * peak)
        + args.sync_s
    )
    return {
        "assumptions": {
            "recipe": "boogu_image_ocr_lora.yaml: 32 x 16 images at 1024², 10 steps CFG 4, window 2, LoRA r64",
            "rollout_tflops_per_image": rollout / 1e12,
            "train_tflops_per_image": train / 1e12,
            "images_per_step": images,
            "trainer_gpus": args.trainer_gpus,
            "rollout_gpus": args.rollout_gpus,
            "peak_tflops": args.peak_tflops,
            "train_mfu": args.train_mfu,
            "rollout_mfu": args.rollout_mfu,
            "sync_s": args.sync_s,
        },
        "rollout_s": t_r,
        "train_s": t_t,
        "sync_step_s": sync,
        "pipelined_step_s": pipelined,
        "colocated_step_s": colocated,
        "speedup_pipelined_over_sync": sync / pipelined,
        "speedup_pipelined_over_colocated": colocated / pipelined,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--steps", type=int, default=30, help="steps per run (the demo's 30)")
    parser.add_argument("--seeds", type=int, default=3)
    parser.add_argument("--first-seed", type=int, default=0)
    parser.add_argument("--trainer-gpus", type=int, default=4)
    parser.add_argument("--rollout-gpus", type=int, default=4)
    parser.add_argument("--train-mfu", type=float, default=0.35, help="stated: the trainer's MFU")
    parser.add_argument("--rollout-mfu", type=float, default=0.40, help="stated: the rollout worker's MFU")
    parser.add_argument("--sync-s", type=float, default=1.0, help="stated: seconds per weight sync")
    parser.add_argument("--peak-tflops", type=float, default=989.4, help="per GPU (H200 dense bf16)")
    parser.add_argument("--json", help="write the figures to this JSON file")
    parser.add_argument(
        "--quick", action="store_true", help="smoke run: 3 steps, 1 seed, 2 x 4 images, 4 denoising steps"
    )
    args = parser.parse_args(argv)
    if args.quick:
        args.steps, args.seeds = 3, 1
    os.environ["OMP_NUM_THREADS"] = "1"  # the trainer and the workers it launches: one core each
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
    torch.set_num_threads(1)

    runs: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory() as tmp:
        for seed in range(args.first_seed, args.first_seed + args.seeds):
            for mode in MODES:
                run = measure(mode, seed, args.steps, tmp, args.quick)
                runs.append(run)
                print(
                    f"seed {seed} pipeline={mode:8s}: {run['step_s']:.2f} s/step, {run['images_per_s']:.2f} images/s, "
                    f"overlap {run['overlap_s']:.2f} s, trainer idle {run['trainer_idle_s']:.2f} s, worker idle "
                    f"{run['worker_idle_s']:.2f} s; reward (last quarter) {run['reward_last_quarter']:.3f}",
                    flush=True,
                )
    by_mode = {m: [r for r in runs if r["mode"] == m] for m in MODES}
    step = {m: sum(r["step_s"] for r in rs) / len(rs) for m, rs in by_mode.items()}
    ratio = step["one_step"] / step["off"]
    diffs = [
        p["reward_last_quarter"] - s["reward_last_quarter"]
        for s, p in zip(by_mode["off"], by_mode["one_step"])
    ]
    mean_diff = sum(diffs) / len(diffs)
    se = (
        math.sqrt(sum((d - mean_diff) ** 2 for d in diffs) / (len(diffs) - 1) / len(diffs))
        if len(diffs) > 1
        else math.nan
    )
    model = gpu_model(args)
    print(
        f"\nCPU, {args.seeds} seed(s) x {args.steps} steps: step time sync {step['off']:.2f} s, pipelined "
        f"{step['one_step']:.2f} s, step_time_ratio (pipelined / sync) {ratio:.3f}"
    )
    print(
        f"demo reward, pipelined - sync (last quarter; per seed {', '.join(f'{d:+.3f}' for d in diffs)}): "
        f"{mean_diff:+.3f} (se {se:.3f})"
    )
    print("\nGPU model (stated assumptions):")
    for key, value in model["assumptions"].items():
        print(f"  {key}: {value}")
    print(
        f"  rollout {model['rollout_s']:.1f} s, training {model['train_s']:.1f} s per step -> sync "
        f"{model['sync_step_s']:.1f} s, pipelined {model['pipelined_step_s']:.1f} s "
        f"({model['speedup_pipelined_over_sync']:.2f}x), the same GPUs colocated {model['colocated_step_s']:.1f} s"
    )
    result = {
        "step_time_ratio": ratio,
        "step_s": step,
        "reward_diff": mean_diff,
        "reward_diff_se": se,
        "runs": runs,
        "gpu_model": model,
        "steps": args.steps,
        "seeds": list(range(args.first_seed, args.first_seed + args.seeds)),
        "threads": {"trainer": 1, "worker": 1, "cpus": os.cpu_count()},
    }
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
