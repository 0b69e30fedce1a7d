"""The trainer <-> rollout-worker wire format (installed in both environments; torch + safetensors).

Every request and response body is one safetensors blob: named tensors, and a JSON document stored
in the safetensors metadata under ``"boogu"``. Nothing is pickled, so a worker in another
environment (vllm-omni's, with its own torch) or on another machine reads exactly what was sent.

Endpoints (HTTP/1.1 on the worker, ``rollout.vllm.url``):

* ``GET /health`` -> JSON ``{"status": "ok", "protocol": PROTOCOL_VERSION, "backend": ..., "model": ...,
  "model_identity": checkpoint_identity(model), "lora_version": int, "lora_fingerprint": str | null}``.
* ``POST /lora`` with ``{"version", "peft_config"}`` and the LoRA tensors (the trainer's file keys) ->
  ``{"version", "fingerprint", "keys"}`` once the adapter is loaded; 409 and the key names when a
  key attaches to nothing in the worker's transformer. ``{"version", "clear": true}`` without
  tensors returns the worker to the base weights; ``{"version", "reset": true}`` does that and
  restarts the version count at ``version`` (a trainer connecting); ``{"version", "relabel": true}``
  keeps the weights and calls them ``version`` (a trainer that put back earlier weights).
* ``POST /generate`` with a :class:`RolloutSpec` (``meta["spec"]``) and the reference images
  (``ref_image.{i}``, uint8 bytes of the encoded file: :func:`reference_tensors`, read back with
  :func:`reference_images`) -> the trajectory tensors (see ``docs/vllm-omni.md``; each unique
  reference's latent as ``ref_latent.{u}``, :func:`ref_latent_key`) and
  ``{"window", "weights_version", "lora_fingerprint", "nfe", "timings"}``.
* ``POST /shutdown``.

Errors come back as JSON ``{"error": message, "kind": name}`` with a 4xx/5xx status.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Mapping
from dataclasses import MISSING, asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load as _st_load
from safetensors.torch import save as _st_save

__all__ = [
    "DIFFUSERS_PREFIX",
    "MAX_SEQUENCE_LENGTH",
    "PEFT_PREFIX",
    "PROTOCOL_VERSION",
    "GroupSpec",
    "ProtocolError",
    "RolloutSpec",
    "auto_dtype",
    "bytes_tensor",
    "checkpoint_identity",
    "lora_fingerprint",
    "pack",
    "ref_image_key",
    "ref_latent_key",
    "reference_images",
    "reference_tensors",
    "resolve_device_type",
    "resolve_dtype_name",
    "tensor_bytes",
    "unpack",
]

__version__ = "0.1.0"

PROTOCOL_VERSION = 1
"""Bumped whenever a field changes meaning; the engine refuses a worker that speaks another."""

_META_KEY = "boogu"

MAX_SEQUENCE_LENGTH = 1280
"""Instruction tokens per prompt (upstream's ``max_sequence_length``): the trainer's default
``model.max_sequence_length`` and the cap the worker encodes prompts with."""

PEFT_PREFIX = "base_model.model."
"""What peft's ``PeftModel`` puts before the module path in ``adapter_model.safetensors``; a LoRA key
sent to the worker may carry it (``boogu_adapters.lora`` owns the key naming and imports it from here)."""
DIFFUSERS_PREFIX = "transformer."
"""What diffusers' ``save_lora_weights`` puts before the transformer's module paths; a LoRA key sent
to the worker may carry it too."""

_REF_IMAGE = "ref_image."
_REF_LATENT = "ref_latent."


class ProtocolError(ValueError):
    """A message that is not a valid protocol message (says which field and what was expected)."""


def pack(meta: Mapping[str, Any], tensors: Mapping[str, torch.Tensor] | None = None) -> bytes:
    """One message: ``meta`` (JSON-able) and ``tensors`` (contiguous CPU copies are made here)."""
    try:
        text = json.dumps(meta, allow_nan=False)
    except (TypeError, ValueError) as error:
        raise ProtocolError(f"message metadata is not JSON-able: {error}") from None
    payload = {}
    for name, tensor in (tensors or {}).items():
        if not isinstance(tensor, torch.Tensor):
            raise ProtocolError(f"tensor {name!r} is a {type(tensor).__name__}, not a torch.Tensor")
        payload[name] = tensor.detach().to("cpu").contiguous()
    return _st_save(payload, metadata={_META_KEY: text})


def unpack(data: bytes) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
    """The ``(meta, tensors)`` of a message made by :func:`pack`."""
    if len(data) < 8:
        raise ProtocolError(f"message of {len(data)} bytes is too short for a safetensors header")
    header_len = int.from_bytes(data[:8], "little")
    if header_len <= 0 or 8 + header_len > len(data):
        raise ProtocolError(f"message header length {header_len} does not fit a {len(data)}-byte message")
    try:
        header = json.loads(data[8 : 8 + header_len])
        meta = json.loads(header.get("__metadata__", {})[_META_KEY])
    except (ValueError, KeyError, TypeError, AttributeError) as error:
        raise ProtocolError(f"message carries no '{_META_KEY}' metadata: {error}") from None
    if not isinstance(meta, dict):
        raise ProtocolError(f"message metadata must be a JSON object, got {type(meta).__name__}")
    try:
        tensors = dict(_st_load(data))
    except Exception as error:  # safetensors raises its own error type
        raise ProtocolError(f"message tensors do not decode: {error}") from None
    return meta, tensors


def bytes_tensor(data: bytes) -> torch.Tensor:
    """Raw bytes (an encoded image file) as a 1-D uint8 tensor."""
    return torch.frombuffer(bytearray(data), dtype=torch.uint8)


def tensor_bytes(tensor: torch.Tensor) -> bytes:
    """The inverse of :func:`bytes_tensor`."""
    if tensor.dtype != torch.uint8 or tensor.dim() != 1:
        raise ProtocolError(f"expected a 1-D uint8 tensor of bytes, got {tensor.dtype} {tuple(tensor.shape)}")
    return tensor.numpy().tobytes()


def ref_image_key(index: int) -> str:
    """The request tensor name of reference image ``index`` (``GroupSpec.ref_image``)."""
    return f"{_REF_IMAGE}{int(index)}"


def ref_latent_key(index: int) -> str:
    """The response tensor name of the latent of unique reference ``index`` (an entry of ``ref_rows``)."""
    return f"{_REF_LATENT}{int(index)}"


def reference_tensors(images: Mapping[int, bytes]) -> dict[str, torch.Tensor]:
    """A ``/generate`` request's tensors: each reference image's encoded file by its index."""
    return {ref_image_key(i): bytes_tensor(data) for i, data in images.items()}


def reference_images(tensors: Mapping[str, torch.Tensor]) -> dict[int, bytes]:
    """The inverse of :func:`reference_tensors`; any other tensor name is a :class:`ProtocolError`."""
    out = {}
    for name, value in tensors.items():
        index = name[len(_REF_IMAGE) :]
        if not name.startswith(_REF_IMAGE) or not index.isdigit():
            raise ProtocolError(f"/generate: unexpected tensor {name!r} (only {_REF_IMAGE}{{i}} are read)")
        out[int(index)] = tensor_bytes(value)
    return out


def resolve_device_type(spec: str) -> str:
    """The device type a ``device`` setting runs on: ``"auto"`` is ``"cuda"`` when CUDA is available,
    else ``"cpu"``; ``"cpu"``, ``"cuda"``, ``"cuda:N"`` are their type.

    The one rule for ``auto`` devices: the trainer's rank device, ``boogu-sample``, the memory plan and
    the rewards all resolve ``auto`` here."""
    if spec == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    return torch.device(spec).type


def auto_dtype(device_type: str) -> str:
    """The compute dtype ``"auto"`` stands for on a device type: bfloat16 on CUDA, float32 elsewhere.

    The one rule for ``auto`` dtypes, shared by the trainer (``model.dtype``, the plan, the rewards,
    ``boogu-sample``) and the rollout worker (its ``--dtype`` default): a trainer and the worker it
    launches with ``rollout.vllm.dtype=auto`` run the same dtype on the same kind of device."""
    return "bfloat16" if device_type == "cuda" else "float32"


def resolve_dtype_name(spec: str, device_type: str) -> str:
    """A dtype setting (``"auto"``, ``"float32"``, ``"bfloat16"``, ``"float16"``) on ``device_type``."""
    return auto_dtype(device_type) if spec == "auto" else spec


def lora_fingerprint(state: Mapping[str, torch.Tensor]) -> str:
    """A hash of LoRA tensors' exact contents: per key, in sorted key order, the key, the dtype, the
    shape and the bytes of a contiguous CPU copy (sha256, first 16 hex digits).

    The trainer fingerprints what it sends (on its device, often CUDA) and the worker what it loaded
    (CPU copies): equal fingerprints mean the rollout samples with the weights the trainer trained.
    Only canonical bytes give that: a float sum depends on the reduction order, which changes with
    the memory layout (a transposed copy) and with the device's kernels, so equal tensors could
    disagree. Each field is length-prefixed, so no two different states feed the hash the same bytes.
    """
    h = hashlib.sha256()

    def field(data: bytes) -> None:
        h.update(len(data).to_bytes(8, "little"))
        h.update(data)

    for key in sorted(state):
        # The copy to the CPU happens here, whatever the caller's device: one byte order on both sides.
        tensor = state[key].detach().to("cpu").contiguous()
        field(key.encode())
        field(str(tensor.dtype).encode())
        field(str(tuple(tensor.shape)).encode())
        # view(uint8) reinterprets the storage (bfloat16 too, which numpy has no type for).
        field(tensor.reshape(-1).view(torch.uint8).numpy().tobytes())
    return h.hexdigest()[:16]


def checkpoint_identity(model_dir: str | os.PathLike[str]) -> str:
    """A cheap identity of a checkpoint folder, the same wherever it is copied: the transformer's and
    the scheduler's configs, and per transformer weight file its name, size and first and last MiB.

    The trainer and the worker must load the same checkpoint (only the LoRA travels); Base and Edit
    share one config, so the weights' bytes are sampled too. Missing files hash as absent.
    """
    root = Path(model_dir)
    h = hashlib.sha256()
    for rel in ("transformer/config.json", "scheduler/scheduler_config.json"):
        path = root / rel
        h.update(rel.encode())
        h.update(path.read_bytes() if path.is_file() else b"<absent>")
    chunk = 1 << 20
    for path in sorted((root / "transformer").glob("*.safetensors")):
        size = path.stat().st_size
        h.update(f"{path.name}:{size}".encode())
        with open(path, "rb") as f:
            h.update(f.read(chunk))
            f.seek(max(size - chunk, 0))
            h.update(f.read(chunk))
    return h.hexdigest()[:16]


@dataclass(frozen=True)
class GroupSpec:
    """One prompt group: its instruction, negative, and the index of its reference image (or None)."""

    instruction: str
    negative: str = ""
    ref_image: int | None = None
    """Index ``i`` of the tensor ``ref_image.{i}`` carrying the encoded image file; None for T2I."""


_WINDOW_FIELDS = frozenset({"kind", "size", "window_range", "start", "scope", "stride", "every"})
"""The fields of ``boogu_schedule.WindowPlan`` a spec's ``window`` may carry."""


@dataclass(frozen=True)
class RolloutSpec:
    """A rollout request as it crosses the wire (the trainer's ``RolloutRequest`` minus the images).

    Field meanings are those of ``boogu_adapters.types.RolloutRequest``; ``window`` holds the fields
    of ``boogu_schedule.WindowPlan`` (``kind, size, window_range, start, scope, stride, every``).
    """

    groups: tuple[GroupSpec, ...]
    group_size: int
    num_steps: int
    guidance_scale: float
    sampler: str
    noise_level: float
    window: dict[str, Any]
    height: int
    width: int
    seed: int
    group_offset: int = 0
    iteration: int = 0
    decode: bool = True
    micro_batch_size: int = 0
    """At most this many samples per transformer call and per VAE decode (the trainer's
    ``rollout.micro_batch_size``); 0 = every sample of the request in one call, as before this field."""
    image_guidance_scale: float = 1.0
    """Upstream's Edit image guidance (``boogu_schedule.guidance_branches``); 1 = off, as before
    this field."""
    protocol: int = PROTOCOL_VERSION
    extra: dict[str, Any] = field(default_factory=dict)

    def to_json(self) -> dict[str, Any]:
        """The spec as plain JSON types (lists, not tuples), as it reads back from the wire."""
        return json.loads(json.dumps(asdict(self)))

    @classmethod
    def from_json(cls, data: Any) -> RolloutSpec:
        if not isinstance(data, dict):
            raise ProtocolError(f"spec must be a JSON object, got {type(data).__name__}")
        if data.get("protocol") != PROTOCOL_VERSION:
            raise ProtocolError(
                f"spec.protocol is {data.get('protocol')!r}; this side speaks protocol {PROTOCOL_VERSION}"
            )
        known = {f for f in cls.__dataclass_fields__}
        unknown = sorted(set(data) - known)
        if unknown:
            raise ProtocolError(f"spec has unknown fields {unknown}")
        required = {
            k
            for k, f in cls.__dataclass_fields__.items()
            if f.default is MISSING and f.default_factory is MISSING
        }
        missing = sorted(required - set(data))
        if missing:
            raise ProtocolError(f"spec lacks the fields {missing}")
        groups = data["groups"]
        if not isinstance(groups, list | tuple) or not groups:
            raise ProtocolError("spec.groups must be a non-empty list")
        parsed = []
        group_fields = set(GroupSpec.__dataclass_fields__)
        for g, group in enumerate(groups):
            if not isinstance(group, dict) or not isinstance(group.get("instruction"), str):
                raise ProtocolError(f"spec.groups[{g}] must be an object with a string 'instruction'")
            if set(group) - group_fields:
                raise ProtocolError(
                    f"spec.groups[{g}] has unknown fields {sorted(set(group) - group_fields)}"
                )
            if not isinstance(group.get("negative", ""), str):
                raise ProtocolError(f"spec.groups[{g}].negative must be a string")
            ref = group.get("ref_image")
            if ref is not None and (isinstance(ref, bool) or not isinstance(ref, int) or ref < 0):
                raise ProtocolError(f"spec.groups[{g}].ref_image must be null or an int >= 0, got {ref!r}")
            parsed.append(GroupSpec(**group))
        window = data["window"]
        if not isinstance(window, dict) or set(window) - _WINDOW_FIELDS:
            raise ProtocolError(
                f"spec.window must be an object with fields from {sorted(_WINDOW_FIELDS)}, got {window!r}"
            )
        if data.get("extra"):
            raise ProtocolError(f"spec.extra is reserved and must be empty, got {sorted(data['extra'])}")
        if not isinstance(data.get("sampler"), str):
            raise ProtocolError(f"spec.sampler must be a string, got {data.get('sampler')!r}")
        if not isinstance(data.get("decode", True), bool):
            raise ProtocolError(f"spec.decode must be true or false, got {data.get('decode')!r}")
        checks = {
            "group_size": (int, lambda v: v >= 1, ">= 1"),
            "num_steps": (int, lambda v: v >= 1, ">= 1"),
            "guidance_scale": ((int, float), lambda v: v >= 1.0, ">= 1"),
            "image_guidance_scale": ((int, float), lambda v: v >= 1.0, ">= 1 (1 = off)"),
            "noise_level": ((int, float), lambda v: v >= 0.0, ">= 0"),
            "height": (int, lambda v: v > 0, "> 0"),
            "width": (int, lambda v: v > 0, "> 0"),
            "seed": (int, lambda v: True, "an int"),
            "group_offset": (int, lambda v: v >= 0, "an int >= 0"),
            "iteration": (int, lambda v: v >= 0, "an int >= 0"),
            "micro_batch_size": (int, lambda v: v >= 0, "an int >= 0 (0 = the whole request at once)"),
        }
        for name, (types, ok, expected) in checks.items():
            if name not in data:
                continue  # a field with a default (the required ones were checked above)
            value = data[name]
            if isinstance(value, bool) or not isinstance(value, types) or not ok(value):
                raise ProtocolError(f"spec.{name} must be {expected}, got {value!r}")
        return cls(**{**data, "groups": tuple(parsed)})
