"""Load a Boogu-Image checkpoint folder into typed parts.

A Boogu checkpoint (``docs/upstream-model.md`` §10) is a diffusers-style folder::

    model_index.json
    transformer/   config.json, diffusion_pytorch_model*.safetensors (+ index), transformer_boogu.py (shim)
    vae/           FLUX.1 AutoencoderKL
    mllm/          Qwen3-VL-8B-Instruct (Qwen3VLForConditionalGeneration, lm_head included)
    processor/     Qwen3-VL tokenizer, image processor and chat template
    scheduler/     scheduler_config.json with the Boogu time-shift keys

:func:`load_boogu` loads each subfolder itself instead of going through ``DiffusionPipeline``:

* The transformer comes either from our own port (``native``: config.json plus the safetensors
  shards, nothing from the checkpoint is executed) or from the checkpoint's own class
  (``canonical``: the ``transformer_boogu.py`` shim, i.e. remote code, allowed only with
  ``trust_remote_code=True``).
* The Qwen3-VL encoder is the inner ``Qwen3VLModel``: the pipeline encodes with
  ``mllm.model`` (``docs/upstream-model.md`` §9), so the 0.6 B-parameter ``lm_head`` is never materialised.
* The scheduler config is read as raw JSON into :class:`boogu_schedule.BooguScheduleConfig`: a
  diffusers ``FlowMatchEulerDiscreteScheduler`` round trip silently drops the Boogu time-shift
  keys, and the class defaults (dynamic v2) differ from the released config (static v1).
* Weights are read from safetensors only, never unpickled.
"""

from __future__ import annotations

import contextlib
import importlib
import json
import logging
import os
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import torch
from diffusers import AutoencoderKL, AutoModel, ModelMixin
from safetensors import safe_open
from transformers import Qwen3VLModel
from transformers.utils import logging as transformers_logging

from boogu_adapters._processor import ImageOnlyQwen3VLProcessor
from boogu_adapters.model import BooguImageTransformer2DModel
from boogu_schedule import BooguScheduleConfig

__all__ = [
    "SUBFOLDERS",
    "BooguParts",
    "CheckpointError",
    "TransformerKind",
    "load_boogu",
    "load_processor",
    "load_schedule_config",
    "load_text_encoder",
    "load_transformer",
    "load_vae",
    "resolve_transformer_kind",
]

logger = logging.getLogger(__name__)

TransformerKind = Literal["auto", "native", "canonical"]

SUBFOLDERS: tuple[str, ...] = ("transformer", "vae", "mllm", "processor", "scheduler")
"""The component folders every Boogu checkpoint has (``model_index.json`` names the same five)."""

WEIGHTS_NAME = "diffusion_pytorch_model.safetensors"
WEIGHTS_INDEX_NAME = "diffusion_pytorch_model.safetensors.index.json"
SCHEDULER_CONFIG_NAME = "scheduler_config.json"

# How many names an error message lists before it summarises the rest.
_LIST_LIMIT = 5


class CheckpointError(ValueError):
    """A checkpoint folder is missing something or does not match the model it should load into."""


@dataclass(frozen=True)
class BooguParts:
    """Everything a Boogu pipeline needs, loaded from one checkpoint folder."""

    transformer: torch.nn.Module
    """The DiT: our ``BooguImageTransformer2DModel`` (native) or the checkpoint's class (canonical)."""
    vae: AutoencoderKL
    """The FLUX VAE; latents are ``(z - shift_factor) * scaling_factor`` with both from its config."""
    text_encoder: Qwen3VLModel
    """The inner Qwen3-VL model (no ``lm_head``); its ``last_hidden_state`` is the instruction feature."""
    processor: ImageOnlyQwen3VLProcessor
    """Tokenizer, image processor and chat template from ``processor/``."""
    schedule_config: BooguScheduleConfig
    """``scheduler/scheduler_config.json`` as read, every key kept."""
    vae_scale_factor: int
    """Pixels per latent cell along each side: ``2 ** (len(block_out_channels) - 1)``, 8 for FLUX."""
    path: Path
    """The checkpoint folder, resolved."""
    transformer_kind: Literal["native", "canonical"]
    """Which loader produced ``transformer``."""


