"""The demo's ending: the base model against the trained LoRA on held-out scene prompts.

``uv run trainer`` (no arguments) post-trains the tiny Boogu pretrained on procedural scenes
(``boogu-tiny --trained``) on the scene set's train captions, and then answers the question RL is
for: does the model follow its prompts better? :func:`heldout_comparison` samples every held-out
prompt (``data.demo_eval_split``: by default train-split captions never used as training prompts)
once with the LoRA switched off and once with it on, with the same seeds (the evaluation's deterministic ODE
path), scores both with the gold reward (``eval.rewards``: ``scene_exact``) and writes, in the run
folder:

* ``heldout.json``: ``{"prompts": n, "base": mean, "trained": mean, "se_diff": standard error of
  the paired difference, ...}``: the gain is real when ``trained - base > 2 * se_diff``;
* ``heldout_grid.png``: the first prompts' images, base above trained, each with its verdict (for
  edit rows, ``trainer examples/tiny_scenes/edit_demo.yaml``, each column's reference image above them).
"""

from __future__ import annotations

import io
import json
import math
from pathlib import Path
from typing import Any

import numpy as np
import torch
from PIL import Image

from boogu_adapters.lora import adapters_disabled
from boogu_data.atomic import atomic_write_text
from boogu_trainer.metrics import sample_grid

__all__ = ["HELDOUT_GRID", "HELDOUT_JSON", "heldout_comparison", "paired_summary"]

HELDOUT_JSON = "heldout.json"
HELDOUT_GRID = "heldout_grid.png"
GRID_PROMPTS = 8
"""Prompts per row pair in the grid (two pairs: the first 16 held-out prompts)."""


def paired_summary(base: list[float], trained: list[float]) -> dict[str, float]:
    """Means of two paired score lists and the standard error of their mean difference."""
    if len(base) != len(trained) or not base:
        raise ValueError(f"paired scores need equal, non-zero lengths, got {len(base)} and {len(trained)}")
    n = len(base)
    diff = [t - b for b, t in zip(base, trained, strict=True)]
    mean_diff = sum(diff) / n
    var = sum((d - mean_diff) ** 2 for d in diff) / (n - 1) if n > 1 else math.nan
    return {
        "prompts": n,
        "base": sum(base) / n,
        "trained": sum(trained) / n,
        "diff": mean_diff,
        "se_diff": math.sqrt(var / n) if n > 1 else math.nan,
    }


def heldout_comparison(trainer: Any, run_dir: Path) -> dict[str, Any]:
    """Base vs trained on the trainer's evaluation prompts (every rank calls it: the sampling is
    collective); rank 0 writes ``heldout.json`` and ``heldout_grid.png`` into ``run_dir``. Call it
    before ``trainer.close()``: the run folder's lock, held to then, keeps a concurrent resume from
    writing the folder meanwhile (docs/reliability.md)."""
    evaluator = trainer.evaluator
    if not evaluator.records:
        raise ValueError(
            "the held-out comparison needs evaluation prompts (data.val_files or data.demo_set=scenes or scene_edits)"
        )
    with adapters_disabled(trainer.transformer):
        base = evaluator.evaluate(step=0)
    # The run's own evaluation of its last step, when it made one, is this very sampling (same
    # prompts, seeds and weights): reuse it instead of sampling the held-out set again.
    last = trainer.last_evaluation
    if last is not None and last.step == trainer.step:
        trained = last
    else:
        with trainer.evaluation_weights():  # the EMA weights with ema.enabled (and ema.evaluate)
            trained = evaluator.evaluate(step=trainer.step)
    summary: dict[str, Any] = paired_summary(
        [p["gold"] for p in base.prompts], [p["gold"] for p in trained.prompts]
    )
    summary.update(
        {
            "gold_rewards": dict(evaluator.gold_rewards.weights),
            "step": trainer.step,
            "sampler": {
                "num_steps": evaluator.eval_config.num_steps,
                "guidance_scale": evaluator.guidance_scale,
                "image_guidance_scale": evaluator.image_guidance_scale,
                "seed": evaluator.seed,
                "kind": "ode",
            },
            "significant": bool(summary["diff"] > 2 * summary["se_diff"]),
        }
    )
    if trainer.dist.is_main:
        run_dir.mkdir(parents=True, exist_ok=True)
        atomic_write_text(run_dir / HELDOUT_JSON, json.dumps(summary, indent=2) + "\n")
        if base.images is not None and trained.images is not None:
            _grid(base, trained, run_dir / HELDOUT_GRID, [r.ref_image for r in evaluator.records])
    return summary


def _reference(png: bytes, like: torch.Tensor) -> torch.Tensor:
    """A reference image as a (3, H, W) uint8 tensor of ``like``'s size (an edit's output follows
    its reference's size, so this is a no-op resize for the scene edits)."""
    image = Image.open(io.BytesIO(png)).convert("RGB")
    if image.size != (like.shape[-1], like.shape[-2]):
        image = image.resize((like.shape[-1], like.shape[-2]), Image.Resampling.BILINEAR)
    return torch.from_numpy(np.asarray(image).copy()).permute(2, 0, 1)


def _grid(base: Any, trained: Any, path: Path, references: list[bytes | None] | None = None) -> None:
    def caption(label: str, row: dict[str, Any]) -> str:
        verdict = "PASS" if row["gold"] >= 0.5 else "fail"
        return f"{label} {verdict} | {row['prompt']}"

    images, captions = [], []
    count = min(len(base.prompts), 2 * GRID_PROMPTS)
    edits = references is not None and any(r is not None for r in references[:count])
    for start in range(0, count, GRID_PROMPTS):
        rows = range(start, min(start + GRID_PROMPTS, count))
        if edits:  # the reference above the base edit and the trained edit of the same instruction
            assert references is not None
            images += [
                torch.zeros_like(base.images[i])
                if references[i] is None
                else _reference(references[i], base.images[i])
                for i in rows
            ]
            captions += [f"reference | {base.prompts[i]['prompt']}" for i in rows]
        images += [base.images[i] for i in rows] + [trained.images[i] for i in rows]
        captions += [caption("base", base.prompts[i]) for i in rows]
        captions += [caption("trained", trained.prompts[i]) for i in rows]
    sample_grid(torch.stack(images), captions, path, columns=min(GRID_PROMPTS, count), cell=192)
