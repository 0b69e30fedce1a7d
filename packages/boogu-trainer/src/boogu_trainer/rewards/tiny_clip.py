"""Build tiny random CLIP folders (and a tiny aesthetic head) offline, for tests and demos.

A folder written by :func:`ensure_tiny_clip` has the layout of a transformers CLIP snapshot such as
``openai/clip-vit-large-patch14`` or ``laion/CLIP-ViT-H-14-laion2B-s32B-b79K``, so every loader path
of :mod:`boogu_trainer.rewards.clip` runs on a laptop in a second::

    config.json, model.safetensors    a CLIPModel: two 2-layer towers of width 32, projection 16,
                                      vision 224 px in 32-px patches (49 tokens), text 77 positions
    preprocessor_config.json          the released CLIP image-processor settings (shortest side
                                      224, bicubic, centre crop 224, CLIP mean/std)
    vocab.json, merges.txt,           a byte-level CLIP BPE tokenizer: the 256 byte symbols, each
    tokenizer.json, ...               also as a word end ("</w>"), merges for a few prompt words,
                                      then <|startoftext|> and <|endoftext|> last (as in CLIP)
    .boogu-tiny-clip.json             completion marker: builder version and arguments

Every weight is random and seeded; the same arguments give byte-identical weights. Building is
atomic (:mod:`boogu_data.atomic`): the folder is written under a hidden temporary sibling name and
renamed into place, with the marker written just before. :func:`write_tiny_aesthetic_head` writes
a random head with the LAION aesthetic predictor's keys (``layers.0/2/4/6/7``) as ``.safetensors``
or ``.pth``. Command line: ``python -m boogu_trainer.rewards.tiny_clip --output-dir DIR``.
"""

from __future__ import annotations

import argparse
import itertools
import json
import logging
import os
import shutil
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from boogu_data.atomic import atomic_file, commit_folder, recover_folder, remove_stale, stage_folder
from boogu_schedule import make_generator

__all__ = [
    "BUILDER_VERSION",
    "CLIP_IMAGE_MEAN",
    "CLIP_IMAGE_STD",
    "MARKER_NAME",
    "ensure_tiny_clip",
    "is_complete_tiny_clip",
    "main",
    "write_tiny_aesthetic_head",
]

logger = logging.getLogger(__name__)

MARKER_NAME = ".boogu-tiny-clip.json"
"""Written last into a finished build; a folder without it is never treated as complete."""

BUILDER_VERSION = 1
"""Bumped whenever the builder writes different files for the same arguments."""

CLIP_IMAGE_MEAN = (0.48145466, 0.4578275, 0.40821073)
CLIP_IMAGE_STD = (0.26862954, 0.26130258, 0.27577711)
"""OpenAI CLIP's normalisation constants (also those of the LAION CLIP-H processor)."""

_WORDS = ("a", "photo", "of", "the", "cat", "dog", "red", "sign", "text", "image", "make", "blue")
"""Words the tiny tokenizer gets merges for, so common prompts are not all single bytes."""

_REQUIRED_FILES = (
    MARKER_NAME,
    "config.json",
    "model.safetensors",
    "preprocessor_config.json",
    "tokenizer_config.json",
)


def ensure_tiny_clip(
    path: str | os.PathLike[str],
    *,
    seed: int = 0,
    image_size: int = 224,
    patch_size: int = 32,
    hidden_size: int = 32,
    projection_dim: int = 16,
    force: bool = False,
) -> Path:
    """Build a tiny random CLIP folder at ``path`` unless a complete one with these arguments is there.

    Raises FileExistsError when ``path`` is a non-empty folder that this builder did not write (it
    is never deleted). Returns the absolute path.
    """
    target = Path(path).expanduser().absolute()
    arguments = {
        "seed": int(seed),
        "image_size": int(image_size),
        "patch_size": int(patch_size),
        "hidden_size": int(hidden_size),
        "projection_dim": int(projection_dim),
    }
    recover_folder(target)
    remove_stale(target.parent)
    current = _marker(target) == {"builder_version": BUILDER_VERSION, **arguments}
    if not force and current and is_complete_tiny_clip(target):
        return target
    if target.exists() and any(target.iterdir()) and not (target / MARKER_NAME).is_file():
        raise FileExistsError(
            f"{target} exists and was not built by tiny_clip (no {MARKER_NAME}); refusing to replace it"
        )
    staging = stage_folder(target)
    try:
        _build(staging, **arguments)
        commit_folder(staging, target)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    logger.info("built tiny CLIP at %s", target)
    return target


def is_complete_tiny_clip(path: str | os.PathLike[str]) -> bool:
    """True when ``path`` holds a finished build: the marker and every required file."""
    root = Path(path).expanduser()
    return all((root / name).is_file() for name in _REQUIRED_FILES)