def load_boogu(
    path: str | os.PathLike[str],
    *,
    transformer: TransformerKind = "auto",
    trust_remote_code: bool = False,
    dtype: torch.dtype = torch.float32,
    device: str | torch.device = "cpu",
    text_encoder_device: str | torch.device | None = None,
) -> BooguParts:
    """Load every part of a Boogu-Image checkpoint folder.

    Args:
        path: the checkpoint folder (the one holding ``model_index.json``).
        transformer: ``"native"`` loads the weights into our own port and executes nothing from the
            checkpoint; ``"canonical"`` loads the checkpoint's own class through its
            ``transformer_boogu.py`` (remote code: requires ``trust_remote_code=True``);
            ``"auto"`` picks canonical when remote code is allowed and the upstream ``boogu``
            package imports, native otherwise, and logs its choice.
        trust_remote_code: allow executing Python files shipped in the checkpoint. Off by default:
            a checkpoint is data, and a downloaded folder's ``.py`` files run with your rights.
        dtype: dtype of every module (float32 on CPU; bfloat16 is the released dtype on GPUs).
        device: where the modules go.
        text_encoder_device: where the text encoder goes instead (None: ``device``); ``"meta"``
            builds it from its config without reading its weights (a trainer whose rollout worker
            encodes the prompts needs only the processor).

    Raises:
        CheckpointError: a subfolder or file is missing, the tensors in the transformer or VAE
            weights do not match the model (missing, unexpected or wrongly shaped names), or the
            scheduler config is invalid (for example an unknown ``time_shift_version``).
        ValueError: ``transformer="canonical"`` without ``trust_remote_code=True``.
    """
    root = _checkpoint_root(path)
    # Cheap checks first: a broken folder should fail before gigabytes are read.
    for name in SUBFOLDERS:
        _subfolder(root, name)
    schedule_config = load_schedule_config(root)
    model, kind = load_transformer(
        root, kind=transformer, trust_remote_code=trust_remote_code, dtype=dtype, device=device
    )
    vae = load_vae(root, dtype=dtype, device=device)
    return BooguParts(
        transformer=model,
        vae=vae,
        text_encoder=load_text_encoder(
            root, dtype=dtype, device=device if text_encoder_device is None else text_encoder_device
        ),
        processor=load_processor(root),
        schedule_config=schedule_config,
        vae_scale_factor=2 ** (len(vae.config.block_out_channels) - 1),
        path=root,
        transformer_kind=kind,
    )


def resolve_transformer_kind(
    kind: TransformerKind, trust_remote_code: bool
) -> Literal["native", "canonical"]:
    """Decide which transformer loader ``kind`` means, refusing canonical without remote code.

    ``auto`` is canonical only when remote code is allowed (by the caller and by diffusers'
    ``DIFFUSERS_DISABLE_REMOTE_CODE``) and the upstream ``boogu`` package imports, since the
    released shim re-exports that package's class; otherwise it is native.
    """
    if kind == "native":
        return "native"
    if kind == "canonical":
        if not trust_remote_code:
            raise ValueError(
                "transformer='canonical' imports and runs transformer/transformer_boogu.py from the "
                "checkpoint folder (remote code). Pass trust_remote_code=True only if you trust where "
                "the checkpoint came from, or use transformer='native', which loads only the "
                "safetensors weights into boogu_adapters' own model class."
            )
        if _remote_code_disabled():
            raise ValueError(
                "transformer='canonical' needs diffusers remote code, but the environment variable "
                "DIFFUSERS_DISABLE_REMOTE_CODE disables it; unset it or use transformer='native'"
            )
        return "canonical"
    if kind != "auto":
        raise ValueError(f"transformer must be 'auto', 'native' or 'canonical', got {kind!r}")
    if not trust_remote_code:
        logger.info("transformer loader: native (auto; trust_remote_code=False)")
        return "native"
    if _remote_code_disabled():
        logger.info("transformer loader: native (auto; DIFFUSERS_DISABLE_REMOTE_CODE is set)")
        return "native"
    try:
        importlib.import_module("boogu")
    except ImportError as e:
        logger.info("transformer loader: native (auto; the upstream 'boogu' package does not import: %s)", e)
        return "native"
    logger.info("transformer loader: canonical (auto; trust_remote_code=True and 'boogu' imports)")
    return "canonical"


