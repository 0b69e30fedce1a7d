"""Build a tiny random Boogu-Image checkpoint with the released folder layout, offline.

The folder mirrors ``Boogu/Boogu-Image-0.1-Base`` (``docs/upstream-model.md`` §10) so that every
loader path runs on a laptop in seconds::

    model_index.json          names BooguImagePipeline and the five components, as released
    transformer/              config.json (+ auto_map), two safetensors shards + index,
                              transformer_boogu.py (shim: upstream's class if `boogu` imports, else ours)
    vae/                      a FLUX-style AutoencoderKL: 16 latent channels, 8x down, scale 0.3611, shift 0.1159;
                              its decoder is initialised smooth, so decoded colours follow the latents
    mllm/                     a Qwen3VLForConditionalGeneration whose text width is the transformer's
                              instruction feature width
    processor/                a stock Qwen3VLProcessor's files: tokenizer, preprocessor_config.json (image),
                              video_preprocessor_config.json, chat_template.jinja; no remote code
    scheduler/                scheduler_config.json with the released Boogu keys (+ shim)

Every weight is random and seeded; the transformer's zero-initialised adaLN and output head are
randomised too, so outputs are non-zero. The completion marker (:data:`MARKER_NAME`) records what the
folder holds (``kind``: ``random`` with its ``seed`` and ``source_model``, or ``trained``: the
committed pretrained checkpoint, with the hash of its manifest), :data:`BUILDER_VERSION`, and the size
and SHA-256 of every other file (``files``).

What a call may keep or replace (docs/tiny-model.md, "What boogu-tiny keeps and replaces"):

- A folder is *complete* only when its marker names what the call asks for (kind, seed, source) and
  every file it lists is there with its size and hash; then nothing is written.
- A different model (``--trained`` over a random build, another ``--seed``) is replaced only with
  ``force``; without it the call stops and says what is there and what was asked.
- The same model from an older builder or older committed files, or with a listed file missing, is
  rebuilt.
- A folder is replaced only when every file in it, at any depth, is one the marker lists, unchanged
  (:func:`boogu_data.atomic.check_replaceable`): a file of yours (``NOTES.txt``, ``my_lora/``) or a
  changed shard stops the call with an error naming it, with or without ``force``; nothing is deleted.
  A marker from before the file list (builder version 3 and older) stands for the released layout's
  paths: ``model_index.json``, ``pretrain_report.json``, ``samples.png`` and the files directly in
  the five component folders.
- A failed write (disk full, read-only storage) is a :class:`CheckpointWriteError` naming the path,
  and leaves no partial output.

``processor/`` and ``scheduler/`` are copied byte for byte from a local Boogu snapshot when one is
given (``source_model=`` or the ``SOURCE_MODEL`` environment variable); its weight shards are never
read. The copy is verbatim on purpose: a diffusers config round trip drops the Boogu time-shift
keys, and the processor must be the real tokenizer and chat template. Without a snapshot both are
fabricated locally, with no network: a small byte-level BPE tokenizer with the Qwen special tokens, a
Qwen3-VL-style chat template, and a Pillow-only image processor (torchvision is not needed).

Building is atomic (:mod:`boogu_data.atomic`): everything is written into a temporary sibling folder
that is renamed into place last, with a completion marker written just before. A crash leaves at
most a hidden ``.<name>.tmp-*`` sibling, never a folder at ``path`` that passes as complete; the next
call removes it, and puts back a previous checkpoint that a crash left under its retired name.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import logging
import math
import os
import shutil
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch
from diffusers import AutoencoderKL
from safetensors import SafetensorError
from tokenizers import Tokenizer, models, pre_tokenizers, trainers
from transformers import AutoTokenizer, Qwen2Tokenizer, Qwen3VLConfig, Qwen3VLForConditionalGeneration
from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil
from transformers.models.qwen3_vl.video_processing_qwen3_vl import Qwen3VLVideoProcessor

from boogu_adapters import __version__
from boogu_adapters.model import TINY_CONFIG, BooguImageTransformer2DModel, randomize_parameters
from boogu_data import SYSTEM_PROMPT_T2I, SYSTEM_PROMPT_TI2I
from boogu_data.atomic import (
    check_replaceable,
    commit_folder,
    file_record,
    folder_manifest,
    recover_folder,
    remove_stale,
    stage_folder,
)
from boogu_schedule import make_generator

__all__ = [
    "BUILDER_VERSION",
    "DEFAULT_TINY_PATH",
    "DEFAULT_TRAINED_EDIT_PATH",
    "DEFAULT_TRAINED_PATH",
    "MARKER_NAME",
    "TRAINED_ASSETS",
    "TRAINED_EDIT_ASSETS",
    "AssetError",
    "CheckpointWriteError",
    "ensure_tiny_checkpoint",
    "ensure_trained_checkpoint",
    "ensure_trained_edit_checkpoint",
    "is_complete_tiny_checkpoint",
    "main",
    "save_trained_assets",
    "save_trained_edit_assets",
    "verify_trained_assets",
    "write_text_side",
]

logger = logging.getLogger(__name__)

DEFAULT_TINY_PATH = "~/models/tiny-random/Boogu-Image"
"""Where the tiny checkpoint lives unless told otherwise (the reference integration's path)."""

DEFAULT_TRAINED_PATH = "~/models/tiny-scenes/Boogu-Image"
"""Where ``boogu-tiny --trained`` puts the pretrained tiny checkpoint unless told otherwise."""

TRAINED_ASSETS = Path(__file__).parent / "assets" / "tiny_scenes"
"""The committed pretrained tiny checkpoint (``boogu-tiny-pretrain --save-assets`` writes it): the
released layout without the two ``.py`` shims (written at install), ``manifest.json`` (sha256 and size
of every file) and the build's ``pretrain_report.json``."""

DEFAULT_TRAINED_EDIT_PATH = "~/models/tiny-scenes-edit/Boogu-Image"
"""Where ``boogu-tiny --trained --edit`` puts the tiny Edit checkpoint unless told otherwise."""

TRAINED_EDIT_ASSETS = Path(__file__).parent / "assets" / "tiny_scenes_edit"
"""The committed tiny Edit checkpoint (``boogu-tiny-edit-pretrain``, saved by
:func:`save_trained_edit_assets`): only what the Edit build changed (``transformer/``,
``edit_pretrain_report.json``, ``samples.png``); its ``manifest.json`` lists them and names the
:data:`TRAINED_ASSETS` manifest it was built on (``base_manifest``), whose other files (text encoder,
VAE, processor, scheduler) an install takes from there."""

EDIT_OWN_FILES = ("transformer/", "edit_pretrain_report.json", "samples.png")
"""What the Edit build writes itself (prefixes of asset paths); everything else is the base's."""

MANIFEST_NAME = "manifest.json"

MARKER_NAME = ".boogu-tiny.json"
"""Written last into a finished build; a folder without it is never treated as complete."""

BUILDER_VERSION = 4
"""Bumped whenever the builder writes different weights, configs or markers for the same arguments.
A complete checkpoint whose marker names another version (or none: version 1) is stale and is
rebuilt by :func:`ensure_tiny_checkpoint`, so a changed builder never silently reuses old weights.
2: smooth, latent-following VAE decoder (see ``_init_smooth_decoder``) with one GroupNorm group.
3: ``processor/`` in the released layout (``preprocessor_config.json``,
``video_preprocessor_config.json``, ``processor_class`` ``Qwen3VLProcessor``, no remote code);
every weight file is byte for byte the version-2 one.
4: the marker records ``kind`` and every file's size and SHA-256 (``files``), which each call checks;
every other file is byte for byte the version-3 one."""

DEFAULT_SEED = 42

MODEL_INDEX: dict[str, Any] = {
    "_class_name": "BooguImagePipeline",
    "_diffusers_version": "0.35.2",
    "mllm": ["transformers", "Qwen3VLForConditionalGeneration"],
    "processor": ["transformers", "Qwen3VLProcessor"],
    "scheduler": ["scheduling_flow_match_euler_discrete_time_shifting", "FlowMatchEulerDiscreteScheduler"],
    "transformer": ["transformer_boogu", "BooguImageTransformer2DModel"],
    "vae": ["diffusers", "AutoencoderKL"],
}
"""The released Base/Edit ``model_index.json`` (docs/upstream-model.md §10)."""

RELEASED_SCHEDULER_CONFIG: dict[str, Any] = {
    "_class_name": "FlowMatchEulerDiscreteScheduler",
    "_diffusers_version": "0.35.2",
    "do_shift": True,
    "dynamic_time_shift": False,
    "num_train_timesteps": 1000,
    "seq_len": 4096,
    "time_shift_version": "v1",
}
"""The released ``scheduler/scheduler_config.json`` keys and values: static v1 shift
(docs/upstream-model.md §8.1)."""

QWEN_SPECIAL_TOKENS: tuple[str, ...] = (
    "<|endoftext|>",
    "<|im_start|>",
    "<|im_end|>",
    "<|object_ref_start|>",
    "<|object_ref_end|>",
    "<|box_start|>",
    "<|box_end|>",
    "<|quad_start|>",
    "<|quad_end|>",
    "<|vision_start|>",
    "<|vision_end|>",
    "<|vision_pad|>",
    "<|image_pad|>",
    "<|video_pad|>",
)
"""Qwen2.5/Qwen3-VL's special tokens in their id order (151643...151656 in the real vocabulary)."""

# Qwen3-VL's ChatML template, reduced to what a processor needs: text, image and video items,
# optional "Picture k: " labels, and the optional generation prompt. For system and user turns it
# renders exactly what the released template renders.
CHAT_TEMPLATE = (
    "{%- set image_count = namespace(value=0) -%}"
    "{%- set video_count = namespace(value=0) -%}"
    "{%- for message in messages -%}"
    "{{- '<|im_start|>' + message['role'] + '\\n' -}}"
    "{%- if message['content'] is string -%}"
    "{{- message['content'] -}}"
    "{%- else -%}"
    "{%- for content in message['content'] -%}"
    "{%- if content['type'] == 'image' or 'image' in content or 'image_url' in content -%}"
    "{%- set image_count.value = image_count.value + 1 -%}"
    "{%- if add_vision_id -%}{{- 'Picture ' + image_count.value|string + ': ' -}}{%- endif -%}"
    "{{- '<|vision_start|><|image_pad|><|vision_end|>' -}}"
    "{%- elif content['type'] == 'video' or 'video' in content -%}"
    "{%- set video_count.value = video_count.value + 1 -%}"
    "{%- if add_vision_id -%}{{- 'Video ' + video_count.value|string + ': ' -}}{%- endif -%}"
    "{{- '<|vision_start|><|video_pad|><|vision_end|>' -}}"
    "{%- elif 'text' in content -%}"
    "{{- content['text'] -}}"
    "{%- endif -%}"
    "{%- endfor -%}"
    "{%- endif -%}"
    "{{- '<|im_end|>\\n' -}}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{- '<|im_start|>assistant\\n' -}}{%- endif -%}"
)

TRANSFORMER_SHIM = '''\
"""BooguImageTransformer2DModel for diffusers' remote-code loader (written by boogu-tiny).

Like the released checkpoints' shim, this file holds no model code: it re-exports upstream's
class when the `boogu` package is installed, and boogu_adapters' port otherwise.
"""

try:
    from boogu.models.transformers.transformer_boogu import BooguImageTransformer2DModel
except ImportError:
    from boogu_adapters.model import BooguImageTransformer2DModel

__all__ = ["BooguImageTransformer2DModel"]
'''

SCHEDULER_SHIM = '''\
"""Upstream's Boogu scheduler for DiffusionPipeline's remote-code loader (written by boogu-tiny).

It needs the `boogu` package. There is deliberately no fallback to diffusers' class of the same
name: that class silently drops the Boogu time-shift keys. boogu_adapters reads
scheduler_config.json as raw JSON instead.
"""

from boogu.schedulers.scheduling_flow_match_euler_discrete_time_shifting import FlowMatchEulerDiscreteScheduler

__all__ = ["FlowMatchEulerDiscreteScheduler"]
'''

_SHIMS: dict[str, str] = {
    "transformer/transformer_boogu.py": TRANSFORMER_SHIM,
    "scheduler/scheduling_flow_match_euler_discrete_time_shifting.py": SCHEDULER_SHIM,
}
"""The remote-code shims every install writes (the committed pretrained files leave them out)."""

# Prompt-like text the tiny tokenizer learns its merges from (with the two system prompts).
_BPE_CORPUS: tuple[str, ...] = (
    'A photo of a red sign that says "OPEN" on a wooden door, the text written in white letters.',
    'A poster with the title "Hello World" in bold black font on a yellow background.',
    "Make the image blue, change the word to CLOSED and keep everything else the same.",
    "a cat, a dog, a street at night, a cup of coffee on the table, a book cover, a logo",
)

# Files (relative to the checkpoint) that a finished build always has.
_REQUIRED_FILES: tuple[str, ...] = (
    MARKER_NAME,
    "model_index.json",
    "transformer/config.json",
    "transformer/transformer_boogu.py",
    "transformer/diffusion_pytorch_model.safetensors.index.json",
    "vae/config.json",
    "vae/diffusion_pytorch_model.safetensors",
    "mllm/config.json",
    "mllm/model.safetensors",
    "scheduler/scheduler_config.json",
)

PROCESSOR_CLASS = "Qwen3VLProcessor"
"""The processor class the released ``processor/`` configs and ``model_index.json`` name."""


def ensure_tiny_checkpoint(
    path: str | os.PathLike[str] = DEFAULT_TINY_PATH,
    source_model: str | os.PathLike[str] | None = None,
    force: bool = False,
    *,
    seed: int = DEFAULT_SEED,
) -> Path:
    """Build the tiny random checkpoint at ``path`` unless a complete one of this seed and source is there.

    Complete means: the marker names a random build of ``seed`` (and of the same source snapshot, or
    none) by this :data:`BUILDER_VERSION`, and every file it lists is there with its size and hash.
    The same build from an older builder, or with a listed file missing, is rebuilt with the
    arguments of this call. See the module docstring for what is never replaced.

    Args:
        path: target folder; ``~`` is expanded.
        source_model: a local Boogu snapshot whose ``processor/`` and ``scheduler/`` folders are
            copied verbatim (its weights are not read). Defaults to the ``SOURCE_MODEL``
            environment variable; a value there that is not a local folder is ignored with a
            warning (the reference integration sets it to a hub id), an explicit argument that is
            not one is an error.
        force: rebuild even when a complete checkpoint exists, and replace a boogu-tiny folder that
            holds another model (another seed or source, or the pretrained one).
        seed: seeds the transformer (seed), the VAE (seed + 1) and the Qwen3-VL model (seed + 2).

    Returns:
        The absolute path of the finished checkpoint.

    Raises:
        FileExistsError: ``path`` is not a folder boogu-tiny wrote (no marker), it holds another
            model and ``force`` is not set, or it holds a file boogu-tiny did not write or that
            changed since (:class:`boogu_data.atomic.ForeignFilesError`, naming it). Nothing is
            deleted then, even with ``force``.
        FileNotFoundError: ``source_model`` is not a folder with ``processor/`` and
            ``scheduler/scheduler_config.json``.
        CheckpointWriteError: writing failed (disk full, read-only storage); nothing was left.
    """
    target = Path(path).expanduser().absolute()
    source = _resolve_source(source_model, warn=False)
    wanted = {"kind": "random", "seed": seed, "source_model": None if source is None else str(source)}

    def build(staging: Path) -> None:
        _build(staging, source=_resolve_source(source_model), seed=seed)

    return _ensure(target, wanted, BUILDER_VERSION, force, build)


def _ensure(
    target: Path, wanted: dict[str, Any], version: Any, force: bool, build: Callable[[Path], None]
) -> Path:
    """Keep, build or replace ``target`` as the module docstring says; ``build(staging)`` writes a
    finished folder (its marker without ``files``, which this adds)."""
    if recover_folder(target):
        logger.warning("put back the checkpoint at %s that an interrupted build had moved aside", target)
    for stale in remove_stale(target.parent):
        logger.info("removed %s, left behind by an interrupted build", stale)
    asked = _describe(wanted)
    existing = _existing(target)
    if existing is not None:
        marker, files = existing
        have = _identity(marker)
        missing, changed = _file_problems(target, files)
        current = files is not None and _version(marker) == version
        if have == wanted and current and not missing and not changed and not force:
            logger.info("%s at %s is complete; nothing to do", asked[0].upper() + asked[1:], target)
            return target
        if have != wanted and not force:
            raise FileExistsError(
                f"{target} holds {_describe(have)}, not {asked} as asked; refusing to replace it. Pass "
                "--force (force=True) to replace it, or choose another folder (boogu-tiny never deletes "
                "files it did not write)."
            )
        _check_replaceable(target, files)
        if have == wanted and not force:
            if files is None:
                why = "its marker lists no files: an older boogu-tiny wrote it"
            elif missing:
                why = f"{missing[0]} is missing"
            else:
                why = "an older boogu-tiny, or older committed files, wrote it"
            logger.warning("%s at %s is not current (%s); rebuilding it", asked, target, why)
    try:
        staging = stage_folder(target)
    except OSError as error:
        raise CheckpointWriteError(target, error) from None
    try:
        build(staging)
        marker = _marker(staging)
        marker["files"] = folder_manifest(staging, exclude=lambda name: name == MARKER_NAME)
        _write_json(staging / MARKER_NAME, marker)
        if not force and _is_complete(target, wanted, version):
            # Another process (e.g. a second rank) finished the same build meanwhile: keep theirs.
            shutil.rmtree(staging, ignore_errors=True)
            return target
        existing = _existing(target)
        if existing is not None:  # what may be replaced is checked again right before the rename
            _check_replaceable(target, existing[1])
        commit_folder(staging, target)
    except FileExistsError:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    except (OSError, SafetensorError) as error:
        shutil.rmtree(staging, ignore_errors=True)
        raise CheckpointWriteError(target, error) from None
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    logger.info("wrote %s at %s", asked, target)
    return target


class CheckpointWriteError(OSError):
    """The checkpoint could not be written (disk full, read-only storage, no permission).

    Raised after the staging folder was removed: the target is as it was before the call. ``path``
    is the checkpoint folder, ``reason`` what the system refused (with the file, when it says).
    """

    def __init__(self, path: Path, error: BaseException) -> None:
        reason = (error.strerror or str(error)) if isinstance(error, OSError) else str(error)
        filename = getattr(error, "filename", None)
        if filename:
            reason += f": {filename}"
        super().__init__(getattr(error, "errno", None), reason)
        self.path = Path(path)
        self.reason = reason

    def __str__(self) -> str:
        return (
            f"cannot write the tiny checkpoint at {self.path} ({self.reason}); nothing was written there "
            "(the partial build was removed). Free space or choose a writable --output-dir."
        )

    def __reduce__(self):  # picklable as itself
        return (_rebuild_write_error, (self.path, self.errno, self.reason))


def _rebuild_write_error(path: Path, errno_: int | None, reason: str) -> CheckpointWriteError:
    return CheckpointWriteError(path, OSError(errno_, reason))


def _existing(target: Path) -> tuple[dict[str, Any], dict[str, Any] | None] | None:
    """``(marker, files it records)`` of the boogu-tiny folder at ``target``; None for a missing or
    empty folder. ``files`` is None for a marker from before the file list (:func:`_recorded_files`).

    Raises:
        FileExistsError: ``target`` is a file, or a folder with no readable marker.
    """
    if not os.path.lexists(target) or _is_empty_dir(target):
        return None
    marker = _marker(target) if target.is_dir() else {}
    if not marker:
        raise FileExistsError(
            f"{target} exists and is not a tiny checkpoint built by boogu-tiny (no {MARKER_NAME}); "
            "refusing to replace it. Remove it yourself or choose another path."
        )
    return marker, _recorded_files(marker)


def _identity(marker: dict[str, Any]) -> dict[str, Any]:
    """What model a marker says its folder holds (what a call asks for, in the same form)."""
    kind = marker.get("kind") or ("trained" if "trained_assets" in marker else "random")
    if kind in ("trained", "trained_edit"):
        return {"kind": kind}
    return {"kind": kind, "seed": marker.get("seed"), "source_model": marker.get("source_model")}


def _version(marker: dict[str, Any]) -> Any:
    """Which build of its model a marker records: the committed files' hash for the pretrained one,
    the builder version (1 when it records none) for a random one."""
    if _identity(marker)["kind"] in ("trained", "trained_edit"):
        return marker.get("trained_assets")
    return marker.get("builder_version", 1)


def _describe(identity: dict[str, Any]) -> str:
    if identity.get("kind") == "trained":
        return "the pretrained tiny checkpoint (boogu-tiny --trained)"
    if identity.get("kind") == "trained_edit":
        return "the pretrained tiny Edit checkpoint (boogu-tiny --trained --edit)"
    if identity.get("kind") != "random":
        return f"a boogu-tiny folder of kind {identity.get('kind')!r}"
    source = identity.get("source_model")
    copied = f", processor/ and scheduler/ copied from {source}" if source else ""
    return f"the tiny random checkpoint (seed {identity.get('seed')}{copied})"


def _recorded_files(marker: dict[str, Any], assets: Path = TRAINED_ASSETS) -> dict[str, Any] | None:
    """The ``{name: {"bytes", "sha256"}}`` a marker records for its folder (the marker itself aside).

    A marker from before the list has none; for a pretrained install of the committed files at hand
    (its ``trained_assets`` is their manifest's hash) they are still known: the committed files and
    the two shims. Otherwise None.
    """
    files = marker.get("files")
    if isinstance(files, dict) and all(
        isinstance(v, dict) and isinstance(v.get("bytes"), int) and isinstance(v.get("sha256"), str)
        for v in files.values()
    ):
        return files
    trained = marker.get("trained_assets")
    if (
        trained is None
        or not (assets / MANIFEST_NAME).is_file()
        or _sha256(assets / MANIFEST_NAME) != trained
    ):
        return None
    try:
        listed = json.loads((assets / MANIFEST_NAME).read_text(encoding="utf-8"))["files"]
    except (OSError, ValueError, KeyError, TypeError):
        return None
    files = {name: entry for name, entry in listed.items() if name != MARKER_NAME}
    for name, text in _SHIMS.items():
        data = text.encode("utf-8")
        files[name] = {"bytes": len(data), "sha256": hashlib.sha256(data).hexdigest()}
    return files


def _file_problems(target: Path, files: dict[str, Any] | None) -> tuple[list[str], list[str]]:
    """(missing, changed): the listed files that are not at ``target``, and those whose size or hash
    differ; both empty when ``files`` is None (nothing to check)."""
    missing, changed = [], []
    for name, expected in sorted((files or {}).items()):
        path = target / name
        if not path.is_file():
            missing.append(name)
        elif path.stat().st_size != expected["bytes"] or file_record(path)["sha256"] != expected["sha256"]:
            changed.append(name)
    return missing, changed


# Where a folder from before the file list keeps files (the released layout, docs/upstream-model.md §10).
_COMPONENTS = ("transformer", "vae", "mllm", "processor", "scheduler")
_LEGACY_TOP_LEVEL = frozenset({"model_index.json", "pretrain_report.json", "samples.png"})


def _check_replaceable(target: Path, files: dict[str, Any] | None) -> None:
    """Refuse to replace ``target`` unless everything in it is boogu-tiny's (see the module docstring)."""
    if files is None:  # a marker from before the file list: the layout's paths stand for it

        def not_layout(name: str) -> bool:
            folder, _, rest = name.partition("/")
            return not (name in _LEGACY_TOP_LEVEL or (folder in _COMPONENTS and rest and "/" not in rest))

        files = folder_manifest(target, exclude=not_layout)
    check_replaceable(
        target,
        files,
        command="boogu-tiny",
        own=frozenset({MARKER_NAME}),
        advice="Move your files out of it (or restore the changed file), or choose another folder.",
    )


def _is_complete(target: Path, wanted: dict[str, Any], version: Any) -> bool:
    """Whether ``target`` holds ``wanted`` at ``version`` with every recorded file intact."""
    try:
        existing = _existing(target)
    except FileExistsError:
        return False
    if existing is None or existing[1] is None:
        return False
    marker, files = existing
    return (
        _identity(marker) == wanted
        and _version(marker) == version
        and _file_problems(target, files) == ([], [])
    )


class AssetError(ValueError):
    """The committed pretrained checkpoint does not match its manifest (a file missing, extra or changed)."""


def _sha256(path: Path) -> str:
    return str(file_record(path)["sha256"])


def _asset_files(root: Path) -> list[str]:
    return sorted(
        p.relative_to(root).as_posix()
        for p in root.rglob("*")
        if p.is_file() and p.name != MANIFEST_NAME and p.suffix != ".py" and "__pycache__" not in p.parts
    )


def save_trained_assets(
    checkpoint: str | os.PathLike[str], assets: str | os.PathLike[str] = TRAINED_ASSETS
) -> Path:
    """Copy a ``boogu-tiny-pretrain`` output into ``assets`` (replacing it) with a manifest of hashes."""
    source = Path(checkpoint).expanduser().absolute()
    target = Path(assets)
    if not (source / "pretrain_report.json").is_file() or not is_complete_tiny_checkpoint(source):
        raise FileNotFoundError(
            f"{source} is not a finished boogu-tiny-pretrain output (no pretrain_report.json)"
        )
    staging = stage_folder(target)
    try:
        for name in _asset_files(source):
            (staging / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(source / name, staging / name)
        files = {
            name: {"sha256": _sha256(staging / name), "bytes": (staging / name).stat().st_size}
            for name in _asset_files(staging)
        }
        _write_json(staging / MANIFEST_NAME, {"files": files})
        commit_folder(staging, target)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    return target


def verify_trained_assets(assets: str | os.PathLike[str] = TRAINED_ASSETS) -> dict[str, Any]:
    """Check every committed file against ``manifest.json``; returns the manifest.

    Raises:
        AssetError: naming each missing, unlisted or changed file (a changed file gives its expected
            and actual sha256).
    """
    root = Path(assets)
    manifest_path = root / MANIFEST_NAME
    try:
        manifest = json.loads(manifest_path.read_text(encoding="utf-8"))
        expected = manifest["files"]
    except (OSError, ValueError, KeyError, TypeError) as error:
        raise AssetError(f"{manifest_path}: cannot read the manifest ({error})") from None
    present = set(_asset_files(root))
    problems = [f"{name}: listed in the manifest but missing" for name in sorted(set(expected) - present)]
    problems += [f"{name}: present but not in the manifest" for name in sorted(present - set(expected))]
    for name in sorted(present & set(expected)):
        actual = _sha256(root / name)
        if actual != expected[name]["sha256"]:
            problems.append(f"{name}: sha256 {actual}, the manifest says {expected[name]['sha256']}")
    if problems:
        raise AssetError(f"{root} does not match {MANIFEST_NAME}:\n  " + "\n  ".join(problems))
    return manifest


def _edit_install_files(assets: Path, base_assets: Path) -> dict[str, Path]:
    """Every file an Edit install copies (asset path -> where it comes from): the base's, less its
    own build's report and samples, overlaid with the Edit assets (after both were verified)."""
    manifest = verify_trained_assets(assets)
    verify_trained_assets(base_assets)
    base_hash = _sha256(base_assets / MANIFEST_NAME)
    if manifest.get("base_manifest") != base_hash:
        raise AssetError(
            f"{assets / MANIFEST_NAME}: built on the base assets whose manifest hashes to "
            f"{manifest.get('base_manifest')!r}, but {base_assets / MANIFEST_NAME} hashes to {base_hash}: "
            "the Edit transformer was trained on another text encoder or VAE; rebuild it "
            "(boogu-tiny-edit-pretrain, then save_trained_edit_assets)"
        )
    files = {
        name: base_assets / name
        for name in _asset_files(base_assets)
        if name not in ("pretrain_report.json", "samples.png")
        and not name.startswith("transformer/")
        and name != MARKER_NAME
    }
    files.update({name: assets / name for name in _asset_files(assets)})
    return files


def save_trained_edit_assets(
    checkpoint: str | os.PathLike[str],
    assets: str | os.PathLike[str] = TRAINED_EDIT_ASSETS,
    *,
    base_assets: str | os.PathLike[str] = TRAINED_ASSETS,
) -> Path:
    """Copy what a ``boogu-tiny-edit-pretrain`` output changed into ``assets`` (replacing it), with a
    manifest of hashes that names the base assets it was built on.

    Raises:
        FileNotFoundError: ``checkpoint`` is not a finished Edit build.
        AssetError: a file outside the Edit build's own (:data:`EDIT_OWN_FILES`) differs from the base
            assets': the build did not start from the committed base.
    """
    source = Path(checkpoint).expanduser().absolute()
    base = Path(base_assets)
    # The Edit build copies its base without the base's marker: every other file of the layout is there.
    layout = [name for name in _REQUIRED_FILES if name != MARKER_NAME] + ["edit_pretrain_report.json"]
    if not all((source / name).is_file() for name in layout):
        raise FileNotFoundError(
            f"{source} is not a finished boogu-tiny-edit-pretrain output (no edit_pretrain_report.json)"
        )
    base_files = verify_trained_assets(base)["files"]
    own, foreign = [], []
    for name in _asset_files(source):
        if name.startswith(EDIT_OWN_FILES):
            own.append(name)
        elif name == MARKER_NAME:
            continue
        elif name not in base_files or base_files[name]["sha256"] != _sha256(source / name):
            foreign.append(name)
    if foreign:
        raise AssetError(
            f"{source}: {foreign} differ from the base assets in {base}: an Edit build must start from "
            "the committed tiny scenes checkpoint (boogu-tiny-edit-pretrain's default --base)"
        )
    target = Path(assets)
    staging = stage_folder(target)
    try:
        for name in own:
            (staging / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(source / name, staging / name)
        files = {
            name: {"sha256": _sha256(staging / name), "bytes": (staging / name).stat().st_size}
            for name in _asset_files(staging)
        }
        _write_json(staging / MANIFEST_NAME, {"files": files, "base_manifest": _sha256(base / MANIFEST_NAME)})
        commit_folder(staging, target)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    return target


def ensure_trained_checkpoint(
    path: str | os.PathLike[str] = DEFAULT_TRAINED_PATH,
    force: bool = False,
    *,
    assets: str | os.PathLike[str] = TRAINED_ASSETS,
) -> Path:
    """Put the committed pretrained tiny checkpoint at ``path`` (seconds: a verified copy, no training).

    A complete install of the same committed files (its marker records the manifest's hash, and every
    installed file still has its recorded size and hash) is kept unless ``force``; an install of
    older committed files, or with a file missing, is replaced. What is never replaced is said in the
    module docstring (a folder of another model needs ``force``; a file boogu-tiny did not write, or
    one that changed since, is never deleted).

    Raises:
        AssetError: the committed files do not match their manifest.
        FileExistsError: as for :func:`ensure_tiny_checkpoint`.
        CheckpointWriteError: writing failed (disk full, read-only storage); nothing was left.
    """
    target = Path(path).expanduser().absolute()
    source = Path(assets)
    verify_trained_assets(source)
    assets_hash = _sha256(source / MANIFEST_NAME)

    def install(staging: Path) -> None:
        for name in _asset_files(source):
            (staging / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(source / name, staging / name)
        for name, text in _SHIMS.items():
            (staging / name).write_text(text, encoding="utf-8")
        marker = _marker(staging)
        marker.pop("files", None)  # the pretraining's list is of its random base, not of this folder
        marker.update(kind="trained", trained_assets=assets_hash)
        _write_json(staging / MARKER_NAME, marker)

    return _ensure(target, {"kind": "trained"}, assets_hash, force, install)


def ensure_trained_edit_checkpoint(
    path: str | os.PathLike[str] = DEFAULT_TRAINED_EDIT_PATH,
    force: bool = False,
    *,
    assets: str | os.PathLike[str] = TRAINED_EDIT_ASSETS,
    base_assets: str | os.PathLike[str] = TRAINED_ASSETS,
) -> Path:
    """Put the committed tiny Edit checkpoint at ``path``: the base assets' text encoder, VAE,
    processor and scheduler with the Edit transformer, its report and samples (seconds, no training).
    Kept, replaced and refused as :func:`ensure_trained_checkpoint` says.

    Raises:
        AssetError: either set of committed files does not match its manifest, or the Edit assets
            were built on other base assets.
        FileExistsError: as for :func:`ensure_tiny_checkpoint`.
        CheckpointWriteError: writing failed (disk full, read-only storage); nothing was left.
    """
    target = Path(path).expanduser().absolute()
    source = Path(assets)
    files = _edit_install_files(source, Path(base_assets))
    assets_hash = _sha256(source / MANIFEST_NAME)

    def install(staging: Path) -> None:
        for name, origin in files.items():
            (staging / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(origin, staging / name)
        for name, text in _SHIMS.items():
            (staging / name).write_text(text, encoding="utf-8")
        marker = json.loads((Path(base_assets) / MARKER_NAME).read_text(encoding="utf-8"))
        marker.pop("files", None)
        marker.update(kind="trained_edit", trained_assets=assets_hash)
        _write_json(staging / MARKER_NAME, marker)

    return _ensure(target, {"kind": "trained_edit"}, assets_hash, force, install)


def _marker(path: Path) -> dict[str, Any]:
    try:
        marker = json.loads((path / MARKER_NAME).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return {}
    return marker if isinstance(marker, dict) else {}


def is_complete_tiny_checkpoint(path: str | os.PathLike[str]) -> bool:
    """True when ``path`` holds a finished build: the completion marker and every required file.

    A check of the layout only: :func:`ensure_tiny_checkpoint` and :func:`ensure_trained_checkpoint`
    also check which model the marker names and every file's size and hash."""
    root = Path(path).expanduser()
    if not all((root / name).is_file() for name in _REQUIRED_FILES):
        return False
    processor = root / "processor"
    return processor.is_dir() and any(processor.iterdir())


def main(argv: Sequence[str] | None = None) -> int:
    """``boogu-tiny``: build the tiny random checkpoint (or install the pretrained one) and print its path."""
    parser = argparse.ArgumentParser(prog="boogu-tiny", description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--output-dir",
        default=None,
        help=f"target folder (default: {DEFAULT_TINY_PATH}, with --trained {DEFAULT_TRAINED_PATH})",
    )
    parser.add_argument(
        "--trained",
        action="store_true",
        help="install the committed checkpoint pretrained on the procedural scenes (boogu-tiny-pretrain) "
        "instead of building a random one",
    )
    parser.add_argument(
        "--edit",
        action="store_true",
        help="with --trained: install the committed tiny Edit checkpoint (boogu-tiny-edit-pretrain: the scenes "
        f"checkpoint fine-tuned on the scene edit pairs; default folder {DEFAULT_TRAINED_EDIT_PATH})",
    )
    parser.add_argument(
        "--source-model",
        default=None,
        help="local Boogu snapshot to copy processor/ and scheduler/ from (default: $SOURCE_MODEL, else fabricate)",
    )
    parser.add_argument(
        "--force",
        action="store_true",
        help="rebuild even if a complete checkpoint exists, and replace a boogu-tiny folder holding another "
        "model (files boogu-tiny did not write are never deleted)",
    )
    parser.add_argument("--seed", type=int, default=DEFAULT_SEED, help="weight seed (default: %(default)s)")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    try:
        if args.edit and not args.trained:
            raise ValueError("--edit installs the committed tiny Edit checkpoint: give --trained --edit")
        if args.trained:
            if args.source_model is not None or args.seed != DEFAULT_SEED:
                raise ValueError(
                    "--trained installs the committed checkpoint as built: --source-model and --seed do not apply "
                    "(its transformer was trained on this text encoder's and tokenizer's features)"
                )
            if args.edit:
                path = ensure_trained_edit_checkpoint(
                    args.output_dir or DEFAULT_TRAINED_EDIT_PATH, args.force
                )
            else:
                path = ensure_trained_checkpoint(args.output_dir or DEFAULT_TRAINED_PATH, args.force)
        else:
            path = ensure_tiny_checkpoint(
                args.output_dir or DEFAULT_TINY_PATH, args.source_model, args.force, seed=args.seed
            )
    except (FileExistsError, FileNotFoundError, ValueError) as e:
        print(f"boogu-tiny: error: {e}", file=sys.stderr)
        return 2
    except OSError as e:  # CheckpointWriteError, or the target cannot be read
        print(f"boogu-tiny: error: {e}", file=sys.stderr)
        return 1
    print(path)
    return 0


# ----------------------------------------------------------------------------------------------
# Building


def _build(root: Path, *, source: Path | None, seed: int) -> None:
    """Write every component into ``root``; the marker goes last."""
    if source is not None:
        # Verbatim, file for file: no config class ever parses these.
        shutil.copytree(source / "processor", root / "processor")
        shutil.copytree(source / "scheduler", root / "scheduler")
    else:
        _write_processor(root / "processor")
        _write_scheduler(root / "scheduler")
    _write_transformer(root / "transformer", seed=seed)
    _write_vae(root / "vae", seed=seed + 1)
    _write_mllm(root / "mllm", tokenizer_dir=root / "processor", seed=seed + 2)
    _write_json(root / "model_index.json", MODEL_INDEX)
    _write_json(
        root / MARKER_NAME,
        {
            "kind": "random",
            "builder": "boogu_tiny.checkpoints",
            "builder_version": BUILDER_VERSION,
            "boogu_adapters_version": __version__,
            "seed": seed,
            "source_model": None if source is None else str(source),
        },
    )


def _write_transformer(folder: Path, *, seed: int) -> None:
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = BooguImageTransformer2DModel(**TINY_CONFIG)
    randomize_parameters(model, seed)
    total_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    # Two shards and an index, like the released checkpoint (three shards there), so the sharded
    # path of every loader is exercised.
    model.save_pretrained(folder, safe_serialization=True, max_shard_size=total_bytes // 2 + 1)
    config_path = folder / "config.json"
    config = json.loads(config_path.read_text(encoding="utf-8"))
    # What diffusers.AutoModel(..., trust_remote_code=True) needs to find the shim.
    config["auto_map"] = {"AutoModel": "transformer_boogu.BooguImageTransformer2DModel"}
    _write_json(config_path, config)
    (folder / "transformer_boogu.py").write_text(TRANSFORMER_SHIM, encoding="utf-8")


def _write_vae(folder: Path, *, seed: int) -> None:
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        vae = AutoencoderKL(
            in_channels=3,
            out_channels=3,
            latent_channels=16,
            down_block_types=["DownEncoderBlock2D"] * 4,  # 4 blocks: 3 downsamplings, factor 8
            up_block_types=["UpDecoderBlock2D"] * 4,
            block_out_channels=[8, 8, 8, 8],
            layers_per_block=1,
            norm_num_groups=1,  # one group: the final GroupNorm keeps the channels' relative colour shifts
            sample_size=64,
            use_quant_conv=False,  # the FLUX VAE has no quant convs
            use_post_quant_conv=False,
            scaling_factor=0.3611,
            shift_factor=0.1159,
        )
    _init_smooth_decoder(vae.decoder, make_generator(seed))
    vae.save_pretrained(folder, safe_serialization=True)


def _init_smooth_decoder(decoder: torch.nn.Module, generator: torch.Generator) -> None:
    """Re-initialise a random VAE decoder so that its images follow the latents, as a trained one's do.

    With PyTorch's default init a tiny random decoder is a noise whitener: every 3x3 conv mixes
    white latent noise into more white noise, the residual branches add noise of their own, and the
    GroupNorm before ``conv_out`` divides the result by its noise-dominated spread, so the decoded
    colours hardly depend on the latents. Here:

    - every 3x3 conv is a random channel mix (``N(0, 1/in_channels)``) times a fixed, normalised
      binomial window ``[1, 2, 1] x [1, 2, 1]``: smoothing instead of whitening, variance-preserving;
    - linear layers (the mid-block attention) are ``N(0, 1/fan_in)``; all biases are zero;
    - the last layer of every residual branch (``conv2``, attention ``to_out``) is scaled by 0.1,
      so blocks start near the identity and the latents reach ``conv_out`` along the skip paths;
    - ``conv_out``'s channel mix is half shared by R, G and B (a luminance component, as in natural
      images, whose colour channels are strongly correlated) and half per colour.

    Decoded images are then soft colour fields whose colours track the latents nearly linearly.
    Measured on the default build over N(0, 1) latents (pixel values as fractions of 255): moving
    the latents' channel means by 0.2 (in Boogu latent units, along the best direction) moves the
    mean brightness by about 0.19, against an image-to-image spread of 0.13, and a linear fit on
    the 16 latent channel means explains about 90 % of the brightness variance; white and black
    are both reachable by a global latent shift. With the default init the same shift moved the
    brightness by 0.0015 (spread 0.0025, 26 % explained). This is what lets the CPU demo's
    image-space reward respond to a LoRA on the tiny transformer.
    """
    window = torch.tensor([1.0, 2.0, 1.0])
    window = torch.outer(window, window)
    window = window / window.norm()
    conv_out = decoder.conv_out
    with torch.no_grad():
        for module in decoder.modules():
            if module is conv_out:
                continue
            if isinstance(module, torch.nn.Conv2d) and module.kernel_size == (3, 3):
                out_channels, in_channels = module.weight.shape[:2]
                mix = torch.randn(out_channels, in_channels, generator=generator, device="cpu") / math.sqrt(
                    in_channels
                )
                module.weight.copy_(mix[:, :, None, None] * window)
            elif isinstance(module, (torch.nn.Conv2d, torch.nn.Linear)):
                fan_in = module.weight[0].numel()
                module.weight.copy_(
                    torch.randn(module.weight.shape, generator=generator, device="cpu") / math.sqrt(fan_in)
                )
            else:
                continue
            if module.bias is not None:
                module.bias.zero_()
        for name, module in decoder.named_modules():
            if name.endswith(".conv2") or name.endswith(".to_out.0"):
                module.weight.mul_(0.1)
        out_channels, in_channels = conv_out.weight.shape[:2]
        shared = torch.randn(1, in_channels, generator=generator, device="cpu")
        own = torch.randn(out_channels, in_channels, generator=generator, device="cpu")
        mix = (shared + own) / math.sqrt(2 * in_channels)
        conv_out.weight.copy_(mix[:, :, None, None] * window)
        conv_out.bias.zero_()


def _write_mllm(folder: Path, *, tokenizer_dir: Path, seed: int) -> None:
    """A tiny Qwen3-VL whose vocabulary and special ids follow the tokenizer in ``tokenizer_dir``.

    The tokenizer is either fabricated or a real Qwen one copied from a snapshot, so the embedding
    table is sized from it. The text width equals the transformer's instruction feature width.
    """
    tokenizer = AutoTokenizer.from_pretrained(str(tokenizer_dir), local_files_only=True)
    ids = {}
    for token in ("<|endoftext|>", "<|image_pad|>", "<|video_pad|>", "<|vision_start|>", "<|vision_end|>"):
        token_id = tokenizer.convert_tokens_to_ids(token)
        if token_id is None or token_id == tokenizer.unk_token_id:
            raise ValueError(
                f"{tokenizer_dir}: the tokenizer has no {token} token; it is not a Qwen3-VL tokenizer"
            )
        ids[token] = token_id
    text_width = TINY_CONFIG["instruction_feature_configs"]["instruction_feat_dim"]
    config = Qwen3VLConfig(
        text_config={
            "vocab_size": len(tokenizer),
            "hidden_size": text_width,
            "intermediate_size": 2 * text_width,
            "num_hidden_layers": 2,  # two, so multi-layer feature extraction has layers to pick
            "num_attention_heads": 4,
            "num_key_value_heads": 2,
            "head_dim": 16,
            "max_position_embeddings": 8192,
            # M-RoPE sections (t, h, w) must sum to head_dim / 2.
            "rope_parameters": {
                "rope_type": "default",
                "rope_theta": 5_000_000.0,
                "mrope_section": [2, 3, 3],
                "mrope_interleaved": True,
            },
            "pad_token_id": ids["<|endoftext|>"],
        },
        vision_config={
            "depth": 1,
            "hidden_size": 32,
            "intermediate_size": 64,
            "num_heads": 2,
            "patch_size": 16,
            "temporal_patch_size": 2,
            "spatial_merge_size": 2,
            "out_hidden_size": text_width,  # vision tokens land in the text stream
            "num_position_embeddings": 16,  # a 4x4 grid; must be a perfect square
            "deepstack_visual_indexes": [0],
        },
        image_token_id=ids["<|image_pad|>"],
        video_token_id=ids["<|video_pad|>"],
        vision_start_token_id=ids["<|vision_start|>"],
        vision_end_token_id=ids["<|vision_end|>"],
        tie_word_embeddings=False,
    )
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = Qwen3VLForConditionalGeneration(config)
    model.save_pretrained(folder, safe_serialization=True)


def write_text_side(root: str | os.PathLike[str], *, seed: int, corpus: Sequence[str] = ()) -> None:
    """Replace the ``processor/`` and ``mllm/`` of the checkpoint at ``root`` with a fabricated pair
    whose tokenizer also learns its merges from ``corpus``.

    The pretrained tiny checkpoint (``boogu-tiny-pretrain``) uses it to give its text side the words
    of its own captions: the random build's tokenizer spells "circle" in five byte pieces, and a
    frozen random text encoder then mixes a shape's identity across them. The text encoder is the
    random build's (``seed``; the random build uses its ``seed + 2``) with the embedding table sized
    to the new vocabulary. With an empty ``corpus`` it writes exactly the random build's text side.
    """
    root = Path(root)
    for name in ("processor", "mllm"):
        shutil.rmtree(root / name, ignore_errors=True)
    _write_processor(root / "processor", corpus=tuple(corpus))
    _write_mllm(root / "mllm", tokenizer_dir=root / "processor", seed=seed)


def _write_processor(folder: Path, corpus: tuple[str, ...] = ()) -> None:
    """Fabricate a Qwen3-VL processor folder in the layout of the released ``processor/``.

    The files are the ones a stock ``Qwen3VLProcessor`` saved by transformers 4.57 (upstream's
    pin) has, and the ones its ``from_pretrained`` reads: ``tokenizer.json`` and
    ``tokenizer_config.json``, ``preprocessor_config.json`` (the image processor),
    ``video_preprocessor_config.json`` (the video processor; ``AutoVideoProcessor`` raises
    "Can't load video processor" without it) and ``chat_template.jinja``, each config naming
    ``processor_class: Qwen3VLProcessor``. There is no ``processor_config.json`` with an
    ``auto_map`` and no ``.py``: nothing in the folder is remote code.

    Every sub-processor is written by its own stock class. ``Qwen3VLVideoProcessor`` is imported
    from its module, where it can be built without torchvision (only processing videos needs it);
    ``transformers.Qwen3VLVideoProcessor`` is a torchvision placeholder.
    """
    vocab, merges = _train_byte_level_bpe(corpus)
    for token in QWEN_SPECIAL_TOKENS:  # after the regular vocabulary, as in Qwen's
        vocab[token] = len(vocab)
    tokenizer = Qwen2Tokenizer(
        vocab=vocab,
        merges=merges,
        unk_token=None,
        bos_token=None,
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        model_max_length=32768,
    )
    tokenizer.add_special_tokens({"additional_special_tokens": list(QWEN_SPECIAL_TOKENS[1:])})
    tokenizer.padding_side = "right"
    # Tiny bounds keep images to at most 16 patches (4 image tokens); Qwen3-VL's own mean/std.
    vision = {
        "patch_size": 16,
        "temporal_patch_size": 2,
        "merge_size": 2,
        "image_mean": [0.5, 0.5, 0.5],
        "image_std": [0.5, 0.5, 0.5],
    }
    image_processor = Qwen2VLImageProcessorPil(min_pixels=32 * 32, max_pixels=64 * 64, **vision)
    video_processor = Qwen3VLVideoProcessor(
        size={"shortest_edge": 32 * 32, "longest_edge": 2 * 64 * 64}, **vision
    )
    tokenizer.save_pretrained(str(folder))
    image_processor.save_pretrained(str(folder))
    video_processor.save_pretrained(str(folder))
    for name in ("tokenizer_config.json", "preprocessor_config.json", "video_preprocessor_config.json"):
        config = json.loads((folder / name).read_text(encoding="utf-8"))
        config["processor_class"] = PROCESSOR_CLASS
        _write_json(folder / name, config)
    (folder / "chat_template.jinja").write_text(CHAT_TEMPLATE, encoding="utf-8")


def _train_byte_level_bpe(corpus: tuple[str, ...] = ()) -> tuple[dict[str, int], list[tuple[str, str]]]:
    """A small byte-level BPE (Qwen's tokenizer family), trained here on a fixed corpus (plus ``corpus``).

    Every byte is in the vocabulary, so any text round-trips exactly. The merges come from
    Boogu's two system prompts and a few prompt-like sentences, which makes templated prompts
    about five times shorter than one token per byte (56 instead of 304 tokens for the TI2I
    system prompt), and every forward of the tiny models cheaper. Training is deterministic.
    """
    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    trainer = trainers.BpeTrainer(
        vocab_size=1024,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        special_tokens=[],
        show_progress=False,
    )
    bpe.train_from_iterator([SYSTEM_PROMPT_T2I, SYSTEM_PROMPT_TI2I, *_BPE_CORPUS, *corpus], trainer)
    model = json.loads(bpe.to_str())["model"]
    # tokenizers writes merges as [a, b] pairs (older versions: "a b" strings); Qwen2Tokenizer wants tuples.
    merges = [tuple(m) if isinstance(m, list) else tuple(m.split(" ")) for m in model["merges"]]
    return dict(model["vocab"]), merges


def _write_scheduler(folder: Path) -> None:
    folder.mkdir(parents=True)
    _write_json(folder / "scheduler_config.json", RELEASED_SCHEDULER_CONFIG)
    (folder / "scheduling_flow_match_euler_discrete_time_shifting.py").write_text(
        SCHEDULER_SHIM, encoding="utf-8"
    )


def _resolve_source(source_model: str | os.PathLike[str] | None, *, warn: bool = True) -> Path | None:
    explicit = source_model is not None
    if not explicit:
        source_model = os.environ.get("SOURCE_MODEL") or None
        if source_model is None:
            return None
    source = Path(source_model).expanduser()
    if not source.is_dir():
        if not explicit:
            if warn:
                logger.warning(
                    "SOURCE_MODEL=%s is not a local folder; fabricating processor/ and scheduler/ instead",
                    source_model,
                )
            return None
        raise FileNotFoundError(
            f"source_model {os.fspath(source_model)!r} is not a local folder. Point it at a local Boogu "
            "snapshot (only processor/ and scheduler/ are read, e.g. after `hf download "
            "Boogu/Boogu-Image-0.1-Base --include 'processor/*' 'scheduler/*' --local-dir DIR`), "
            "or leave it unset to fabricate them."
        )
    for required in ("processor", "scheduler/scheduler_config.json"):
        if not (source / required).exists():
            raise FileNotFoundError(f"source model {source}: missing {required}")
    return source.absolute()


def _write_json(path: Path, data: dict[str, Any]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(data, indent=2, sort_keys=True) + "\n", encoding="utf-8")


def _is_empty_dir(path: Path) -> bool:
    return path.is_dir() and not any(path.iterdir())


if __name__ == "__main__":
    raise SystemExit(main())
