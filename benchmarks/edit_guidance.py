"""Does upstream's image guidance help the tiny Edit checkpoint? Held-out ``scene_edit_exact`` of the
base Edit checkpoint at each text CFG / image guidance setting.

The question of issue 48, item 4 (image guidance stays off in the RL recipes "unless it helps the
held-out edit score"), answered before any RL run reads it: for each ``g:ig`` of ``--settings`` the
Edit demo's evaluation prompts (``data.demo_set=scene_edits``, ``demo_eval_split=heldout``: the first
``--prompts`` held-out instructions) are sampled once by the evaluation path (ODE, ``--steps`` steps,
seed 0: every setting draws the same initial noise and the same reference latents) and scored with
``scene_edit_exact``. It prints each setting's mean, standard error and per-operation means, and its
paired difference to the first setting (the default, ``4:1``: text CFG 4, no image guidance) with the
difference's standard error. A setting helps when that difference exceeds twice its standard error.

    uv run python benchmarks/edit_guidance.py [--prompts 400] [--settings 4:1,4:1.5,4:2,1:2]
        [--steps 20] [--chunk 50] [--checkpoint DIR] [--json out.json]

About 2 minutes per setting with two forwards a step and 3 with three (400 prompts, 2 cores).
"""

from __future__ import annotations

import os

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import argparse
import json
import time
from pathlib import Path


def parse_settings(text: str) -> list[tuple[float, float]]:
    settings = []
    for item in text.split(","):
        g, sep, ig = item.partition(":")
        try:
            pair = (float(g), float(ig))
        except ValueError:
            pair = None
        if not sep or pair is None or min(pair) < 1:
            raise argparse.ArgumentTypeError(f"--settings: {item!r} is not G:IG with both scales >= 1")
        settings.append(pair)
    return settings


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--prompts", type=int, default=400)
    parser.add_argument("--settings", type=parse_settings, default=parse_settings("4:1,4:1.5,4:2,1:2"))
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--chunk", type=int, default=50, help="prompts per rollout request")
    parser.add_argument("--checkpoint", default=None, help="an Edit checkpoint (default: the committed one)")
    parser.add_argument("--json", default=None)
    args = parser.parse_args(argv)
    if args.prompts < 2 or args.steps < 1 or args.chunk < 1:
        parser.error("--prompts >= 2, --steps >= 1 and --chunk >= 1")

    import torch

    from boogu_adapters.components import build_local_engine
    from boogu_adapters.loading import load_boogu
    from boogu_tiny.checkpoints import DEFAULT_TRAINED_EDIT_PATH, ensure_trained_edit_checkpoint
    from boogu_tiny.verify import score_edits
    from boogu_trainer.data import SCENE_EDITS_SIZE, demo_records
    from boogu_trainer.demo import paired_summary
    from boogu_trainer.evaluation import deterministic_request

    folder = (
        Path(args.checkpoint)
        if args.checkpoint
        else ensure_trained_edit_checkpoint(DEFAULT_TRAINED_EDIT_PATH)
    )
    engine = build_local_engine(load_boogu(folder, transformer="native"))
    records = demo_records(args.prompts, "scene_edits", split="heldout")
    ops = [json.loads(r.ground_truth)["instruction"]["op"] for r in records]
    report: dict = {"checkpoint": str(folder), "prompts": len(records), "steps": args.steps, "settings": []}
    scores: list[list[float]] = []
    print(
        f"{'g':>4} {'ig':>4} {'exact':>6} {'(se)':>7} {'recolour':>8} {'add':>5} {'remove':>6} {'move':>5} "
        f"{'vs first (se)':>16} {'s':>6}"
    )
    for g, ig in args.settings:
        t0 = time.perf_counter()
        exact = []
        for start in range(0, len(records), args.chunk):
            part = records[start : start + args.chunk]
            request = deterministic_request(
                part,
                num_steps=args.steps,
                guidance_scale=g,
                image_guidance_scale=ig,
                height=SCENE_EDITS_SIZE,
                width=SCENE_EDITS_SIZE,
                seed=0,
                group_offset=start,  # prompt i draws stream (0, i) whatever the chunking
            )
            with torch.no_grad():
                exact += score_edits(engine.generate(request).images, part).tolist()
        scores.append(exact)
        first = paired_summary(scores[0], exact)
        by_op = {
            op: sum(e for e, o in zip(exact, ops) if o == op) / max(ops.count(op), 1)
            for op in sorted(set(ops))
        }
        mean = sum(exact) / len(exact)
        se = (sum((e - mean) ** 2 for e in exact) / (len(exact) - 1) / len(exact)) ** 0.5
        row = {
            "guidance_scale": g,
            "image_guidance_scale": ig,
            "scene_edit_exact": mean,
            "se": se,
            "by_op": by_op,
            "diff_vs_first": first["diff"],
            "se_diff_vs_first": first["se_diff"],
            "helps": bool(first["diff"] > 2 * first["se_diff"]),
            "seconds": time.perf_counter() - t0,
        }
        report["settings"].append(row)
        print(
            f"{g:4.1f} {ig:4.1f} {mean:6.3f} ({se:5.3f}) {by_op.get('recolour', 0):8.3f} {by_op.get('add', 0):5.3f} "
            f"{by_op.get('remove', 0):6.3f} {by_op.get('move', 0):5.3f} "
            f"{first['diff']:+7.3f} ({first['se_diff']:.3f}) {row['seconds']:6.0f}",
            flush=True,
        )
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    main()