def load_transformer(
    path: str | os.PathLike[str],
    *,
    kind: TransformerKind = "auto",
    trust_remote_code: bool = False,
    dtype: torch.dtype = torch.float32,
    device: str | torch.device = "cpu",
) -> tuple[torch.nn.Module, Literal["native", "canonical"]]:
    """Load ``<path>/transformer``; returns the model (eval mode) and the loader that was used.

    Both loaders first compare the tensor names and shapes in the safetensors headers with the
    model the config describes (built on the meta device, so nothing is allocated), and raise a
    :class:`CheckpointError` naming the first differences.

    ``canonical`` resolves the class the checkpoint names: ``auto_map["AutoModel"]`` in
    ``transformer/config.json`` (the tiny checkpoint writes it) through
    ``diffusers.AutoModel.from_pretrained(<path>/transformer, trust_remote_code=True)``, or else
    ``model_index.json``'s ``transformer: [module, class]`` entry with ``transformer/<module>.py``,
    the way ``DiffusionPipeline`` does (the released checkpoints have no ``auto_map``).
    ``AutoModel.from_pretrained(path, subfolder="transformer")`` is not used: in diffusers 0.42
    it reads ``auto_map`` from the root's ``model_index.json`` and then refuses remote code.
    """
    root = _checkpoint_root(path)
    chosen = resolve_transformer_kind(kind, trust_remote_code)
    transformer_dir = _subfolder(root, "transformer")
    config = _read_json(transformer_dir / "config.json")
    if chosen == "native":
        model_cls: type[ModelMixin] = BooguImageTransformer2DModel
        class_name = config.get("_class_name")
        if class_name is not None and class_name != BooguImageTransformer2DModel.__name__:
            raise CheckpointError(
                f"{transformer_dir / 'config.json'}: _class_name is {class_name!r}, the native loader "
                f"loads only {BooguImageTransformer2DModel.__name__!r}"
            )
    else:
        model_cls = _canonical_class(root, transformer_dir, config)
    _check_weights(transformer_dir, model_cls, config)
    if chosen == "canonical" and "AutoModel" in (config.get("auto_map") or {}):
        model = AutoModel.from_pretrained(
            str(transformer_dir),
            trust_remote_code=True,
            local_files_only=True,
            dtype=dtype,
            use_safetensors=True,
        )
    else:
        model = model_cls.from_pretrained(
            str(transformer_dir), local_files_only=True, dtype=dtype, use_safetensors=True
        )
    return model.to(device).eval(), chosen


def load_vae(
    path: str | os.PathLike[str], *, dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu"
) -> AutoencoderKL:
    """Load ``<path>/vae`` as a diffusers ``AutoencoderKL``, checking its tensors and FLUX factors."""
    vae_dir = _subfolder(_checkpoint_root(path), "vae")
    config = _read_json(vae_dir / "config.json")
    if config.get("scaling_factor") is None:
        raise CheckpointError(
            f"{vae_dir / 'config.json'}: missing 'scaling_factor' (the FLUX VAE's is 0.3611); "
            "latents cannot be scaled without it"
        )
    _check_weights(vae_dir, AutoencoderKL, config)
    vae = AutoencoderKL.from_pretrained(
        str(vae_dir), local_files_only=True, dtype=dtype, use_safetensors=True
    )
    return vae.to(device).eval()


def load_text_encoder(
    path: str | os.PathLike[str], *, dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu"
) -> Qwen3VLModel:
    """Load the inner ``Qwen3VLModel`` from ``<path>/mllm`` without its ``lm_head``.

    The folder holds a ``Qwen3VLForConditionalGeneration``; transformers maps its ``model.*``
    tensors onto ``Qwen3VLModel`` and the ``lm_head`` is skipped. Any other missing, unexpected
    or mismatched tensor is an error (transformers would otherwise initialise it randomly).
    ``device="meta"``: the module built from ``config.json`` alone, no weight read or allocated.
    """
    mllm_dir = _subfolder(_checkpoint_root(path), "mllm")
    _read_json(mllm_dir / "config.json")
    if torch.device(device).type == "meta":
        from transformers import Qwen3VLConfig

        config = Qwen3VLConfig.from_pretrained(str(mllm_dir), local_files_only=True)
        with torch.device("meta"):
            return Qwen3VLModel._from_config(config, torch_dtype=dtype).eval()
    if not any(mllm_dir.glob("*.safetensors")):
        raise CheckpointError(f"{mllm_dir}: no *.safetensors weights (pickled weights are never loaded)")
    # The load report lists lm_head as unexpected, which is the point; the real problems are raised below.
    with _transformers_verbosity(transformers_logging.ERROR):
        model, info = Qwen3VLModel.from_pretrained(
            str(mllm_dir), dtype=dtype, local_files_only=True, use_safetensors=True, output_loading_info=True
        )
    unexpected = sorted(k for k in info.get("unexpected_keys", ()) if not k.startswith("lm_head."))
    problems = [
        _name_list("missing from the checkpoint", sorted(info.get("missing_keys", ()))),
        _name_list("unexpected", unexpected),
        _name_list("with mismatched shapes", sorted(str(k) for k in info.get("mismatched_keys", ()))),
    ]
    problems = [p for p in problems if p]
    if problems:
        raise CheckpointError(
            f"{mllm_dir}: Qwen3-VL weights do not match its config.json: " + "; ".join(problems)
        )
    return model.to(device).eval()


