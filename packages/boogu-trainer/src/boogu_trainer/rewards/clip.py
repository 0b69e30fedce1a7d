"""CLIP-family rewards from local folders: ``clip_score``, ``pickscore``, ``aesthetic``, ``edit_preservation``.

Every model is a transformers ``CLIPModel`` folder on disk, loaded with ``local_files_only=True``:
nothing is downloaded at run time. Images go through the folder's own CLIP image processor (PIL
backend, the reference preprocessing: shortest side resized to 224 with bicubic resampling,
centre crop, CLIP mean/std), text through its tokenizer (truncated to the text tower's 77
positions). Each ``(path, processor_path, device, dtype)`` loads once per process and is shared by
every reward that names it; both towers run in ``batch_size`` chunks under ``torch.no_grad`` on
the trainer's device and dtype ("auto": the current CUDA device if there is one, else the CPU;
bfloat16 on CUDA, float32 elsewhere, as ``model.dtype: auto``). Embeddings are cast to float32
before the scoring formula; scores come back as ``(B,)`` float32 on the CPU.

Scoring rules (``e_img``/``e_txt``: the projected image/text embeddings, ``cos``: their cosine):

* ``clip_score``: CLIP-S (Hessel et al. 2021), ``scale * max(cos(e_img, e_txt), 0)``; the paper's
  ``scale`` is 2.5 (the default), torchmetrics' ``CLIPScore`` reports ``scale=100``.
* ``pickscore``: PickScore (Kirstain et al. 2023, ``yuvalkirstain/PickScore_v1`` with the processor
  of ``laion/CLIP-ViT-H-14-laion2B-s32B-b79K``), ``logit_scale.exp() * cos(e_img, e_txt)``: the
  model's own logit scale (about 100 for the released model) times the cosine.
* ``aesthetic``: the LAION aesthetic predictor v2 (improved-aesthetic-predictor,
  ``sac+logos+ava1-l14-linearMSE.pth``): an MLP 768-1024-128-64-16-1 without activations (dropout
  only, a no-op in eval) on the L2-normalised CLIP ViT-L/14 image embedding; roughly 1..10.
* ``edit_preservation``: how much of ``record.ref_image`` survives in the output (see its class).
"""

from __future__ import annotations

import io
import math
import threading
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
from PIL import Image

from boogu_data import PromptRecord
from boogu_protocol import auto_dtype, resolve_device_type
from boogu_trainer.rewards.base import RewardError, check_batch, images_to_numpy
from boogu_trainer.rewards.registry import register_reward

__all__ = [
    "AESTHETIC_KEYS",
    "AestheticReward",
    "ClipBundle",
    "ClipScoreReward",
    "EditPreservationReward",
    "PickScoreReward",
    "aesthetic_head",
    "clear_clip_cache",
    "load_aesthetic_weights",
    "load_clip",
    "resolve_device",
    "resolve_dtype",
]

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}

AESTHETIC_KEYS: tuple[str, ...] = tuple(
    f"layers.{i}.{kind}" for i in (0, 2, 4, 6, 7) for kind in ("weight", "bias")
)
"""The state-dict keys of the LAION aesthetic predictor's MLP (``nn.Sequential`` indices; the odd
indices 1, 3, 5 are its dropouts)."""


# ----------------------------------------------------------------------------------------------
# Device, dtype, loading


def resolve_device(spec: str | torch.device = "auto") -> torch.device:
    """``"auto"``: the current CUDA device when CUDA is available (the trainer's rank device), else the CPU."""
    if isinstance(spec, torch.device):
        device = spec
    elif spec == "auto":
        if resolve_device_type(spec) == "cuda":
            return torch.device("cuda", torch.cuda.current_device())
        return torch.device("cpu")
    else:
        try:
            device = torch.device(spec)
        except (RuntimeError, TypeError) as error:
            raise ValueError(f"device must be 'auto', 'cpu', 'cuda' or 'cuda:N', got {spec!r}") from error
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"device={spec!r} but CUDA is not available on this machine")
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    return device


