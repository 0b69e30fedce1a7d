"""Prompt and image encoding on the tiny checkpoint, checked against upstream's conventions.

The conventions are those of ``docs/upstream-model.md`` §9.
"""

from __future__ import annotations

import copy
import hashlib
import io
import re

import numpy as np
import pytest
import torch
from hypothesis import example, given
from hypothesis import strategies as st
from PIL import Image

from boogu_adapters.components import QwenPromptEncoder
from boogu_adapters.encoding import (
    MAX_VLM_REFERENCE_PIXELS,
    MAX_VLM_REFERENCE_SIDE,
    PromptCache,
    PromptEmbeds,
    count_prompt_tokens,
    decode_latents,
    encode_prompts,
    encode_reference_images,
    fit_size,
    latents_to_vae,
    num_instruction_feature_layers,
    preprocess_reference_image,
    preprocess_vlm_images,
    resolve_output_size,
    vae_to_latents,
    vlm_image_sizes,
)

# Digests of upstream's two system prompts, from docs/upstream-model.md §9.1: the test does not
# trust any copy of the prompt text, only what reaches the tokenizer.
T2I_SHA256 = "1c3cf6989807dc33333dd5e5d711673562f39ae3f5974ad9556d609bf3944e9b"
TI2I_SHA256 = "4b2e8ed6183d7c55a3cc9af5fd0f051ffe6afff4a84e41c1ba706380e24b8862"
CHATML = re.compile(
    r"<\|im_start\|>system\n(.*)<\|im_end\|>\n<\|im_start\|>user\n(.*)<\|im_end\|>\n", re.DOTALL
)


def _decode_row(parts, embeds: PromptEmbeds, row: int) -> str:
    ids = embeds.input_ids[row][embeds.attention_mask[row] == 1]
    return parts.processor.tokenizer.decode(ids, skip_special_tokens=False)


def _split_turns(text: str) -> tuple[str, str]:
    match = CHATML.fullmatch(text)
    assert match is not None, f"not Boogu's ChatML layout: {text!r}"
    return match.group(1), match.group(2)


def _sha(text: str) -> str:
    return hashlib.sha256(text.encode("utf-8")).hexdigest()


def _noise_image(height: int, width: int, seed: int = 0) -> Image.Image:
    pixels = np.random.default_rng(seed).integers(0, 256, (height, width, 3), dtype=np.uint8)
    return Image.fromarray(pixels)


def test_template_text_reaches_the_tokenizer_byte_exact(tiny_parts) -> None:
    instructions = ['A neon sign that says "Café 24/7"', "line one\nline two, ünïcödé 文字 🙂", "x"]
    embeds = encode_prompts(tiny_parts.text_encoder, tiny_parts.processor, instructions)
    for row, instruction in enumerate(instructions):
        system, user = _split_turns(_decode_row(tiny_parts, embeds, row))
        assert user == instruction
        assert _sha(system) == T2I_SHA256
    # Two turns, no generation prompt (the full match above already ends at the user turn).
    assert all(
        _decode_row(tiny_parts, embeds, row).count("<|im_start|>") == 2 for row in range(len(instructions))
    )


def test_t2i_negative_carries_the_ti2i_system_prompt(tiny_parts) -> None:
    # Upstream's pipeline default: an empty instruction is encoded with the TI2I prompt even in T2I.
    embeds = encode_prompts(tiny_parts.text_encoder, tiny_parts.processor, ["a red bicycle", "", " \t"])
    systems = [_split_turns(_decode_row(tiny_parts, embeds, row))[0] for row in range(3)]
    assert [_sha(s) for s in systems] == [T2I_SHA256, TI2I_SHA256, TI2I_SHA256]


def test_batch_is_right_padded_and_rows_are_independent(tiny_parts) -> None:
    short, long = "a cat", "a very long instruction about a poster with many words on it"
    batch = encode_prompts(tiny_parts.text_encoder, tiny_parts.processor, [short, long])
    alone = encode_prompts(tiny_parts.text_encoder, tiny_parts.processor, [short])
    mask = batch.attention_mask
    assert mask.dtype == torch.int64 and mask.shape == batch.input_ids.shape
    assert batch.hidden_states.shape == (*mask.shape, tiny_parts.text_encoder.config.text_config.hidden_size)
    assert batch.hidden_states.dtype == torch.float32
    length = int(alone.attention_mask.sum())
    assert mask[0, :length].all() and not mask[0, length:].any()  # ones, then zeros: right padding
    assert mask[1].all()
    pad_id = tiny_parts.processor.tokenizer.pad_token_id
    assert (batch.input_ids[0, length:] == pad_id).all()
    # Causal attention plus right padding: the short prompt's features do not see the padding.
    torch.testing.assert_close(batch.hidden_states[0, :length], alone.hidden_states[0], rtol=1e-5, atol=1e-5)


