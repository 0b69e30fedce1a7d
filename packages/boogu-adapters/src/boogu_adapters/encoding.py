"""Prompts to Qwen3-VL features, reference images to VAE latents, latents back to images.

Everything here follows upstream's ``BooguImagePipeline`` (``docs/upstream-model.md`` §9; section numbers
below refer to that page):

* **Prompts** (§9.2-§9.4): each instruction becomes boogu-data's two-turn chat (system prompt by
  upstream's per-encoding rule, including the empty-instruction quirk: ``""`` gets the TI2I
  prompt even in T2I), the whole batch is tokenised by one ``processor.apply_chat_template`` call
  with right padding and no generation prompt, and the feature is the inner ``Qwen3VLModel``'s
  ``last_hidden_state`` over the whole templated sequence (system tokens included), with the
  processor's attention mask.
* **Reference images, VLM path** (§9.5): by default (``vlm_view="upstream"``) resized as
  upstream's ``preprocess_vlm_input_pil_images`` does before the processor sees them: area at
  most ``MAX_VLM_REFERENCE_PIXELS`` (384²), long side at most ``MAX_VLM_REFERENCE_SIDE`` (768),
  sides floored to multiples of 16, Lanczos, never upsampled, and a sample's later images resized
  to its first one's size. ``vlm_view="processor"`` hands them to the processor as they are.
* **Reference images, VAE path** (§9.5): resized so the area is at most ``max_pixels`` (2048²)
  and the long side at most 4096, sides floored to multiples of 16, never upsampled; scaled to
  ``[-1, 1]``; encoded; ``z = (z - shift_factor) * scaling_factor``.
* **Output size** (§9.6): an edit follows its reference's VAE size; T2I requests are clamped by
  area to 2048² and floored to multiples of 16.
* **Latents** are ``(z - shift) * scale`` of the VAE's posterior; :func:`decode_latents` inverts
  that and returns uint8 pixels the way diffusers' ``VaeImageProcessor.postprocess`` rounds them.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Hashable, Sequence
from dataclasses import dataclass
from typing import Any, Literal, get_args

import numpy as np
import torch
from PIL import Image

from boogu_data import build_messages
from boogu_protocol import MAX_SEQUENCE_LENGTH
from boogu_schedule.sampling import output_size

__all__ = [
    "DEFAULT_MAX_SEQUENCE_LENGTH",
    "DEFAULT_SIZE",
    "MAX_REFERENCE_PIXELS",
    "MAX_REFERENCE_SIDE",
    "MAX_VLM_REFERENCE_PIXELS",
    "MAX_VLM_REFERENCE_SIDE",
    "SIZE_MULTIPLE",
    "PromptCache",
    "PromptEmbeds",
    "VlmView",
    "count_prompt_tokens",
    "decode_latents",
    "encode_prompts",
    "encode_reference_images",
    "fit_size",
    "latents_to_vae",
    "num_instruction_feature_layers",
    "preprocess_reference_image",
    "preprocess_vlm_images",
    "resolve_output_size",
    "vae_to_latents",
    "vlm_image_sizes",
]

DEFAULT_MAX_SEQUENCE_LENGTH = MAX_SEQUENCE_LENGTH
"""Upstream ``__call__``'s ``max_sequence_length`` (``boogu_protocol.MAX_SEQUENCE_LENGTH``, which the
rollout worker encodes with too); it only matters with ``truncate=True``."""
MAX_REFERENCE_PIXELS = 2048 * 2048
"""Upstream's ``max_input_image_pixels`` default: the area cap of reference images and outputs."""
MAX_REFERENCE_SIDE = 4096
"""Upstream's ``max_input_image_side_length`` default (reference images only, not outputs)."""
SIZE_MULTIPLE = 16
"""Image sides are floored to multiples of this: VAE factor 8 times patch size 2."""
DEFAULT_SIZE = 1024
"""Upstream's output side when a request gives none (``default_sample_size`` 128 x VAE factor 8)."""
MAX_VLM_REFERENCE_PIXELS = 384 * 384
"""Upstream ``__call__``'s ``max_vlm_input_pil_pixels`` default: the area cap of the VLM's copy of a reference."""
MAX_VLM_REFERENCE_SIDE = 384 * 2
"""Upstream ``__call__``'s ``max_vlm_input_pil_side_length`` default (768 px), the VLM copy's side cap."""

