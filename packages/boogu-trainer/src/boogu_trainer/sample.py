"""``boogu-sample``: generate with a trained checkpoint, and merge its LoRA into a shippable model.

boogu-sample --checkpoint DIR --prompt TEXT --output OUT          the base model + the checkpoint's LoRA
boogu-sample --checkpoint DIR --prompt TEXT --output OUT --no-lora  the base model alone (same seeds)
boogu-sample --checkpoint DIR --prompt TEXT --output OUT --ema      the EMA of the LoRA weights
boogu-sample --checkpoint DIR --merge-to MERGED                     a model folder with the LoRA merged in

Sampling is the evaluation path (`boogu_trainer.evaluation`): deterministic ODE steps
(``noise_level=0``, no SDE window), text CFG, the run's own config (``config.yaml`` in the
checkpoint) for the model, size, steps and guidance unless given. Image ``k`` of prompt ``i``
draws its noise from the stream ``(seed, i)`` (`boogu_adapters.engines`), so the same prompt and
seed give the same starting noise with and without ``--no-lora``: before/after is two commands.

``--merge-to`` writes a complete Boogu checkpoint folder: the transformer's weights with
``W + scale * B @ A`` (computed in float32, stored in the original dtype) in the original shard
layout, the original ``config.json`` and every other component copied, so ``load_boogu`` and
upstream's ``BooguImagePipeline.from_pretrained`` load it like the base model.

What it may replace (`check_target`): an output folder is built aside and committed with one
rename, so an existing folder there would be deleted. A tool never deletes what it did not create:
a missing or empty folder is written; a non-empty one only with ``--overwrite``, and only when it is
an earlier output of the same option, recognised by the marker file every output carries
(``samples.json`` for ``--output``, ``merged_lora.json`` for ``--merge-to``). Never, even with
``--overwrite``: a folder that is or contains the base model, the checkpoint being read, its run
folder, anything that looks like a run (``checkpoints/``, ``metrics.jsonl``, ``config.yaml``) or
another model, or the current working directory.
"""

from __future__ import annotations

import os

# Before torch loads OpenMP: spinning idle threads make runs on a busy machine many times slower.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import argparse
import json
import logging
import math
import re
import shutil
import sys
import tempfile
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

PROG = "boogu-sample"
LoraChoice = Literal["lora", "ema", "none"]


class SampleError(RuntimeError):
    """What the user asked for cannot be done (the message says why and what to pass instead)."""


# ---- the checkpoint ------------------------------------------------------------------------------
@dataclass(frozen=True)
class TrainedLora:
    """A checkpoint's LoRA (or EMA) tensors and what is needed to apply them."""

    tensors: dict[str, Any]
    """File keys (``<module path>.lora_A.weight``) -> tensors."""
    scale: float
    """peft's ``alpha / r``: the adapter adds ``scale * B @ A``."""
    source: Path
    """The safetensors file they came from."""
    target_modules: tuple[str, ...] | str
    """The run's ``lora.target_modules``: every module they select must have its LoRA tensors."""
    rank: int
    """The run's ``lora.rank``."""

    @property
    def modules(self) -> list[str]:
        """The module paths the LoRA adapts, sorted."""
        from boogu_adapters.lora import lora_module

        return sorted({lora_module(key) for key in self.tensors})


def resolve_checkpoint(path: str | os.PathLike[str]) -> Path:
    """The intact checkpoint folder ``path`` names: a ``step_XXXXXX`` folder, or a run folder (its
    newest intact checkpoint, chosen as the trainer's ``resume=auto`` does: a newer broken one is
    skipped with a warning naming it and the one used). Raises `SampleError` saying what is wrong."""
    from boogu_trainer.checkpoint import COMPLETE, newest_intact_checkpoint, verify_checkpoint

    folder = Path(path).expanduser()
    if not folder.is_dir():
        raise SampleError(f"--checkpoint {folder}: no such folder")
    if not (folder / COMPLETE).exists() and (folder / "checkpoints").is_dir():
        found = newest_intact_checkpoint(folder / "checkpoints")
        if found is None:
            raise SampleError(f"--checkpoint {folder}: the run folder has no intact checkpoint")
        folder = found
    if not (folder / COMPLETE).exists() or not (folder / "adapter_model.safetensors").exists():
        raise SampleError(
            f"--checkpoint {folder} is not a checkpoint folder: a checkpoint is "
            "runs/<name>/checkpoints/step_XXXXXX/ with adapter_model.safetensors, config.yaml and COMPLETE "
            "(or pass the run folder runs/<name> for its newest checkpoint)"
        )
    problem = verify_checkpoint(folder)
    if problem is not None:
        raise SampleError(f"--checkpoint {folder} is not an intact checkpoint: {problem}")
    return folder


