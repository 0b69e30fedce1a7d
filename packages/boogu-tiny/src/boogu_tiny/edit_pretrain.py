"""Fine-tune the tiny scenes Boogu into a tiny Edit Boogu on the scene edit pairs (issue 27, item 5).

Boogu-Image-0.1's Base and Edit checkpoints share one architecture; the Edit one reads the
reference image twice, as the real model does: the VLM text encoder sees it in the user turn with
the instruction (`boogu_adapters.encoding.encode_prompts` with images), and its VAE latents enter
the transformer through the reference-image refiner (``ref_image_hidden_states``). This module
starts from the tiny T2I checkpoint pretrained on scenes (`boogu_tiny.scenes_pretrain`; the
committed one by default) and trains its transformer with the same flow-matching objective on
:mod:`boogu_data.scene_edits` pairs: the target is the edited scene, the reference the source
scene. With probability ``cond_dropout`` the instruction is replaced by the empty negative prompt,
encoded text-only as the engines encode negatives, while the reference latents stay: so CFG
contrasts "this instruction" with "no instruction, same reference", as upstream's Edit sampling
does. The VAE, the text encoder and the scheduler are the base checkpoint's, unchanged.

``uv run boogu-tiny-edit-pretrain --output-dir DIR`` writes a complete checkpoint in the released
layout plus ``edit_pretrain_report.json`` and ``samples.png`` (val pairs: reference, output, each
framed by its ``scene_edit_exact`` verdict). ``--quick`` is the smoke build.
"""

from __future__ import annotations

import argparse
import dataclasses
import io
import json
import math
import shutil
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from PIL import Image

from boogu_adapters.encoding import encode_prompts, vae_to_latents
from boogu_adapters.loading import load_boogu
from boogu_adapters.step import pad_features
from boogu_data import PromptRecord
from boogu_data.atomic import commit_folder, stage_folder
from boogu_data.scene_edits import SceneEdit, generate_edits
from boogu_data.scenes import render, render_objects
from boogu_tiny.checkpoints import DEFAULT_TRAINED_PATH, ensure_trained_checkpoint
from boogu_tiny.scenes_pretrain import (
    PretrainConfig,
    _save_transformer,
    _to_unit,
    check_output_folder,
    ode_samples,
    report_header,
    train_transformer,
    training_sigmas,
    verdict_grid,
    write_report,
)
from boogu_tiny.verify import score_edits

__all__ = ["EditPretrainConfig", "edit_pretrain", "main"]

REPORT_NAME = "edit_pretrain_report.json"


@dataclass(frozen=True)
class EditPretrainConfig:
    """Every setting of an Edit build."""

    seed: int = 0
    """Seeds the pairs (``boogu-scene-edits/{seed}/...``) and every draw of the training."""
    base: str = DEFAULT_TRAINED_PATH
    """The T2I checkpoint to start from (installed from the committed files when it is the default
    path and missing)."""
    layout: str = "grid"
    """Layout of the scenes (as the base was pretrained)."""
    train_pairs: int = 8000
    eval_pairs: int = 200
    """Val and test pairs (and new train-split pairs, ``unseen``) scored at the end (each)."""
    threads: int = 2
    steps: int = 3000
    batch: int = 32
    lr: float = 5e-4
    warmup: int = 100
    ema_decay: float = 0.999
    cond_dropout: float = 0.1
    eval_every: int = 1000
    """Steps between progress evaluations (64 val pairs; 0: none)."""
    eval_steps: int = 20
    eval_guidance: float = 4.0

    @classmethod
    def quick(cls, base: str = DEFAULT_TRAINED_PATH) -> EditPretrainConfig:
        """A smoke build (seconds): every stage runs, nothing is learned."""
        return cls(
            base=base, train_pairs=32, eval_pairs=8, steps=3, batch=4, warmup=1, eval_every=0, eval_steps=3
        )


def _images(objects: Sequence[Sequence[Any]], size: int) -> torch.Tensor:
    arrays = np.stack([np.asarray(render_objects(o, size), dtype=np.uint8) for o in objects])
    return torch.from_numpy(arrays).permute(0, 3, 1, 2).contiguous()


@torch.no_grad()
def _latents(vae: torch.nn.Module, images: torch.Tensor, chunk: int = 256) -> torch.Tensor:
    """Boogu latents (shift and scale applied) of uint8 images: the posterior means."""
    raw = torch.cat(
        [vae.encode(_to_unit(images[i : i + chunk])).latent_dist.mode() for i in range(0, len(images), chunk)]
    )
    return vae_to_latents(vae, raw)