VlmView = Literal["upstream", "processor"]
"""How a reference reaches the Qwen processor: ``"upstream"`` resized first as upstream's pipeline
does (:func:`preprocess_vlm_images`), ``"processor"`` as it is (the reference integration's way)."""


@dataclass(frozen=True)
class PromptEmbeds:
    """Instruction features of a batch of prompts, right-padded to the longest prompt."""

    hidden_states: torch.Tensor | list[torch.Tensor]
    """(B, L, D) in the text encoder's dtype, or a list of the last n layers' (B, L, D) when the
    transformer takes ``num_instruction_feature_layers = n > 1``."""
    attention_mask: torch.Tensor
    """(B, L) int64, 1 for tokens, 0 for right padding."""
    input_ids: torch.Tensor
    """(B, L) int64 token ids, kept for debugging and cache keys."""

    @property
    def batch_size(self) -> int:
        return int(self.attention_mask.shape[0])


class PromptCache:
    """A bounded LRU of encoded prompt batches: ``key -> tensors``, at most ``max_entries`` entries and
    ``max_bytes`` bytes of tensors (least recently used first out; a batch larger than ``max_bytes``
    is not kept).

    The caller's key must hold everything the tensors depend on (`QwenPromptEncoder` keys on the
    whole batch of instructions and images, the template, the encoder's weights, device and dtype).
    A hit returns the stored tensors themselves: read them, never modify them in place.
    """

    def __init__(self, max_entries: int, max_bytes: int) -> None:
        if max_entries < 1:
            raise ValueError(f"max_entries must be >= 1, got {max_entries}")
        if max_bytes < 1:
            raise ValueError(f"max_bytes must be >= 1, got {max_bytes}")
        self.max_entries, self.max_bytes = max_entries, max_bytes
        self._entries: OrderedDict[Hashable, tuple[tuple[torch.Tensor, ...], int]] = OrderedDict()
        self.bytes = 0
        """Bytes of the tensors held now."""
        self.hits = 0
        self.misses = 0

    def __len__(self) -> int:
        return len(self._entries)

    def __contains__(self, key: Hashable) -> bool:
        return key in self._entries

    def get(self, key: Hashable) -> tuple[torch.Tensor, ...] | None:
        """The tensors stored under ``key`` (now the most recently used), or None (a miss)."""
        entry = self._entries.get(key)
        if entry is None:
            self.misses += 1
            return None
        self._entries.move_to_end(key)
        self.hits += 1
        return entry[0]

    def put(self, key: Hashable, tensors: tuple[torch.Tensor, ...]) -> None:
        """Keep ``tensors`` under ``key``, then drop least recently used entries down to the bounds."""
        size = sum(t.numel() * t.element_size() for t in tensors)
        if key in self._entries:
            self.bytes -= self._entries.pop(key)[1]
        if size > self.max_bytes:
            return
        self._entries[key] = (tensors, size)
        self.bytes += size
        while len(self._entries) > self.max_entries or self.bytes > self.max_bytes:
            _, (_, dropped) = self._entries.popitem(last=False)
            self.bytes -= dropped

    def clear(self) -> None:
        self._entries.clear()
        self.bytes = 0


def num_instruction_feature_layers(transformer: Any) -> int:
    """How many last hidden layers ``transformer`` takes, read the way upstream's pipeline reads it.

    The pipeline looks up ``instruction_feature_configs["num_instruction_feature_layers"]``
    (default 1). Upstream's transformer itself reads ``num_instruction_feat_layers``; the
    released config only has the former (§2.6), so this follows the pipeline.
    """
    config = getattr(transformer, "config", transformer)
    feature_configs = getattr(config, "instruction_feature_configs", None)
    if feature_configs is None and isinstance(config, dict):
        feature_configs = config.get("instruction_feature_configs")
    return int((feature_configs or {}).get("num_instruction_feature_layers", 1))


