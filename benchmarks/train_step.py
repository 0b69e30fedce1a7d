"""Time split of one full FlowGRPO trainer step and the share spent inside model forwards/backwards.

Builds a ``boogu_trainer.trainer.Trainer`` on the mid-size random transformer (TINY_CONFIG with hidden
256, 4 double- + 4 single-stream blocks, ~23 M parameters; the tiny checkpoint's Qwen3-VL encoder,
VAE and processor; 512x512 images = 64x64 latents), injected with ``Trainer(config, parts=...)``,
with the cheap ``demo_brightness`` reward. After one warm-up step (same code paths, 3 denoising
steps at a small size) it times ``--timed-steps`` full ``train_step()`` calls and prints:

* the wall time per phase (rollout, reward, train = policy forward + backward over the window
  steps + optimizer step, sync, and the glue between them), next to the trainer's own
  ``time/*`` metrics;
* the time inside model calls, measured by hooks on the modules (transformer forward, text
  encoder forward, VAE decode) and by timing ``loss.backward()`` and the reward function, per
  phase, and its share of the step (target: >= 85%);
* NFE (transformer sample-forwards) per trained image, from the hooks and from the metrics.

    uv run python benchmarks/train_step.py [--timed-steps 2] [--prompts 2] [--group-size 4]
        [--steps 10] [--size 512] [--model mid|tiny] [--lora-rank 8] [--kl-coef 0] [--profile]
        [--json out.json]

The default run (warm-up + 2 timed 512x512 steps) uses about 7.5 CPU-minutes: roughly 4 minutes when
both cores are free, 9 minutes measured while other processes shared them. ``--size 256`` (about 1
minute) or ``--timed-steps 1`` give a quicker look; ``--model tiny --size 64`` times the CPU demo's
model. Sets ``OMP_WAIT_POLICY=PASSIVE`` unless it is set (see benchmarks/README.md).
"""

from __future__ import annotations

import os

# Before torch loads OpenMP: idle OpenMP threads sleep instead of spinning (see rollout.py, README).
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import argparse
import dataclasses
import tempfile
import time
from collections import defaultdict

import torch
from _common import (
    ForwardClock,
    count_parameters,
    environment,
    load_tiny_parts,
    maybe_profile,
    share,
    table,
    timed_backward,
    tiny_checkpoint,
    watch_pipeline,
    watch_transformer_internals,
    with_mid_size_transformer,
    write_json,
)

from boogu_trainer.config import load_config
from boogu_trainer.trainer import Trainer

TARGET_SHARE = 0.85
PHASES = ("rollout", "reward", "train", "sync")
MODEL_CATEGORIES = ("transformer", "backward", "encoder", "vae", "reward")


class _PhasedRewards:
    """The trainer's reward object, run inside the "reward" phase (attributes pass through)."""

    def __init__(self, inner, clock: ForwardClock):
        self._inner = inner
        self._call = clock.phased("reward", inner)

    def __call__(self, images, records, **kwargs):
        return self._call(images, records, **kwargs)

    def __getattr__(self, name):
        return getattr(self._inner, name)


def build_trainer(args, parts, run_dir: str) -> Trainer:
    overrides = [
        f"model.device={args.device}",
        f"data.prompts_per_step={args.prompts}",
        f"data.demo_prompts={max(4 * args.prompts, 8)}",
        f"algorithm.group_size={args.group_size}",
        "algorithm.mini_batches=1",
        f"algorithm.kl_coef={args.kl_coef}",
        f"sampler.num_steps={args.steps}",
        f"sampler.height={args.size}",
        f"sampler.width={args.size}",
        f"sampler.guidance_scale={args.guidance}",
        "sampler.window_size=2",
        f"sampler.window_range=[0,{max(3, args.steps // 2)}]",
        f"lora.rank={args.lora_rank}",
        f"lora.alpha={2 * args.lora_rank}",
        "reward.rewards=[{name: demo_brightness}]",
        f"logging.run_dir={run_dir}",
        "logging.name=bench",
        "logging.progress=false",
        "logging.sample_every=0",
        "checkpoint.save_every=0",
        "total_steps=1000",
        f"seed={args.seed}",
    ]
    return Trainer(load_config(None, overrides), parts=parts)


