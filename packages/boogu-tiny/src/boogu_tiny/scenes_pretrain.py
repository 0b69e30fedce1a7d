"""Pretrain the tiny Boogu on procedural scenes: the checkpoint that ``boogu-tiny --trained`` installs.

``uv run boogu-tiny-pretrain --output-dir DIR`` rebuilds it from nothing, on a CPU, in stages:

1. **Scenes** (:mod:`boogu_data.scenes`): ``train_scenes`` train captions and renders, drawn from the
   scene set's own seeded streams; the val and test splits hold out colour-shape pairs.
2. **The rest of the checkpoint**: the tiny random build (:func:`boogu_tiny.checkpoints.ensure_tiny_checkpoint`,
   seed 42): processor, scheduler, the tiny Qwen3-VL text encoder, with a text side of its own
   (``scene_vocabulary``): the byte-level tokenizer also learns the scene words (:func:`scene_corpus`),
   so every colour, shape, number and relation is one token, and the text encoder is rebuilt for
   that vocabulary. It stays random and frozen: its features carry the caption's tokens, and the
   transformer learns to read them.
3. **VAE**: a FLUX-layout ``AutoencoderKL`` (16 latent channels, 8x down, no quant convs; widths
   ``vae_widths``) trained on the renders with an L2 loss that weights object (non-white) pixels
   ``vae_object_weight`` times (plain L2 paints every object in the palette's mean colour) and a
   tiny KL term. Its ``shift_factor``/``scaling_factor`` are then set from the train latents (mean 0,
   std 1), as the FLUX VAE's were.
4. **Transformer**: ``BooguImageTransformer2DModel(**TINY_CONFIG)`` with ``hidden_size`` 128 and ``patch_size`` 1 from upstream's
   init, trained with the flow-matching objective in Boogu's conventions (docs/upstream-model.md §8):
   a noise level ``sigma`` from the checkpoint's schedule (static v1 shift, ``seq_len``
   ``schedule_seq_len``; 1000 levels),
   ``x_t = (1 - sigma) x0 + sigma eps``, time ``t = 1 - sigma``, velocity target ``x0 - eps``; the
   caption is replaced by the empty negative prompt with probability ``cond_dropout``, so CFG works.
   AdamW, warm-up then cosine decay; the saved weights are an EMA of the trained ones.
5. **Evaluation**: PSNR of the VAE on held-out renders; the ``scene_exact``/``scene_dense`` verifier
   (:mod:`boogu_tiny.verify`) on samples of val and test prompts (ODE, ``eval_steps`` steps,
   CFG ``eval_guidance``), one sample per prompt, the seeds fixed.

The output folder is a complete checkpoint in the released layout (every loader and engine reads it
unchanged) plus ``pretrain_report.json`` (settings, stage times, losses, the scores) and
``samples.png`` (val prompts, with each image's verdict). ``--save-assets`` then copies it into
``boogu_tiny/assets/tiny_scenes/`` with a manifest of hashes: what ``boogu-tiny --trained``
installs. Deterministic for a seed and thread count (``threads``, default 1): the data, the
initialisations and every draw come from seeded generators, and the CPU kernels used reduce in a
fixed order for a fixed thread count. One thread is the default because it is also the fastest
choice on a shared 2-core machine (measured: a VAE step 0.45 s on one thread, 0.75 s on two while
another job used a core); ``torch.use_deterministic_algorithms`` is not set (it made a VAE step 17x
slower on two threads).
"""

from __future__ import annotations

import os

# Before torch loads OpenMP: spinning idle threads make a build on a busy machine many times slower
# (the trainer's CLI does the same; benchmarks/README.md).
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import argparse
import dataclasses
import functools
import json
import logging
import math
import shutil
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from copy import deepcopy
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from PIL import Image, ImageDraw

from boogu_adapters.components import build_local_engine
from boogu_adapters.encoding import decode_latents, encode_prompts, vae_to_latents
from boogu_adapters.loading import load_boogu
from boogu_adapters.model import TINY_CONFIG, BooguImageTransformer2DModel, get_freqs_cis
from boogu_adapters.step import _forward, pad_features
from boogu_adapters.types import RolloutRequest
from boogu_data import PromptRecord
from boogu_data.atomic import check_replaceable, commit_folder, folder_manifest, stage_folder
from boogu_data.scenes import COLOURS, NUMBERS, RELATIONS, SHAPES, generate_scenes, render
from boogu_schedule import BooguScheduleConfig, boogu_sigmas, flow_target, forward_noise, make_generator
from boogu_schedule.sde import Sampler
from boogu_tiny.checkpoints import (
    RELEASED_SCHEDULER_CONFIG,
    ensure_tiny_checkpoint,
    save_trained_assets,
    write_text_side,
)
from boogu_tiny.verify import score_scenes