def test_several_feature_layers(tiny_parts) -> None:
    one = encode_prompts(tiny_parts.text_encoder, tiny_parts.processor, ["a cat", ""])
    two = encode_prompts(tiny_parts.text_encoder, tiny_parts.processor, ["a cat", ""], num_feature_layers=2)
    assert isinstance(two.hidden_states, list) and len(two.hidden_states) == 2
    # The last entry of the hidden-state tuple is last_hidden_state (after the final norm).
    torch.testing.assert_close(two.hidden_states[-1], one.hidden_states, rtol=0, atol=0)
    assert not torch.equal(two.hidden_states[0], two.hidden_states[1])
    with pytest.raises(ValueError, match="returns only"):
        encode_prompts(tiny_parts.text_encoder, tiny_parts.processor, ["a"], num_feature_layers=10)
    assert num_instruction_feature_layers(tiny_parts.transformer) == 1
    assert (
        num_instruction_feature_layers({"instruction_feature_configs": {"num_instruction_feature_layers": 3}})
        == 3
    )


# (height, width) -> the VLM copy's size under upstream's preprocess_vlm_input_pil_images, worked out
# by hand from BooguImageProcessor.get_new_height_width with max_pixels 384², side 768, multiple 16:
# ratio = min((147456 / (H W)) ** 0.5, 768 / max(H, W), 1), side = int(side * ratio) // 16 * 16.
UPSTREAM_VLM_SIZES = {
    (40, 72): (32, 64),  # under the cap (ratio 1): only floored to multiples of 16
    (72, 40): (64, 32),
    (400, 500): (336, 416),  # ratio 0.858650: 343.46 -> 336, 429.33 -> 416
    (500, 400): (416, 336),
    (1200, 1200): (384, 384),  # ratio 0.32: the area cap
    (1152, 1152): (384, 384),  # ratio 1/3 as a float: 1152 * ratio is 384.0, so 384, not 368
    (2000, 3000): (304, 464),  # ratio 0.156767: 313.53 -> 304, 470.30 -> 464
    (100, 2000): (32, 768),  # the 768 side cap binds (ratio 0.384): 38.4 -> 32, 768
    (384, 384): (384, 384),  # exactly at the cap: kept
    (16, 16): (16, 16),  # never upsampled
}


def test_vlm_caps_are_upstreams() -> None:
    # pipeline_boogu.py __call__ defaults: max_vlm_input_pil_pixels=384 * 384, max_vlm_input_pil_side_length=384 * 2.
    assert (MAX_VLM_REFERENCE_PIXELS, MAX_VLM_REFERENCE_SIDE) == (147456, 768)


@pytest.mark.parametrize("size", list(UPSTREAM_VLM_SIZES))
def test_vlm_image_sizes_upstream(size) -> None:
    assert vlm_image_sizes([size]) == [UPSTREAM_VLM_SIZES[size]]
    assert vlm_image_sizes([size], vlm_view="processor") == [size]


def test_vlm_later_images_take_the_first_ones_size() -> None:
    # Upstream's loop passes the first image's new (height, width) on to the next images.
    assert vlm_image_sizes([(400, 500), (1200, 1200), (40, 72)]) == [(336, 416)] * 3
    assert vlm_image_sizes([(400, 500), (40, 72)], vlm_view="processor") == [(400, 500), (40, 72)]
    assert vlm_image_sizes([]) == []
    with pytest.raises(ValueError, match="vlm_view"):
        vlm_image_sizes([(40, 72)], vlm_view="qwen")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="smaller than 16 px"):
        vlm_image_sizes([(8, 72)])