def instrument(trainer: Trainer, clock: ForwardClock) -> None:
    watch_pipeline(clock, trainer.parts, trainer.transformer)
    watch_transformer_internals(clock)
    trainer.rewards.terms = tuple(
        (label, weight, clock.wrap("reward", fn)) for label, weight, fn in trainer.rewards.terms
    )
    trainer.rollout.rewards = _PhasedRewards(trainer.rollout.rewards, clock)
    trainer.rollout.engine.generate = clock.phased("rollout", trainer.rollout.engine.generate)
    trainer.learner.update = clock.phased("train", trainer.learner.update)
    trainer.publish_weights = clock.phased("sync", trainer.publish_weights)
    # Not a model call: shown separately inside "train" (AdamW over the LoRA parameters).
    trainer.learner.optimizer.step = clock.wrap("optimizer", trainer.learner.optimizer.step)


def one_step(trainer: Trainer) -> tuple[float, dict]:
    t0 = time.perf_counter()
    result = trainer.train_step()
    if trainer.device.type == "cuda":
        torch.cuda.synchronize(trainer.device)
    wall = time.perf_counter() - t0
    trainer.step += 1  # what Trainer.train() does after each step (the sync version follows it)
    return wall, result.metrics


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--checkpoint", help="tiny checkpoint folder (built if missing; default: a temp dir)")
    parser.add_argument("--timed-steps", type=int, default=2, help="trainer steps timed after the warm-up")
    parser.add_argument("--prompts", type=int, default=2, help="data.prompts_per_step")
    parser.add_argument("--group-size", type=int, default=4, help="algorithm.group_size")
    parser.add_argument("--steps", type=int, default=10, help="sampler.num_steps")
    parser.add_argument("--guidance", type=float, default=4.0, help="sampler.guidance_scale")
    parser.add_argument(
        "--model", choices=["mid", "tiny"], default="mid", help="mid-size random transformer, or the tiny one"
    )
    parser.add_argument("--size", type=int, default=512, help="image side in pixels (latent = size/8)")
    parser.add_argument("--warmup-size", type=int, default=128, help="image side of the warm-up step")
    parser.add_argument("--lora-rank", type=int, default=8, help="lora.rank (alpha = 2 x rank)")
    parser.add_argument(
        "--kl-coef", type=float, default=0.0, help="algorithm.kl_coef (> 0 adds the reference pass)"
    )
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--threads", type=int, default=0, help="torch CPU threads (0: torch's default)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--profile",
        action="store_true",
        help="cProfile the code outside the model calls during the timed steps (slows them)",
    )
    parser.add_argument("--json", help="also write the figures to this JSON file")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)

    with tempfile.TemporaryDirectory() as tmp:
        parts = load_tiny_parts(tiny_checkpoint(args.checkpoint, tmp), args.device)
        if args.model == "mid":
            parts = with_mid_size_transformer(parts)
        trainer = build_trainer(args, parts, tmp)
        clock = ForwardClock(trainer.device)
        instrument(trainer, clock)

        # Warm-up: one full step through every code path (rollout, decode, reward, forward and
        # backward, AdamW state creation, sync) with 3 denoising steps at a small size.
        config = trainer.config
        trainer.config = dataclasses.replace(
            config,
            sampler=dataclasses.replace(
                config.sampler, num_steps=3, height=args.warmup_size, width=args.warmup_size
            ),
        )
        with timed_backward(clock):
            warmup_s, _ = one_step(trainer)
        trainer.config = config

        per_step = []
        totals: dict = defaultdict(float)
        with timed_backward(clock), maybe_profile(args.profile, clock) as prof:
            for _ in range(args.timed_steps):
                clock.reset()
                wall, metrics = one_step(trainer)
                per_step.append(
                    {
                        "wall_s": wall,
                        "model_s": sum(clock.total(c) for c in MODEL_CATEGORIES),
                        "metrics": metrics,
                    }
                )
                totals["wall"] += wall
                for (phase, category), seconds in clock.seconds.items():
                    totals[("s", phase, category)] += seconds
                for (phase, category), rows in clock.rows.items():
                    totals[("rows", phase, category)] += rows
                for (phase, category), calls in clock.calls.items():
                    totals[("calls", phase, category)] += calls
                for (phase, category, label), seconds in clock.sub_seconds.items():
                    totals[("inner", phase, category, label)] += seconds
                for phase, seconds in clock.phase_wall.items():
                    totals[("phase", phase)] += seconds
                for key in (
                    "time/rollout",
                    "time/encode",
                    "time/reward",
                    "time/train",
                    "time/sync",
                    "time/step",
                    "perf/tflops",
                    "perf/mfu",
                    "perf/tflops_per_image",
                ):
                    totals[("metric", key)] += metrics.get(key, 0.0)
        clock.remove()

    figures = summarize(args, parts, trainer, warmup_s, per_step, totals)
    print_figures(figures)
    if "report" in prof:
        print(prof["report"])
    write_json(args.json, figures)