def read_lora(folder: Path, which: Literal["lora", "ema"] = "lora") -> TrainedLora:
    """The checkpoint's LoRA (``adapter_model.safetensors``) or its EMA (``ema.safetensors``), with the
    run's targets and rank (``config.yaml``)."""
    from boogu_adapters.lora import from_peft_keys
    from boogu_trainer.checkpoint import CheckpointError, lora_scale, read_json, read_tensors

    name = "adapter_model.safetensors" if which == "lora" else "ema.safetensors"
    if not (folder / name).is_file():
        raise SampleError(f"--ema: {folder} has no {name} (the run was trained with ema.enabled=false)")
    run = run_config(folder).lora
    try:
        config = read_json(folder / "adapter_config.json")
        scale = lora_scale(config, folder / "adapter_config.json")
        tensors = from_peft_keys(read_tensors(folder / name))
    except CheckpointError as error:
        raise SampleError(str(error)) from None
    except ValueError as error:
        raise SampleError(f"{folder / name}: {error}") from None
    if config.get("r", 8) != run.rank:  # the scale alpha / r would be another than the run trained with
        raise SampleError(
            f"{folder / 'adapter_config.json'}: r={config.get('r', 8)!r}, but the run's config.yaml has "
            f"lora.rank={run.rank}; the two are written together, so the checkpoint was altered"
        )
    return TrainedLora(
        tensors=tensors,
        scale=scale,
        source=folder / name,
        target_modules=run.target_modules,
        rank=run.rank,
    )


def run_config(folder: Path, device: str | None = None):
    """The run's resolved config from the checkpoint's ``config.yaml`` (``model.device`` overridable).

    Its rewards are not resolved: sampling and merging score nothing, so a run whose reward module
    cannot be imported here (another machine's package, a service's client) is still sampled."""
    from boogu_trainer.config import ConfigError, load_config

    overrides = [f"model.device={device}"] if device else []
    try:
        return load_config(folder / "config.yaml", overrides, saved=True, check_rewards=False)
    except ConfigError as error:
        raise SampleError(f"{folder / 'config.yaml'}: {error}") from None


# ---- applying the LoRA ---------------------------------------------------------------------------
def check_lora_matches(lora: TrainedLora, shapes: Mapping[str, Sequence[int]]) -> None:
    """Refuse a LoRA that is not exactly the one the run's config gives this model (the trainer's
    resume check, `boogu_adapters.lora.check_lora_state`): no tensor for a module the targets do not
    select, none missing for a module they do, every shape equal.

    ``shapes`` maps the model's weight names (``<module path>.weight``) to their shapes.
    """
    from boogu_adapters.lora import LoraMismatchError, check_lora_state, expected_lora_shapes

    expected = expected_lora_shapes(shapes, lora.target_modules, lora.rank)
    try:
        check_lora_state(
            expected, {k: tuple(v.shape) for k, v in lora.tensors.items()}, source=str(lora.source)
        )
    except LoraMismatchError as error:
        raise SampleError(str(error)) from None