def encode_edits(
    parts: Any, edits: Sequence[SceneEdit], size: int, chunk: int = 128
) -> tuple[torch.Tensor, torch.Tensor]:
    """Instruction features of each pair with its reference image in the VLM's user turn, and the
    empty negative (text-only) as the last row, padded to one length."""
    batches = []
    for i in range(0, len(edits), chunk):
        part = edits[i : i + chunk]
        batches.append(
            encode_prompts(
                parts.text_encoder,
                parts.processor,
                [e.instruction.text() for e in part],
                [[render(e.source, size)] for e in part],
            )
        )
    batches.append(encode_prompts(parts.text_encoder, parts.processor, [""]))
    length = max(b.hidden_states.shape[1] for b in batches)
    padded = [pad_features(b.hidden_states, b.attention_mask, length) for b in batches]
    return torch.cat([h for h, _ in padded]), torch.cat([m for _, m in padded])


def _flow_config(config: EditPretrainConfig) -> PretrainConfig:
    """The transformer-training settings of `scenes_pretrain.train_transformer`, from an Edit build's."""
    return PretrainConfig(
        seed=config.seed,
        dit_steps=config.steps,
        dit_batch=config.batch,
        dit_lr=config.lr,
        dit_warmup=config.warmup,
        ema_decay=config.ema_decay,
        cond_dropout=config.cond_dropout,
        eval_every=config.eval_every,
    )