def encode_prompts(
    text_encoder: torch.nn.Module,
    processor: Any,
    instructions: Sequence[str | None],
    images: Sequence[Sequence[Image.Image] | None] | None = None,
    *,
    max_sequence_length: int = DEFAULT_MAX_SEQUENCE_LENGTH,
    truncate: bool = False,
    num_feature_layers: int = 1,
    vlm_view: VlmView = "upstream",
) -> PromptEmbeds:
    """Encode a batch of instructions (with optional reference images) as upstream does.

    The messages come from :func:`boogu_data.build_messages`, so an empty instruction (the
    default negative ``""``) carries the TI2I system prompt even without images: upstream's
    pipeline default, which the released model was sampled with. Negatives in edit mode are
    encoded text-only (pass ``images=None`` for them).

    Reference images for the VLM are by default (``vlm_view="upstream"``) first resized as
    upstream's pipeline does (:func:`preprocess_vlm_images`: at most 384² pixels and 768 px per
    side, sides floored to multiples of 16, Lanczos), then sized again by the processor's own
    rules (Qwen's smart resize between its min and max pixels). ``vlm_view="processor"`` skips the
    first resize, as the verl-omni reference integration does (``docs/reference-integration.md``
    §4): it tokenised in another process than it encoded, so it let the processor alone size the
    image. Tokenisation and encoding happen here in one call, so that reason does not apply and
    the default follows upstream (``docs/upstream-model.md`` §9.5).

    Args:
        text_encoder: the inner ``Qwen3VLModel`` (``BooguParts.text_encoder``).
        processor: the checkpoint's Qwen3-VL processor (``BooguParts.processor``).
        instructions: B instructions; None is treated as ``""``.
        images: None, or B lists (possibly empty) of reference images for the VLM; images first,
            then the text, in the user turn.
        max_sequence_length: tokens kept per prompt when ``truncate`` is True.
        truncate: truncate long prompts (upstream's ``truncate_instruction_sequence``, default off).
        num_feature_layers: 1 returns ``last_hidden_state``; n > 1 returns the last n entries of
            the hidden-state tuple as a list (see :func:`num_instruction_feature_layers`).
        vlm_view: ``"upstream"`` (default) or ``"processor"``, see above and :data:`VlmView`.

    Returns:
        PromptEmbeds on the text encoder's device, features in its dtype. Computed without grad.
    """
    if isinstance(instructions, str):
        raise TypeError("instructions must be a sequence of strings, not a single string")
    if len(instructions) == 0:
        raise ValueError("instructions is empty")
    if num_feature_layers < 1:
        raise ValueError(f"num_feature_layers must be >= 1, got {num_feature_layers}")
    _check_vlm_view(vlm_view)
    if images is not None and len(images) != len(instructions):
        raise ValueError(
            f"images has {len(images)} entries for {len(instructions)} instructions; pass one list per instruction"
        )
    conversations = []
    for i, instruction in enumerate(instructions):
        sample_images = [] if images is None or images[i] is None else images[i]
        sample_images = preprocess_vlm_images(sample_images, vlm_view=vlm_view)
        conversations.append(build_messages(instruction, sample_images))
    inputs = processor.apply_chat_template(
        conversations,
        tokenize=True,
        return_dict=True,
        return_tensors="pt",
        add_generation_prompt=False,
        processor_kwargs={
            "padding": "longest",
            "padding_side": "right",
            "max_length": max_sequence_length,
            "truncation": truncate,
        },
    )
    device = _module_device(text_encoder)
    inputs = {k: v.to(device) if isinstance(v, torch.Tensor) else v for k, v in inputs.items()}
    dtype = _module_dtype(text_encoder)
    with torch.no_grad():
        if num_feature_layers == 1:
            hidden: torch.Tensor | list[torch.Tensor] = text_encoder(**inputs).last_hidden_state.to(dtype)
        else:
            all_layers = text_encoder(**inputs, output_hidden_states=True).hidden_states
            if len(all_layers) < num_feature_layers:
                raise ValueError(
                    f"num_feature_layers={num_feature_layers}, but the text encoder returns only {len(all_layers)} hidden states"
                )
            hidden = [layer.to(dtype) for layer in all_layers[-num_feature_layers:]]
    return PromptEmbeds(
        hidden_states=hidden,
        attention_mask=inputs["attention_mask"].to(torch.int64),
        input_ids=inputs["input_ids"],
    )