def write_tiny_aesthetic_head(
    path: str | os.PathLike[str],
    *,
    input_dim: int = 16,
    seed: int = 0,
    hidden: Sequence[int] = (1024, 128, 64, 16),
) -> Path:
    """Write a random head with the LAION aesthetic predictor's keys, ``.safetensors`` or ``.pth`` by suffix.

    The layers are ``input_dim -> hidden[0] -> ... -> hidden[3] -> 1`` under ``layers.0/2/4/6/7``;
    ``input_dim`` must be the CLIP folder's ``projection_dim``. Written atomically.
    """
    file = Path(path).expanduser().absolute()
    if file.suffix not in (".safetensors", ".pth"):
        raise ValueError(f"tiny aesthetic head: {file} must end in .safetensors or .pth")
    dims = [int(input_dim), *(int(h) for h in hidden), 1]
    if len(dims) != 6:
        raise ValueError(f"tiny aesthetic head: hidden must have 4 widths, got {tuple(hidden)}")
    generator = make_generator(seed)
    state: dict[str, torch.Tensor] = {}
    for index, (fan_in, fan_out) in zip((0, 2, 4, 6, 7), itertools.pairwise(dims), strict=True):
        bound = 1.0 / fan_in**0.5  # nn.Linear's default init range
        state[f"layers.{index}.weight"] = (
            torch.rand(fan_out, fan_in, generator=generator, device="cpu") * 2 - 1
        ) * bound
        state[f"layers.{index}.bias"] = (
            torch.rand(fan_out, generator=generator, device="cpu") * 2 - 1
        ) * bound
    file.parent.mkdir(parents=True, exist_ok=True)
    with atomic_file(file) as temporary:
        if file.suffix == ".safetensors":
            from safetensors.torch import save_file

            save_file(state, str(temporary))
        else:
            torch.save(state, temporary)
    return file


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m boogu_trainer.rewards.tiny_clip``: build a tiny CLIP folder (and head) and print its path."""
    parser = argparse.ArgumentParser(prog="tiny_clip", description=__doc__.split("\n\n")[0])
    parser.add_argument("--output-dir", required=True, help="target folder")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--aesthetic-head", default=None, help="also write a tiny aesthetic head to this file"
    )
    parser.add_argument("--force", action="store_true", help="rebuild even if a complete folder exists")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    try:
        folder = ensure_tiny_clip(args.output_dir, seed=args.seed, force=args.force)
    except FileExistsError as error:
        print(f"tiny_clip: error: {error}", file=sys.stderr)
        return 2
    if args.aesthetic_head:
        write_tiny_aesthetic_head(args.aesthetic_head, input_dim=16, seed=args.seed)
    print(folder)
    return 0


# ----------------------------------------------------------------------------------------------
# Building


def _marker(path: Path) -> dict[str, Any] | None:
    try:
        marker = json.loads((path / MARKER_NAME).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    return marker if isinstance(marker, dict) else None


def _write_json(path: Path, data: dict[str, Any]) -> None:
    path.write_text(json.dumps(data, indent=2, sort_keys=True) + "\n", encoding="utf-8")


def _tokenizer_tables() -> tuple[dict[str, int], list[tuple[str, str]]]:
    """A byte-level CLIP vocabulary and merges: bytes, bytes + "</w>", word merges, then the specials."""
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    symbols = list(bytes_to_unicode().values())
    vocab: dict[str, int] = {}
    for symbol in symbols + [s + "</w>" for s in symbols]:
        vocab[symbol] = len(vocab)
    merges: list[tuple[str, str]] = []
    for word in _WORDS:
        pieces = [*word[:-1], word[-1] + "</w>"]
        left = pieces[0]
        for right in pieces[1:]:
            merge = (left, right)
            left = left + right
            if merge not in merges:
                merges.append(merge)
            vocab.setdefault(left, len(vocab))
    vocab["<|startoftext|>"] = len(vocab)
    vocab["<|endoftext|>"] = len(vocab)
    return vocab, merges


def _build(
    root: Path, *, seed: int, image_size: int, patch_size: int, hidden_size: int, projection_dim: int
) -> None:
    from transformers import CLIPConfig, CLIPModel, CLIPTokenizer

    vocab, merges = _tokenizer_tables()
    tokenizer = CLIPTokenizer(vocab=vocab, merges=merges, model_max_length=77)
    tokenizer.save_pretrained(root)
    heads = 2
    tower = {
        "hidden_size": hidden_size,
        "intermediate_size": 2 * hidden_size,
        "num_hidden_layers": 2,
        "num_attention_heads": heads,
    }
    config = CLIPConfig(
        text_config={
            **tower,
            "vocab_size": len(vocab),
            "max_position_embeddings": 77,
            # The pooled text token is the first eos: CLIPTextTransformer finds it by this id.
            "bos_token_id": tokenizer.bos_token_id,
            "eos_token_id": tokenizer.eos_token_id,
            "pad_token_id": tokenizer.pad_token_id,
        },
        vision_config={**tower, "image_size": image_size, "patch_size": patch_size},
        projection_dim=projection_dim,
    )
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = CLIPModel(config).eval()
    model.save_pretrained(root, safe_serialization=True)
    _write_json(
        root / "preprocessor_config.json",
        {
            "crop_size": {"height": image_size, "width": image_size},
            "do_center_crop": True,
            "do_convert_rgb": True,
            "do_normalize": True,
            "do_rescale": True,
            "do_resize": True,
            "image_mean": list(CLIP_IMAGE_MEAN),
            "image_processor_type": "CLIPImageProcessor",
            "image_std": list(CLIP_IMAGE_STD),
            "processor_class": "CLIPProcessor",
            "resample": 3,
            "rescale_factor": 1 / 255,
            "size": {"shortest_edge": image_size},
        },
    )
    _write_json(
        root / MARKER_NAME,
        {
            "builder_version": BUILDER_VERSION,
            "seed": seed,
            "image_size": image_size,
            "patch_size": patch_size,
            "hidden_size": hidden_size,
            "projection_dim": projection_dim,
        },
    )


if __name__ == "__main__":
    raise SystemExit(main())