def resolve_dtype(spec: str | torch.dtype, device: torch.device) -> torch.dtype:
    """``"auto"``: bfloat16 on CUDA, float32 elsewhere (the trainer's ``model.dtype: auto``)."""
    if isinstance(spec, torch.dtype):
        if spec not in _DTYPES.values():
            raise ValueError(f"dtype must be one of {sorted(_DTYPES)} or 'auto', got {spec}")
        return spec
    if spec == "auto":
        return _DTYPES[auto_dtype(device.type)]
    if spec not in _DTYPES:
        raise ValueError(f"dtype must be one of {sorted(_DTYPES)} or 'auto', got {spec!r}")
    return _DTYPES[spec]


def _check_folder(path: str | Path, what: str, required: Sequence[str]) -> Path:
    folder = Path(path).expanduser()
    if not folder.is_dir():
        raise FileNotFoundError(
            f"{what}: {str(folder)!r} is not a folder (nothing is downloaded; give a local path)"
        )
    missing = [name for name in required if not (folder / name).is_file()]
    if missing:
        raise FileNotFoundError(f"{what}: {str(folder)!r} has no {', '.join(missing)}")
    return folder.resolve()


@dataclass
class ClipBundle:
    """A loaded CLIP model with its image processor and tokenizer, on one device and dtype."""

    model: Any
    image_processor: Any
    processor_path: Path
    device: torch.device
    dtype: torch.dtype
    _tokenizer: Any = field(default=None, repr=False)
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    @property
    def tokenizer(self) -> Any:
        """The tokenizer of ``processor_path``, loaded on first use (image-only rewards never need it)."""
        with self._lock:
            if self._tokenizer is None:
                from transformers import AutoTokenizer

                self._tokenizer = AutoTokenizer.from_pretrained(self.processor_path, local_files_only=True)
            return self._tokenizer

    @property
    def projection_dim(self) -> int:
        return int(self.model.config.projection_dim)

    @property
    def logit_scale(self) -> float:
        return float(self.model.logit_scale.detach().float().exp().cpu())

    def pixel_values(self, images: torch.Tensor) -> torch.Tensor:
        """The image processor's ``(B, 3, S, S)`` float32 CPU input for ``(B, 3, H, W)`` uint8 images."""
        arrays = list(images_to_numpy(images))
        out = self.image_processor(images=arrays, return_tensors="pt", input_data_format="channels_last")
        return out["pixel_values"]

    @torch.no_grad()
    def image_embeds(self, images: torch.Tensor, batch_size: int) -> torch.Tensor:
        """``(B, D)`` float32 projected image embeddings (not normalised), in ``batch_size`` chunks."""
        chunks = []
        for start in range(0, images.shape[0], batch_size):
            pixels = self.pixel_values(images[start : start + batch_size])
            pixels = pixels.to(self.device, self.dtype)
            chunks.append(_features(self.model.get_image_features(pixel_values=pixels)).float())
        return torch.cat(chunks)

    @torch.no_grad()
    def text_embeds(self, texts: Sequence[str], batch_size: int) -> torch.Tensor:
        """``(T, D)`` float32 projected text embeddings (not normalised), truncated to the text tower."""
        tokenizer = self.tokenizer
        max_length = int(self.model.config.text_config.max_position_embeddings)
        chunks = []
        for start in range(0, len(texts), batch_size):
            tokens = tokenizer(
                list(texts[start : start + batch_size]),
                padding=True,
                truncation=True,
                max_length=max_length,
                return_tensors="pt",
            )
            tokens = {k: v.to(self.device) for k, v in tokens.items() if k in ("input_ids", "attention_mask")}
            chunks.append(_features(self.model.get_text_features(**tokens)).float())
        return torch.cat(chunks)


def _features(output: Any) -> torch.Tensor:
    """transformers 4 returns the projected features as a tensor, 5 as ``pooler_output`` of an output."""
    if isinstance(output, torch.Tensor):
        return output
    return output.pooler_output


_CLIP_CACHE: dict[tuple[str, str, str, str], ClipBundle] = {}
_CLIP_LOCK = threading.Lock()


