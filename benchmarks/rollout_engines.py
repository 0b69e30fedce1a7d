"""Rollout images/s of the two engines on the same request: ``local`` and ``vllm_omni``.

Both engines get the same checkpoint, request and seeds; the benchmark warms each up with one small
rollout, then times ``--repeats`` rollouts of the request and prints images/s, the worker's own time
split (encode, reference, denoise, decode) and what the trainer side adds (HTTP, safetensors
messages), and the max |difference| of the two trajectories (latents, log-probs), which must stay at
float rounding. The vllm-omni worker needs the rollout environment
(``uv sync --locked --project packages/boogu-vllm``); without it the benchmark says so and exits 2.

    uv run python benchmarks/rollout_engines.py [--checkpoint DIR] [--size 64] [--steps 10]
        [--prompts 2] [--group-size 4] [--guidance 4.0] [--repeats 3] [--backend direct|omni|auto]
        [--device cpu|cuda] [--json out.json]

On 2 CPU cores with the tiny checkpoint at 64x64 it takes about a minute (most of it the worker's
start: importing vllm). On a GPU machine, ``--backend omni --device cuda`` measures vllm-omni's
engine against the local engine on the same GPU.
"""

from __future__ import annotations

import os

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # see benchmarks/README.md

import argparse
import sys
import tempfile
import time
from pathlib import Path

import torch
from _common import environment, load_tiny_parts, table, tiny_checkpoint, write_json

from boogu_adapters.components import build_local_engine
from boogu_adapters.types import RolloutRequest
from boogu_adapters.vllm_engine import RolloutWorkerError, VllmOmniRolloutEngine, default_project_dir
from boogu_schedule import WindowPlan
from boogu_trainer.data import demo_records


def make_request(args, *, warmup: bool = False) -> RolloutRequest:
    records = demo_records(None)[: 1 if warmup else args.prompts]
    steps = 4 if warmup else args.steps
    return RolloutRequest(
        records,
        group_size=1 if warmup else args.group_size,
        num_steps=steps,
        guidance_scale=args.guidance,
        height=args.size,
        width=args.size,
        seed=7,
        window=WindowPlan(kind="random", size=2, window_range=(0, steps - 1)),
    )


def timed(engine, request, warmup, repeats: int):
    """The fastest of ``repeats`` rollouts (after a warm-up), and the engine's timers over those."""
    engine.generate(warmup)
    before = dict(engine.stats.seconds)
    seconds, traj = [], None
    for _ in range(repeats):
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        traj = engine.generate(request)
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        seconds.append(time.perf_counter() - t0)
    split = {k: (v - before.get(k, 0.0)) / repeats for k, v in engine.stats.seconds.items()}
    return traj, min(seconds), split


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--checkpoint", default=None, help="checkpoint folder (default: a fresh tiny one)")
    parser.add_argument("--size", type=int, default=64)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--prompts", type=int, default=2)
    parser.add_argument("--group-size", type=int, default=4)
    parser.add_argument("--guidance", type=float, default=4.0)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--backend", choices=("auto", "direct", "omni"), default="auto")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--worker-python", default=None, help="the rollout environment's python")
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    if args.worker_python is None and not (default_project_dir() / ".venv" / "bin" / "python").exists():
        print(
            "rollout_engines: no rollout environment: run `uv sync --locked --project packages/boogu-vllm` "
            "(or pass --worker-python)",
            file=sys.stderr,
        )
        return 2
    with tempfile.TemporaryDirectory() as tmp:
        ckpt = tiny_checkpoint(args.checkpoint, tmp)
        request = make_request(args)
        parts = load_tiny_parts(Path(ckpt), device=args.device)
        local = build_local_engine(parts, cfg_mode="sequential", device=args.device)
        t0 = time.perf_counter()
        try:
            remote = VllmOmniRolloutEngine(
                ckpt,
                python=args.worker_python,
                device=args.device,
                worker_args=["--backend", args.backend],
                log_path=Path(tmp) / "worker.log",
            )
        except RolloutWorkerError as error:
            print(f"rollout_engines: {error}", file=sys.stderr)
            return 2
        startup = time.perf_counter() - t0
        try:
            warmup = make_request(args, warmup=True)
            local_traj, local_s, _ = timed(local, request, warmup, args.repeats)
            remote_traj, remote_s, split = timed(remote, request, warmup, args.repeats)
        finally:
            remote.close()
    images = request.batch_size
    diff = {
        name: (getattr(remote_traj, name).double().cpu() - getattr(local_traj, name).double().cpu())
        .abs()
        .max()
        .item()
        for name in ("latents", "log_prob", "final_latents")
    }
    worker_inside = sum(v for k, v in split.items() if k.startswith("worker/"))
    rows = [
        ("local", f"{images / local_s:.3f}", f"{local_s:.3f}", "-"),
        (
            "vllm_omni",
            f"{images / remote_s:.3f}",
            f"{remote_s:.3f}",
            f"{split.get('worker', 0.0) - worker_inside:.3f}",
        ),
    ]
    print(
        f"request: {args.prompts} prompts x {args.group_size}, {args.steps} steps, {args.size}x{args.size}, "
        f"CFG {args.guidance}, device {args.device}, worker backend {remote.worker_info.get('backend')}"
    )
    print(table(rows, ("engine", "images/s", "s/rollout", "protocol+HTTP s")))
    print(f"vllm_omni / local images/s: {local_s / remote_s:.2f}x   (worker start-up {startup:.1f} s)")
    print(
        "worker time split (s per rollout):",
        {k: round(v, 4) for k, v in split.items() if k.startswith("worker/")},
    )
    print("max |vllm_omni - local|:", {k: f"{v:.2e}" for k, v in diff.items()})
    write_json(
        args.json,
        {
            "environment": environment(),
            "request": vars(args),
            "images_per_s": {"local": images / local_s, "vllm_omni": images / remote_s},
            "ratio_vllm_over_local": local_s / remote_s,
            "worker_startup_s": startup,
            "worker_split_s": split,
            "max_abs_diff": diff,
        },
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
