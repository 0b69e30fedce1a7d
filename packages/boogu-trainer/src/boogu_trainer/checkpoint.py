"""Checkpoints: atomic, verified, pickle-free folders, and the rules for run folders and resumes.

Layout of ``checkpoints/step_000030/``:

* ``adapter_model.safetensors`` + ``adapter_config.json``: the LoRA in peft's layout
  (``PeftModel.from_pretrained(model, folder)``; diffusers:
  ``model.load_lora_adapter(folder, weight_name="adapter_model.safetensors", prefix="base_model.model")``).
* ``pytorch_lora_weights.safetensors``: the same LoRA in diffusers' layout (keys
  ``transformer.<module path>.lora_A.weight``, what ``save_lora_weights`` writes), for upstream's
  ``BooguImagePipeline.load_lora_weights(folder, weight_name="pytorch_lora_weights.safetensors")``.
  Upstream's loader drops the file's metadata and assumes ``lora_alpha == r``, so the peft scale
  ``alpha / r`` is multiplied into ``lora_B`` here (`diffusers_lora_state`).
* ``ema.safetensors``: the EMA of the LoRA weights (when enabled), same keys as ``adapter_model``.
* ``old_policy.safetensors``: DiffusionNFT's old (sampling) policy, same keys as ``adapter_model``.
* ``rollout_policy.safetensors`` (``rollout.pipeline=one_step``, a batch in flight): the weights the
  engine sampled that batch with (one step older than the LoRA), same keys as ``adapter_model``;
  ``trainer_state.json``'s ``pipeline`` says its step and version (a resume rolls it out again).
* ``optimizer.safetensors`` + ``optimizer.json``: AdamW moments and hyper-parameters, by parameter name.
* ``rng.safetensors``: each rank's global RNG states (torch CPU and CUDA, numpy, ``random``).
* ``<component>.<key>.safetensors``: any other dict of tensors in the state (a new algorithm's own
  tensors, say): no code here names it.
* ``trainer_state.json``: ``{"format": 2, "step", "run_id", "state"}``, ``state`` being the trainer's
  state by component (`Trainer.state_dict`: ``trainer``, ``learner``, ``data``, ``gold``, ``totals``,
  ``pipeline``, ``rng``) with each part that lives in a file above replaced by
  ``{"$tensors": file, "peft": bool}`` or ``{"$json": file}``.
* ``config.yaml``: the resolved config.
* ``manifest.json``: size and SHA-256 of every file above; ``COMPLETE`` is written last.

State by one rule: `write_checkpoint` walks the state and `load_checkpoint` walks it back; the
only names here are the files other tools read (`NAMED_FILES`). The flat ``trainer_state.json`` of
v0.2 and v0.3 (no ``format``) is read through a rename table (`RENAMED`, `FLAT_DEFAULTS`), tested
with a committed checkpoint of each (``tests/trainer/data/checkpoints/``).

Nothing is ever unpickled: tensors are safetensors, everything else JSON or YAML. A folder is built
under a temporary name and committed with one rename (`boogu_data.atomic.commit_folder`), so a
kill at any moment leaves either the previous or the new complete checkpoint, never half of one;
a checkpoint whose files do not match its manifest (a truncated copy, a bad disk) is skipped on
resume with a warning naming it and the newest intact one used instead (`newest_intact_checkpoint`,
shared with ``boogu-sample``).

Rules (`Checkpointer`): a fresh run never writes into a used run folder (it moves to ``name_1``,
``name_2``, ..., decided on rank 0 for every world size); pruning keeps the newest ``keep_last``
checkpoints *of this run* (its ``run_id``) and never touches another run's; a resume whose config
differs from the checkpoint's in a key that changes the past is refused unless the key is listed
in ``resume_allow_changes``.

Best checkpoint (``checkpoint.keep_best``): ``checkpoints/best.json`` = ``{"step", "gold", "folder"}``
names the checkpoint folder with the best gold evaluation score so far. It is a pointer, not a
symlink (portable, and replaced atomically), written only after that folder is committed; pruning
never deletes the folder it names. A resume rewrites it from the trainer state, so it never points
to a checkpoint of a discarded future.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import logging
import math
import os
import random
import re
import shutil
import socket
import sys
import uuid
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, TextIO

import numpy as np
import torch
import yaml
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file

from boogu_adapters.lora import DIFFUSERS_PREFIX, from_peft_keys, is_lora_b, to_peft_keys
from boogu_data.atomic import (
    atomic_write_text,
    commit_folder,
    recover_folder,
    remove_stale,
    stage_folder,
)
from boogu_trainer.config import (
    TrainerConfig,
    config_changes,
    config_to_dict,
    config_to_yaml,
    resume_not_bitwise_changes,
)
from boogu_trainer.distributed import DistEnv
from boogu_trainer.faults import fault_point

logger = logging.getLogger("boogu_trainer")

STEP_DIR = re.compile(r"^step_(\d{6,})$")
COMPLETE = "COMPLETE"
MANIFEST = "manifest.json"
BEST = "best.json"
ROLLOUT_POLICY = "rollout_policy.safetensors"


class CheckpointError(RuntimeError):
    """A checkpoint cannot be used (missing, broken, or incompatible with this run)."""


def step_dir_name(step: int) -> str:
    return f"step_{step:06d}"


FORMAT = 2
"""``trainer_state.json``'s ``"format"``: 2 holds the state by component (`write_checkpoint`). A file
without it is the flat layout of v0.2 and v0.3, read through `RENAMED`."""

NAMED_FILES: dict[tuple[str, ...], tuple[str, bool]] = {
    ("learner", "lora"): ("adapter_model.safetensors", True),
    ("learner", "lora_config"): ("adapter_config.json", False),
    ("learner", "ema"): ("ema.safetensors", True),
    ("learner", "old"): ("old_policy.safetensors", True),
    ("learner", "optimizer_tensors"): ("optimizer.safetensors", False),
    ("learner", "optimizer_meta"): ("optimizer.json", False),
    ("pipeline", "lora"): (ROLLOUT_POLICY, True),
    ("rng",): ("rng.safetensors", False),
}
"""The parts of the state whose files keep their v0.3 names, by path in the state: (file, whether its
tensor keys carry peft's prefix). peft reads ``adapter_model.safetensors`` + ``adapter_config.json``,
``boogu-sample --ema`` the EMA, and the golden runs hash the tensor files by name. Any other part is
placed by the rule (`write_checkpoint`): a new component's state needs no line here."""

RENAMED: dict[str, tuple[str, ...]] = {
    "step": ("trainer", "step"),
    "nonfinite_streak": ("trainer", "nonfinite_streak"),
    "weights_version": ("trainer", "weights_version"),
    "world_size": ("trainer", "world_size"),
    "counters": ("learner", "counters"),
    "data": ("data",),
    "gold": ("gold",),
    "totals": ("totals",),
    "pipeline": ("pipeline",),
}
"""The flat ``trainer_state.json`` of v0.2 and v0.3: its key -> the path in the state. (``run_id`` is
the checkpoint's own, as now.) Its tensor and JSON files are `NAMED_FILES`."""

FLAT_DEFAULTS: dict[tuple[str, ...], Any] = {
    ("trainer", "world_size"): None,
    ("learner", "ema"): None,
    ("gold",): None,
    ("totals",): {},
    ("pipeline",): None,
}
"""What a flat checkpoint that lacks a part means: the EMA's file and the batch in flight are there only
when on (v0.2 had no pipelining); the world size, gold state and totals, which both committed releases
wrote, are read with the defaults the v0.3 reader gave them."""

_TENSORS, _JSON = "$tensors", "$json"
"""The markers in ``trainer_state.json`` for a part that lives in a file of its own."""


@dataclass(frozen=True)
class SavedCheckpoint:
    """What `load_checkpoint` reads: the trainer's state by component (`Trainer.state_dict`, tensors on
    the CPU) and the checkpoint's own record."""

    step: int
    run_id: str | None
    state: dict[str, Any]
    config_yaml: str


def _is_tensors(value: Any) -> bool:
    return (
        isinstance(value, dict) and bool(value) and all(isinstance(v, torch.Tensor) for v in value.values())
    )


def _lay_out(value: Any, path: tuple[str, ...], folder: Path) -> Any:
    """``value`` (a part of the state at ``path``) as ``trainer_state.json`` holds it, its tensors
    written into ``folder``: a part named in `NAMED_FILES` to its file, any other non-empty dict of
    tensors to ``<path joined by dots>.safetensors``, the rest inline (JSON)."""
    where = ".".join(path) or "the state"
    if path in NAMED_FILES and value is not None:
        name, peft = NAMED_FILES[path]
        if name.endswith(".json"):
            (folder / name).write_text(json.dumps(value, indent=2, sort_keys=True))
            return {_JSON: name}
        tensors = {k: v.contiguous() for k, v in value.items()}
        save_tensors(
            to_peft_keys(tensors) if peft else tensors,
            folder / name,
            metadata={"format": "pt"} if peft else None,
        )
        return {_TENSORS: name, "peft": peft}
    if _is_tensors(value):
        name = f"{where}.safetensors"
        save_tensors({k: v.contiguous() for k, v in value.items()}, folder / name)
        return {_TENSORS: name, "peft": False}
    if isinstance(value, dict):
        if any(not isinstance(k, str) or k.startswith("$") for k in value):
            raise CheckpointError(
                f"checkpoint state {where}: keys must be strings not starting with '$', got {sorted(map(str, value))}"
            )
        return {k: _lay_out(v, (*path, k), folder) for k, v in value.items()}
    if isinstance(value, torch.Tensor):
        raise CheckpointError(
            f"checkpoint state {where}: a tensor outside a dict of tensors (a component's tensors are saved as "
            "a dict of name -> tensor)"
        )
    return value


def _read_back(value: Any, folder: Path) -> Any:
    """The inverse of `_lay_out`: the part as the state holds it, its files read from ``folder``."""
    if isinstance(value, dict) and _TENSORS in value:
        tensors = read_tensors(folder / value[_TENSORS])
        return from_peft_keys(tensors) if value.get("peft") else tensors
    if isinstance(value, dict) and _JSON in value:
        return read_json(folder / value[_JSON])
    if isinstance(value, dict):
        return {k: _read_back(v, folder) for k, v in value.items()}
    return value


def _put(tree: dict[str, Any], path: tuple[str, ...], value: Any) -> None:
    for key in path[:-1]:
        tree = tree.setdefault(key, {})
    tree[path[-1]] = value


def _by_component(flat: Mapping[str, Any], folder: Path) -> dict[str, Any]:
    """A v0.2/v0.3 ``trainer_state.json`` (flat) as a format-2 one, through `RENAMED`, `NAMED_FILES`
    (the files present) and `FLAT_DEFAULTS`."""
    unknown = sorted(set(flat) - set(RENAMED) - {"run_id"})
    if unknown:
        raise CheckpointError(
            f"{folder / 'trainer_state.json'}: keys {unknown} are in no known layout "
            f"(format {FORMAT} has a 'format' key; v0.2/v0.3 have {sorted(RENAMED)} and run_id)"
        )
    state: dict[str, Any] = {}
    for key, path in RENAMED.items():
        if key in flat:
            _put(state, path, flat[key])
    for path, (name, peft) in NAMED_FILES.items():
        if (folder / name).is_file():
            _put(state, path, {_JSON: name} if name.endswith(".json") else {_TENSORS: name, "peft": peft})
    for path, default in FLAT_DEFAULTS.items():
        parent = state
        for key in path[:-1]:
            parent = parent.setdefault(key, {})
        parent.setdefault(path[-1], default)
    return {"format": FORMAT, "step": flat["step"], "run_id": flat.get("run_id"), "state": state}


# ---- RNG ------------------------------------------------------------------------------------------
# The project itself never draws from a global RNG (its streams are explicit generators), but a
# user's reward may: each rank's global states are saved, so such a reward resumes exactly too.
_RANK_PREFIX = "rank"


def seed_global_rngs(seed: int) -> None:
    """Seed torch's (CPU and every CUDA device), numpy's legacy and Python's global RNGs with ``seed``."""
    torch.manual_seed(seed)
    np.random.seed(seed % 2**32)
    random.seed(seed)


@contextmanager
def seeded_global_rngs(seed: int, device: torch.device | str | None = None) -> Iterator[None]:
    """The block draws from the global RNGs seeded with ``seed``; the states from before it (those of
    ``device`` for CUDA) are put back after, so what draws outside it sees no draw made inside.

    An evaluation scores under it: a user's reward that draws from the global RNGs then draws the
    same numbers at every evaluation, and training's stream, which the checkpoints keep, has one
    order whether evaluations run or not and whether rollouts are pipelined (docs/reliability.md)."""
    # The states as the RNGs give them (not as `rng_state`'s tensors: an evaluation may run under a
    # fake-tensor mode, the GPU dry run's, where a tensor made here would be fake).
    py_state, np_state, cpu_state = random.getstate(), np.random.get_state(), torch.get_rng_state()
    cuda = device is not None and torch.device(device).type == "cuda"
    cuda_state = torch.cuda.get_rng_state(torch.device(device)) if cuda else None
    seed_global_rngs(seed)
    try:
        yield
    finally:
        random.setstate(py_state)
        np.random.set_state(np_state)
        torch.set_rng_state(cpu_state)
        if cuda_state is not None:
            torch.cuda.set_rng_state(cuda_state, torch.device(device))


def rng_state(device: torch.device | str | None = None) -> dict[str, torch.Tensor]:
    """This process's global RNG states: torch's CPU one, the CUDA one of ``device`` (when it is a CUDA
    device), numpy's legacy ``np.random`` and Python's ``random``, as tensors (safetensors-ready)."""
    version, keys, gauss = random.getstate()
    kind, np_keys, np_pos, np_has_gauss, np_gauss = np.random.get_state()
    if kind != "MT19937":  # numpy's legacy global generator is always MT19937
        raise CheckpointError(f"np.random's global state is {kind!r}, expected 'MT19937'")
    out = {
        "torch_cpu": torch.get_rng_state(),
        "numpy_keys": torch.from_numpy(np.asarray(np_keys, dtype=np.int64).copy()),
        "numpy_extra": torch.tensor([np_pos, np_has_gauss, np_gauss], dtype=torch.float64),
        "python_keys": torch.tensor(keys, dtype=torch.int64),
        "python_extra": torch.tensor(
            [version, gauss is not None, 0.0 if gauss is None else gauss], dtype=torch.float64
        ),
    }
    if device is not None and torch.device(device).type == "cuda":
        out["torch_cuda"] = torch.cuda.get_rng_state(torch.device(device))
    return out


def set_rng_state(state: Mapping[str, torch.Tensor], device: torch.device | str | None = None) -> None:
    """Put back the states of `rng_state` (also the torch-only states of checkpoints before v0.3)."""
    torch.set_rng_state(state["torch_cpu"])
    if "python_keys" in state:
        version, has_gauss, gauss = state["python_extra"].tolist()
        random.setstate((int(version), tuple(state["python_keys"].tolist()), gauss if has_gauss else None))
        pos, np_has_gauss, np_gauss = state["numpy_extra"].tolist()
        keys = state["numpy_keys"].numpy().astype(np.uint32)
        np.random.set_state(("MT19937", keys, int(pos), int(np_has_gauss), float(np_gauss)))
    if "torch_cuda" in state and device is not None and torch.device(device).type == "cuda":
        torch.cuda.set_rng_state(state["torch_cuda"], torch.device(device))
    cuda = [state[k] for k in sorted(k for k in state if k.startswith("torch_cuda_"))]  # before v0.3
    if cuda and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(cuda)


def rng_states_of_ranks(states: Sequence[Mapping[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    """The `rng_state` of each rank (in rank order) as one flat dict: ``rank<r>.<name>``."""
    return {f"{_RANK_PREFIX}{r}.{k}": v for r, state in enumerate(states) for k, v in state.items()}


def rng_state_of_rank(saved: Mapping[str, torch.Tensor], rank: int) -> dict[str, torch.Tensor] | None:
    """Rank ``rank``'s states out of `rng_states_of_ranks`' dict; a checkpoint before v0.3 holds one
    process's states for every rank; None when the checkpoint has no states for ``rank`` (it was
    written by fewer ranks)."""
    if not any(k.startswith(_RANK_PREFIX) for k in saved):
        return dict(saved)
    prefix = f"{_RANK_PREFIX}{rank}."
    mine = {k[len(prefix) :]: v for k, v in saved.items() if k.startswith(prefix)}
    return mine or None


# ---- one folder -----------------------------------------------------------------------------------
def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 22), b""):
            h.update(chunk)
    return h.hexdigest()


DIFFUSERS_LORA_NAME = "pytorch_lora_weights.safetensors"
"""The diffusers-layout LoRA file of a checkpoint (diffusers' ``LORA_WEIGHT_NAME_SAFE``)."""


def lora_scale(lora_config: Any, source: str | os.PathLike[str] = "adapter_config.json") -> float:
    """peft's LoRA scale for ``adapter_config.json``: ``alpha / r`` (``alpha / sqrt(r)`` with rsLoRA).

    A `CheckpointError` naming ``source``, the key and what is expected when the file's JSON is not
    such a config (a file can match its manifest and still hold ``[]`` or ``"r": 0``)."""
    if not isinstance(lora_config, Mapping):
        raise CheckpointError(
            f"{source}: expected a JSON object (peft's LoraConfig: r, lora_alpha, ...), "
            f"got {type(lora_config).__name__} {str(lora_config)[:80]}"
        )
    if lora_config.get("rank_pattern") or lora_config.get("alpha_pattern"):
        raise CheckpointError(
            f"{source}: per-module LoRA ranks or alphas (rank_pattern, alpha_pattern) are not supported"
        )
    # Absent keys take peft's LoraConfig defaults (r=8, lora_alpha=8), as PeftModel.from_pretrained does.
    r, alpha = lora_config.get("r", 8), lora_config.get("lora_alpha", 8)
    rslora = lora_config.get("use_rslora", False)
    if isinstance(r, bool) or not isinstance(r, int) or r < 1:
        raise CheckpointError(f"{source}: r={r!r}: expected the LoRA rank, a whole number >= 1")
    if isinstance(alpha, bool) or not isinstance(alpha, int | float) or not 0 < alpha < math.inf:
        raise CheckpointError(f"{source}: lora_alpha={alpha!r}: expected a finite number > 0")
    if not isinstance(rslora, bool):
        raise CheckpointError(f"{source}: use_rslora={rslora!r}: expected true or false")
    return alpha / r**0.5 if rslora else alpha / r


def diffusers_lora_state(
    lora: Mapping[str, torch.Tensor], lora_config: Mapping[str, Any]
) -> dict[str, torch.Tensor]:
    """File keys -> diffusers' layout (``transformer.`` prefix), the scale folded into ``lora_B``.

    Upstream's ``BooguImageLoraLoaderMixin.lora_state_dict`` discards the safetensors metadata and
    ``load_lora_into_transformer`` passes no alphas, so diffusers builds its ``LoraConfig`` with
    ``lora_alpha == r`` (scale 1, ``diffusers.utils.peft_utils.get_peft_kwargs``). With
    ``lora_B * scale`` the loaded adapter computes ``B A x * scale``, exactly what was trained.
    """
    scale = lora_scale(lora_config)
    out = {}
    for key, value in lora.items():
        value = value.detach().to("cpu")
        if is_lora_b(key) and scale != 1.0:
            value = (value.float() * scale).to(value.dtype)
        out[DIFFUSERS_PREFIX + key] = value.contiguous()
    return out


def save_tensors(
    tensors: Mapping[str, torch.Tensor], path: Path, metadata: dict[str, str] | None = None
) -> None:
    """`safetensors.torch.save_file`, with a write the system refused (disk full, read-only storage)
    raised as the `OSError` it is, naming the file: safetensors reports it as its own `SafetensorError`
    ("... No space left on device (os error 28)"), which callers that name failed writes (the CLI,
    ``boogu-sample --merge-to``) would not catch. Other safetensors errors pass through unchanged."""
    try:
        save_file(dict(tensors), path, metadata=metadata)
    except SafetensorError as error:
        # 0.8 says "I/O error: ... (os error 28)"; older releases "IoError(Os { code: 28, ... })"
        code = re.search(r"os error (\d+)|Os \{ code: (\d+)", str(error))
        if code is None:
            raise
        number = int(code.group(1) or code.group(2))
        raise OSError(number, os.strerror(number), str(path)) from error


def write_checkpoint(
    folder: Path, step: int, state: Mapping[str, Any], *, run_id: str, config_yaml: str
) -> None:
    """Write the trainer's state by component into ``folder`` (a staging folder), manifest and marker last.

    One rule for every part (`_lay_out`): the parts of `NAMED_FILES` in their files, any other dict of
    tensors in ``<component>.<key>.safetensors``, everything else in ``trainer_state.json``, which
    names each file where its part was. Plus, for diffusers, the LoRA in its layout (not read back).
    """
    laid_out = _lay_out(dict(state), (), folder)
    learner = state.get("learner") or {}
    if "lora" in learner:
        save_tensors(
            diffusers_lora_state(learner["lora"], learner["lora_config"]),
            folder / DIFFUSERS_LORA_NAME,
            metadata={"format": "pt"},
        )
    record = {"format": FORMAT, "step": int(step), "run_id": run_id, "state": laid_out}
    (folder / "trainer_state.json").write_text(json.dumps(record, indent=2, sort_keys=True))
    (folder / "config.yaml").write_text(config_yaml)
    manifest = {
        p.name: {"size": p.stat().st_size, "sha256": _sha256(p)}
        for p in sorted(folder.iterdir())
        if p.is_file()
    }
    (folder / MANIFEST).write_text(json.dumps(manifest, indent=2, sort_keys=True))
    # No fsync here: `commit_folder` fsyncs every file of the staging folder (this marker included)
    # before the rename that makes it a checkpoint; until then a crash leaves only a staging folder.
    (folder / COMPLETE).write_text(str(step))


def verify_checkpoint(folder: Path, *, hashes: bool = True) -> str | None:
    """None when ``folder`` is an intact checkpoint, else what is wrong with it (for a warning)."""
    if not (folder / COMPLETE).is_file():
        return f"no {COMPLETE} marker"
    manifest_path = folder / MANIFEST
    if not manifest_path.is_file():
        return f"no {MANIFEST}"
    try:
        manifest = json.loads(manifest_path.read_text())
    except (OSError, ValueError) as error:
        return f"unreadable {MANIFEST}: {error}"
    for name, expected in manifest.items():
        path = folder / name
        if not path.is_file():
            return f"{name} is missing"
        size = path.stat().st_size
        if size != expected["size"]:
            return f"{name} has {size} bytes, the manifest says {expected['size']}"
        if hashes and _sha256(path) != expected["sha256"]:
            return f"{name} does not match its SHA-256 in the manifest"
    return None


def read_tensors(path: Path) -> dict[str, torch.Tensor]:
    """The tensors of a checkpoint's safetensors file; a `CheckpointError` naming it if it cannot be read
    or is not a valid safetensors file (a file can match its manifest and still be garbage: the
    manifest records what was written, not that it was a safetensors file)."""
    try:
        return load_file(path)
    except SafetensorError as error:
        raise CheckpointError(f"{path} is not a valid safetensors file ({error})") from error
    except OSError as error:
        raise CheckpointError(f"{path}: cannot be read ({error.strerror or error})") from error


def read_json(path: Path) -> Any:
    """A checkpoint's JSON file; a `CheckpointError` naming it if it cannot be read or is not JSON."""
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except OSError as error:
        raise CheckpointError(f"{path}: cannot be read ({error.strerror or error})") from error
    except ValueError as error:  # JSONDecodeError, or bytes that are not UTF-8
        raise CheckpointError(f"{path} is not valid JSON ({error})") from error


def load_checkpoint(folder: str | os.PathLike[str]) -> SavedCheckpoint:
    """Read a checkpoint folder (verify it first: `verify_checkpoint`): this layout, or v0.2/v0.3's."""
    folder = Path(folder)
    if not (folder / COMPLETE).is_file():
        raise CheckpointError(f"{folder} is not a complete checkpoint (no {COMPLETE} marker)")
    record = read_json(folder / "trainer_state.json")
    if not isinstance(record, dict):
        raise CheckpointError(f"{folder / 'trainer_state.json'}: expected a JSON object")
    if "format" not in record:
        record = _by_component(record, folder)
    elif record["format"] != FORMAT:
        raise CheckpointError(
            f"{folder / 'trainer_state.json'}: format {record['format']!r}; this version reads format {FORMAT} "
            "and the flat layout of v0.2/v0.3 (a newer boogu-trainer wrote it?)"
        )
    return SavedCheckpoint(
        step=int(record["step"]),
        run_id=record.get("run_id"),
        state=_read_back(record["state"], folder),
        config_yaml=(folder / "config.yaml").read_text(),
    )


def checkpoint_folders(root: str | os.PathLike[str]) -> list[tuple[int, Path]]:
    """``(step, folder)`` of every checkpoint folder that has its COMPLETE marker, oldest first.

    Puts back a checkpoint a kill left under its retired name while it was being replaced, and
    removes temporaries of dead writers (a live writer's staging folder is left alone).
    """
    root = Path(root)
    if not root.is_dir():
        return []
    for child in list(root.iterdir()):
        if child.name.startswith(".step_") and ".retired-" in child.name:
            recover_folder(root / child.name[1 : child.name.index(".retired-")])
    remove_stale(root)
    found = []
    for child in root.iterdir():
        m = STEP_DIR.match(child.name)
        if m and (child / COMPLETE).is_file():
            found.append((int(m.group(1)), child))
    return sorted(found)


def newest_intact_checkpoint(root: str | os.PathLike[str], *, echo: TextIO | None = None) -> Path | None:
    """The newest checkpoint folder under ``root`` that passes `verify_checkpoint`, or None.

    Each newer checkpoint that fails its manifest is skipped with a warning (logged, and printed to
    ``echo`` when given) naming it, what is wrong and the checkpoint used instead. The trainer's
    ``resume=auto`` and ``boogu-sample --checkpoint RUN`` both choose through here.
    """
    broken: list[tuple[Path, str]] = []
    found = None
    for _, candidate in reversed(checkpoint_folders(root)):
        reason = verify_checkpoint(candidate)
        if reason is None:
            found = candidate
            break
        broken.append((candidate, reason))
    instead = f"using {found} instead" if found is not None else "no intact checkpoint is left"
    for candidate, reason in broken:
        message = f"checkpoint {candidate} is broken ({reason}); {instead}"
        logger.warning("%s", message)
        if echo is not None:
            print(f"warning: {message}", file=echo)
    return found


def run_id_of(folder: Path) -> str | None:
    try:
        return json.loads((folder / "trainer_state.json").read_text()).get("run_id")
    except (OSError, ValueError):
        return None


# ---- the component ----------------------------------------------------------------------------------
class RunFolderLocked(CheckpointError):
    """Another live process holds the run folder's lock."""


class RunFolderLock:
    """An exclusive lock on one run folder for the life of the run: ``fcntl.flock`` on ``<run>/.lock``.

    The OS drops it when its process dies (kill -9 included), so a dead run never leaves a stale
    lock; while the holder lives, a second writer (a ``resume=auto`` started while a killed job's
    ranks are still finishing, a second fresh run racing for the same name) is refused with an error
    naming the holder's pid and host. Taken and held by rank 0, the one rank that writes the folder.

    A lock that had to create its folder (a fresh run) removes it again on `release` when the run
    wrote nothing else there (a start-up that failed, a ``Trainer`` closed before it trained), with
    the parent folders it created: a refused or failed start leaves no run folder behind.
    """

    NAME = ".lock"

    def __init__(self, folder: Path) -> None:
        self.folder = Path(folder)
        self._file: Any = None
        self._created: list[Path] = []
        """The folders `acquire` created, innermost first."""

    @property
    def held(self) -> bool:
        return self._file is not None

    def acquire(self) -> None:
        if self._file is not None:
            return
        path = self.folder / self.NAME
        created = [p for p in (self.folder, *self.folder.parents) if not p.exists()]
        self.folder.mkdir(parents=True, exist_ok=True)
        for _ in range(3):
            file = open(path, "a+", encoding="utf-8")  # noqa: SIM115 (held open for the life of the run)
            try:
                fcntl.flock(file.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
            except OSError:
                file.seek(0)
                holder = file.read().strip() or "a process that has not written its name yet"
                file.close()
                raise RunFolderLocked(
                    f"{self.folder} is in use by another run ({holder}, holding {path}); a run folder has one "
                    "writer at a time: wait for that run to end, stop it, or give this run another "
                    "logging.name"
                ) from None
            # A holder that removed its empty folder on release unlinked the file we opened: the
            # lock is then on a file no one else can find; open the folder's file again.
            try:
                same = os.stat(path).st_ino == os.fstat(file.fileno()).st_ino
            except FileNotFoundError:
                same = False
            if same:
                break
            file.close()
            self.folder.mkdir(parents=True, exist_ok=True)
        else:
            raise RunFolderLocked(f"{path} keeps being removed while this run takes it; try again")
        file.seek(0)
        file.truncate()
        file.write(f"pid {os.getpid()} on host {socket.gethostname()}\n")
        file.flush()
        self._file = file
        self._created = created

    def release(self) -> None:
        if self._file is None:
            return
        if self._created:  # still holding the lock: no other run can be starting in the folder
            try:
                if [p.name for p in self.folder.iterdir()] == [self.NAME]:
                    (self.folder / self.NAME).unlink()
                    for folder in self._created:
                        folder.rmdir()  # OSError when not empty: someone else's now
            except OSError:
                pass
        self._file.close()  # closing the descriptor drops the flock
        self._file = None
        self._created = []


def _used(folder: Path) -> bool:
    return folder.exists() and (not folder.is_dir() or any(folder.iterdir()))


def resolve_run_folder(config: TrainerConfig, dist: DistEnv) -> tuple[TrainerConfig, str | None]:
    """The config with the run folder this run writes to, and a note for the user (or None).

    A fresh run (``resume=''``) never writes into a folder that holds anything: it takes the first
    unused ``name_1``, ``name_2``, ... . ``resume=auto`` continues the newest of those that has a
    checkpoint. Rank 0 decides and every rank gets its decision, so a torchrun job behaves exactly
    like one process.
    """
    if config.resume and config.resume != "auto":
        return config, None
    name = None
    if dist.is_main:
        base, parent = config.logging.name, Path(config.logging.run_dir).expanduser()
        names = [base]
        while _used(parent / names[-1]):
            names.append(f"{base}_{len(names)}")
        if config.resume == "auto":
            # The newest of name, name_1, ... that has a checkpoint: the run a fresh start moved to.
            with_checkpoints = [n for n in names if checkpoint_folders(parent / n / "checkpoints")]
            name = with_checkpoints[-1] if with_checkpoints else base
        else:
            name = names[-1]
    name = dist.broadcast_object(name, "choose the run folder")
    if name == config.logging.name:
        return config, None
    moved = replace(config, logging=replace(config.logging, name=name))
    if config.resume:
        return moved, f"note: resuming {moved.run_path}, the newest run named {config.logging.name!r}"
    note = (
        f"note: {config.run_path} is already used by another run; this fresh run writes to {moved.run_path} "
        "(pass resume=auto to continue the newest one)"
    )
    return moved, note


class Checkpointer:
    """Saves, prunes, verifies and finds the checkpoints of one run folder."""

    def __init__(self, config: TrainerConfig, dist: DistEnv):
        self.config = config
        self.dist = dist
        self.root = config.run_path / "checkpoints"
        self.run_id = uuid.uuid4().hex
        """This run's identity; a resume adopts the checkpoint's, so pruning knows its own checkpoints."""

    def save(self, step: int, state: Mapping[str, Any]) -> Path:
        """Write the trainer's state by component (`Trainer.state_dict`) as ``checkpoints/step_XXXXXX``,
        atomically, on rank 0, then prune; every rank returns its path."""
        final = self.root / step_dir_name(step)
        if not self.dist.is_main:
            return final
        self.root.mkdir(parents=True, exist_ok=True)
        staging = stage_folder(final)
        try:
            write_checkpoint(
                staging, step, state, run_id=self.run_id, config_yaml=config_to_yaml(self.config)
            )
            fault_point("checkpoint_staged", step, self.dist.rank)
            commit_folder(staging, final)
        except BaseException:
            shutil.rmtree(staging, ignore_errors=True)
            raise
        fault_point("checkpoint_committed", step, self.dist.rank)
        self.prune(keep=final)
        return final

    def committed(self, step: int) -> Path | None:
        """This run's intact checkpoint of ``step``, or None. Decided on rank 0, the same on every rank.

        A stop in the middle of step ``k + 1`` asks for step ``k``'s: if it exists it is exactly the
        state a resume needs, and it must not be replaced by the stop's mid-step state.
        """
        found: Path | None = None
        if self.dist.is_main:
            folder = self.root / step_dir_name(step)
            if (
                (folder / COMPLETE).is_file()
                and run_id_of(folder) == self.run_id
                and verify_checkpoint(folder) is None
            ):
                found = folder
        return self.dist.broadcast_object(found, f"find the committed checkpoint of step {step}")

    def prune(self, keep: Path | None = None) -> list[Path]:
        """Delete this run's checkpoints beyond the newest ``keep_last``; other runs' are never touched,
        nor the one ``best.json`` names."""
        best = self.best()
        protected = {keep, None if best is None else self.root / best["folder"]}
        mine = [
            (s, f)
            for s, f in checkpoint_folders(self.root)
            if run_id_of(f) == self.run_id and verify_checkpoint(f, hashes=False) is None
        ]
        doomed = [f for _, f in mine[: -self.config.checkpoint.keep_last] if f not in protected]
        for folder in doomed:
            shutil.rmtree(folder, ignore_errors=True)
        return doomed

    def best(self) -> dict[str, Any] | None:
        """What ``checkpoints/best.json`` says (``{"step", "gold", "folder"}``), or None (none, unreadable)."""
        try:
            best = json.loads((self.root / BEST).read_text())
        except (OSError, ValueError):
            return None
        if not isinstance(best, dict) or not STEP_DIR.match(str(best.get("folder", ""))):
            return None
        return best

    def best_folder(self) -> Path | None:
        """The best checkpoint's folder, if ``best.json`` names one that is still complete."""
        best = self.best()
        folder = None if best is None else self.root / best["folder"]
        return folder if folder is not None and (folder / COMPLETE).is_file() else None

    def mark_best(self, step: int, gold: float, folder: Path | None = None) -> None:
        """Point ``best.json`` at the (committed) checkpoint of ``step``, then prune the previous best
        if ``keep_last`` no longer keeps it. Rank 0 writes; other ranks return at once."""
        if not self.dist.is_main:
            return
        folder = folder or self.root / step_dir_name(step)
        if not (folder / COMPLETE).is_file():
            raise CheckpointError(f"mark_best: {folder} is not a complete checkpoint")
        record = {"step": int(step), "gold": float(gold), "folder": folder.name}
        atomic_write_text(self.root / BEST, json.dumps(record, indent=2, sort_keys=True) + "\n")
        self.prune(keep=folder)

    def restore_best(self, best: Mapping[str, Any] | None) -> None:
        """On resume: make ``best.json`` say what the trainer state says (the best as of that step).

        A pointer written after the checkpoint resumed from (a discarded future) is replaced, or
        removed when the state has no best; its folder is then pruned like any other.
        """
        if not self.dist.is_main or not self.config.checkpoint.keep_best:
            return
        if best is None or not (self.root / best["folder"] / COMPLETE).is_file():
            (self.root / BEST).unlink(missing_ok=True)
            return
        if self.best() != {"step": best["step"], "gold": best["gold"], "folder": best["folder"]}:
            record = {"step": int(best["step"]), "gold": float(best["gold"]), "folder": best["folder"]}
            atomic_write_text(self.root / BEST, json.dumps(record, indent=2, sort_keys=True) + "\n")

    def find(self, spec: str) -> Path | None:
        """The checkpoint to resume from: ``'auto'`` -> the newest intact one of this run folder (None
        if there is none), else the given path (which must be intact). Decided on rank 0."""
        folder: Path | None = None
        problem = None
        if self.dist.is_main:
            if spec == "auto":
                folder = newest_intact_checkpoint(self.root, echo=sys.stdout)
            else:
                folder = Path(spec).expanduser()
                problem = verify_checkpoint(folder)
        folder, problem = self.dist.broadcast_object((folder, problem), "choose the checkpoint")
        if problem is not None:
            raise CheckpointError(f"resume={spec}: {folder} is not an intact checkpoint: {problem}")
        return folder

    def load(self, folder: Path) -> SavedCheckpoint:
        """Read ``folder`` and check that this run's config may continue it (`check_resume_config`)."""
        saved = load_checkpoint(folder)
        check_resume_config(saved.config_yaml, self.config, folder)
        self.run_id = saved.run_id or self.run_id
        return saved


def check_resume_config(saved_yaml: str, config: TrainerConfig, folder: Path) -> None:
    """Refuse a resume whose config changes the past, unless each change is opted into."""
    old = yaml.safe_load(saved_yaml) or {}
    changes = config_changes(old, config_to_dict(config), config.resume_allow_changes)
    if not changes:
        for key, a, b in resume_not_bitwise_changes(old, config_to_dict(config)):
            logger.warning(
                "resume: %s changed from %r (in %s) to %r; accepted, but the run is no longer bitwise equal "
                "to one that never stopped (the same numbers are computed in another order)",
                key,
                a,
                folder,
                b,
            )
        return
    listed = "\n".join(f"  {key}: {a!r} (checkpoint) -> {b!r} (now)" for key, a, b in changes)
    keys = ",".join(key for key, _, _ in changes)
    raise CheckpointError(
        f"the config differs from the one {folder} was trained with, in keys that change the run's past:\n"
        f"{listed}\nRestore them, or accept the changes with resume_allow_changes=[{keys}] "
        "(the new values then take effect from the next step). Keys that cannot change the numbers "
        "(config.RESUME_FREE_KEYS) and other spellings of the same value (a path with a trailing slash, "
        "model.device=auto for the device it resolves to) are accepted without it: docs/reliability.md."
    )