def load_clip(
    path: str | Path,
    *,
    processor_path: str | Path | None = None,
    device: str | torch.device = "auto",
    dtype: str | torch.dtype = "auto",
    what: str = "clip",
) -> ClipBundle:
    """The process-wide `ClipBundle` for a local ``CLIPModel`` folder, loaded on first use.

    ``processor_path`` (default ``path``) holds ``preprocessor_config.json`` and the tokenizer
    (PickScore's model folder has neither: point it at a CLIP-H folder). Raises FileNotFoundError
    naming the folder when it or its ``config.json`` / ``preprocessor_config.json`` is missing.
    """
    folder = _check_folder(path, what, ("config.json",))
    processor_folder = _check_folder(
        folder if processor_path is None else processor_path,
        f"{what} processor",
        ("preprocessor_config.json",),
    )
    torch_device = resolve_device(device)
    torch_dtype = resolve_dtype(dtype, torch_device)
    key = (str(folder), str(processor_folder), str(torch_device), str(torch_dtype))
    with _CLIP_LOCK:
        bundle = _CLIP_CACHE.get(key)
        if bundle is None:
            from transformers import AutoImageProcessor, CLIPModel

            model = CLIPModel.from_pretrained(folder, local_files_only=True, dtype=torch_dtype)
            model = model.to(torch_device).eval().requires_grad_(False)
            # The PIL backend is the reference preprocessing, identical with or without torchvision.
            image_processor = AutoImageProcessor.from_pretrained(
                processor_folder, local_files_only=True, backend="pil"
            )
            bundle = ClipBundle(model, image_processor, processor_folder, torch_device, torch_dtype)
            _CLIP_CACHE[key] = bundle
        return bundle


def clear_clip_cache() -> None:
    """Forget every loaded model (tests; freeing memory)."""
    with _CLIP_LOCK:
        _CLIP_CACHE.clear()


def _check_batch_size(batch_size: object, reward: str) -> int:
    if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1:
        raise ValueError(f"{reward}: batch_size must be an int >= 1, got {batch_size!r}")
    return batch_size