def summarize(args, parts, trainer, warmup_s, per_step, totals) -> dict:
    n = len(per_step)
    wall = totals["wall"] / n

    def s(phase, category):  # mean seconds per step inside (phase, category); None = any
        return (
            sum(
                v
                for k, v in totals.items()
                if isinstance(k, tuple)
                and k[0] == "s"
                and (phase is None or k[1] == phase)
                and (category is None or k[2] == category)
            )
            / n
        )

    def rows(phase, category):
        return (
            sum(v for k, v in totals.items() if k[:1] == ("rows",) and k[1] == phase and k[2] == category) / n
        )

    phases = {}
    for phase in PHASES:
        phase_wall = totals[("phase", phase)] / n
        inside = {c: s(phase, c) for c in MODEL_CATEGORIES if s(phase, c) > 0}
        model = sum(inside.values())
        phases[phase] = {
            "wall_s": phase_wall,
            "share_of_step": share(phase_wall, wall),
            "trainer_metric_s": totals[("metric", f"time/{phase}")] / n,
            "inside_models_s": inside,
            "model_share_of_phase": share(model, phase_wall),
            "outside_models_s": phase_wall - model,
        }
    phases["train"]["optimizer_step_s"] = s("train", "optimizer")
    between = wall - sum(p["wall_s"] for p in phases.values())
    inside = {c: s(None, c) for c in MODEL_CATEGORIES}
    model_total = sum(inside.values())
    batch = args.prompts * args.group_size
    rollout_rows = rows("rollout", "transformer")
    train_rows = rows("train", "transformer")
    last = per_step[-1]["metrics"]
    return {
        "environment": environment(),
        "setup": {
            **vars(args),
            "transformer_parameters": count_parameters(parts.transformer),
            "trainable_lora_parameters": sum(p.numel() for p in trainer.learner.params),
            "images_per_step": batch,
            "latent_size": args.size // parts.vae_scale_factor,
        },
        "warmup_s": warmup_s,
        "timed_steps": n,
        "step_wall_s": wall,
        "step_walls_s": [p["wall_s"] for p in per_step],
        "images_per_s": batch / wall,
        "phases": phases,
        "between_phases_s": between,
        "inside_models_s": inside,
        "model_total_s": model_total,
        "model_share": share(model_total, wall),
        "model_share_per_step": [share(p["model_s"], p["wall_s"]) for p in per_step],
        "outside_models_s": wall - model_total,
        "target_share": TARGET_SHARE,
        "meets_target": share(model_total, wall) >= TARGET_SHARE,
        # Inside the transformer forwards (rollout and train): float64 RoPE and attention kernels.
        "transformer_forward_internals_s": {
            label: sum(
                v
                for k, v in totals.items()
                if k[:1] == ("inner",) and k[2] == "transformer" and k[3] == label
            )
            / n
            for label in ("rope", "sdpa")
        },
        "nfe": {
            "rollout_per_image": rollout_rows / batch,
            "train_per_image": train_rows / batch,
            "per_trained_image": (rollout_rows + train_rows) / batch,
            "backward_calls_per_step": sum(
                v for k, v in totals.items() if k[:1] == ("calls",) and k[2] == "backward"
            )
            / n,
            "metric_rollout_per_image": last["nfe/rollout_per_image"],
            "metric_train_per_image": last["nfe/train_per_image"],
        },
        "encoder_calls_per_prompt_metric": last["prompt_encodings_per_prompt"],
        "encoder_rows_per_step": rows("rollout", "encoder"),
        "trainer_time_step_s": totals[("metric", "time/step")] / n,
        "trainer_time_encode_s": totals[("metric", "time/encode")] / n,
        "perf": {key: totals[("metric", f"perf/{key}")] / n for key in ("tflops", "mfu", "tflops_per_image")},
    }


