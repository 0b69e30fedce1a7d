"""Overhead of ``boogu_schedule.sde_step`` over the same arithmetic written by hand.

Times ``sde_step("flow_sde", ...)`` on a (16, 16, 128, 128) float32 batch (16 samples of a 1024^2
latent) against one hand-written expression of the Flow-GRPO step (mean, draw, log-prob), and
prints microseconds per call and the ratio measured in the same run. Target: ratio <= 1.2.

    uv run python benchmarks/schedule.py [--repeats 20] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import time

import torch

from boogu_schedule import sde_step

LOG_SQRT_2PI = 0.5 * math.log(2 * math.pi)


def hand_written(x, v, sigma, sigma_next, eta, generator):
    dt = sigma_next - sigma
    s = eta * math.sqrt(sigma / (1 - sigma))
    mean = x * (1 + s**2 / (2 * sigma) * dt) + v * (1 + s**2 * (1 - sigma) / (2 * sigma)) * dt
    std = s * math.sqrt(-dt)
    x_next = mean + std * torch.randn(x.shape, generator=generator, dtype=x.dtype)
    log_prob = (-((x_next - mean) ** 2) / (2 * std**2) - math.log(std) - LOG_SQRT_2PI).mean(dim=(1, 2, 3))
    return x_next, mean, log_prob


def timed(fn, repeats: int) -> list[float]:
    fn()  # warm-up
    out = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        out.append(time.perf_counter() - t0)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--shape", type=int, nargs=4, default=[16, 16, 128, 128])
    parser.add_argument("--json", help="also write the figures to this JSON file")
    args = parser.parse_args()

    gen = torch.Generator().manual_seed(0)
    x = torch.randn(*args.shape, generator=gen)
    v = torch.randn(*args.shape, generator=gen)
    sigma, sigma_next, eta = 0.9266, 0.8805, 1.2

    # Interleave the two so machine noise hits both alike; report medians.
    ours, hand = [], []
    for _ in range(args.repeats):
        ours += timed(lambda: sde_step("flow_sde", x, v, sigma, sigma_next, eta, generator=gen), 1)
        hand += timed(lambda: hand_written(x, v, sigma, sigma_next, eta, gen), 1)
    ours_us, hand_us = statistics.median(ours) * 1e6, statistics.median(hand) * 1e6
    result = {
        "shape": args.shape,
        "threads": torch.get_num_threads(),
        "sde_step_us": round(ours_us, 1),
        "hand_written_us": round(hand_us, 1),
        "ratio": round(ours_us / hand_us, 3),
        "target_ratio": 1.2,
    }
    print(f"sde_step(flow_sde) on {tuple(args.shape)} float32, {result['threads']} threads")
    print(f"  boogu_schedule.sde_step : {ours_us:12.1f} us/call (median of {args.repeats})")
    print(f"  hand-written expression : {hand_us:12.1f} us/call")
    print(f"  ratio                   : {result['ratio']:.3f}  (target <= 1.2)")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=2)


if __name__ == "__main__":
    main()
