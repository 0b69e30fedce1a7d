"""A few FlowGRPO steps of a random-weight Boogu transformer at the released size, on one GPU.

The text encoder, VAE and processor come from the tiny checkpoint (built here); the transformer
is ``RELEASED_CONFIG`` (10.3B parameters in bf16) with its instruction projection sized to the
tiny encoder, randomised. If it does not fit, the number of single-stream layers is halved until
it does. Prints images/s, MFU, the step-time split, transformer forwards per image and peak memory.

    python3 benchmarks/gpu_scale.py [--preset released|mid|tiny] [--device cuda] [--size 1024]
        [--prompts 2] [--group 4] [--steps 3] [--sampler-steps 10] [--micro-batch 8]
        [--train-micro-batch 4] [--compile] [--json out.json]

The step-time split is every ``time/<phase>`` the trainer reports (``rollout``, ``train``,
``sync``, and ``encode``, which is part of ``rollout``); ``time/step`` is the whole step. On CPU
(``--device cpu --preset tiny``) it runs the same code at toy sizes: a smoke test only.

The random weights are drawn on ``--device`` (a CUDA generator there: a CPU draw of the released
size took ~55 s), and ``--json`` is rewritten (atomically) after the build, the warm-up step and every
timed step, with the figures of the steps done so far (``timed_steps``): a run cut short by a timeout
keeps them.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import tempfile
import time
from typing import Any

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import torch
from _common import MID_SIZE_OVERRIDES, write_json_atomic

from boogu_adapters.loading import load_boogu
from boogu_adapters.model import (
    RELEASED_CONFIG,
    TINY_CONFIG,
    BooguImageTransformer2DModel,
    count_parameters,
    randomize_parameters,
)
from boogu_schedule import make_generator
from boogu_tiny.checkpoints import ensure_tiny_checkpoint
from boogu_trainer.config import load_config
from boogu_trainer.trainer import Trainer

PRESETS = {"released": RELEASED_CONFIG, "mid": {**TINY_CONFIG, **MID_SIZE_OVERRIDES}, "tiny": TINY_CONFIG}


def build_transformer(
    preset: dict[str, Any], num_layers: int, feat_dim: int, device: torch.device, dtype: torch.dtype
) -> torch.nn.Module:
    cfg = {**preset, "num_layers": num_layers}
    cfg["instruction_feature_configs"] = {
        **preset["instruction_feature_configs"],
        "instruction_feat_dim": feat_dim,
    }
    with torch.device("meta"):
        model = BooguImageTransformer2DModel(**cfg)
    model = model.to_empty(device=device).to(dtype)
    with torch.no_grad():  # on the device: a CPU draw of the released size took ~55 s
        randomize_parameters(model, make_generator(0, device))
    return model


def step_split(rows: list[dict[str, Any]]) -> dict[str, float]:
    """Mean seconds of every ``time/<phase>`` the trainer reported in all ``rows`` (``time/step`` apart)."""
    phases = [k for k in rows[0] if k.startswith("time/") and k != "time/step" and all(k in r for r in rows)]
    return {k: sum(float(r[k]) for r in rows) / len(rows) for k in phases}


def summary(rows: list[dict[str, Any]], device: torch.device) -> dict[str, Any]:
    """The figures of the timed steps in ``rows`` (their means; none while ``rows`` is empty)."""
    if not rows:
        return {"timed_steps": 0}
    mean = {k: sum(r[k] for r in rows) / len(rows) for k in rows[0] if isinstance(rows[0][k], int | float)}
    return {
        "timed_steps": len(rows),
        "images_per_s": mean["images_per_s"],
        "step_s": mean["time/step"],
        "wall_s": mean["wall"],
        "split_s": step_split(rows),
        "nfe_rollout_per_image": mean["nfe/rollout_per_image"],
        "nfe_train_per_image": mean["nfe/train_per_image"],
        "peak_memory_gb": torch.cuda.max_memory_allocated(device) / 2**30 if device.type == "cuda" else None,
        "tflops_per_step": mean["perf/tflops"],
        "mfu": mean["perf/mfu"],
        "tflops_per_image": mean["perf/tflops_per_image"],
        "logprob_diff_max": max((v for k, v in mean.items() if k.startswith("logprob_diff/")), default=0.0),
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--preset", choices=sorted(PRESETS), default="released")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--size", type=int, default=1024)
    p.add_argument("--prompts", type=int, default=2)
    p.add_argument("--group", type=int, default=4)
    p.add_argument("--steps", type=int, default=3, help="timed trainer steps after one warm-up step")
    p.add_argument("--sampler-steps", type=int, default=10, help="sampler.num_steps")
    p.add_argument("--micro-batch", type=int, default=8, help="rollout.micro_batch_size")
    p.add_argument("--train-micro-batch", type=int, default=4, help="algorithm.train_micro_batch_size")
    p.add_argument("--compile", action="store_true", help="model.compile=true")
    p.add_argument("--json")
    args = p.parse_args()
    if args.steps < 1:
        p.error(f"--steps must be >= 1 (timed steps after the warm-up), got {args.steps}")
    device = torch.device(args.device)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    preset = PRESETS[args.preset]

    tiny = ensure_tiny_checkpoint(tempfile.mkdtemp() + "/Boogu-Image")
    parts = load_boogu(tiny, transformer="native", dtype=dtype, device=str(device))
    # The transformer reads the text model's hidden states (Qwen3-VL keeps them in text_config).
    feat_dim = parts.text_encoder.config.text_config.hidden_size
    layers = preset["num_layers"]
    while True:
        try:
            if device.type == "cuda":
                torch.cuda.empty_cache()
            model = build_transformer(preset, layers, feat_dim, device, dtype)
            break
        except torch.OutOfMemoryError:
            double = preset["num_double_stream_layers"]
            if layers <= double + 1:
                raise
            layers = double + (layers - double) // 2
            print(f"out of memory: retrying with {layers} layers")
    params = count_parameters(model)
    config = load_config(
        None,
        [
            f"model.device={device.type}",
            "model.dtype=auto",
            f"rollout.micro_batch_size={args.micro_batch}",
            f"algorithm.train_micro_batch_size={args.train_micro_batch}",
            f"data.prompts_per_step={args.prompts}",
            f"algorithm.group_size={args.group}",
            f"sampler.height={args.size}",
            f"sampler.width={args.size}",
            f"sampler.num_steps={args.sampler_steps}",
            "sampler.window_size=2",
            f"sampler.window_range=[0,{max(3, args.sampler_steps // 2)}]",
            "sampler.guidance_scale=4.0",
            "lora.rank=64",
            "lora.alpha=128",
            "reward.rewards=[{name: demo_brightness}]",
            f"total_steps={args.steps + 1}",
            "checkpoint.save_every=0",
            f"logging.run_dir={tempfile.mkdtemp()}",
            "logging.sample_every=0",
            "logging.progress=false",
            f"model.compile={str(args.compile).lower()}",
        ],
    )
    out: dict[str, Any] = {
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "preset": args.preset,
        "transformer_params": params,
        "layers": layers,
        "size": args.size,
        "images_per_step": args.prompts * args.group,
        "steps_requested": args.steps,
        "timed_steps": 0,
    }
    write_json_atomic(args.json, out)
    trainer = Trainer(config, parts=dataclasses.replace(parts, transformer=model))
    t0 = time.perf_counter()
    trainer.train_step()  # warm-up
    trainer.step += 1  # what Trainer.train() does after each step
    out["warmup_s"] = time.perf_counter() - t0
    write_json_atomic(args.json, out)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats()
    rows = []
    for _ in range(args.steps):
        t0 = time.perf_counter()
        rows.append(trainer.train_step().metrics)
        trainer.step += 1
        rows[-1]["wall"] = time.perf_counter() - t0
        out.update(summary(rows, device))
        write_json_atomic(args.json, out)
    print(json.dumps(out, indent=2))


if __name__ == "__main__":
    main()