def print_figures(f: dict) -> None:
    st = f["setup"]
    print(
        f"== trainer step ({st['model']}): {st['transformer_parameters'] / 1e6:.2f} M-parameter transformer + LoRA rank "
        f"{st['lora_rank']} ({st['trainable_lora_parameters'] / 1e3:.0f} k trainable), {st['size']}x{st['size']} "
        f"images ({st['latent_size']}^2 latents), {st['prompts']} prompts x {st['group_size']}, "
        f"{st['steps']} steps, CFG {st['guidance']}, window 2, kl_coef {st['kl_coef']} =="
    )
    print(
        f"warm-up {f['warmup_s']:.1f} s; {f['timed_steps']} timed steps: "
        + ", ".join(f"{w:.1f} s" for w in f["step_walls_s"])
        + f" (mean {f['step_wall_s']:.1f} s, trainer's time/step {f['trainer_time_step_s']:.1f} s); "
        f"{f['images_per_s']:.3f} images/s; model FLOPs {f['perf']['tflops']:.3f} TFLOPs/step "
        f"({f['perf']['tflops_per_image']:.4f} per image), perf/mfu {f['perf']['mfu']:.1%} of the measured CPU peak"
    )
    wall = f["step_wall_s"]
    rows = []
    for name, p in f["phases"].items():
        inside = ", ".join(f"{c} {v:.2f}" for c, v in p["inside_models_s"].items()) or "-"
        rows.append(
            (
                name,
                f"{p['wall_s']:.3f}",
                f"{p['share_of_step']:.1%}",
                f"{p['trainer_metric_s']:.3f}",
                inside,
                f"{p['model_share_of_phase']:.1%}",
                f"{p['outside_models_s']:.3f}",
            )
        )
    rows.append(
        (
            "between phases",
            f"{f['between_phases_s']:.3f}",
            f"{share(f['between_phases_s'], wall):.1%}",
            "",
            "-",
            "",
            f"{f['between_phases_s']:.3f}",
        )
    )
    rows.append(
        (
            "step",
            f"{wall:.3f}",
            "100.0%",
            f"{f['trainer_time_step_s']:.3f}",
            "",
            f"{f['model_share']:.1%}",
            f"{f['outside_models_s']:.3f}",
        )
    )
    print(
        table(
            rows,
            ("phase", "wall s", "of step", "trainer s", "inside models (s)", "model share", "outside s"),
        )
    )
    print(
        f"train phase: AdamW optimizer.step {f['phases']['train']['optimizer_step_s'] * 1000:.1f} ms (counted outside)"
    )
    inside = f["inside_models_s"]
    print(
        table(
            [(c, f"{v:.3f}", f"{share(v, wall):.1%}") for c, v in inside.items()]
            + [("inside models, total", f"{f['model_total_s']:.3f}", f"{f['model_share']:.1%}")],
            ("inside", "s per step", "share of step"),
        )
    )
    fwd = inside["transformer"]
    print(
        "inside the transformer forwards: "
        + ", ".join(
            f"{k} {v:.3f} s ({share(v, fwd):.1%} of them)"
            for k, v in f["transformer_forward_internals_s"].items()
        )
    )
    nfe = f["nfe"]
    print(
        f"NFE per trained image: {nfe['per_trained_image']:.1f} = rollout {nfe['rollout_per_image']:.1f} "
        f"(metric {nfe['metric_rollout_per_image']:.1f}) + train forwards {nfe['train_per_image']:.1f} "
        f"(metric {nfe['metric_train_per_image']:.1f}); {nfe['backward_calls_per_step']:.0f} backward calls per step; "
        f"encoder calls per prompt (metric) {f['encoder_calls_per_prompt_metric']:.2f}"
    )
    verdict = "meets" if f["meets_target"] else "MISSES"
    print(
        f"model share {f['model_share']:.1%} (per step: "
        + ", ".join(f"{x:.1%}" for x in f["model_share_per_step"])
        + f"): {verdict} the {f['target_share']:.0%} target"
    )
    print(f["environment"])


if __name__ == "__main__":
    main()