def attach_lora(transformer, lora: TrainedLora) -> None:
    """Inject the LoRA into ``transformer`` in place and load its tensors; every module must attach."""
    from boogu_adapters.lora import add_lora, is_lora_param, load_lora_state_dict, lora_file_keys, lora_module

    check_lora_matches(lora, {n: tuple(p.shape) for n, p in transformer.named_parameters()})
    rank = next(iter(lora.tensors.values())).shape[0] if lora.tensors else 0
    # alpha = scale * r reproduces the trained scale; targets are the exact module paths.
    add_lora(transformer, rank=rank, alpha=lora.scale * rank, target_modules=lora.modules, seed=0)
    attached = sorted({lora_module(k) for k in lora_file_keys(transformer)})
    missing = sorted(set(lora.modules) - set(attached))
    if missing or len(attached) != len(lora.modules):
        raise SampleError(
            f"the LoRA in {lora.source} attaches to {len(attached)} of its {len(lora.modules)} modules; "
            f"not attached: {_names(missing or sorted(set(attached) - set(lora.modules)))}"
        )
    # float32 adapters on any base dtype, as the trainer keeps them (`models.prepare_policy`).
    for name, param in transformer.named_parameters():
        param.requires_grad_(False)
        if is_lora_param(name):
            param.data = param.data.float()
    load_lora_state_dict(transformer, {k: v.float() for k, v in lora.tensors.items()})
    transformer.eval()


def _names(names: Sequence[str], limit: int = 5) -> str:
    shown = ", ".join(names[:limit])
    return shown + (f", ... ({len(names) - limit} more)" if len(names) > limit else "")


# ---- sampling ------------------------------------------------------------------------------------
@dataclass(frozen=True)
class SampleSpec:
    prompts: list[str]
    reference: bytes | None = None
    num_images: int = 1
    steps: int | None = None
    guidance: float | None = None
    seed: int | None = None
    height: int | None = None
    width: int | None = None
    image_guidance: float | None = None


def sample(
    folder: Path, spec: SampleSpec, *, lora: LoraChoice = "lora", device: str | None = None, parts=None
):
    """Images ``(len(prompts) * num_images, 3, H, W)`` uint8 and their captions.

    ``parts`` (a fresh `load_boogu` result, modified in place) skips loading the base model.
    """
    import torch

    from boogu_adapters.components import build_local_engine
    from boogu_data import PromptRecord
    from boogu_trainer.distributed import resolve_device
    from boogu_trainer.evaluation import deterministic_request
    from boogu_trainer.models import load_base_parts
    from boogu_trainer.plan import batch_memory_problem

    config = run_config(folder, device)
    trained = None if lora == "none" else read_lora(folder, lora)
    dev = resolve_device(config.model.device)
    height, width = spec.height or config.sampler.height, spec.width or config.sampler.width
    # Each prompt's images are generated at once on the device, and all of them kept on the host:
    # refuse what cannot fit before the model loads (an edit follows its reference: 16x16 at least).
    size = (16, 16) if spec.reference is not None else (height, width)
    for images, where in ((spec.num_images, dev), (spec.num_images * len(spec.prompts), "cpu")):
        problem = batch_memory_problem(images, *size, where)
        if problem is not None:
            raise SampleError(f"--num-images {spec.num_images} for {len(spec.prompts)} prompt(s): {problem}")
    if parts is None:
        parts = load_base_parts(config, dev)
    if trained is not None:
        attach_lora(parts.transformer, trained)
    engine = build_local_engine(
        parts,
        max_sequence_length=config.model.max_sequence_length,
        cfg_mode=config.rollout.cfg_mode,
        device=dev,
    )
    images, captions = [], []
    what = {"lora": f"LoRA step {_step(folder)}", "ema": f"EMA step {_step(folder)}", "none": "base model"}
    seed = config.seed if spec.seed is None else spec.seed
    for i, prompt in enumerate(spec.prompts):
        # One request per prompt; group_offset=i gives prompt i the noise stream it has in one batch.
        request = deterministic_request(
            [PromptRecord(instruction=prompt, ref_image=spec.reference)],
            group_size=spec.num_images,
            num_steps=spec.steps or config.eval.num_steps,
            guidance_scale=config.sampler.guidance_scale if spec.guidance is None else spec.guidance,
            image_guidance_scale=config.sampler.image_guidance_scale
            if spec.image_guidance is None
            else spec.image_guidance,
            height=height,
            width=width,
            seed=seed,
            group_offset=i,
        )
        with torch.no_grad():
            traj = engine.generate(request)
        images.append(traj.images.cpu())
        captions += [f"{prompt[:60]} | seed {seed} #{k} | {what[lora]}" for k in range(spec.num_images)]
    return torch.cat(images), captions