def load_processor(path: str | os.PathLike[str]) -> ImageOnlyQwen3VLProcessor:
    """Load ``<path>/processor`` (tokenizer, image processor, chat template); no remote code.

    The folder is the released stock ``Qwen3VLProcessor`` layout; its
    ``video_preprocessor_config.json`` is not read (a stock processor needs torchvision, see
    :mod:`boogu_adapters._processor`).

    The tokenizer must pad on the right (Boogu's RoPE text positions assume it); the released
    processor does, and :func:`boogu_adapters.encoding.encode_prompts` passes
    ``padding_side="right"`` on every call anyway.
    """
    processor_dir = _subfolder(_checkpoint_root(path), "processor")
    processor = ImageOnlyQwen3VLProcessor.from_pretrained(str(processor_dir), local_files_only=True)
    if processor.tokenizer.pad_token is None:
        raise CheckpointError(f"{processor_dir}: the tokenizer has no pad token (Qwen's is '<|endoftext|>')")
    if processor.chat_template is None:
        raise CheckpointError(
            f"{processor_dir}: no chat template (chat_template.jinja or chat_template.json)"
        )
    return processor


def load_schedule_config(path: str | os.PathLike[str]) -> BooguScheduleConfig:
    """Read ``<path>/scheduler/scheduler_config.json`` as raw JSON; every key is kept."""
    scheduler_dir = _subfolder(_checkpoint_root(path), "scheduler")
    config_path = scheduler_dir / SCHEDULER_CONFIG_NAME
    if not config_path.is_file():
        raise CheckpointError(f"{scheduler_dir}: missing {SCHEDULER_CONFIG_NAME}")
    try:
        return BooguScheduleConfig.from_json(config_path)
    except (ValueError, TypeError) as e:
        message = str(e)
        if str(config_path) not in message:
            message = f"{config_path}: {message}"
        raise CheckpointError(message) from e


# ----------------------------------------------------------------------------------------------
# Helpers


def _checkpoint_root(path: str | os.PathLike[str]) -> Path:
    root = Path(path).expanduser().resolve()
    if not root.is_dir():
        raise CheckpointError(f"{root}: not a directory (expected a Boogu checkpoint folder)")
    return root


def _subfolder(root: Path, name: str) -> Path:
    folder = root / name
    if not folder.is_dir():
        raise CheckpointError(
            f"{root}: missing subfolder '{name}/' (a Boogu checkpoint has "
            + ", ".join(f"{n}/" for n in SUBFOLDERS)
            + " and model_index.json)"
        )
    return folder


def _read_json(path: Path) -> dict[str, Any]:
    if not path.is_file():
        raise CheckpointError(f"{path}: missing")
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise CheckpointError(f"{path}: not valid JSON ({e})") from e
    if not isinstance(data, dict):
        raise CheckpointError(f"{path}: expected a JSON object, got {type(data).__name__}")
    return data


def _remote_code_disabled() -> bool:
    # The same switch diffusers reads (utils/constants.py): any of these values turns remote code off.
    return os.environ.get("DIFFUSERS_DISABLE_REMOTE_CODE", "").upper() in {"1", "ON", "YES", "TRUE"}


def _canonical_class(root: Path, transformer_dir: Path, config: Mapping[str, Any]) -> type[ModelMixin]:
    """The class the checkpoint itself names, imported from its folder (remote code)."""
    from diffusers.utils.dynamic_modules_utils import get_class_from_dynamic_module

    reference = (config.get("auto_map") or {}).get("AutoModel")
    if reference is not None:
        module_name, _, class_name = str(reference).rpartition(".")
        source = f"{transformer_dir / 'config.json'} auto_map.AutoModel"
    else:
        index = _read_json(root / "model_index.json")
        entry = index.get("transformer")
        if not (isinstance(entry, list) and len(entry) == 2):
            raise CheckpointError(
                f"{root / 'model_index.json'}: 'transformer' must be [module, class], got {entry!r}"
            )
        module_name, class_name = entry
        source = f"{root / 'model_index.json'} 'transformer'"
    if not module_name or not (transformer_dir / f"{module_name}.py").is_file():
        raise CheckpointError(
            f"{source} names {module_name!r}.{class_name!r}, but {transformer_dir / (module_name + '.py')} "
            "does not exist; the canonical loader needs the checkpoint's transformer module "
            "(use transformer='native' to load the weights into boogu_adapters' own class)"
        )
    return get_class_from_dynamic_module(
        str(transformer_dir),
        module_file=f"{module_name}.py",
        class_name=class_name,
        trust_remote_code=True,
        local_files_only=True,
    )