def count_prompt_tokens(
    processor: Any,
    instructions: Sequence[str | None],
    image_sizes: Sequence[Sequence[tuple[int, int]] | None] | None = None,
    *,
    chunk_size: int = 1024,
    vlm_view: VlmView = "upstream",
) -> list[int]:
    """How many tokens each prompt has in :func:`encode_prompts` (its ``attention_mask.sum(1)``), untruncated.

    The same messages and ``processor.apply_chat_template`` rendering as :func:`encode_prompts`, then
    the processor's tokenizer, but no text encoder and no pixels: the rendered text holds one
    ``<|image_pad|>`` per image, which the processor expands to ``grid_t * grid_h * grid_w / merge²``
    copies, so each image adds that count minus one. The grid follows from the image's size alone:
    the size ``vlm_view`` hands the processor (:func:`vlm_image_sizes`), then Qwen's smart resize
    (``image_processor.get_number_of_image_patches``); an image processor without that rule, or
    with resizing off, is run on a blank image of that size instead. Identical (instruction, image
    count) pairs are rendered and tokenised once.

    Args:
        processor: the checkpoint's Qwen3-VL processor (``BooguParts.processor``).
        instructions: B instructions; None is treated as ``""``.
        image_sizes: None, or B lists (possibly empty, or None) of reference image sizes as
            ``(height, width)`` in pixels, in the order :func:`encode_prompts` would get the images.
        chunk_size: unique prompts rendered and tokenised per call, bounding the memory it takes.
        vlm_view: the view :func:`encode_prompts` is called with.
    """
    if isinstance(instructions, str):
        raise TypeError("instructions must be a sequence of strings, not a single string")
    if image_sizes is not None and len(image_sizes) != len(instructions):
        raise ValueError(
            f"image_sizes has {len(image_sizes)} entries for {len(instructions)} instructions; pass one list per instruction"
        )
    _check_vlm_view(vlm_view)
    sizes = [
        []
        if image_sizes is None or image_sizes[i] is None
        else vlm_image_sizes(image_sizes[i], vlm_view=vlm_view)
        for i in range(len(instructions))
    ]
    keys = [("" if text is None else text, len(sizes[i])) for i, text in enumerate(instructions)]
    unique = list(dict.fromkeys(keys))
    text_tokens: dict[tuple[str, int], int] = {}
    tokenizer = processor.tokenizer
    for start in range(0, len(unique), chunk_size):
        chunk = unique[start : start + chunk_size]
        # Bare image items: the template renders one <|image_pad|> for each, as for real images.
        texts = processor.apply_chat_template(
            [build_messages(text, n) for text, n in chunk], tokenize=False, add_generation_prompt=False
        )
        # As the processor's apply_chat_template: no BOS added when the template already starts with one.
        bos = tokenizer.bos_token
        add_special_tokens = not (bos is not None and texts[0].startswith(bos))
        ids = tokenizer(texts, add_special_tokens=add_special_tokens, return_attention_mask=False)[
            "input_ids"
        ]
        text_tokens.update((key, len(row)) for key, row in zip(chunk, ids))
    per_size: dict[tuple[int, int], int] = {}
    counts = []
    for key, row_sizes in zip(keys, sizes):
        n = text_tokens[key]
        for size in row_sizes:
            if size not in per_size:
                per_size[size] = _image_token_count(processor, *size)
            n += per_size[size] - 1  # the one <|image_pad|> of the template becomes this many
        counts.append(n)
    return counts


def _image_token_count(processor: Any, height: int, width: int) -> int:
    """``<|image_pad|>`` tokens the processor puts in for one image of this size (Qwen3-VL's
    ``replace_image_token``: the grid's product over ``merge_size²``)."""
    image_processor = processor.image_processor
    merge = image_processor.merge_size
    if getattr(image_processor, "do_resize", False) and hasattr(
        image_processor, "get_number_of_image_patches"
    ):
        # Qwen2-VL's image processors: smart_resize of (height, width), then (h/patch)(w/patch)
        # patches; a still image is one temporal patch.
        return image_processor.get_number_of_image_patches(height, width) // merge**2
    blank = Image.new("RGB", (width, height))
    grid = image_processor(images=[blank], return_tensors="np")["image_grid_thw"][0]
    return int(np.prod(grid)) // merge**2


def vlm_image_sizes(
    sizes: Sequence[tuple[int, int]], *, vlm_view: VlmView = "upstream"
) -> list[tuple[int, int]]:
    """The ``(height, width)`` each reference image of one sample has when the processor gets it.

    ``"upstream"`` follows ``BooguImagePipeline.preprocess_vlm_input_pil_images`` as
    ``_get_instruction_feature_embeds`` calls it: :func:`fit_size` with the VLM caps
    (``MAX_VLM_REFERENCE_PIXELS``, ``MAX_VLM_REFERENCE_SIDE``, multiples of 16). Its loop passes
    the size found for the first image on as the next image's ``height``/``width``, so every later
    image of a sample is resized to the first one's size (re-fitting that size leaves it as is).
    ``"processor"`` keeps the sizes.
    """
    _check_vlm_view(vlm_view)
    sizes = [(int(height), int(width)) for height, width in sizes]
    if vlm_view == "processor":
        return sizes
    out: list[tuple[int, int]] = []
    for size in sizes:
        out.append(
            fit_size(
                *(out[0] if out else size),
                max_pixels=MAX_VLM_REFERENCE_PIXELS,
                max_side_length=MAX_VLM_REFERENCE_SIDE,
            )
        )
    return out