def _step(folder: Path) -> int:
    m = re.search(r"step_(\d+)$", folder.name)
    return int(m.group(1)) if m else -1


def write_samples(
    images,
    captions: Sequence[str],
    prompts: Sequence[str],
    num_images: int,
    output: Path,
    *,
    overwrite: bool = False,
    protected: Sequence[tuple[Path, str]] = (),
):
    """``OUT/<prompt>_<k>.png`` per image, ``OUT/grid.png`` with captions, ``OUT/samples.json``; the
    folder is built aside and committed with one rename. An existing OUT is replaced only as
    `check_target` allows (``protected``: `protected_folders`)."""
    from PIL import Image

    from boogu_data.atomic import commit_folder, stage_folder
    from boogu_trainer.metrics import sample_grid

    output = check_target("--output", output, overwrite=overwrite, protected=protected)
    try:
        staging = stage_folder(output)
    except OSError as error:
        raise SampleError(f"--output {output}: {_write_error(error)}") from None
    try:
        files = []
        for j, image in enumerate(images):
            name = f"{j // num_images:03d}_{_slug(prompts[j // num_images])}_{j % num_images}.png"
            Image.fromarray(image.permute(1, 2, 0).numpy()).save(staging / name)
            files.append({"file": name, "caption": captions[j]})
        sample_grid(images, list(captions), staging / "grid.png")
        (staging / SAMPLES_MARKER).write_text(json.dumps(files, indent=2))
        commit_folder(staging, output)
    except OSError as error:  # a disk that filled up while writing: nothing is left behind
        shutil.rmtree(staging, ignore_errors=True)
        raise SampleError(f"--output {output}: {_write_error(error)}; nothing was written there") from None
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    return [output / f["file"] for f in files]


def _write_error(error: OSError) -> str:
    where = f" ({error.filename})" if error.filename else ""
    return f"cannot be written: {error.strerror or error}{where}"


def check_writable(flag: str, target: Path) -> None:
    """Refuse, before any work, an output that could not be written: the folder it is built in (the
    nearest that exists of its parents) must take a new folder, as the output's staging folder will
    (a read-only or full disk). Creates and removes one empty folder there."""
    parent = next(p for p in (target.parent, *target.parent.parents) if p.exists())
    try:
        Path(tempfile.mkdtemp(prefix=".boogu-sample-probe-", dir=parent)).rmdir()
    except OSError as error:
        raise SampleError(
            f"{flag} {target} cannot be written: {error.strerror or error} ({parent}); nothing was sampled"
        ) from None


def _slug(text: str) -> str:
    return re.sub(r"[^a-z0-9]+", "-", text.lower()).strip("-")[:40] or "prompt"


# ---- what an output may replace ------------------------------------------------------------------
SAMPLES_MARKER = "samples.json"
"""Every ``--output`` folder holds it: ``[{"file", "caption"}, ...]``."""
MERGE_MARKER = "merged_lora.json"
"""Every ``--merge-to`` folder holds it: ``{"checkpoint", "weights", "scale", "modules", "base_model"}``."""
RUN_LIKE = ("checkpoints", "metrics.jsonl")
"""A folder holding any of these (or a run's ``config.yaml``) looks like a run and is never replaced."""


def protected_folders(checkpoint: Path, base: Path) -> list[tuple[Path, str]]:
    """What no output may be or contain, with words for an error: the checkpoint, its run, the base model."""
    out = [(checkpoint, "the checkpoint being read"), (base, "the base model")]
    if checkpoint.parent.name == "checkpoints":
        out.append((checkpoint.parent.parent, "the checkpoint's run folder"))
    return [(Path(p).expanduser().resolve(), what) for p, what in out]