def _weight_files(folder: Path) -> list[Path]:
    """The safetensors files of a diffusers model folder: the shards its index lists, or the single file."""
    index_path = folder / WEIGHTS_INDEX_NAME
    if index_path.is_file():
        weight_map = _read_json(index_path).get("weight_map")
        if not isinstance(weight_map, dict) or not weight_map:
            raise CheckpointError(f"{index_path}: missing or empty 'weight_map'")
        shards = sorted(set(weight_map.values()))
        missing = [s for s in shards if not (folder / s).is_file()]
        if missing:
            raise CheckpointError(f"{index_path}: lists shard files that do not exist: {', '.join(missing)}")
        return [folder / s for s in shards]
    if (folder / WEIGHTS_NAME).is_file():
        return [folder / WEIGHTS_NAME]
    pickled = sorted(p.name for p in folder.glob("*.bin")) + sorted(p.name for p in folder.glob("*.pt"))
    hint = f" (found {', '.join(pickled)}: pickled weights are never loaded)" if pickled else ""
    raise CheckpointError(f"{folder}: no {WEIGHTS_INDEX_NAME} or {WEIGHTS_NAME}{hint}")


def _stored_shapes(folder: Path) -> dict[str, tuple[tuple[int, ...], str]]:
    """Tensor name -> (shape, file name), read from the safetensors headers only."""
    found: dict[str, tuple[tuple[int, ...], str]] = {}
    for file in _weight_files(folder):
        try:
            with safe_open(str(file), framework="pt") as f:
                for name in f.keys():  # noqa: SIM118 - safe_open handles are not iterable
                    if name in found:
                        raise CheckpointError(
                            f"{folder}: tensor {name!r} is stored twice ({found[name][1]}, {file.name})"
                        )
                    found[name] = (tuple(f.get_slice(name).get_shape()), file.name)
        except CheckpointError:
            raise
        except Exception as e:  # safetensors raises its own error types for corrupt headers
            raise CheckpointError(f"{file}: not a readable safetensors file ({e})") from e
    return found


def _expected_shapes(
    model_cls: type[ModelMixin], config: Mapping[str, Any], config_path: Path
) -> dict[str, tuple[int, ...]]:
    """Names and shapes of ``model_cls``'s state dict for ``config``, built on the meta device."""
    init_config = {k: v for k, v in config.items() if k != "auto_map"}
    try:
        with torch.device("meta"):
            model = model_cls.from_config(init_config)
    except (TypeError, ValueError, AssertionError) as e:
        raise CheckpointError(
            f"{config_path}: {model_cls.__name__} cannot be built from this config ({e})"
        ) from e
    return {name: tuple(tensor.shape) for name, tensor in model.state_dict().items()}


def _check_weights(folder: Path, model_cls: type[ModelMixin], config: Mapping[str, Any]) -> None:
    """Raise a CheckpointError unless the stored tensors are exactly the ones the model has."""
    expected = _expected_shapes(model_cls, config, folder / "config.json")
    found = _stored_shapes(folder)
    missing = sorted(set(expected) - set(found))
    unexpected = sorted(set(found) - set(expected))
    if missing or unexpected:
        problems = [
            _name_list(f"tensors missing from the checkpoint (expected by {model_cls.__name__})", missing),
            _name_list("unexpected tensors in the checkpoint", unexpected),
        ]
        raise CheckpointError(f"{folder}: " + "; ".join(p for p in problems if p))
    for name in sorted(expected):
        shape, file_name = found[name]
        if shape != expected[name]:
            raise CheckpointError(
                f"{folder / file_name}: tensor {name!r} has shape {list(shape)}, "
                f"but {model_cls.__name__} built from config.json expects {list(expected[name])}"
            )


def _name_list(what: str, names: list[str]) -> str:
    if not names:
        return ""
    shown = ", ".join(names[:_LIST_LIMIT])
    more = f" and {len(names) - _LIST_LIMIT} more" if len(names) > _LIST_LIMIT else ""
    return f"{len(names)} {what}: {shown}{more}"


@contextlib.contextmanager
def _transformers_verbosity(level: int) -> Iterator[None]:
    previous = transformers_logging.get_verbosity()
    transformers_logging.set_verbosity(level)
    try:
        yield
    finally:
        transformers_logging.set_verbosity(previous)
