"""Glue from loaded checkpoint parts to the rollout engine's encoder and VAE codec."""

from __future__ import annotations

import contextlib
import io
import time
from collections.abc import Iterator, Sequence
from functools import lru_cache
from typing import get_args

import torch
from PIL import Image

from boogu_adapters.encoding import (
    DEFAULT_MAX_SEQUENCE_LENGTH,
    PromptCache,
    VlmView,
    _module_device,
    _module_dtype,
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
PROMPT_CACHE_ENTRIES = 64
"""Encoded prompt batches a `QwenPromptEncoder` keeps by default (0 turns the cache off)."""
PROMPT_CACHE_BYTES = 256 * 2**20
"""Most bytes of features those batches may hold (on the encoder's device)."""


class QwenPromptEncoder:
    """Qwen3-VL prompt features as upstream computes them (see :func:`encoding.encode_prompts`).

    A prompt longer than ``max_sequence_length`` tokens is an error naming it: upstream keeps the
    whole prompt by default, and silently cutting it (the reference's defect) changes the task.
    ``vlm_view`` is how an edit's reference reaches the processor (:data:`encoding.VlmView`);
    :meth:`__call__` and :meth:`token_counts` both follow it.

    The text encoder is frozen, so a batch encoded once need not be encoded again: the encoder keeps
    the last ``cache_entries`` batches (at most ``cache_bytes`` bytes; :class:`encoding.PromptCache`),
    each under the whole batch: its instructions and reference images in order, the chat template,
    the view, the encoder's weights (storage and in-place version of every parameter), device and
    dtype. A rollout's negative prompt (the same ``[""]`` every step) and an evaluation's prompt set
    are encoded once. The key is the whole batch, not each prompt, because a prompt's features
    depend, in their last bits, on the padded length of the batch it was encoded in (matrix shapes
    change the kernels' summation order): a hit returns exactly the tensors a fresh encode of the
    same batch computes, so results never depend on what was encoded before (a resumed run encodes
    as the original did).

    ``offload_to``: the encoder's weights wait in host memory (pinned on CUDA) and are copied to that
    device for each encode, then dropped there: the GPU holds them only while it encodes. The host
    tensors stay the same, so cache keys stay valid. An encoder built on the meta device (the
    trainer's with ``rollout.engine=vllm_omni``: the worker encodes) refuses to encode, with a message.
    """

    def __init__(
        self,
        text_encoder,
        processor,
        *,
        max_sequence_length: int = MAX_SEQUENCE_LENGTH,
        num_feature_layers: int = 1,
        vlm_view: VlmView = "upstream",
        cache_entries: int = PROMPT_CACHE_ENTRIES,
        cache_bytes: int = PROMPT_CACHE_BYTES,
        offload_to: torch.device | str | None = None,
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
        self.num_feature_layers = num_feature_layers
        if cache_entries < 0:
            raise ValueError(f"cache_entries must be >= 0 (0 = no cache), got {cache_entries}")
        self.cache = PromptCache(cache_entries, cache_bytes) if cache_entries else None
        """The encoded batches kept (None: every call encodes)."""
        self.seconds = 0.0
        self.offload_to = None if offload_to is None else torch.device(offload_to)
        """Where the offloaded encoder runs (None: where its weights are)."""
        if self.offload_to is not None:
            self._to_host(text_encoder, pin=self.offload_to.type == "cuda" and torch.cuda.is_available())

    @staticmethod
    def _to_host(module: torch.nn.Module, *, pin: bool) -> None:
        for t in (*module.parameters(), *module.buffers()):
            host = t.data if t.device.type == "cpu" else t.data.cpu()
            t.data = host.pin_memory() if pin and not host.is_pinned() else host

    @contextlib.contextmanager
    def _weights_in_place(self) -> Iterator[None]:
        """The encoder's weights on ``offload_to`` for one encode (a no-op without offloading)."""
        if _module_device(self.text_encoder).type == "meta":
            raise RuntimeError(
                "the trainer holds no text encoder weights (rollout.engine=vllm_omni: the rollout worker "
                "encodes the prompts); encoding here needs rollout.engine=local"
            )
        if self.offload_to is None:
            yield
            return
        tensors = [*self.text_encoder.parameters(), *self.text_encoder.buffers()]
        host = [t.data for t in tensors]
        try:
            for t, h in zip(tensors, host, strict=True):
                # a copy (from pinned memory: no host wait), dropped after the call
                t.data = h.to(self.offload_to, non_blocking=True, copy=True)
            yield
        finally:
            for t, h in zip(tensors, host, strict=True):
                t.data = h  # the device copies are freed with the call's last use

    def __call__(self, instructions: Sequence[str], images: Sequence[bytes | None] | None):
        t0 = time.perf_counter()
        key = None if self.cache is None else self.cache_key(instructions, images)
        cached = None if key is None else self.cache.get(key)
        if cached is None:
            pil = None if images is None else [None if b is None else [_decode_image(b)] for b in images]
            with self._weights_in_place():
                embeds = encode_prompts(
                    self.text_encoder,
                    self.processor,
                    list(instructions),
                    pil,
                    max_sequence_length=DEFAULT_MAX_SEQUENCE_LENGTH,
                    truncate=False,
                    num_feature_layers=self.num_feature_layers,
                    vlm_view=self.vlm_view,
                )
            hidden, mask = embeds.hidden_states, embeds.attention_mask
        else:
            hidden, mask = cached
        lengths = mask.sum(dim=1)
        too_long = (lengths > self.max_sequence_length).nonzero().flatten().tolist()
        if too_long:
            i = too_long[0]
            raise ValueError(
                f"prompt {instructions[i][:60]!r} has {int(lengths[i])} tokens, more than "
                f"model.max_sequence_length={self.max_sequence_length}"
            )
        if cached is None and key is not None:
            self.cache.put(key, (hidden, mask))
        self.seconds += time.perf_counter() - t0
        return hidden, mask

    def cache_key(self, instructions: Sequence[str], images: Sequence[bytes | None] | None) -> tuple:
        """Everything the features of this batch depend on (see the class docstring)."""
        encoder = self.text_encoder
        no_images = images is None or all(b is None for b in images)
        return (
            tuple("" if text is None else text for text in instructions),  # encode_prompts: None is ""
            None if no_images else tuple(images),
            getattr(self.processor, "chat_template", None),
            self.vlm_view,
            self.num_feature_layers,
            self.offload_to or _module_device(encoder),
            _module_dtype(encoder),
            tuple((p.data_ptr(), p._version) for p in encoder.parameters()),
        )

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
    encode_cache: bool = True,
    cache_text_path: bool = True,
    text_encoder_offload: torch.device | str | None = None,
) -> LocalRolloutEngine:
    """A :class:`LocalRolloutEngine` over the parts (``transformer`` overrides ``parts.transformer``,
    e.g. the LoRA-injected module the trainer trains; ``edit_vlm_view`` is the prompt encoder's
    ``vlm_view``; ``micro_batch_size`` caps the latents per transformer call and VAE decode).

    ``encode_cache`` keeps encoded prompt batches (`QwenPromptEncoder`), ``cache_text_path`` runs the
    transformer's text path once per rollout (`LocalRolloutEngine`); neither changes a result, both
    are there to be switched off for a comparison (``benchmarks/demo_throughput.py``).
    ``text_encoder_offload``: the device the text encoder runs on while its weights wait in host
    memory between encodes (`QwenPromptEncoder`'s ``offload_to``; None: they stay where they are)."""
    model = transformer if transformer is not None else parts.transformer
    return LocalRolloutEngine(
        model,
        encode_prompts=QwenPromptEncoder(
            parts.text_encoder,
            parts.processor,
            max_sequence_length=max_sequence_length,
            num_feature_layers=num_instruction_feature_layers(model),
            vlm_view=edit_vlm_view,
            cache_entries=PROMPT_CACHE_ENTRIES if encode_cache else 0,
            offload_to=text_encoder_offload,
        ),
        codec=VaeCodec(parts.vae, parts.vae_scale_factor),
        schedule_config=parts.schedule_config,
        freqs_cis=rope_tables(model),
        latent_channels=model.config.in_channels,
        cfg_mode=cfg_mode,
        device=device,
        shares_module=transformer is not None,
        micro_batch_size=micro_batch_size,
        cache_text_path=cache_text_path,
    )
