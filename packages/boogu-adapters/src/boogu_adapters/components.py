"""Glue from loaded checkpoint parts to the rollout engine's encoder and VAE codec."""

from __future__ import annotations

import io
import time
from collections.abc import Sequence
from functools import lru_cache
from typing import get_args

import torch
from PIL import Image

from boogu_adapters.encoding import (
    VlmView,
    count_prompt_tokens,
    decode_latents,
    encode_prompts,
    encode_reference_images,
    fit_size,
    num_instruction_feature_layers,
)
from boogu_adapters.engines import LocalRolloutEngine
from boogu_adapters.loading import BooguParts
from boogu_adapters.model import get_freqs_cis
from boogu_adapters.step import CfgMode
from boogu_protocol import MAX_SEQUENCE_LENGTH
from boogu_schedule.sampling import reference_generator

ROPE_THETA = 10000.0


class QwenPromptEncoder:
    """Qwen3-VL prompt features as upstream computes them (see :func:`encoding.encode_prompts`).

    A prompt longer than ``max_sequence_length`` tokens is an error naming it: upstream keeps the
    whole prompt by default, and silently cutting it (the reference's defect) changes the task.
    ``vlm_view`` is how an edit's reference reaches the processor (:data:`encoding.VlmView`);
    :meth:`__call__` and :meth:`token_counts` both follow it.
    """

    def __init__(
        self,
        text_encoder,
        processor,
        *,
        max_sequence_length: int = MAX_SEQUENCE_LENGTH,
        num_feature_layers: int = 1,
        vlm_view: VlmView = "upstream",
    ):
        if num_feature_layers != 1:
            raise NotImplementedError(
                "checkpoints with num_instruction_feature_layers > 1 are not supported by the rollout engine yet"
            )
        self.text_encoder, self.processor = text_encoder, processor
        self.max_sequence_length = max_sequence_length
        if vlm_view not in get_args(VlmView):
            raise ValueError(f"vlm_view must be one of {get_args(VlmView)}, got {vlm_view!r}")
        self.vlm_view: VlmView = vlm_view
        self.seconds = 0.0

    def __call__(self, instructions: Sequence[str], images: Sequence[bytes | None] | None):
        t0 = time.perf_counter()
        pil = None if images is None else [None if b is None else [_decode_image(b)] for b in images]
        embeds = encode_prompts(
            self.text_encoder, self.processor, list(instructions), pil, vlm_view=self.vlm_view
        )
        lengths = embeds.attention_mask.sum(dim=1)
        too_long = (lengths > self.max_sequence_length).nonzero().flatten().tolist()
        if too_long:
            i = too_long[0]
            raise ValueError(
                f"prompt {instructions[i][:60]!r} has {int(lengths[i])} tokens, more than "
                f"model.max_sequence_length={self.max_sequence_length}"
            )
        self.seconds += time.perf_counter() - t0
        return embeds.hidden_states, embeds.attention_mask

    def token_counts(self, instructions: Sequence[str], images: Sequence[bytes | None] | None) -> list[int]:
        """The token count each prompt has in :meth:`__call__` (its attention mask's sum), without
        running the text encoder: tokenisation only, each image sized from its header
        (see :func:`encoding.count_prompt_tokens`). For checking a dataset against
        ``max_sequence_length`` when it is loaded."""
        if images is not None and len(images) != len(instructions):
            raise ValueError(f"images has {len(images)} entries for {len(instructions)} instructions")
        sizes = None if images is None else [None if b is None else [_pixel_size(b)] for b in images]
        return count_prompt_tokens(self.processor, list(instructions), sizes, vlm_view=self.vlm_view)


class VaeCodec:
    """The FLUX VAE as the rollout engine's :class:`~boogu_adapters.engines.ImageCodec`."""

    def __init__(self, vae, vae_scale_factor: int = 8, *, sample_references: bool = True):
        self.vae, self.factor = vae, vae_scale_factor
        self.sample_references = sample_references
        self.seconds = 0.0

    def encode_references(self, images: Sequence[bytes], generator: torch.Generator) -> list[torch.Tensor]:
        t0 = time.perf_counter()
        # The VAE posterior draw uses a CPU generator derived from the request's, so the same
        # request gives the same reference latents on any device (and in the vllm-omni engine).
        cpu_gen = reference_generator(generator)
        out = encode_reference_images(
            self.vae,
            [_decode_image(b) for b in images],
            generator=cpu_gen,
            sample=self.sample_references,
        )
        self.seconds += time.perf_counter() - t0
        return out

    def decode(self, latents: torch.Tensor) -> torch.Tensor:
        t0 = time.perf_counter()
        out = decode_latents(self.vae, latents)
        self.seconds += time.perf_counter() - t0
        return out

    def latent_size(self, height: int, width: int) -> tuple[int, int]:
        return height // self.factor, width // self.factor

    def reference_size(self, image: bytes) -> tuple[int, int]:
        return _image_size(image)


@lru_cache(maxsize=64)
def _image_size(image: bytes) -> tuple[int, int]:
    with Image.open(io.BytesIO(image)) as im:
        return fit_size(im.height, im.width)


def _pixel_size(image: bytes) -> tuple[int, int]:
    """(height, width) from the image's header; Pillow decodes no pixels until asked."""
    with Image.open(io.BytesIO(image)) as im:
        width, height = im.size
    return height, width


def _decode_image(data: bytes) -> Image.Image:
    with Image.open(io.BytesIO(data)) as im:
        return im.convert("RGB")


def rope_tables(transformer: torch.nn.Module) -> list[torch.Tensor]:
    config = transformer.config
    return get_freqs_cis(config.axes_dim_rope, config.axes_lens, ROPE_THETA)


def build_local_engine(
    parts: BooguParts,
    *,
    transformer: torch.nn.Module | None = None,
    max_sequence_length: int = MAX_SEQUENCE_LENGTH,
    cfg_mode: CfgMode = "batched",
    device: torch.device | str | None = None,
    edit_vlm_view: VlmView = "upstream",
    micro_batch_size: int = 0,
) -> LocalRolloutEngine:
    """A :class:`LocalRolloutEngine` over the parts (``transformer`` overrides ``parts.transformer``,
    e.g. the LoRA-injected module the trainer trains; ``edit_vlm_view`` is the prompt encoder's
    ``vlm_view``; ``micro_batch_size`` caps the latents per transformer call and VAE decode)."""
    model = transformer if transformer is not None else parts.transformer
    return LocalRolloutEngine(
        model,
        encode_prompts=QwenPromptEncoder(
            parts.text_encoder,
            parts.processor,
            max_sequence_length=max_sequence_length,
            num_feature_layers=num_instruction_feature_layers(model),
            vlm_view=edit_vlm_view,
        ),
        codec=VaeCodec(parts.vae, parts.vae_scale_factor),
        schedule_config=parts.schedule_config,
        freqs_cis=rope_tables(model),
        latent_channels=model.config.in_channels,
        cfg_mode=cfg_mode,
        device=device,
        shares_module=transformer is not None,
        micro_batch_size=micro_batch_size,
    )