@pytest.mark.parametrize("size", [(40, 72), (400, 500), (1200, 1200)])
def test_preprocess_vlm_images_is_a_lanczos_resize(size) -> None:
    height, width = size
    image = _noise_image(height, width, seed=height)
    (got,) = preprocess_vlm_images([image])
    want_h, want_w = UPSTREAM_VLM_SIZES[size]
    want = image.resize((want_w, want_h), resample=Image.Resampling.LANCZOS)
    assert got.size == (want_w, want_h) and got.mode == "RGB"
    assert np.array_equal(np.asarray(got), np.asarray(want))
    (same,) = preprocess_vlm_images([image], vlm_view="processor")
    assert np.array_equal(np.asarray(same), np.asarray(image))
    # Greyscale is promoted to RGB before the resize; Lanczos works per channel, so the pixels are
    # those of upstream's order (resize the greyscale image, then the processor's RGB conversion).
    grey_image = image.convert("L")
    (grey,) = preprocess_vlm_images([grey_image])
    grey_want = grey_image.resize((want_w, want_h), resample=Image.Resampling.LANCZOS).convert("RGB")
    assert np.array_equal(np.asarray(grey), np.asarray(grey_want))


@pytest.mark.parametrize("vlm_view", ["upstream", "processor"])
def test_vlm_images_come_first_sized_by_the_view(tiny_parts, vlm_view) -> None:
    image = _noise_image(300, 200)  # sides not multiples of 16: upstream gives the processor 288x192
    embeds = encode_prompts(
        tiny_parts.text_encoder,
        tiny_parts.processor,
        ["make it blue", ""],
        images=[[image], None],
        vlm_view=vlm_view,
    )
    seen = image.resize((192, 288), resample=Image.Resampling.LANCZOS) if vlm_view == "upstream" else image
    grid = tiny_parts.processor.image_processor(images=[seen], return_tensors="pt")["image_grid_thw"][0]
    merge = tiny_parts.processor.image_processor.merge_size
    n_tokens = int(grid.prod()) // merge**2
    system, user = _split_turns(_decode_row(tiny_parts, embeds, 0))
    assert _sha(system) == TI2I_SHA256
    assert user == "<|vision_start|>" + "<|image_pad|>" * n_tokens + "<|vision_end|>make it blue"
    # The text-only negative in the same batch has no image tokens.
    assert "<|vision_start|>" not in _decode_row(tiny_parts, embeds, 1)
    # The features are those of the processor-view encode of the image the view hands over.
    direct = encode_prompts(
        tiny_parts.text_encoder,
        tiny_parts.processor,
        ["make it blue", ""],
        images=[[seen], None],
        vlm_view="processor",
    )
    torch.testing.assert_close(embeds.hidden_states, direct.hidden_states, rtol=0, atol=0)


def test_vlm_views_give_different_features(tiny_parts) -> None:
    image = _noise_image(40, 72)
    upstream, processor = (
        encode_prompts(tiny_parts.text_encoder, tiny_parts.processor, ["x"], images=[[image]], vlm_view=v)
        for v in ("upstream", "processor")
    )
    assert upstream.hidden_states.shape == processor.hidden_states.shape
    assert not torch.equal(upstream.hidden_states, processor.hidden_states)
    with pytest.raises(ValueError, match="vlm_view"):
        encode_prompts(tiny_parts.text_encoder, tiny_parts.processor, ["x"], vlm_view="raw")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="vlm_view"):
        QwenPromptEncoder(None, tiny_parts.processor, vlm_view="raw")  # type: ignore[arg-type]


# Qwen3-VL's released image-processor bounds (preprocessor_config.json "size"): 256² .. 4096² pixels.
QWEN3_VL_SIZE = {"shortest_edge": 256 * 256, "longest_edge": 4096 * 4096}


@pytest.mark.parametrize(
    ("side", "upstream", "processor"),
    [
        (512, 144, 256),  # 384² / 32² = 144; 512² / 32² = 256
        (1024, 144, 1024),
        (1200, 144, 1444),  # smart resize rounds 1200 to 1216: 38² tokens, above the 1280 cap
    ],
)
def test_vision_tokens_with_the_released_processor_bounds(tiny_parts, side, upstream, processor) -> None:
    real = copy.deepcopy(tiny_parts.processor)
    real.image_processor.size = dict(QWEN3_VL_SIZE)
    for view, want in (("upstream", upstream), ("processor", processor)):
        got = count_prompt_tokens(real, ["x"], [[(side, side)]], vlm_view=view)[0]
        # A 256² reference is 8² merged patches under both views (under the caps, a multiple of 32).
        known = count_prompt_tokens(real, ["x"], [[(256, 256)]], vlm_view=view)[0]
        assert got - known == want - 64, view