def sample_edits(
    parts: Any, records: Sequence[PromptRecord], config: EditPretrainConfig, *, seed: int = 0
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """One ODE sample per edit row with the parts' transformer; (images, exact, dense)."""
    images = ode_samples(parts, records, config.eval_steps, config.eval_guidance, 64, seed=seed)
    return images, score_edits(images, records), score_edits(images, records, dense=True)


def evaluation_pairs(config: EditPretrainConfig) -> dict[str, list[SceneEdit]]:
    """``unseen`` (train-split pairs after the ``train_pairs`` trained on), ``val`` and ``test``."""
    return {
        "unseen": generate_edits(
            config.seed, "train", config.train_pairs + config.eval_pairs, layout=config.layout
        )[config.train_pairs :],
        "val": generate_edits(config.seed, "val", config.eval_pairs, layout=config.layout),
        "test": generate_edits(config.seed, "test", config.eval_pairs, layout=config.layout),
    }


def _summary(records: Sequence[PromptRecord], exact: torch.Tensor, dense: torch.Tensor) -> dict[str, Any]:
    ops = sorted({json.loads(r.ground_truth)["instruction"]["op"] for r in records})
    return {
        "pairs": len(records),
        "scene_edit_exact": float(exact.mean()),
        "scene_edit_exact_se": float(exact.std() / math.sqrt(len(records))) if len(records) > 1 else 0.0,
        "scene_edit_dense": float(dense.mean()),
        "scene_edit_exact_by_op": {
            op: float(exact[[json.loads(r.ground_truth)["instruction"]["op"] == op for r in records]].mean())
            for op in ops
        },
    }


def _pair_grid(records: Sequence[PromptRecord], images: torch.Tensor, verdicts: torch.Tensor) -> Image.Image:
    """Reference above output, each output framed by its verdict (8 pairs a row)."""
    refs = torch.stack(
        [
            torch.from_numpy(
                np.asarray(Image.open(io.BytesIO(r.ref_image or b"")).convert("RGB")).copy()
            ).permute(2, 0, 1)
            for r in records
        ]
    )
    columns = 8
    rows = []
    for i in range(0, len(records), columns):
        rows += [refs[i : i + columns], images[i : i + columns]]
    stacked = torch.cat(rows)
    marks = torch.cat(
        [
            torch.cat([torch.ones(len(refs[i : i + columns])), verdicts[i : i + columns]])
            for i in range(0, len(records), columns)
        ]
    )
    return verdict_grid(stacked, marks, columns)


def edit_pretrain(
    output_dir: str | Path, config: EditPretrainConfig, *, log: Callable[[str], None] = print
) -> dict[str, Any]:
    """Build the tiny Edit checkpoint into ``output_dir`` (atomic); returns the report."""
    output = Path(output_dir).expanduser().absolute()
    check_output_folder(output, REPORT_NAME, "boogu-tiny-edit-pretrain")
    torch.set_num_threads(config.threads)
    base = Path(config.base).expanduser()
    if str(config.base) == DEFAULT_TRAINED_PATH:
        base = ensure_trained_checkpoint(base)
    parts = load_boogu(base, transformer="native")
    size = int(parts.vae.config.sample_size)
    times: dict[str, float] = {}
    begin = time.perf_counter()

    t = time.perf_counter()
    train = generate_edits(config.seed, "train", config.train_pairs, layout=config.layout)
    evals = evaluation_pairs(config)
    targets = _latents(parts.vae, _images([e.target() for e in train], size))
    references = _latents(parts.vae, _images([e.source.objects for e in train], size))
    hidden, mask = encode_edits(parts, train, size)
    sigma_levels = training_sigmas(parts.schedule_config)
    times["data"] = time.perf_counter() - t
    log(
        f"pairs: {len(train)} train ({hidden.shape[1]} instruction tokens with the reference), "
        f"{config.eval_pairs} each of unseen/val/test ({times['data']:.0f} s)"
    )
    val_records = [e.record("val", i, size) for i, e in enumerate(evals["val"])]
    progress: list[dict[str, float]] = []

    def evaluate(model: torch.nn.Module, step: int) -> None:
        _, exact, dense = sample_edits(
            dataclasses.replace(parts, transformer=model), val_records[:64], config
        )
        progress.append({"step": step, "val_exact": float(exact.mean()), "val_dense": float(dense.mean())})
        log(
            f"  eval at step {step}: val scene_edit_exact {exact.mean():.3f}, dense {dense.mean():.3f} (64 pairs)"
        )

    _, base_exact, base_dense = sample_edits(parts, val_records[:64], config)
    log(
        f"the T2I base on {len(val_records[:64])} val pairs: scene_edit_exact {base_exact.mean():.3f}, "
        f"dense {base_dense.mean():.3f}"
    )

    t = time.perf_counter()
    model = parts.transformer
    model.requires_grad_(True)
    ema, losses = train_transformer(
        model, targets, hidden, mask, sigma_levels, _flow_config(config), log, evaluate, references=references
    )
    times["transformer"] = time.perf_counter() - t

    t = time.perf_counter()
    trained = dataclasses.replace(parts, transformer=ema)
    scores: dict[str, dict[str, Any]] = {}
    grid = None
    for split, pairs in evals.items():
        records = [e.record("train" if split == "unseen" else split, i, size) for i, e in enumerate(pairs)]
        images, exact, dense = sample_edits(trained, records, config)
        scores[split] = _summary(records, exact, dense)
        if split == "val":
            grid = _pair_grid(records[:32], images[:32], exact[:32])
        log(
            f"{split}: scene_edit_exact {exact.mean():.3f} ± {scores[split]['scene_edit_exact_se']:.3f}, dense {dense.mean():.3f}"
        )
    times["evaluation"] = time.perf_counter() - t
    times["total"] = time.perf_counter() - begin
    report = {
        **report_header(config, times),
        "t2i_base_val": {
            "pairs": len(val_records[:64]),
            "scene_edit_exact": float(base_exact.mean()),
            "scene_edit_dense": float(base_dense.mean()),
        },
        "transformer": {
            "final_loss": float(np.mean(losses[-250:])),
            "loss_every_250": [
                round(float(np.mean(losses[i : i + 250])), 4) for i in range(0, len(losses), 250)
            ],
            "progress": progress,
        },
        "sampler": {"num_steps": config.eval_steps, "guidance_scale": config.eval_guidance, "sampler": "ode"},
        "scores": scores,
    }
    staging = stage_folder(output)
    try:
        shutil.copytree(
            base,
            staging,
            dirs_exist_ok=True,
            ignore=shutil.ignore_patterns("pretrain_report.json", "samples.png", ".boogu-tiny.json"),
        )
        _save_transformer(ema, staging / "transformer")
        assert grid is not None
        grid.save(staging / "samples.png")
        write_report(staging, REPORT_NAME, report)
        commit_folder(staging, output)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    log(f"wrote {output} in {times['total'] / 60:.1f} min")
    return report


def main(argv: Sequence[str] | None = None) -> int:
    """``boogu-tiny-edit-pretrain``: fine-tune the tiny scenes checkpoint on the scene edit pairs."""
    parser = argparse.ArgumentParser(prog="boogu-tiny-edit-pretrain", description=__doc__.split("\n\n")[0])
    parser.add_argument("--output-dir", required=True, help="where the Edit checkpoint goes")
    parser.add_argument("--base", default=DEFAULT_TRAINED_PATH, help="the T2I checkpoint to start from")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--quick", action="store_true", help="a smoke build in seconds (nothing is learned)")
    parser.add_argument(
        "--set", action="append", default=[], metavar="KEY=VALUE", help="an EditPretrainConfig field"
    )
    args = parser.parse_args(argv)
    config = EditPretrainConfig.quick(args.base) if args.quick else EditPretrainConfig(base=args.base)
    fields = {f.name: f for f in dataclasses.fields(EditPretrainConfig)}
    changes: dict[str, Any] = {"seed": args.seed}
    for item in args.set:
        key, sep, value = item.partition("=")
        if not sep or key not in fields or key in ("base", "seed"):
            print(
                f"boogu-tiny-edit-pretrain: --set {item!r}: expected KEY=VALUE, KEY one of {sorted(set(fields) - {'base', 'seed'})}",
                file=sys.stderr,
            )
            return 2
        kind = type(getattr(config, key))
        try:
            changes[key] = kind(value)
        except ValueError:
            print(f"boogu-tiny-edit-pretrain: --set {item!r}: {key} takes a {kind.__name__}", file=sys.stderr)
            return 2
    edit_pretrain(args.output_dir, dataclasses.replace(config, **changes))
    return 0