def preprocess_vlm_images(
    images: Sequence[Image.Image], *, vlm_view: VlmView = "upstream"
) -> list[Image.Image]:
    """One sample's reference images as the VLM processor gets them (RGB, sized by :func:`vlm_image_sizes`).

    Resized with Lanczos, as upstream's ``BooguImageProcessor.resize`` (diffusers' ``resample``
    default "lanczos", no ``reducing_gap``). Converted to RGB first, as upstream's example scripts
    do before calling the pipeline.
    """
    images = [_as_rgb(image) for image in images]
    sizes = vlm_image_sizes([(image.height, image.width) for image in images], vlm_view=vlm_view)
    return [_resize(image, height, width) for image, (height, width) in zip(images, sizes, strict=True)]


def fit_size(
    height: int,
    width: int,
    *,
    max_pixels: int = MAX_REFERENCE_PIXELS,
    max_side_length: int | None = MAX_REFERENCE_SIDE,
    multiple: int = SIZE_MULTIPLE,
) -> tuple[int, int]:
    """Upstream's resize rule: shrink to the area and side caps (never enlarge), floor to ``multiple``.

    ``ratio = min(sqrt(max_pixels / (H W)), max_side_length / max(H, W), 1)``; the new size is
    ``floor(H ratio) // multiple * multiple`` by the same for W (``BooguImageProcessor.get_new_height_width``).
    """
    if height <= 0 or width <= 0:
        raise ValueError(f"image size must be positive, got {height}x{width}")
    ratio = min((max_pixels / (height * width)) ** 0.5, 1.0)
    if max_side_length is not None:
        ratio = min(ratio, max_side_length / max(height, width))
    new_height = int(height * ratio) // multiple * multiple
    new_width = int(width * ratio) // multiple * multiple
    if new_height == 0 or new_width == 0:
        raise ValueError(
            f"a {height}x{width} image is smaller than {multiple} px on a side after resizing; "
            f"Boogu needs sides of at least {multiple} px"
        )
    return new_height, new_width


def resolve_output_size(
    height: int | None = None,
    width: int | None = None,
    *,
    reference_latents: torch.Tensor | None = None,
    vae_scale_factor: int = 8,
    max_pixels: int = MAX_REFERENCE_PIXELS,
) -> tuple[int, int]:
    """The (height, width) Boogu generates at (§9.6).

    With ``reference_latents`` (an edit) the output follows the reference: its VAE-preprocessed
    size, ``latent shape * vae_scale_factor``; the requested size is ignored, as upstream does
    with ``align_res=True``. Otherwise the request (default 1024²) is clamped by area to
    ``max_pixels`` and floored to multiples of 16; the side cap is not applied here, as upstream
    (``boogu_schedule.sampling.output_size``, the rule both rollout engines apply).
    """
    references = ()
    if reference_latents is not None:
        h, w = int(reference_latents.shape[-2]), int(reference_latents.shape[-1])
        references = ((h * vae_scale_factor, w * vae_scale_factor),)
    height = DEFAULT_SIZE if height is None else height
    width = DEFAULT_SIZE if width is None else width
    return output_size(height, width, references, max_pixels=max_pixels)


def preprocess_reference_image(
    image: Image.Image,
    *,
    max_pixels: int = MAX_REFERENCE_PIXELS,
    max_side_length: int = MAX_REFERENCE_SIDE,
) -> torch.Tensor:
    """A reference image as the VAE sees it: (1, 3, H, W) float32 in [-1, 1], sides multiples of 16.

    Resized with Lanczos (diffusers' default) to :func:`fit_size`; converted to RGB first
    (upstream's example scripts do that before calling the pipeline).
    """
    image = _as_rgb(image)
    height, width = fit_size(
        image.height, image.width, max_pixels=max_pixels, max_side_length=max_side_length
    )
    image = _resize(image, height, width)
    pixels = torch.from_numpy(np.asarray(image, dtype=np.float32) / 255.0)  # (H, W, 3) in [0, 1]
    return (pixels.permute(2, 0, 1).unsqueeze(0) * 2.0 - 1.0).contiguous()