def check_target(
    flag: Literal["--output", "--merge-to"],
    target: str | os.PathLike[str],
    *,
    overwrite: bool,
    protected: Sequence[tuple[Path, str]] = (),
) -> Path:
    """The absolute folder ``flag`` may write (built aside, then put in place by one rename that
    deletes what was there), or a `SampleError` naming the flag, the folder and what it holds.

    A missing or empty folder may be written. A non-empty one only with ``overwrite`` and only if it
    is an earlier output of ``flag`` (its marker file: `SAMPLES_MARKER`, `MERGE_MARKER`) holding no
    run, checkpoint or other model. Never, whatever ``overwrite`` says: a folder that is or contains a
    ``protected`` one (`protected_folders`) or the current working directory.
    """
    target = Path(target).expanduser().resolve()
    if target.exists() and not target.is_dir():
        raise SampleError(f"{flag} {target} exists and is not a folder")
    guarded = [*protected, (Path.cwd().resolve(), "the current working directory")]
    same = [what for path, what in guarded if path == target]
    inside = [f"{what} ({path})" for path, what in guarded if target in path.parents]
    if same or inside:
        relation = f"is {same[0]}" if same else f"contains {', '.join(inside)}"
        raise SampleError(
            f"{flag} {target} {relation}; writing there would delete it, which boogu-sample never does "
            "(not even with --overwrite): choose a new folder"
        )
    entries = sorted(p.name for p in target.iterdir()) if target.is_dir() else []
    if not entries:
        return target
    marker = SAMPLES_MARKER if flag == "--output" else MERGE_MARKER
    if not overwrite:
        raise SampleError(
            f"{flag} {target} is not empty (it holds {_names(entries)}); choose a new or empty folder, "
            f"or pass --overwrite to replace an earlier `boogu-sample {flag}` output there"
        )
    if not _is_output(target / marker, flag):
        raise SampleError(
            f"{flag} {target} is not an earlier `boogu-sample {flag}` output (no valid {marker}; it holds "
            f"{_names(entries)}); --overwrite replaces only those: choose a new folder"
        )
    foreign = _foreign(target, flag) or _not_written(target, flag)
    if foreign:
        raise SampleError(
            f"{flag} {target} holds {foreign}, which boogu-sample did not write; it never deletes that "
            "(not even with --overwrite): move it out or choose a new folder"
        )
    return target


def _not_written(target: Path, flag: str) -> str | None:
    """The first entry of an earlier output that its marker does not list as boogu-sample's, or None.

    ``--output``: its plain top-level files named in `SAMPLES_MARKER`, ``grid.png`` and the marker
    (the images are not hashed: a changed image of the command's own is replaced). ``--merge-to``:
    the files in `MERGE_MARKER`'s manifest, each with its size and SHA-256
    (`boogu_data.atomic.foreign_files`); a marker without one (an older boogu-sample) vouches for
    nothing."""
    from boogu_data.atomic import foreign_files

    record = json.loads((target / (SAMPLES_MARKER if flag == "--output" else MERGE_MARKER)).read_text())
    if flag == "--output":
        allowed = {SAMPLES_MARKER, "grid.png", *(r["file"] for r in record)}
        for entry in sorted(target.iterdir()):
            if entry.name not in allowed or entry.is_symlink() or not entry.is_file():
                return f"{entry} (not listed in its {SAMPLES_MARKER})"
        return None
    if not isinstance(record.get("files"), dict):
        return (
            f"{target / MERGE_MARKER} without a file list (an older boogu-sample), so the rest is unvouched"
        )
    found = foreign_files(target, record["files"], own=frozenset({MERGE_MARKER}))
    if found:
        name, reason = found[0]
        why = {"unlisted": f"not in its {MERGE_MARKER}", "changed": "changed since it was written"}
        return f"{target / name} ({why.get(reason, reason)})"
    return None


def _overlap(a: Path, b: Path) -> bool:
    return a == b or a in b.parents or b in a.parents


def _is_output(marker: Path, flag: str) -> bool:
    try:
        record = json.loads(marker.read_text())
    except (OSError, ValueError):
        return False
    if flag == "--output":
        return isinstance(record, list) and all(
            isinstance(r, dict) and {"file", "caption"} <= set(r) for r in record
        )
    return isinstance(record, dict) and {"checkpoint", "base_model"} <= set(record)


def _is_run_config(path: Path) -> bool:
    import yaml

    try:
        record = yaml.safe_load(path.read_text())
    except (OSError, ValueError, yaml.YAMLError):
        return True  # unreadable: it may be a run's; never delete it
    return isinstance(record, dict) and {"model", "lora"} <= set(record)


