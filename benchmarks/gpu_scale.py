"""A few FlowGRPO steps of a random-weight Boogu transformer at the released size, on one GPU.

The text encoder, VAE and processor come from the tiny checkpoint (built here); the transformer
is ``RELEASED_CONFIG`` (10.3B parameters in bf16) with its instruction projection sized to the
tiny encoder, randomised. If it does not fit, the number of single-stream layers is halved until
it does. Prints images/s, MFU, the step-time split, transformer forwards per image and peak memory.

    python3 benchmarks/gpu_scale.py [--size 1024] [--prompts 2] [--group 4] [--steps 3]
        [--micro-batch 8] [--train-micro-batch 4] [--compile] [--json out.json]
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import tempfile
import time

import torch

from boogu_adapters.loading import load_boogu
from boogu_adapters.model import (
    RELEASED_CONFIG,
    BooguImageTransformer2DModel,
    count_parameters,
    randomize_parameters,
)
from boogu_adapters.tiny import ensure_tiny_checkpoint
from boogu_trainer.config import load_config
from boogu_trainer.loop import Trainer


def build_transformer(num_layers: int, feat_dim: int) -> torch.nn.Module:
    cfg = {**RELEASED_CONFIG, "num_layers": num_layers}
    cfg["instruction_feature_configs"] = {
        **RELEASED_CONFIG["instruction_feature_configs"],
        "instruction_feat_dim": feat_dim,
    }
    with torch.device("meta"):
        model = BooguImageTransformer2DModel(**cfg)
    model = model.to_empty(device="cuda").to(torch.bfloat16)
    with torch.no_grad():
        randomize_parameters(model, 0)
    return model


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--size", type=int, default=1024)
    p.add_argument("--prompts", type=int, default=2)
    p.add_argument("--group", type=int, default=4)
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--micro-batch", type=int, default=8, help="rollout.micro_batch_size")
    p.add_argument("--train-micro-batch", type=int, default=4, help="algorithm.train_micro_batch_size")
    p.add_argument("--compile", action="store_true", help="model.compile=true")
    p.add_argument("--json")
    args = p.parse_args()

    tiny = ensure_tiny_checkpoint(tempfile.mkdtemp() + "/Boogu-Image")
    parts = load_boogu(tiny, transformer="native", dtype=torch.bfloat16, device="cuda")
    feat_dim = parts.text_encoder.config.hidden_size
    layers = RELEASED_CONFIG["num_layers"]
    while True:
        try:
            torch.cuda.empty_cache()
            model = build_transformer(layers, feat_dim)
            break
        except torch.OutOfMemoryError:
            layers = (
                RELEASED_CONFIG["num_double_stream_layers"]
                + (layers - RELEASED_CONFIG["num_double_stream_layers"]) // 2
            )
            print(f"out of memory: retrying with {layers} layers")
    params = count_parameters(model)
    config = load_config(
        None,
        [
            "model.device=cuda",
            "model.dtype=auto",
            f"rollout.micro_batch_size={args.micro_batch}",
            f"algorithm.train_micro_batch_size={args.train_micro_batch}",
            f"data.prompts_per_step={args.prompts}",
            f"algorithm.group_size={args.group}",
            f"sampler.height={args.size}",
            f"sampler.width={args.size}",
            "sampler.num_steps=10",
            "sampler.window_size=2",
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
    trainer = Trainer(config, parts=dataclasses.replace(parts, transformer=model))
    trainer.train_step()  # warm-up
    trainer.step += 1
    torch.cuda.reset_peak_memory_stats()
    rows = []
    for _ in range(args.steps):
        t0 = time.perf_counter()
        rows.append(trainer.train_step().metrics)
        trainer.step += 1
        rows[-1]["wall"] = time.perf_counter() - t0
    mean = {k: sum(r[k] for r in rows) / len(rows) for k in rows[0] if isinstance(rows[0][k], int | float)}
    out = {
        "transformer_params": params,
        "layers": layers,
        "size": args.size,
        "images_per_step": args.prompts * args.group,
        "images_per_s": mean["images_per_s"],
        "step_s": mean["time/step"],
        "split_s": {
            k: mean[k] for k in ("time/rollout", "time/encode", "time/reward", "time/train", "time/sync")
        },
        "nfe_rollout_per_image": mean["nfe/rollout_per_image"],
        "nfe_train_per_image": mean["nfe/train_per_image"],
        "peak_memory_gb": torch.cuda.max_memory_allocated() / 2**30,
        "tflops_per_step": mean["perf/tflops"],
        "mfu": mean["perf/mfu"],
        "tflops_per_image": mean["perf/tflops_per_image"],
        "logprob_diff_max": max(mean.get(f"logprob_diff/step{k}", 0.0) for k in range(2)),
    }
    print(json.dumps(out, indent=2))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=2)


if __name__ == "__main__":
    main()