def encode_reference_images(
    vae: Any,
    images: Sequence[Image.Image],
    *,
    generator: torch.Generator | None = None,
    sample: bool = True,
    max_pixels: int = MAX_REFERENCE_PIXELS,
    max_side_length: int = MAX_REFERENCE_SIDE,
) -> list[torch.Tensor]:
    """Encode reference images to scaled latents, one (C, H/8, W/8) tensor per image, in the VAE dtype.

    ``sample=True`` draws from the VAE posterior like upstream, but from ``generator`` rather than
    the global RNG (upstream's draw is not reproducible, §9.5); ``sample=False`` takes its
    mode. Images are encoded one at a time because their sizes may differ.
    """
    latents = []
    with torch.no_grad():
        for image in images:
            pixels = preprocess_reference_image(image, max_pixels=max_pixels, max_side_length=max_side_length)
            posterior = vae.encode(pixels.to(device=_module_device(vae), dtype=vae.dtype)).latent_dist
            z = posterior.sample(generator=generator) if sample else posterior.mode()
            latents.append(vae_to_latents(vae, z)[0].to(vae.dtype))
    return latents


def vae_to_latents(vae: Any, z: torch.Tensor) -> torch.Tensor:
    """VAE posterior space to Boogu latent space: ``(z - shift_factor) * scaling_factor``."""
    shift, scale = _vae_factors(vae)
    return (z - shift) * scale


def latents_to_vae(vae: Any, latents: torch.Tensor) -> torch.Tensor:
    """Boogu latent space to VAE decoder input: ``latents / scaling_factor + shift_factor`` (upstream's order)."""
    shift, scale = _vae_factors(vae)
    return latents / scale + shift


def decode_latents(vae: Any, latents: torch.Tensor) -> torch.Tensor:
    """Decode (B, C, h, w) Boogu latents to (B, 3, 8h, 8w) uint8 images on the CPU.

    Pixels are ``round(clamp(x / 2 + 0.5, 0, 1) * 255)`` computed in float32, which is what
    diffusers' ``VaeImageProcessor.postprocess`` does for the pipeline's PIL output.
    """
    with torch.no_grad():
        z = latents_to_vae(vae, latents.to(device=_module_device(vae), dtype=vae.dtype))
        pixels = vae.decode(z).sample.float()
    return ((pixels / 2 + 0.5).clamp(0, 1) * 255).round().to(torch.uint8).cpu()


def _vae_factors(vae: Any) -> tuple[float, float]:
    config = vae.config
    scale = config.scaling_factor
    if scale is None:
        raise ValueError("the VAE config has no scaling_factor (the FLUX VAE's is 0.3611)")
    # Upstream skips the shift when the config has none (SD-style VAEs); the FLUX VAE's is 0.1159.
    shift = config.shift_factor if getattr(config, "shift_factor", None) is not None else 0.0
    return float(shift), float(scale)


def _resize(image: Image.Image, height: int, width: int) -> Image.Image:
    """Lanczos resize (upstream's ``BooguImageProcessor`` default); Pillow returns a same-size image unresampled."""
    if (image.height, image.width) == (height, width):
        return image
    return image.resize((width, height), resample=Image.Resampling.LANCZOS)


def _check_vlm_view(vlm_view: str) -> None:
    if vlm_view not in get_args(VlmView):
        raise ValueError(f"vlm_view must be one of {get_args(VlmView)}, got {vlm_view!r}")


def _as_rgb(image: Image.Image) -> Image.Image:
    if not isinstance(image, Image.Image):
        raise TypeError(f"reference images must be PIL images, got {type(image).__name__}")
    return image if image.mode == "RGB" else image.convert("RGB")


def _module_device(module: torch.nn.Module) -> torch.device:
    for tensor in module.parameters():
        return tensor.device
    return torch.device("cpu")


def _module_dtype(module: torch.nn.Module) -> torch.dtype:
    dtype = getattr(module, "dtype", None)
    if isinstance(dtype, torch.dtype):
        return dtype
    for tensor in module.parameters():
        return tensor.dtype
    return torch.float32