__all__ = [
    "FlowBatch",
    "PretrainConfig",
    "draw_flow_batch",
    "evaluate_checkpoint",
    "evaluation_scenes",
    "flow_matching_loss",
    "main",
    "pretrain",
    "training_sigmas",
]

logger = logging.getLogger(__name__)

REPORT_NAME = "pretrain_report.json"
TEXT_SEED = 42
"""Seed of the tiny random build whose processor, scheduler and text encoder the checkpoint starts from."""


@dataclass(frozen=True)
class PretrainConfig:
    """Every setting of a build; the defaults are the committed checkpoint's."""

    seed: int = 0
    """Seeds the scenes (``boogu-scenes/{seed}/...``), the VAE and transformer inits and every draw."""
    size: int = 64
    """Image side in pixels: 64 image tokens at 64² (8x VAE, patch size 1). 128² (256 tokens, the VAE
    trained on 64² crops) learned worse at equal wall time (docs/tiny-model.md)."""
    scene_layout: str = "grid"
    """Layout of the training scenes (:func:`boogu_data.scenes.sample_scene`): ``grid`` puts every
    object on whole latent cells, so a shape has one latent pattern instead of 64 sub-cell phases;
    at equal steps it doubled the exact score of ``free`` (docs/tiny-model.md). Captions are the same."""
    train_scenes: int = 8000
    eval_prompts: int = 200
    """Val and test prompts scored at the end (each)."""
    threads: int = 2
    hidden_size: int = 128
    """The transformer's width (TINY_CONFIG has 64); its heads stay 16 wide (``hidden_size // 16`` query
    heads, half as many kv heads). At equal steps 128 reached a lower loss and about twice the exact
    score of 64 (docs/tiny-model.md, runs e1/e2)."""
    num_layers: int = 2
    """Transformer blocks, double-stream ones included (TINY_CONFIG: 2)."""
    num_double_stream_layers: int = 1
    patch_size: int = 1
    """The transformer's patch size (TINY_CONFIG has 2): 1 gives one image token per 8x8 pixels, so
    that a shape spans several tokens."""
    schedule_seq_len: int = 256
    """``seq_len`` of the checkpoint's static v1 time shift (released: 4096, shift e^1.15 = 3.2, for
    4096-token images); 256 gives the formula's smallest shift, e^0.5 = 1.65 (these images have 64 tokens)."""
    vae_widths: tuple[int, ...] = (8, 16, 32, 64)
    vae_groups: int = 8
    vae_steps: int = 2000
    vae_batch: int = 16
    vae_crop: int = 64
    """The VAE trains on random ``vae_crop``² windows of the renders (8-pixel aligned; a convolutional
    autoencoder does not need the whole image), a quarter of the cost per step at 128²."""
    vae_lr: float = 2e-3
    vae_object_weight: float = 10.0
    vae_kl_weight: float = 1e-6
    dit_steps: int = 4500
    dit_batch: int = 32
    dit_lr: float = 1e-3
    dit_warmup: int = 200
    ema_decay: float = 0.999
    cond_dropout: float = 0.1
    scene_vocabulary: bool = True
    """Give the checkpoint a text side of its own (:func:`boogu_tiny.checkpoints.write_text_side`): the
    tokenizer also learns the scene words (one token each: "circle" was five byte pieces), the
    random frozen text encoder is sized to it. ``False`` keeps the random build's."""
    eval_every: int = 1500
    """Transformer steps between progress evaluations (64 val prompts; 0: none)."""
    eval_steps: int = 20
    eval_guidance: float = 4.0

    @classmethod
    def quick(cls) -> PretrainConfig:
        """A smoke build (seconds): every stage runs, nothing is learned."""
        return cls(
            train_scenes=64,
            eval_prompts=8,
            vae_steps=3,
            vae_batch=4,
            dit_steps=4,
            dit_batch=4,
            dit_warmup=2,
            eval_every=0,
            eval_steps=4,
        )


# ----------------------------------------------------------------------------------------- stages


def scene_corpus() -> list[str]:
    """Every word of the scene grammar (boogu_data.scenes), in caption-like phrases: the tokenizer's
    extra training text, so that each colour, shape, number and relation becomes one token."""
    phrases = [f"a {colour} {shape}" for colour in COLOURS for shape in SHAPES]
    phrases += [f"{number} {colour} {shape}s" for number in NUMBERS for colour in COLOURS for shape in SHAPES]
    phrases += [f"a red circle {relation} a blue square" for relation in RELATIONS]
    phrases.append("a red circle and a blue square")
    return phrases