def test_encode_prompts_rejects_bad_input(tiny_parts) -> None:
    with pytest.raises(TypeError, match="not a single string"):
        encode_prompts(tiny_parts.text_encoder, tiny_parts.processor, "a cat")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="one list per instruction"):
        encode_prompts(tiny_parts.text_encoder, tiny_parts.processor, ["a", "b"], images=[[]])


def _png(image: Image.Image) -> bytes:
    buffer = io.BytesIO()
    image.save(buffer, format="PNG")
    return buffer.getvalue()


# A long prompt (about 3000 characters) and Unicode beyond the tiny tokenizer's training text.
LONG_PROMPT = " ".join(f"poster{i} saying 'Grand Opening {i}' in neon" for i in range(75))
UNICODE_PROMPT = 'line one\nline two, ünïcödé 文字 🙂 "Café 24/7"\t'


def test_token_counts_equal_the_real_encode_t2i(tiny_parts) -> None:
    instructions = ["a red bicycle", "", " \t", LONG_PROMPT, UNICODE_PROMPT, "a red bicycle", "x"]
    assert len(LONG_PROMPT) > 2500
    encoder = QwenPromptEncoder(tiny_parts.text_encoder, tiny_parts.processor, max_sequence_length=10**6)
    _, mask = encoder(instructions, None)
    want = mask.sum(dim=1).tolist()
    assert encoder.token_counts(instructions, None) == want
    assert encoder.token_counts(instructions, [None] * len(instructions)) == want
    assert len(set(want)) == len(want) - 1  # only the repeated prompt repeats its count
    # The counts need only the processor: an encoder without a text encoder gives the same.
    assert QwenPromptEncoder(None, tiny_parts.processor).token_counts(instructions, None) == want


@pytest.mark.parametrize("vlm_view", ["upstream", "processor"])
def test_token_counts_equal_the_real_encode_with_reference_images(tiny_parts, vlm_view) -> None:
    # The tiny image processor resizes to between 32² and 64² pixels: these sizes are enlarged,
    # kept, shrunk, and of extreme aspect; one is greyscale, one a JPEG.
    sizes = [(16, 16), (32, 32), (48, 80), (300, 200), (1000, 64), (64, 1000), (333, 517)]
    images = [_png(_noise_image(h, w, seed=i)) for i, (h, w) in enumerate(sizes)]
    images[2] = _png(_noise_image(48, 80).convert("L"))
    jpeg = io.BytesIO()
    _noise_image(300, 200).save(jpeg, format="JPEG")
    images[3] = jpeg.getvalue()
    instructions = ["make it blue", "", LONG_PROMPT, UNICODE_PROMPT, "make it blue", "add a hat", "x"]
    # Edit rows and text-only rows in one batch, as a mixed dataset would be counted.
    all_images = [*images, None, None]
    all_instructions = [*instructions, "make it blue", ""]
    encoder = QwenPromptEncoder(
        tiny_parts.text_encoder, tiny_parts.processor, max_sequence_length=10**6, vlm_view=vlm_view
    )
    _, mask = encoder(all_instructions, all_images)
    want = mask.sum(dim=1).tolist()
    counter = QwenPromptEncoder(None, tiny_parts.processor, vlm_view=vlm_view)
    assert counter.token_counts(all_instructions, all_images) == want
    # Image tokens do count: the same text with an image is longer than without.
    assert want[0] > want[-2]


@given(st.lists(st.text(max_size=200), min_size=1, max_size=4))
def test_count_prompt_tokens_equals_the_mask_sum(tiny_parts, instructions: list[str]) -> None:
    embeds = encode_prompts(tiny_parts.text_encoder, tiny_parts.processor, instructions)
    assert count_prompt_tokens(tiny_parts.processor, instructions) == embeds.attention_mask.sum(1).tolist()