def _foreign(target: Path, flag: str) -> str | None:
    """What in an earlier output's tree boogu-sample never writes there: a run, a checkpoint, a model
    below the top (a merged model's own ``model_index.json`` is at the top), or None."""
    for folder, dirs, files in os.walk(target):  # symlinks are not followed (nor would rmtree)
        here = Path(folder)
        names = {*dirs, *files}
        run_like = sorted(names & set(RUN_LIKE))
        if "config.yaml" in files and _is_run_config(here / "config.yaml"):
            run_like.append("a run's config.yaml")
        if run_like:
            return f"{here}, which looks like a run or a checkpoint (it has {', '.join(run_like)})"
        if "model_index.json" in files and (here != target or flag == "--output"):
            return f"{here}, a model folder (model_index.json)"
    return None


# ---- reference images ----------------------------------------------------------------------------
def read_reference(path: str | os.PathLike[str]) -> bytes:
    """The reference image's bytes, refused unless it meets the Edit rules the datasets follow
    (`boogu_data.images.check_image`: sides multiples of 16, at most 2048² pixels)."""
    from boogu_data.images import check_image

    path = Path(path).expanduser()
    try:
        data = path.read_bytes()
    except OSError as error:
        raise SampleError(f"--image {path}: cannot be read ({error.strerror})") from None
    try:
        check_image(data)
    except ValueError as error:
        raise SampleError(
            f"--image {path}: {error} (resize or pad it first, e.g. the edit converter's letterbox)"
        ) from None
    return data


# ---- merging -------------------------------------------------------------------------------------
def merge_to(
    folder: Path, output: Path, *, lora: Literal["lora", "ema"] = "lora", overwrite: bool = False
) -> Path:
    """Write ``output``: the run's base model with the LoRA merged into its transformer weights.

    Works shard by shard on the CPU (one shard in memory at a time); the shard names, the index,
    ``config.json`` and every other file are the base model's, so the result loads like it.
    ``MERGE_MARKER`` records where it came from. An existing ``output`` is replaced only as
    `check_target` allows.
    """
    from safetensors import safe_open
    from safetensors.torch import load_file

    from boogu_adapters.lora import lora_pair_keys
    from boogu_data.atomic import commit_folder, folder_manifest, stage_folder
    from boogu_trainer.checkpoint import save_tensors
    from boogu_trainer.models import base_model_path

    config = run_config(folder, "cpu")
    trained = read_lora(folder, lora)
    base = base_model_path(config)
    transformer = base / "transformer"
    shards = sorted(transformer.glob("*.safetensors"))
    if not shards:
        raise SampleError(f"{transformer}: no safetensors weights to merge into")
    shapes = {}
    for shard in shards:
        with safe_open(shard, framework="pt") as f:
            shapes.update({k: f.get_slice(k).get_shape() for k in f.keys()})  # noqa: SIM118
    check_lora_matches(trained, shapes)
    output = check_target(
        "--merge-to", output, overwrite=overwrite, protected=protected_folders(folder, base)
    )
    if base.resolve() in output.parents:  # the copy of the base model would copy itself
        raise SampleError(f"--merge-to {output} is inside the base model {base}; choose a folder outside it")
    try:
        staging = stage_folder(output)
    except OSError as error:
        raise SampleError(f"--merge-to {output}: {_write_error(error)}") from None
    try:
        shutil.copytree(base, staging, dirs_exist_ok=True, ignore=shutil.ignore_patterns("*.safetensors"))
        for other in base.rglob("*.safetensors"):
            if other.parent != transformer:
                shutil.copy2(other, staging / other.relative_to(base))
        for shard in shards:
            tensors = load_file(shard)
            for m in trained.modules:
                key = f"{m}.weight"
                if key in tensors:
                    w = tensors[key]
                    key_a, key_b = lora_pair_keys(m)
                    a, b = trained.tensors[key_a].float(), trained.tensors[key_b].float()
                    # (out, in) float32: peft's merge, W + scale * B @ A, then the stored dtype.
                    tensors[key] = (w.float() + trained.scale * (b @ a)).to(w.dtype).contiguous()
            save_tensors(tensors, staging / "transformer" / shard.name, metadata={"format": "pt"})
        (staging / MERGE_MARKER).write_text(
            json.dumps(
                {
                    "checkpoint": str(folder),
                    "weights": trained.source.name,
                    "scale": trained.scale,
                    "modules": len(trained.modules),
                    "base_model": str(base),
                    # What a later --overwrite may replace: every file written, with size and SHA-256.
                    "files": folder_manifest(staging, exclude=lambda name: name == MERGE_MARKER),
                },
                indent=2,
            )
        )
        commit_folder(staging, output)
    except OSError as error:  # a disk that filled up while writing: nothing is left behind
        shutil.rmtree(staging, ignore_errors=True)
        raise SampleError(f"--merge-to {output}: {_write_error(error)}; nothing was written there") from None
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    return output