def _images(scenes: Sequence[Any], size: int) -> torch.Tensor:
    """uint8 (N, 3, size, size) renders."""
    arrays = np.stack([np.asarray(render(scene, size), dtype=np.uint8) for scene in scenes])
    return torch.from_numpy(arrays).permute(0, 3, 1, 2).contiguous()


def _records(scenes: Sequence[Any], split: str) -> list[PromptRecord]:
    return [scene.record(split, i) for i, scene in enumerate(scenes)]


def _split_records(scenes: Sequence[Any], split: str) -> list[PromptRecord]:
    """Records of an :func:`evaluation_scenes` split (``unseen`` scenes are train-split rows)."""
    return _records(scenes, "train" if split == "unseen" else split)


def _to_unit(images: torch.Tensor) -> torch.Tensor:
    return images.float() / 127.5 - 1.0


def psnr(a: torch.Tensor, b: torch.Tensor) -> float:
    """Mean PSNR (dB) of two uint8 image batches."""
    mse = (a.float() - b.float()).pow(2).mean(dim=(1, 2, 3)).clamp_min(1e-10)
    return float((10 * torch.log10(255.0**2 / mse)).mean())


def _lr(step: int, steps: int, peak: float, warmup: int) -> float:
    """Linear warm-up, then cosine decay to a tenth of the peak."""
    if step < warmup:
        return peak * (step + 1) / warmup
    progress = (step - warmup) / max(1, steps - warmup)
    return peak * (0.1 + 0.9 * 0.5 * (1.0 + math.cos(math.pi * progress)))


def _build_vae(config: PretrainConfig, generator_seed: int):
    from diffusers import AutoencoderKL

    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(generator_seed)
        return AutoencoderKL(
            in_channels=3,
            out_channels=3,
            latent_channels=16,
            down_block_types=["DownEncoderBlock2D"] * len(config.vae_widths),
            up_block_types=["UpDecoderBlock2D"] * len(config.vae_widths),
            block_out_channels=list(config.vae_widths),
            layers_per_block=1,
            norm_num_groups=config.vae_groups,
            sample_size=config.size,
            use_quant_conv=False,
            use_post_quant_conv=False,
            scaling_factor=1.0,
            shift_factor=0.0,
        )