def _cosine(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Row-wise cosine of two ``(B, D)`` float32 tensors (each row L2-normalised first)."""
    a = a / a.norm(dim=-1, keepdim=True)
    b = b / b.norm(dim=-1, keepdim=True)
    return (a * b).sum(dim=-1)


class _TextImageReward:
    """Shared body of ``clip_score`` and ``pickscore``: the cosine of each image with its instruction."""

    name: str

    def __init__(
        self,
        path: str,
        processor_path: str | None,
        device: str,
        dtype: str,
        batch_size: int,
        prefix: str,
    ) -> None:
        if not isinstance(prefix, str):
            raise ValueError(f"{self.name}: prefix must be a string, got {prefix!r}")
        self.batch_size = _check_batch_size(batch_size, self.name)
        self.prefix = prefix
        self.clip = load_clip(path, processor_path=processor_path, device=device, dtype=dtype, what=self.name)

    def cosines(self, images: torch.Tensor, records: Sequence[PromptRecord]) -> torch.Tensor:
        """``(B,)`` float32 CPU cosine between image i and ``prefix + records[i].instruction``."""
        check_batch(images, records, self.name)
        texts = [self.prefix + record.instruction for record in records]
        positions = {text: j for j, text in enumerate(dict.fromkeys(texts))}
        # A GRPO group shares its prompt: each distinct text is encoded once.
        text = self.clip.text_embeds(list(positions), self.batch_size)
        index = torch.tensor([positions[t] for t in texts], device=text.device)
        image = self.clip.image_embeds(images, self.batch_size)
        return _cosine(image, text[index]).cpu()


@register_reward("clip_score")
class ClipScoreReward(_TextImageReward):
    """CLIP score (CLIP-S, Hessel et al. 2021): does the image match its instruction?

    Measures: ``scale * max(cos(E_img, E_text), 0)`` with a transformers ``CLIPModel`` folder
    (e.g. ``openai/clip-vit-large-patch14`` downloaded beforehand); the text is
    ``prefix + record.instruction`` (the paper prefixes "A photo depicts"; default no prefix).
    Range: [0, scale]; 2.5 is the paper's weight (default), 100 gives torchmetrics' CLIPScore.
    Options: ``path`` (model folder), ``processor_path`` (default ``path``), ``device``,
    ``dtype``, ``batch_size`` (images/texts per forward, default 32), ``scale``, ``prefix``.
    Cost: one image-tower forward per image and one text-tower forward per distinct prompt;
    ViT-L/14 (both towers, 428 M parameters) is ~0.9 GB in bf16.
    """

    name = "clip_score"

    def __init__(
        self,
        path: str,
        *,
        processor_path: str | None = None,
        device: str = "auto",
        dtype: str = "auto",
        batch_size: int = 32,
        scale: float = 2.5,
        prefix: str = "",
    ) -> None:
        if (
            isinstance(scale, bool)
            or not isinstance(scale, int | float)
            or not math.isfinite(scale)
            or scale <= 0
        ):
            raise ValueError(f"clip_score: scale must be a finite number > 0, got {scale!r}")
        self.scale = float(scale)
        super().__init__(path, processor_path, device, dtype, batch_size, prefix)

    def __call__(self, images: torch.Tensor, records: Sequence[PromptRecord]) -> torch.Tensor:
        return (self.scale * self.cosines(images, records).clamp(min=0.0)).to(torch.float32)


@register_reward("pickscore")
class PickScoreReward(_TextImageReward):
    """PickScore (Kirstain et al. 2023): a CLIP-H fine-tuned on Pick-a-Pic human preferences.

    Measures: ``logit_scale.exp() * cos(E_img, E_text)``, the model's own logit scale (about 100
    for ``yuvalkirstain/PickScore_v1``) times the cosine of image and instruction; its authors'
    rule (they softmax these over the candidates of one prompt to get preference probabilities).
    Range: [-logit_scale.exp(), logit_scale.exp()], about [-100, 100]; in practice a narrow band
    around 20 for real images with their prompt (differences between candidates matter, not the level).
    Options: ``path`` (the PickScore_v1 folder), ``processor_path`` (the folder of
    ``laion/CLIP-ViT-H-14-laion2B-s32B-b79K``, whose processor PickScore uses; default ``path``),
    ``device``, ``dtype``, ``batch_size`` (default 32), ``prefix`` (default none).
    Cost: CLIP-H (~2 GB in bf16), one image forward per image, one text forward per distinct prompt.
    """

    name = "pickscore"

    def __init__(
        self,
        path: str,
        *,
        processor_path: str | None = None,
        device: str = "auto",
        dtype: str = "auto",
        batch_size: int = 32,
        prefix: str = "",
    ) -> None:
        super().__init__(path, processor_path, device, dtype, batch_size, prefix)

    def __call__(self, images: torch.Tensor, records: Sequence[PromptRecord]) -> torch.Tensor:
        return (self.clip.logit_scale * self.cosines(images, records)).to(torch.float32)


# ----------------------------------------------------------------------------------------------
# LAION aesthetic predictor


def load_aesthetic_weights(path: str | Path) -> dict[str, torch.Tensor]:
    """The aesthetic MLP's state dict from a local ``.pth`` (``torch.load(weights_only=True)``) or ``.safetensors``.

    Raises FileNotFoundError naming ``path`` when it is missing, ValueError when its keys or shapes
    are not the predictor's (`AESTHETIC_KEYS`: 768 -> 1024 -> 128 -> 64 -> 16 -> 1, or any input width).
    """
    file = Path(path).expanduser()
    if not file.is_file():
        raise FileNotFoundError(
            f"aesthetic: weights file {str(file)!r} does not exist (nothing is downloaded)"
        )
    if file.suffix == ".safetensors":
        from safetensors.torch import load_file

        state = load_file(str(file))
    elif file.suffix in (".pth", ".pt", ".bin"):
        state = torch.load(file, map_location="cpu", weights_only=True)
    else:
        raise ValueError(f"aesthetic: weights {str(file)!r} must be a .pth/.pt/.bin or .safetensors file")
    if not isinstance(state, dict):
        raise ValueError(f"aesthetic: {str(file)!r} holds a {type(state).__name__}, not a state dict")
    if set(state) != set(AESTHETIC_KEYS):
        raise ValueError(
            f"aesthetic: {str(file)!r} has keys {sorted(state)}; expected the LAION predictor's {list(AESTHETIC_KEYS)}"
        )
    widths = [int(state["layers.0.weight"].shape[1])]
    for i in (0, 2, 4, 6, 7):
        weight, bias = state[f"layers.{i}.weight"], state[f"layers.{i}.bias"]
        if weight.ndim != 2 or weight.shape[1] != widths[-1] or tuple(bias.shape) != (weight.shape[0],):
            raise ValueError(
                f"aesthetic: {str(file)!r}: layers.{i} has shape {tuple(weight.shape)}, which does not chain"
            )
        widths.append(int(weight.shape[0]))
    if widths[-1] != 1:
        raise ValueError(f"aesthetic: {str(file)!r}: the last layer has {widths[-1]} outputs, expected 1")
    return {key: value.detach().to(torch.float32).contiguous() for key, value in state.items()}


def aesthetic_head(state: dict[str, torch.Tensor]) -> torch.nn.Sequential:
    """The predictor's ``nn.Sequential`` (Linear, Dropout(0.2), Linear, Dropout(0.2), Linear,
    Dropout(0.1), Linear, Linear) in eval mode, loaded strictly from ``state``."""
    dims = [state["layers.0.weight"].shape[1]] + [
        state[f"layers.{i}.weight"].shape[0] for i in (0, 2, 4, 6, 7)
    ]
    head = torch.nn.Sequential(
        torch.nn.Linear(dims[0], dims[1]),
        torch.nn.Dropout(0.2),
        torch.nn.Linear(dims[1], dims[2]),
        torch.nn.Dropout(0.2),
        torch.nn.Linear(dims[2], dims[3]),
        torch.nn.Dropout(0.1),
        torch.nn.Linear(dims[3], dims[4]),
        torch.nn.Linear(dims[4], dims[5]),
    )
    head.load_state_dict({key.removeprefix("layers."): value for key, value in state.items()}, strict=True)
    return head.eval().requires_grad_(False)


_HEAD_CACHE: dict[tuple[str, str], torch.nn.Sequential] = {}


@register_reward("aesthetic")
class AestheticReward:
    """LAION aesthetic predictor v2: how much people would like the image, prompt ignored.

    Measures: the improved-aesthetic-predictor MLP (``sac+logos+ava1-l14-linearMSE.pth``; five
    linear layers, no activations) on the L2-normalised CLIP ViT-L/14 image embedding.
    Range: roughly 1..10 (LAION-5B images mostly 4..7).
    Options: ``clip_path`` (a local ``openai/clip-vit-large-patch14`` CLIPModel folder, whose
    projection width must be the head's input, 768), ``weights`` (the head as a local ``.pth`` or
    ``.safetensors`` file), ``processor_path``, ``device``, ``dtype``, ``batch_size`` (default 32).
    The CLIP tower runs in the trainer's dtype; the head in float32 on the same device.
    Cost: one ViT-L/14 image forward per image (the model ~0.9 GB in bf16); the head is ~0.9 M parameters.
    """

    name = "aesthetic"

    def __init__(
        self,
        clip_path: str,
        weights: str,
        *,
        processor_path: str | None = None,
        device: str = "auto",
        dtype: str = "auto",
        batch_size: int = 32,
    ) -> None:
        self.batch_size = _check_batch_size(batch_size, self.name)
        self.clip = load_clip(
            clip_path, processor_path=processor_path, device=device, dtype=dtype, what=self.name
        )
        file = Path(weights).expanduser()
        key = (str(file.resolve()) if file.exists() else str(file), str(self.clip.device))
        with _CLIP_LOCK:
            head = _HEAD_CACHE.get(key)
            if head is None:
                head = aesthetic_head(load_aesthetic_weights(file)).to(self.clip.device)
                _HEAD_CACHE[key] = head
        width = head[0].in_features
        if width != self.clip.projection_dim:
            raise ValueError(
                f"aesthetic: the head in {str(file)!r} takes {width}-wide embeddings but the CLIP model in "
                f"{clip_path!r} produces {self.clip.projection_dim} (the released head needs ViT-L/14, 768)"
            )
        self.head = head

    @torch.no_grad()
    def __call__(self, images: torch.Tensor, records: Sequence[PromptRecord]) -> torch.Tensor:
        check_batch(images, records, self.name)
        embeds = self.clip.image_embeds(images, self.batch_size)
        embeds = embeds / embeds.norm(dim=-1, keepdim=True)
        return self.head(embeds).squeeze(-1).cpu().to(torch.float32)


# ----------------------------------------------------------------------------------------------
# Edit preservation


def decode_reference(data: bytes, size: tuple[int, int]) -> torch.Tensor:
    """``(3, H, W)`` uint8 RGB from encoded image bytes, resized (bicubic) to ``size = (H, W)``."""
    with Image.open(io.BytesIO(data)) as image:
        rgb = image.convert("RGB")
    height, width = size
    if rgb.size != (width, height):
        rgb = rgb.resize((width, height), Image.Resampling.BICUBIC)
    return torch.from_numpy(np.asarray(rgb).copy()).permute(2, 0, 1).contiguous()


@register_reward("edit_preservation")
class EditPreservationReward:
    """Edit preservation: how much of the reference image (``record.ref_image``) survives in the output.

    An Edit run weighs "did the edit" (e.g. ``vlm_ocr``, ``clip_score`` on the instruction) against
    "kept the rest" with this reward. The reference is decoded with Pillow and resized (bicubic)
    to the output's size first.

    Measures (``metric``):

    * ``"clip"`` (default): cosine of the CLIP image embeddings of reference and output (``path``:
      a local CLIPModel folder). Range [-1, 1]; 1 for an identical image, ~0.9+ for small
      edits, lower as content/layout/style drift. Insensitive to small shifts and noise.
    * ``"pixel"``: ``1 - mean|output - reference| / 255`` over all pixels and channels. Range
      [0, 1]; 1 for an identical image. Punishes every changed pixel, the edit's own included.

    What it cannot do: there is no edit mask in a record, so both metrics score the *whole* image;
    the region the instruction asks to change is penalised like the rest, and an unchanged copy of
    the reference scores the maximum. It must therefore be weighted against an edit-success reward,
    never used alone. ``"clip"`` does not see pixel-exact fidelity (colour shifts, small
    text); ``"pixel"`` does not see semantics (a 2-px shift of a sharp image costs a lot).

    Rows without a reference (text-to-image prompts): ``on_missing="raise"`` (default) raises
    `RewardError` naming the row, since the reward is meaningless there; ``"nan"`` scores them NaN,
    which the trainer treats as "no gradient" for that sample (its total reward is NaN too, so in a
    mixed T2I/edit batch those T2I samples drop out of the update). A reference that cannot be
    decoded always raises `RewardError`.
    Cost: ``"pixel"``: one decode + resize per image, milliseconds; ``"clip"``: two image-tower
    forwards per image.
    """

    name = "edit_preservation"

    def __init__(
        self,
        path: str | None = None,
        *,
        metric: str = "clip",
        processor_path: str | None = None,
        device: str = "auto",
        dtype: str = "auto",
        batch_size: int = 32,
        on_missing: str = "raise",
    ) -> None:
        if metric not in ("clip", "pixel"):
            raise ValueError(f"edit_preservation: metric must be 'clip' or 'pixel', got {metric!r}")
        if on_missing not in ("raise", "nan"):
            raise ValueError(f"edit_preservation: on_missing must be 'raise' or 'nan', got {on_missing!r}")
        self.metric = metric
        self.on_missing = on_missing
        self.batch_size = _check_batch_size(batch_size, self.name)
        self.clip: ClipBundle | None = None
        if metric == "clip":
            if path is None:
                raise ValueError("edit_preservation: metric='clip' needs path, a local CLIPModel folder")
            self.clip = load_clip(
                path, processor_path=processor_path, device=device, dtype=dtype, what=self.name
            )

    def __call__(self, images: torch.Tensor, records: Sequence[PromptRecord]) -> torch.Tensor:
        batch_size = check_batch(images, records, self.name)
        size = (int(images.shape[2]), int(images.shape[3]))
        rows: list[int] = []
        references: list[torch.Tensor] = []
        for i, record in enumerate(records):
            if record.ref_image is None:
                if self.on_missing == "raise":
                    raise RewardError(
                        f"edit_preservation: record {i} has no ref_image (a text-to-image row); "
                        "use on_missing='nan' to score such rows NaN"
                    )
                continue
            try:
                references.append(decode_reference(record.ref_image, size))
            except Exception as error:
                raise RewardError(
                    f"edit_preservation: cannot decode record {i}'s ref_image: {error}"
                ) from error
            rows.append(i)
        scores = torch.full((batch_size,), float("nan"), dtype=torch.float32)
        if not rows:
            return scores
        outputs = images.detach().cpu()[rows]
        refs = torch.stack(references)
        if self.metric == "pixel":
            diff = (outputs.to(torch.float32) - refs.to(torch.float32)).abs().mean(dim=(1, 2, 3))
            values = 1.0 - diff / 255.0
        else:
            assert self.clip is not None
            embeds = self.clip.image_embeds(torch.cat([outputs, refs]), self.batch_size)
            values = _cosine(embeds[: len(rows)], embeds[len(rows) :]).cpu()
        scores[rows] = values.to(torch.float32)
        return scores