# ---- the command ---------------------------------------------------------------------------------
def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog=PROG,
        description="Sample a trained checkpoint deterministically (the evaluation path), with or "
        "without its LoRA, or merge the LoRA into a complete model folder.",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog=__doc__.split("\n\n")[1],
    )
    parser.add_argument(
        "--checkpoint",
        required=True,
        metavar="DIR",
        help="runs/<name>/checkpoints/step_XXXXXX (or runs/<name>: its newest)",
    )
    parser.add_argument("--prompt", action="append", default=[], metavar="TEXT", help="a prompt (repeatable)")
    parser.add_argument("--prompts", metavar="FILE", help="a text file, one prompt per line")
    parser.add_argument("--image", metavar="REF", help="a reference image: every prompt is an edit of it")
    parser.add_argument("--output", metavar="OUT", help="folder for the PNGs, grid.png and samples.json")
    parser.add_argument(
        "--num-images", type=int, default=1, metavar="N", help="images per prompt (default 1)"
    )
    parser.add_argument(
        "--steps", type=int, metavar="N", help="denoising steps (default: the run's eval.num_steps)"
    )
    parser.add_argument(
        "--guidance",
        type=float,
        metavar="G",
        help="text CFG scale, a finite number >= 1 (default: the run's sampler.guidance_scale)",
    )
    parser.add_argument(
        "--image-guidance",
        type=float,
        metavar="G",
        help="with --image: the edit's image guidance scale, a finite number >= 1 "
        "(default: the run's sampler.image_guidance_scale; 1 turns it off)",
    )
    parser.add_argument("--seed", type=int, metavar="S", help="seed, in [0, 2**63) (default: the run's seed)")
    parser.add_argument(
        "--height",
        type=int,
        help="output height, a positive multiple of 16 (default: the run's sampler.height)",
    )
    parser.add_argument(
        "--width", type=int, help="output width, a positive multiple of 16 (default: the run's sampler.width)"
    )
    which = parser.add_mutually_exclusive_group()
    which.add_argument("--no-lora", action="store_true", help="the base model alone")
    which.add_argument("--ema", action="store_true", help="the EMA of the LoRA weights instead of the LoRA")
    parser.add_argument(
        "--merge-to", metavar="DIR", help="write a model folder with the LoRA (or --ema) merged in"
    )
    parser.add_argument(
        "--overwrite",
        action="store_true",
        help="replace a non-empty --output / --merge-to folder if it is an earlier output of that "
        "option (never a run, a checkpoint, the base model or the working directory)",
    )
    parser.add_argument("--device", help="cpu, cuda, cuda:1 (default: the run's model.device)")
    return parser


def _prompts(parser: argparse.ArgumentParser, ns: argparse.Namespace) -> list[str]:
    prompts = list(ns.prompt)
    if ns.prompts:
        try:
            lines = Path(ns.prompts).expanduser().read_text(encoding="utf-8").splitlines()
        except (OSError, UnicodeDecodeError) as error:
            parser.error(f"--prompts {ns.prompts}: cannot be read ({error})")
        prompts += [line.strip() for line in lines if line.strip()]
        if not any(line.strip() for line in lines):
            parser.error(f"--prompts {ns.prompts} holds no prompt")
    return prompts