@pytest.mark.parametrize("size", [(16, 16), (40, 40), (48, 80), (300, 200), (1000, 64), (4000, 3000)])
@pytest.mark.parametrize("from_header", [True, False], ids=["resize-rule", "processor-run"])
@pytest.mark.parametrize("vlm_view", ["upstream", "processor"])
def test_image_tokens_from_the_size(tiny_parts, monkeypatch, size, from_header: bool, vlm_view) -> None:
    processor = tiny_parts.processor
    if not from_header:
        # An image processor without the resize rule: the count comes from running it instead.
        monkeypatch.delattr(type(processor.image_processor), "get_number_of_image_patches")
    height, width = size
    image = Image.new("RGB", (width, height))
    other = _noise_image(32, 32)
    embeds = encode_prompts(
        tiny_parts.text_encoder, processor, ["a", "b c"], images=[[image], [image, other]], vlm_view=vlm_view
    )
    got = count_prompt_tokens(processor, ["a", "b c"], [[size], [size, (32, 32)]], vlm_view=vlm_view)
    assert got == embeds.attention_mask.sum(1).tolist()


@given(
    height=st.integers(1, 9000),
    width=st.integers(1, 9000),
    max_pixels=st.integers(256, 2048 * 2048),
    max_side=st.integers(16, 5000),
)
@example(height=1024, width=1024, max_pixels=2048 * 2048, max_side=4096)
@example(height=3000, width=2000, max_pixels=2048 * 2048, max_side=4096)
@example(height=5000, width=100, max_pixels=2048 * 2048, max_side=4096)
def test_fit_size_matches_upstream_rule(height: int, width: int, max_pixels: int, max_side: int) -> None:
    # Independent float64 reference of BooguImageProcessor.get_new_height_width.
    ratio = min((max_pixels / (height * width)) ** 0.5, max_side / max(height, width), 1.0)
    want = (int(height * ratio) // 16 * 16, int(width * ratio) // 16 * 16)
    if 0 in want:
        with pytest.raises(ValueError, match="smaller than 16 px"):
            fit_size(height, width, max_pixels=max_pixels, max_side_length=max_side)
        return
    got = fit_size(height, width, max_pixels=max_pixels, max_side_length=max_side)
    assert got == want
    assert got[0] % 16 == 0 and got[1] % 16 == 0
    assert got[0] <= height and got[1] <= width  # never upsampled


def test_fit_size_examples() -> None:
    assert fit_size(1024, 1024) == (1024, 1024)
    assert fit_size(1000, 1000) == (992, 992)
    assert fit_size(3000, 2000) == (2496, 1664)  # area clamp to 2048²
    assert fit_size(5000, 100) == (4096, 80)  # side clamp to 4096


def test_resolve_output_size() -> None:
    assert resolve_output_size() == (1024, 1024)
    assert resolve_output_size(1000, 1000) == (992, 992)
    assert resolve_output_size(3000, 3000) == (2048, 2048)  # area clamp, no side clamp
    assert resolve_output_size(8192, 512) == (8192, 512)  # the 4096 side cap is not applied to outputs
    # An edit follows its reference's VAE size, whatever was requested.
    assert resolve_output_size(1024, 1024, reference_latents=torch.zeros(16, 8, 10)) == (64, 80)


def test_preprocess_reference_image() -> None:
    image = _noise_image(32, 48)
    pixels = preprocess_reference_image(image)
    assert pixels.shape == (1, 3, 32, 48) and pixels.dtype == torch.float32
    want = torch.from_numpy(np.asarray(image).astype(np.float64) / 255.0 * 2.0 - 1.0).permute(2, 0, 1)
    torch.testing.assert_close(pixels[0].double(), want, rtol=0, atol=1e-6)
    # Resized to multiples of 16 (Lanczos), greyscale promoted to RGB.
    assert preprocess_reference_image(_noise_image(70, 90).convert("L")).shape == (1, 3, 64, 80)


def test_reference_latents_are_seeded_and_scaled(tiny_parts) -> None:
    vae = tiny_parts.vae
    image = _noise_image(70, 90)
    first = encode_reference_images(vae, [image], generator=torch.Generator().manual_seed(1))
    again = encode_reference_images(vae, [image], generator=torch.Generator().manual_seed(1))
    other = encode_reference_images(vae, [image], generator=torch.Generator().manual_seed(2))
    assert first[0].shape == (16, 8, 10)  # 70x90 -> 64x80 pixels -> 8x10 latents
    torch.testing.assert_close(first[0], again[0], rtol=0, atol=0)
    assert not torch.equal(first[0], other[0])
    mode = encode_reference_images(vae, [image], sample=False)[0]
    with torch.no_grad():
        posterior = vae.encode(preprocess_reference_image(image)).latent_dist
    torch.testing.assert_close(mode, (posterior.mean[0] - 0.1159) * 0.3611, rtol=1e-6, atol=1e-6)
    assert resolve_output_size(reference_latents=first[0]) == (64, 80)


def test_latent_scaling_round_trip(tiny_parts) -> None:
    vae = tiny_parts.vae
    z = torch.randn(2, 16, 4, 4, generator=torch.Generator().manual_seed(0))
    latents = vae_to_latents(vae, z)
    torch.testing.assert_close(latents, (z - 0.1159) * 0.3611, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(latents_to_vae(vae, latents), z, rtol=1e-5, atol=1e-5)


def test_decode_latents_to_uint8(tiny_parts) -> None:
    vae = tiny_parts.vae
    latents = torch.randn(2, 16, 8, 8, generator=torch.Generator().manual_seed(0))
    images = decode_latents(vae, latents)
    assert images.shape == (2, 3, 64, 64) and images.dtype == torch.uint8
    with torch.no_grad():
        decoded = vae.decode(latents / 0.3611 + 0.1159).sample.double()
    want = ((decoded / 2 + 0.5).clamp(0, 1) * 255).round()
    # float32 vs float64 rounding can move a pixel sitting on a .5 boundary by one level.
    assert (images.double() - want).abs().max() <= 1
    assert images.float().std() > 0


# ---------------------------------------------------------------------------- the prompt cache


class _CountingEncoder(torch.nn.Module):
    """The tiny text encoder, counting its forwards (a cache hit runs none)."""

    def __init__(self, inner: torch.nn.Module) -> None:
        super().__init__()
        self.inner = inner
        self.calls = 0

    @property
    def dtype(self) -> torch.dtype:
        return self.inner.dtype

    def forward(self, *args, **kwargs):
        self.calls += 1
        return self.inner(*args, **kwargs)


def test_a_cached_batch_is_bitwise_a_fresh_encode(tiny_parts) -> None:
    counting = _CountingEncoder(tiny_parts.text_encoder)
    cached = QwenPromptEncoder(counting, tiny_parts.processor)
    fresh = QwenPromptEncoder(tiny_parts.text_encoder, tiny_parts.processor, cache_entries=0)
    assert fresh.cache is None
    batches = [["a red circle", "two blue squares left of a cat"], [""], ["a red circle"]]
    first = [cached(batch, None) for batch in batches]
    assert counting.calls == 3 and cached.cache.misses == 3
    for batch, (hidden, mask) in zip(batches, first, strict=True):
        again_hidden, again_mask = cached(batch, None)  # a hit: no encoder forward
        want_hidden, want_mask = fresh(batch, None)
        assert torch.equal(again_hidden, want_hidden) and torch.equal(again_mask, want_mask)
        assert again_hidden is hidden and again_mask is mask  # the stored tensors themselves
    assert counting.calls == 3 and cached.cache.hits == 3
    # A prompt in another batch is not served from its first batch: its features there would differ
    # in the last bits (the padded length changes the kernels' summation order).
    hidden, _ = cached(["a red circle", "two blue squares left of a cat", "x"], None)
    assert counting.calls == 4
    assert torch.equal(hidden, fresh(["a red circle", "two blue squares left of a cat", "x"], None)[0])


def test_the_cache_key_changes_with_everything_the_features_depend_on(tiny_parts) -> None:
    encoder = QwenPromptEncoder(tiny_parts.text_encoder, tiny_parts.processor)
    image = _png(_noise_image(40, 72))
    base = encoder.cache_key(["a cat", ""], None)
    assert encoder.cache_key(["a cat", ""], None) == base
    assert encoder.cache_key(["a cat", None], [None, None]) == base  # None is "", no images is no image
    other_processor = copy.deepcopy(tiny_parts.processor)
    other_processor.chat_template = other_processor.chat_template + " "
    moved = copy.deepcopy(tiny_parts.text_encoder)
    variants = {
        "instruction": encoder.cache_key(["a dog", ""], None),
        "order": encoder.cache_key(["", "a cat"], None),
        "batch": encoder.cache_key(["a cat"], None),
        "image": encoder.cache_key(["a cat", ""], [image, None]),
        "template": QwenPromptEncoder(tiny_parts.text_encoder, other_processor).cache_key(
            ["a cat", ""], None
        ),
        "view": QwenPromptEncoder(
            tiny_parts.text_encoder, tiny_parts.processor, vlm_view="processor"
        ).cache_key(["a cat", ""], None),
        "weights": QwenPromptEncoder(moved, tiny_parts.processor).cache_key(["a cat", ""], None),
        "dtype": QwenPromptEncoder(copy.deepcopy(moved).double(), tiny_parts.processor).cache_key(
            ["a cat", ""], None
        ),
        "device": QwenPromptEncoder(copy.deepcopy(moved).to("meta"), tiny_parts.processor).cache_key(
            ["a cat", ""], None
        ),
    }
    assert all(key != base for key in variants.values()), [k for k, v in variants.items() if v == base]
    assert len(set(variants.values())) == len(variants)
    # An in-place change of the weights (a load, an accidental update) is a miss, then a fresh encode.
    tracked = QwenPromptEncoder(moved, tiny_parts.processor)
    before, _ = tracked(["a cat"], None)
    with torch.no_grad():
        moved.language_model.norm.weight.mul_(1.5)  # the text path's last norm (the first are the VLM's)
    after, _ = tracked(["a cat"], None)
    assert tracked.cache.hits == 0 and tracked.cache.misses == 2 and not torch.equal(before, after)
    want = QwenPromptEncoder(moved, tiny_parts.processor, cache_entries=0)(["a cat"], None)[0]
    assert torch.equal(after, want)


def test_a_hit_is_still_checked_against_the_length_limit(tiny_parts) -> None:
    encoder = QwenPromptEncoder(tiny_parts.text_encoder, tiny_parts.processor)
    _, mask = encoder(["a cat"], None)
    encoder.max_sequence_length = int(mask.sum()) - 1
    with pytest.raises(ValueError, match="max_sequence_length"):
        encoder(["a cat"], None)
    assert encoder.cache.hits == 1


def test_prompt_cache_is_a_bounded_lru() -> None:
    def tensors(n: int) -> tuple[torch.Tensor, ...]:
        return (torch.zeros(n, dtype=torch.float32), torch.zeros(n, dtype=torch.int64))  # 12 n bytes

    cache = PromptCache(max_entries=3, max_bytes=1200)
    for key in "abc":
        cache.put(key, tensors(10))
    assert cache.get("a") is not None  # a is now the most recently used: b, c, a
    cache.put("d", tensors(10))  # a fourth entry: b, the least recently used, goes
    assert [k in cache for k in "abcd"] == [True, False, True, True] and cache.bytes == 360
    cache.put("e", tensors(80))  # 960 bytes: c goes for the entry bound, which also fits 1200 bytes
    assert [k in cache for k in "acde"] == [True, False, True, True] and cache.bytes == 1200
    cache.put("f", tensors(20))  # 240 more bytes: a and then d go until the bytes fit
    assert [k in cache for k in "adef"] == [False, False, True, True] and cache.bytes == 1200
    cache.put("huge", tensors(101))  # 1212 bytes, more than the whole cache: never kept
    assert "huge" not in cache and len(cache) == 2 and cache.bytes == 1200
    old = cache.get("e")
    cache.put("e", tensors(5))  # a new value replaces the old one and its bytes
    assert cache.get("e") is not old and cache.bytes == 240 + 60
    assert (cache.hits, cache.misses) == (3, 0)
    assert cache.get("a") is None and cache.misses == 1
    cache.clear()
    assert len(cache) == 0 and cache.bytes == 0
    with pytest.raises(ValueError, match="max_entries"):
        PromptCache(max_entries=0, max_bytes=1)
    with pytest.raises(ValueError, match="cache_entries"):
        QwenPromptEncoder(None, None, cache_entries=-1)


def test_the_encoder_cache_stays_within_its_bounds(tiny_parts) -> None:
    encoder = QwenPromptEncoder(tiny_parts.text_encoder, tiny_parts.processor, cache_entries=2)
    for text in ("a", "b", "c", "a"):
        encoder([text], None)
    # a, b, c miss; a was evicted by c (two entries kept), so the last a misses again.
    assert (encoder.cache.hits, encoder.cache.misses, len(encoder.cache)) == (0, 4, 2)
    hidden, mask = encoder(["a"], None)
    size = hidden.numel() * hidden.element_size() + mask.numel() * mask.element_size()
    small = QwenPromptEncoder(tiny_parts.text_encoder, tiny_parts.processor, cache_bytes=size - 1)
    small(["a"], None)
    small(["a"], None)
    assert len(small.cache) == 0 and small.cache.misses == 2  # too big to keep: encoded each time
