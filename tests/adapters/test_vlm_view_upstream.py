"""The edit reference's VLM view against upstream's own code (opt-in).

Skipped unless ``BOOGU_UPSTREAM_SRC`` names upstream's source (see
``tests/adapters/test_model_upstream_parity.py``). Upstream's ``BooguImagePipeline`` methods are
called unbound on a small stand-in holding only what they read: its ``BooguImageProcessor`` (as
the pipeline builds it, VAE factor 8 x 2), the tiny checkpoint's processor and inner Qwen3-VL
model as ``mllm``, and the system prompts. The prompt features come from upstream's
``_get_instruction_feature_embeds`` itself, with ``__call__``'s VLM defaults.
"""

from __future__ import annotations

import warnings
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from PIL import Image

from boogu_adapters.encoding import (
    MAX_VLM_REFERENCE_PIXELS,
    MAX_VLM_REFERENCE_SIDE,
    encode_prompts,
    preprocess_vlm_images,
)
from boogu_data import SYSTEM_PROMPT_T2I, SYSTEM_PROMPT_TI2I
from tests.upstream import import_upstream

upstream_pipeline, upstream_image_processor = import_upstream(
    "boogu.pipelines.boogu.pipeline_boogu", "boogu.pipelines.image_processor"
)

Pipeline = upstream_pipeline.BooguImagePipeline
# (height, width): a side not a multiple of 16, above 384², above 1152².
SIZES = [(40, 72), (400, 500), (1200, 1200)]
# upstream __call__'s defaults, passed on to _get_instruction_feature_embeds.
UPSTREAM_VLM_PIXELS, UPSTREAM_VLM_SIDE = 384 * 384, 384 * 2


class _Upstream:
    """The attributes upstream's prompt-encoding methods read, and those methods, unbound."""

    preprocess_vlm_input_pil_images = Pipeline.preprocess_vlm_input_pil_images
    _apply_chat_template = Pipeline._apply_chat_template
    _get_instruction_feature_embeds = Pipeline._get_instruction_feature_embeds

    def __init__(self, parts) -> None:
        # As BooguImagePipeline.__init__: BooguImageProcessor(vae_scale_factor=self.vae_scale_factor * 2).
        self.image_processor = upstream_image_processor.BooguImageProcessor(
            vae_scale_factor=parts.vae_scale_factor * 2, do_resize=True
        )
        self.processor = parts.processor
        self.mllm = parts.text_encoder
        self.transformer = SimpleNamespace(instruction_feature_configs={})
        self.prompt_embedding = None
        self.MASK_VISION_TOKENS_FEATURE = False
        self.VISION_TOKEN_IDs: list[int] = []
        # Set in upstream's __init__ (not reachable without building the pipeline); boogu-data's
        # copies, whose SHA-256 test_encoding.py checks against docs/upstream-model.md §9.1.
        self.SYSTEM_PROMPT_4_T2I = SYSTEM_PROMPT_T2I
        self.SYSTEM_PROMPT_DROP = self.SYSTEM_PROMPT_4_TI2I = self.SYSTEM_PROMPT_4_I2I = SYSTEM_PROMPT_TI2I


def _noise_image(height: int, width: int, seed: int) -> Image.Image:
    pixels = np.random.default_rng(seed).integers(0, 256, (height, width, 3), dtype=np.uint8)
    return Image.fromarray(pixels)


@pytest.fixture(scope="module")
def upstream(tiny_parts) -> _Upstream:
    return _Upstream(tiny_parts)


def test_caps_are_upstreams_call_defaults() -> None:
    import inspect

    defaults = inspect.signature(Pipeline.__call__).parameters
    assert defaults["max_vlm_input_pil_pixels"].default == MAX_VLM_REFERENCE_PIXELS == UPSTREAM_VLM_PIXELS
    assert defaults["max_vlm_input_pil_side_length"].default == MAX_VLM_REFERENCE_SIDE == UPSTREAM_VLM_SIDE


@pytest.mark.parametrize("size", SIZES, ids=lambda s: f"{s[0]}x{s[1]}")
def test_resized_images_are_bit_identical(upstream, size) -> None:
    image = _noise_image(*size, seed=size[0])
    (theirs,) = upstream.preprocess_vlm_input_pil_images(
        [image], max_pixels=UPSTREAM_VLM_PIXELS, max_side_length=UPSTREAM_VLM_SIDE
    )
    (ours,) = preprocess_vlm_images([image])
    assert ours.size == theirs.size
    assert np.array_equal(np.asarray(ours), np.asarray(theirs))


def test_later_images_take_the_first_ones_size(upstream) -> None:
    images = [_noise_image(h, w, seed=i) for i, (h, w) in enumerate(SIZES[1:] + SIZES[:1])]
    theirs = upstream.preprocess_vlm_input_pil_images(
        images, max_pixels=UPSTREAM_VLM_PIXELS, max_side_length=UPSTREAM_VLM_SIDE
    )
    ours = preprocess_vlm_images(images)
    for a, b in zip(ours, theirs, strict=True):
        assert a.size == b.size
        assert np.array_equal(np.asarray(a), np.asarray(b))


def test_prompt_features_equal_upstreams(tiny_parts, upstream) -> None:
    images = [_noise_image(*size, seed=i) for i, size in enumerate(SIZES)]
    instructions = ["make it blue", "add a red hat", ""]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        feats, mask = upstream._get_instruction_feature_embeds(
            instructions,
            [[im] for im in images],
            device=torch.device("cpu"),
            max_sequence_length=1280,
            max_vlm_input_pil_pixels=UPSTREAM_VLM_PIXELS,
            max_vlm_input_pil_side_length=UPSTREAM_VLM_SIDE,
        )
    ours = encode_prompts(
        tiny_parts.text_encoder, tiny_parts.processor, instructions, images=[[im] for im in images]
    )
    torch.testing.assert_close(ours.attention_mask, mask.to(torch.int64), rtol=0, atol=0)
    torch.testing.assert_close(ours.hidden_states, feats, rtol=0, atol=0)
    # And the processor view is what differs from upstream.
    other = encode_prompts(
        tiny_parts.text_encoder,
        tiny_parts.processor,
        instructions,
        images=[[im] for im in images],
        vlm_view="processor",
    )
    assert not torch.equal(other.hidden_states, feats)