def main(argv: list[str] | None = None) -> int:
    parser = _parser()
    ns = parser.parse_args(sys.argv[1:] if argv is None else argv)
    prompts = _prompts(parser, ns)
    if ns.no_lora and ns.merge_to:
        parser.error("--merge-to merges the LoRA; it cannot be combined with --no-lora")
    if not prompts and not ns.merge_to:
        parser.error("give --prompt TEXT or --prompts FILE (or --merge-to DIR)")
    if prompts and not ns.output:
        parser.error("--output OUT is required to write the images")
    if ns.num_images < 1 or (ns.steps is not None and ns.steps < 1):
        parser.error("--num-images and --steps must be at least 1")
    # Given, a value is used as it is: 0 is not "the run's size" (leave the flag out for that).
    for flag, value in (("--height", ns.height), ("--width", ns.width)):
        if value is not None and value < 1:
            parser.error(
                f"{flag} {value}: expected a positive multiple of 16; leave it out for the run's size"
            )
    if ns.guidance is not None and not (math.isfinite(ns.guidance) and ns.guidance >= 1):
        parser.error(f"--guidance {ns.guidance}: expected a finite number >= 1 (1 turns CFG off)")
    if ns.image_guidance is not None and not (math.isfinite(ns.image_guidance) and ns.image_guidance >= 1):
        parser.error(
            f"--image-guidance {ns.image_guidance}: expected a finite number >= 1 (1 turns image guidance off)"
        )
    if ns.image_guidance is not None and not ns.image:
        parser.error("--image-guidance guides an edit by its reference image: give --image REF too")
    if ns.seed is not None and not 0 <= ns.seed < 2**63:
        parser.error(f"--seed {ns.seed}: expected a whole number in [0, 2**63), as the trainer's seed")
    lora: LoraChoice = "none" if ns.no_lora else "ema" if ns.ema else "lora"
    logging.basicConfig(
        level=os.environ.get("BOOGU_LOG_LEVEL", "WARNING"), format="%(levelname)s %(name)s: %(message)s"
    )
    try:
        folder = resolve_checkpoint(ns.checkpoint)
        reference = read_reference(ns.image) if ns.image else None
        # Every output folder is checked before anything is written: a refusal leaves nothing behind.
        from boogu_trainer.models import base_model_path

        protected = protected_folders(folder, base_model_path(run_config(folder, "cpu")))
        wanted = [
            (f, p)
            for f, p in (("--merge-to", ns.merge_to), ("--output", ns.output if prompts else None))
            if p
        ]
        targets = [check_target(f, p, overwrite=ns.overwrite, protected=protected) for f, p in wanted]
        if len(targets) == 2 and _overlap(*targets):
            raise SampleError(
                f"--merge-to {targets[0]} and --output {targets[1]} overlap; give them separate folders"
            )
        # Before the model loads and samples: a read-only or full disk is found now, not after.
        for (flag, _), target in zip(wanted, targets, strict=True):
            check_writable(flag, target)
        if ns.merge_to:
            merged = merge_to(
                folder, Path(ns.merge_to), lora="ema" if ns.ema else "lora", overwrite=ns.overwrite
            )
            print(f"merged {folder} into {merged}")
        if prompts:
            from boogu_trainer.cli import _quiet_libraries

            _quiet_libraries()
            spec = SampleSpec(
                prompts,
                reference,
                ns.num_images,
                ns.steps,
                ns.guidance,
                ns.seed,
                ns.height,
                ns.width,
                ns.image_guidance,
            )
            images, captions = sample(folder, spec, lora=lora, device=ns.device)
            files = write_samples(
                images,
                captions,
                prompts,
                ns.num_images,
                Path(ns.output),
                overwrite=ns.overwrite,
                protected=protected,
            )
            print(
                f"wrote {len(files)} images and {Path(ns.output) / 'grid.png'} ({captions[0].split(' | ')[-1]})"
            )
    except SampleError as error:
        print(f"{PROG}: error: {error}", file=sys.stderr)
        return 2
    except ValueError as error:  # a size or request the model cannot produce
        print(f"{PROG}: error: {error}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