def _crop(images: torch.Tensor, side: int, generator: torch.Generator) -> torch.Tensor:
    """One random ``side``² window of a batch, its corner on the 8-pixel grid (the VAE's cell)."""
    height, width = images.shape[-2:]
    if side >= min(height, width):
        return images
    top, left = (
        int(torch.randint(0, (extent - side) // 8 + 1, (), generator=generator, device=generator.device)) * 8
        for extent in (height, width)
    )
    return images[..., top : top + side, left : left + side]


def train_vae(
    vae: torch.nn.Module, images: torch.Tensor, config: PretrainConfig, log: Callable[[str], None]
) -> list[float]:
    """Train ``vae`` in place on uint8 ``images``; returns the loss of every step."""
    generator = make_generator(config.seed * 1000 + 1)
    optimizer = torch.optim.AdamW(vae.parameters(), lr=config.vae_lr, weight_decay=0.0)
    vae.train()
    losses: list[float] = []
    start = time.perf_counter()
    for step in range(config.vae_steps):
        for group in optimizer.param_groups:
            group["lr"] = _lr(step, config.vae_steps, config.vae_lr, min(50, config.vae_steps))
        x = _to_unit(
            _crop(
                images[
                    torch.randint(
                        0, images.shape[0], (config.vae_batch,), generator=generator, device=generator.device
                    )
                ],
                config.vae_crop,
                generator,
            )
        )
        posterior = vae.encode(x).latent_dist
        reconstruction = vae.decode(posterior.sample(generator=generator)).sample
        # Object pixels (any channel well below white) weigh vae_object_weight times the background.
        weight = 1.0 + (config.vae_object_weight - 1.0) * (x.min(dim=1, keepdim=True).values < 0.9).float()
        loss = (weight * (reconstruction - x).pow(2)).mean() + config.vae_kl_weight * posterior.kl().mean()
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
        if (step + 1) % 100 == 0 or step + 1 == config.vae_steps:
            rate = (time.perf_counter() - start) / (step + 1)
            log(
                f"vae step {step + 1}/{config.vae_steps} loss {np.mean(losses[-100:]):.4f} "
                f"({rate:.2f} s/step, {rate * (config.vae_steps - step - 1) / 60:.1f} min left)"
            )
    vae.eval()
    return losses


@torch.no_grad()
def encode_images(vae: torch.nn.Module, images: torch.Tensor, chunk: int = 256) -> torch.Tensor:
    """The posterior means of uint8 ``images`` (raw VAE latents, before shift and scale)."""
    return torch.cat(
        [vae.encode(_to_unit(images[i : i + chunk])).latent_dist.mode() for i in range(0, len(images), chunk)]
    )


@torch.no_grad()
def reconstruct(vae: torch.nn.Module, images: torch.Tensor) -> torch.Tensor:
    """uint8 reconstructions through the Boogu latent convention (shift and scale included)."""
    return decode_latents(vae, vae_to_latents(vae, encode_images(vae, images)))


@torch.no_grad()
def encode_captions(
    parts: Any, captions: Sequence[str], chunk: int = 256
) -> tuple[torch.Tensor, torch.Tensor]:
    """Instruction features of ``captions`` and of the empty negative (last row), padded to one length."""
    embeds = [
        encode_prompts(parts.text_encoder, parts.processor, list(captions[i : i + chunk]))
        for i in range(0, len(captions), chunk)
    ]
    embeds.append(encode_prompts(parts.text_encoder, parts.processor, [""]))
    length = max(e.hidden_states.shape[1] for e in embeds)
    padded = [pad_features(e.hidden_states, e.attention_mask, length) for e in embeds]
    return torch.cat([h for h, _ in padded]), torch.cat([m for _, m in padded])


def training_sigmas(schedule_config: BooguScheduleConfig) -> torch.Tensor:
    """The noise levels the transformer trains on: the checkpoint's schedule at 1000 levels, the last
    (``sigma = 0``, clean data) left out. (1000,) float32."""
    return boogu_sigmas(schedule_config, 1000)[:-1]


@dataclass(frozen=True)
class FlowBatch:
    """One flow-matching mini-batch of `draw_flow_batch` (B rows)."""

    rows: torch.Tensor
    """(B,) int64: the rows of the latents (and of their captions) drawn, with replacement."""
    x0: torch.Tensor
    """(B, C, h, w): the clean latents ``latents[rows]``."""
    noise: torch.Tensor
    """(B, C, h, w): standard normal noise ``eps``."""
    sigma: torch.Tensor
    """(B,) float32: each row's noise level, uniform over the levels given."""
    text_rows: torch.Tensor
    """(B,) int64: the feature row each sample is conditioned on: ``rows``, or the empty negative's
    row where the caption is dropped."""


def draw_flow_batch(
    latents: torch.Tensor,
    batch_size: int,
    sigma_levels: torch.Tensor,
    cond_dropout: float,
    empty_row: int,
    generator: torch.Generator,
) -> FlowBatch:
    """Draw a flow-matching batch from ``generator``, in a fixed order (rows, noise, levels, dropout):
    rows of ``latents`` uniformly with replacement, a level of ``sigma_levels`` per row, and the caption
    replaced by the empty negative (feature row ``empty_row``) with probability ``cond_dropout``."""
    rows = torch.randint(0, latents.shape[0], (batch_size,), generator=generator, device=generator.device)
    x0 = latents[rows]
    noise = torch.randn(x0.shape, generator=generator, device=generator.device)
    sigma = sigma_levels[
        torch.randint(0, sigma_levels.numel(), (batch_size,), generator=generator, device=generator.device)
    ]
    dropped = torch.rand(batch_size, generator=generator, device=generator.device) < cond_dropout
    text_rows = torch.where(dropped, torch.full_like(rows, empty_row), rows)
    return FlowBatch(rows=rows, x0=x0, noise=noise, sigma=sigma, text_rows=text_rows)


def flow_matching_loss(
    model: torch.nn.Module,
    batch: FlowBatch,
    hidden: torch.Tensor,
    mask: torch.Tensor,
    freqs: Sequence[torch.Tensor],
    references: torch.Tensor | None = None,
) -> torch.Tensor:
    """The pretraining's objective on one batch (docs/upstream-model.md §8, DESIGN.md §4.8): the
    transformer sees ``x_t = (1 - sigma) x0 + sigma eps`` at Boogu time ``t = 1 - sigma`` and is
    regressed onto the velocity ``x0 - eps``; mean squared error, in float32. ``hidden``/``mask``:
    right-padded caption features indexed by ``batch.text_rows``; ``references``: one reference
    latent per latent row (an Edit build)."""
    text_mask = mask[batch.text_rows]
    length = int(text_mask.sum(1).max())  # right-padded: trim the columns no row uses
    velocity = _forward(
        model,
        forward_noise(batch.x0, batch.noise, batch.sigma),
        1.0 - batch.sigma,
        hidden[batch.text_rows, :length],
        text_mask[:, :length],
        None if references is None else [[references[r]] for r in batch.rows.tolist()],
        freqs,
        text_mask.sum(1).tolist(),
    )
    # Float32 whatever the transformer's dtype (DESIGN.md §4.8): the squared error of a bf16 velocity
    # would round away the small differences the gradient is made of.
    return (velocity.float() - flow_target(batch.x0, batch.noise)).pow(2).mean()


def train_transformer(
    model: torch.nn.Module,
    latents: torch.Tensor,
    hidden: torch.Tensor,
    mask: torch.Tensor,
    sigma_levels: torch.Tensor,
    config: PretrainConfig,
    log: Callable[[str], None],
    evaluate: Callable[[torch.nn.Module, int], None] | None = None,
    references: torch.Tensor | None = None,
) -> tuple[torch.nn.Module, list[float]]:
    """Flow-matching training of ``model`` on Boogu latents; returns (EMA model, step losses).

    ``hidden``/``mask`` hold one row per latent and the empty negative prompt as their last row.
    ``references`` (an Edit build, `boogu_tiny.edit_pretrain`): one reference latent per row,
    given to the transformer's reference-image refiner; a dropped instruction keeps its reference.
    """
    generator = make_generator(config.seed * 1000 + 2)
    optimizer = torch.optim.AdamW(model.parameters(), lr=config.dit_lr, betas=(0.9, 0.99), weight_decay=0.0)
    ema = _copy_model(model)
    freqs = get_freqs_cis(model.config.axes_dim_rope, model.config.axes_lens, 10000.0)
    empty = hidden.shape[0] - 1
    model.train()
    losses: list[float] = []
    start = time.perf_counter()
    for step in range(config.dit_steps):
        for group in optimizer.param_groups:
            group["lr"] = _lr(step, config.dit_steps, config.dit_lr, config.dit_warmup)
        batch = draw_flow_batch(
            latents, config.dit_batch, sigma_levels, config.cond_dropout, empty, generator
        )
        loss = flow_matching_loss(model, batch, hidden, mask, freqs, references)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        decay = min(config.ema_decay, (1.0 + step) / (10.0 + step))
        with torch.no_grad():
            for e, p in zip(ema.parameters(), model.parameters(), strict=True):
                e.lerp_(p, 1.0 - decay)
        losses.append(loss.item())
        done = step + 1
        if done % 250 == 0 or done == config.dit_steps:
            rate = (time.perf_counter() - start) / done
            log(
                f"transformer step {done}/{config.dit_steps} loss {np.mean(losses[-250:]):.4f} "
                f"({rate:.3f} s/step, {rate * (config.dit_steps - done) / 60:.1f} min left)"
            )
        if (
            evaluate is not None
            and config.eval_every
            and done % config.eval_every == 0
            and done < config.dit_steps
        ):
            evaluate(ema, done)
            model.train()
    ema.eval()
    return ema, losses


def transformer_config(config: PretrainConfig) -> dict[str, Any]:
    """``TINY_CONFIG`` with the build's width, depth and patch size (heads 16 wide, GQA 2:1 as in TINY_CONFIG)."""
    if config.hidden_size % 32:
        raise ValueError(
            f"hidden_size must be a multiple of 32 (16-wide heads, 2 per kv head), got {config.hidden_size}"
        )
    heads = config.hidden_size // 16
    return {
        **TINY_CONFIG,
        "hidden_size": config.hidden_size,
        "num_attention_heads": heads,
        "num_kv_heads": heads // 2,
        "num_layers": config.num_layers,
        "num_double_stream_layers": config.num_double_stream_layers,
        "patch_size": config.patch_size,
    }


def _copy_model(model: torch.nn.Module) -> torch.nn.Module:
    copy = deepcopy(model)  # not a rebuild from model.config: a loaded model's config carries auto_map
    copy.requires_grad_(False)
    return copy


def sample_and_score(
    parts: Any, records: Sequence[PromptRecord], config: PretrainConfig, *, seed: int = 0
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """One ODE sample per record with the parts' transformer; (images, exact, dense)."""
    images = ode_samples(parts, records, config.eval_steps, config.eval_guidance, config.size, seed=seed)
    return images, score_scenes(images, records, "exact"), score_scenes(images, records, "dense")


def ode_samples(
    parts: Any, records: Sequence[PromptRecord], num_steps: int, guidance: float, size: int, *, seed: int = 0
) -> torch.Tensor:
    """One ODE sample per record (uint8 images; an edit row's output takes its reference's size)."""
    batch = build_local_engine(parts).generate(
        RolloutRequest(
            records=list(records),
            group_size=1,
            num_steps=num_steps,
            guidance_scale=guidance,
            sampler=Sampler.ODE,
            noise_level=0.0,
            height=size,
            width=size,
            seed=seed,
        )
    )
    return batch.images


def evaluation_scenes(config: PretrainConfig) -> dict[str, list[Any]]:
    """The scenes a build is scored on: ``eval_prompts`` of ``unseen`` (the train-split scenes after
    the ``train_scenes`` it trains on: new scenes of seen colour-shape pairs; the split has only 396
    distinct captions, so theirs recur in training), ``val`` and ``test`` (held-out pairs)."""
    draw = functools.partial(generate_scenes, config.seed, layout=config.scene_layout)
    return {
        "unseen": draw("train", config.train_scenes + config.eval_prompts)[config.train_scenes :],
        "val": draw("val", config.eval_prompts),
        "test": draw("test", config.eval_prompts),
    }


def score_split(
    parts: Any, records: Sequence[PromptRecord], config: PretrainConfig
) -> tuple[torch.Tensor, torch.Tensor, dict[str, Any]]:
    """One ODE sample per record, scored: (images, exact, summary with the standard error and the
    exact score per task)."""
    images, exact, dense = sample_and_score(parts, records, config)
    summary = {
        "prompts": len(records),
        "scene_exact": float(exact.mean()),
        "scene_exact_se": float(exact.std() / math.sqrt(len(records))) if len(records) > 1 else 0.0,
        "scene_dense": float(dense.mean()),
        "scene_exact_by_task": {
            tag: float(exact[[r.ability == tag for r in records]].mean())
            for tag in sorted({r.ability for r in records})
        },
    }
    return images, exact, summary


def evaluate_checkpoint(folder: str | os.PathLike[str], config: PretrainConfig) -> dict[str, dict[str, Any]]:
    """Score a built checkpoint on :func:`evaluation_scenes` (what ``--evaluate DIR`` prints)."""
    torch.set_num_threads(config.threads)
    parts = load_boogu(Path(folder).expanduser(), transformer="native")
    return {
        split: score_split(parts, _split_records(scenes, split), config)[2]
        for split, scenes in evaluation_scenes(config).items()
    }


def verdict_grid(images: torch.Tensor, verdicts: torch.Tensor, columns: int = 8) -> Image.Image:
    """A grid of uint8 images, each framed green (verdict 1) or red (0)."""
    n, _, h, w = images.shape
    rows = math.ceil(n / columns)
    border = 2
    grid = Image.new("RGB", (columns * (w + 2 * border), rows * (h + 2 * border)), (255, 255, 255))
    draw = ImageDraw.Draw(grid)
    for i in range(n):
        x, y = (i % columns) * (w + 2 * border), (i // columns) * (h + 2 * border)
        colour = (40, 170, 60) if verdicts[i] >= 0.5 else (200, 40, 40)
        draw.rectangle([x, y, x + w + 2 * border - 1, y + h + 2 * border - 1], fill=colour)
        grid.paste(Image.fromarray(images[i].permute(1, 2, 0).numpy()), (x + border, y + border))
    return grid


# ------------------------------------------------------------------------------------------ build


def pretrain(
    output_dir: str | os.PathLike[str], config: PretrainConfig, *, log: Callable[[str], None] = print
) -> dict:
    """Build the pretrained tiny checkpoint into ``output_dir`` (atomic); returns the report."""
    output = Path(output_dir).expanduser().absolute()
    check_output_folder(output, REPORT_NAME, "boogu-tiny-pretrain")
    torch.set_num_threads(config.threads)
    times: dict[str, float] = {}
    begin = time.perf_counter()

    t = time.perf_counter()
    train = generate_scenes(config.seed, "train", config.train_scenes, layout=config.scene_layout)
    evals = evaluation_scenes(config)
    train_images = _images(train, config.size)
    val_images = _images(evals["val"], config.size)
    times["scenes"] = time.perf_counter() - t
    log(
        f"scenes: {len(train)} train, {config.eval_prompts} val, {config.eval_prompts} test ({times['scenes']:.0f} s)"
    )

    with tempfile.TemporaryDirectory(prefix="boogu-pretrain-") as scratch:
        base = ensure_tiny_checkpoint(Path(scratch) / "random", seed=TEXT_SEED)
        if config.scene_vocabulary:
            write_text_side(base, seed=TEXT_SEED + 2, corpus=scene_corpus())
        parts = load_boogu(base, transformer="native")

        t = time.perf_counter()
        vae = _build_vae(config, config.seed * 1000 + 3)
        vae_losses = train_vae(vae, train_images, config, log)
        raw = encode_images(vae, train_images)
        shift = float(raw.mean())
        scale = float(1.0 / (raw - shift).std())
        vae.register_to_config(shift_factor=shift, scaling_factor=scale)
        latents = vae_to_latents(vae, raw)
        recon = reconstruct(vae, val_images)
        vae_psnr = psnr(recon, val_images)
        val_records = _records(evals["val"], "val")
        recon_exact = float(score_scenes(recon, val_records, "exact").mean())
        times["vae"] = time.perf_counter() - t
        log(
            f"vae: {sum(p.numel() for p in vae.parameters()):,} parameters, val PSNR {vae_psnr:.2f} dB, "
            f"scene_exact of its reconstructions {recon_exact:.3f} ({times['vae'] / 60:.1f} min)"
        )

        t = time.perf_counter()
        hidden, mask = encode_captions(parts, [s.caption() for s in train])
        scheduler = {**RELEASED_SCHEDULER_CONFIG, "seq_len": config.schedule_seq_len}
        parts = dataclasses.replace(parts, schedule_config=BooguScheduleConfig.from_dict(scheduler))
        sigma_levels = training_sigmas(parts.schedule_config)
        times["captions"] = time.perf_counter() - t
        parts = dataclasses.replace(parts, vae=vae)

        progress: list[dict[str, float]] = []

        def evaluate(model: torch.nn.Module, step: int) -> None:
            _, exact, dense = sample_and_score(
                dataclasses.replace(parts, transformer=model), val_records[:64], config
            )
            progress.append(
                {"step": step, "val_exact": float(exact.mean()), "val_dense": float(dense.mean())}
            )
            log(
                f"  eval at step {step}: val scene_exact {exact.mean():.3f}, scene_dense {dense.mean():.3f} (64 prompts)"
            )

        t = time.perf_counter()
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(config.seed * 1000 + 4)
            model = BooguImageTransformer2DModel(**transformer_config(config))
        ema, dit_losses = train_transformer(model, latents, hidden, mask, sigma_levels, config, log, evaluate)
        times["transformer"] = time.perf_counter() - t

        t = time.perf_counter()
        trained = dataclasses.replace(parts, transformer=ema)
        scores: dict[str, dict[str, Any]] = {}
        grid_images = grid_verdicts = None
        for split, scenes in evals.items():
            images, exact, scores[split] = score_split(trained, _split_records(scenes, split), config)
            if split == "val":
                grid_images, grid_verdicts = images[:32], exact[:32]
            log(
                f"{split}: scene_exact {exact.mean():.3f} ± {scores[split]['scene_exact_se']:.3f}, "
                f"dense {scores[split]['scene_dense']:.3f}"
            )
        times["evaluation"] = time.perf_counter() - t
        times["total"] = time.perf_counter() - begin

        report = {
            **report_header(config, times),
            "vae": {
                "parameters": sum(p.numel() for p in vae.parameters()),
                "val_psnr_db": round(vae_psnr, 3),
                "val_reconstruction_scene_exact": recon_exact,
                "shift_factor": shift,
                "scaling_factor": scale,
                "final_loss": float(np.mean(vae_losses[-100:])),
            },
            "transformer": {
                "parameters": sum(p.numel() for p in ema.parameters()),
                "final_loss": float(np.mean(dit_losses[-250:])),
                "loss_every_250": [
                    round(float(np.mean(dit_losses[i : i + 250])), 4) for i in range(0, len(dit_losses), 250)
                ],
                "progress": progress,
            },
            "sampler": {
                "num_steps": config.eval_steps,
                "guidance_scale": config.eval_guidance,
                "sampler": "ode",
            },
            "scores": scores,
        }
        staging = stage_folder(output)
        try:
            shutil.copytree(base, staging, dirs_exist_ok=True)
            shutil.rmtree(staging / "vae")
            vae.save_pretrained(staging / "vae", safe_serialization=True)
            _save_transformer(ema, staging / "transformer")
            (staging / "scheduler" / "scheduler_config.json").write_text(
                json.dumps(scheduler, indent=2, sort_keys=True) + "\n", encoding="utf-8"
            )
            verdict_grid(grid_images, grid_verdicts).save(staging / "samples.png")
            write_report(staging, REPORT_NAME, report)
            commit_folder(staging, output)
        except BaseException:
            shutil.rmtree(staging, ignore_errors=True)
            raise
    log(f"wrote {output} in {times['total'] / 60:.1f} min")
    return report


def check_output_folder(output: Path, report_name: str, command: str) -> None:
    """Refuse, before any work, to build into a folder holding anything ``command`` did not write.

    A missing or empty folder may be written. A non-empty one only when it is an earlier build of the
    same command, file for file: its report (``report_name``) lists every file the build wrote with
    its size and SHA-256 (:func:`write_report`), and nothing else may be there (a file of yours, a
    changed file, a link: `boogu_data.atomic.foreign_files`). The folder is left as it is on refusal."""
    if not output.exists() or not any(output.iterdir()):
        return
    report = output / report_name
    if not report.is_file():
        raise FileExistsError(f"{output} exists and is not a {command} output; refusing to replace it")
    try:
        files = json.loads(report.read_text(encoding="utf-8"))["files"]
        if not isinstance(files, dict):
            raise TypeError
    except (ValueError, KeyError, TypeError):
        raise FileExistsError(
            f"{output}: its {report_name} lists no files (a build older than this command's file "
            f"manifest), so what else is in the folder cannot be told apart; refusing to replace it. "
            "Delete the folder yourself, or choose another output folder"
        ) from None
    check_replaceable(output, files, command=command, own=frozenset({report_name}))


def write_report(staging: Path, report_name: str, report: dict[str, Any]) -> None:
    """Write ``report`` as the build's last file, with the manifest of every other file under
    ``"files"`` (what :func:`check_output_folder` lets a later build replace)."""
    report["files"] = folder_manifest(staging, exclude=lambda name: name == report_name)
    (staging / report_name).write_text(json.dumps(report, indent=2) + "\n", encoding="utf-8")


def report_header(config: Any, times: dict[str, float]) -> dict[str, Any]:
    """What every build report starts with: the settings, torch and threads, minutes per stage."""
    return {
        "config": dataclasses.asdict(config),
        "torch": torch.__version__,
        "threads": torch.get_num_threads(),
        "minutes": {k: round(v / 60, 2) for k, v in times.items()},
    }


def _save_transformer(model: torch.nn.Module, folder: Path) -> None:
    """Replace the random build's shards with ``model``'s weights, in the same two-shard layout."""
    for path in folder.glob("diffusion_pytorch_model*"):
        path.unlink()
    config_path = folder / "config.json"
    auto_map = json.loads(config_path.read_text(encoding="utf-8")).get("auto_map")
    total = sum(p.numel() * p.element_size() for p in model.parameters())
    model.save_pretrained(folder, safe_serialization=True, max_shard_size=total // 2 + 1)
    config = json.loads(config_path.read_text(encoding="utf-8"))
    # diffusers records the folder a loaded model came from: a path of the building machine, which
    # would then be committed and installed everywhere (an Edit build loads its base from disk).
    config.pop("_name_or_path", None)
    if auto_map is not None:
        config["auto_map"] = auto_map
    config_path.write_text(json.dumps(config, indent=2, sort_keys=True) + "\n", encoding="utf-8")


def main(argv: Sequence[str] | None = None) -> int:
    """``boogu-tiny-pretrain``: rebuild the pretrained tiny checkpoint from scratch."""
    parser = argparse.ArgumentParser(prog="boogu-tiny-pretrain", description=__doc__.split("\n\n")[0])
    parser.add_argument("--output-dir", help="where the checkpoint goes (a new or earlier output folder)")
    parser.add_argument("--seed", type=int, default=PretrainConfig.seed)
    parser.add_argument("--quick", action="store_true", help="a smoke build in seconds (nothing is learned)")
    parser.add_argument(
        "--evaluate",
        metavar="DIR",
        help="build nothing: score the checkpoint in DIR on the build's evaluation captions and print JSON",
    )
    parser.add_argument(
        "--save-assets",
        action="store_true",
        help="also copy the result into boogu_tiny/assets/tiny_scenes (what boogu-tiny --trained installs)",
    )
    parser.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="override a PretrainConfig field (e.g. --set dit_steps=3000); repeatable",
    )
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(message)s")
    config = PretrainConfig.quick() if args.quick else PretrainConfig()
    try:
        config = dataclasses.replace(config, seed=args.seed, **_overrides(args.set))
    except (TypeError, ValueError) as error:
        print(f"boogu-tiny-pretrain: error: {error}", file=sys.stderr)
        return 2
    if args.evaluate:
        print(json.dumps(evaluate_checkpoint(args.evaluate, config), indent=2))
        return 0
    if not args.output_dir:
        print("boogu-tiny-pretrain: error: --output-dir is required (or --evaluate DIR)", file=sys.stderr)
        return 2
    try:
        pretrain(args.output_dir, config, log=lambda line: print(line, flush=True))
    except FileExistsError as error:
        print(f"boogu-tiny-pretrain: error: {error}", file=sys.stderr)
        return 2
    if args.save_assets:
        print(save_trained_assets(args.output_dir))
    return 0


def _overrides(items: Sequence[str]) -> dict[str, Any]:
    fields = {f.name: f for f in dataclasses.fields(PretrainConfig)}
    out: dict[str, Any] = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep or key not in fields:
            raise ValueError(f"--set {item!r}: expected KEY=VALUE with KEY one of {sorted(fields)}")
        default = getattr(PretrainConfig, key)
        if isinstance(default, tuple):
            out[key] = tuple(int(v) for v in value.split(","))
        else:
            out[key] = type(default)(value)
    return out
