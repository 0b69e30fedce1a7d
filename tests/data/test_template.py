"""The Boogu chat template: byte-exact system prompts, the selection rule, and the rendered ChatML."""

from __future__ import annotations

import hashlib

import pytest
from hypothesis import example, given
from hypothesis import strategies as st

from boogu_data import (
    SYSTEM_PROMPT_T2I,
    SYSTEM_PROMPT_TI2I,
    PromptRecord,
    build_messages,
    render_text,
    select_system_prompt,
)
from boogu_data.template import SYSTEM_PROMPT_DROP
from tests.data.helpers import REF_T2I, REF_TI2I
from tests.data.strategies import non_empty_texts, whitespace_texts

T2I_SHA256 = "1c3cf6989807dc33333dd5e5d711673562f39ae3f5974ad9556d609bf3944e9b"
TI2I_SHA256 = "4b2e8ed6183d7c55a3cc9af5fd0f051ffe6afff4a84e41c1ba706380e24b8862"


@pytest.mark.parametrize(
    ("prompt", "length", "digest"),
    [(SYSTEM_PROMPT_T2I, 123, T2I_SHA256), (SYSTEM_PROMPT_TI2I, 304, TI2I_SHA256)],
    ids=["t2i", "ti2i"],
)
def test_system_prompts_are_byte_exact(prompt: str, length: int, digest: str) -> None:
    assert prompt.isascii()
    assert len(prompt) == length
    assert hashlib.sha256(prompt.encode("ascii")).hexdigest() == digest


def test_drop_prompt_is_the_ti2i_prompt() -> None:
    # Upstream's SYSTEM_PROMPT_DROP (what the empty negative gets) is the TI2I text, not a third one.
    assert SYSTEM_PROMPT_DROP == SYSTEM_PROMPT_TI2I
    assert (REF_T2I, REF_TI2I) == (SYSTEM_PROMPT_T2I, SYSTEM_PROMPT_TI2I)


# The four cells of upstream's per-encoding table (docs/upstream-model.md §9.2).
@pytest.mark.parametrize(
    ("instruction", "images", "expected"),
    [
        ("a red sign that says STOP", 0, SYSTEM_PROMPT_T2I),
        ("", 0, SYSTEM_PROMPT_TI2I),  # the quirk: the default negative of a pure T2I run
        ("make the sign say GO", 1, SYSTEM_PROMPT_TI2I),
        ("", 1, SYSTEM_PROMPT_TI2I),
    ],
    ids=["text-no-image", "empty-no-image", "text-image", "empty-image"],
)
def test_selection_table(instruction: str, images: int, expected: str) -> None:
    assert select_system_prompt(instruction, has_images=images > 0) == expected
    messages = build_messages(instruction, images)
    assert messages[0] == {"role": "system", "content": [{"type": "text", "text": expected}]}


@given(whitespace_texts(), st.integers(min_value=0, max_value=2))
@example(" ", 0)  # upstream's default empty_instruction
@example("\u3000\u2028\x1c", 0)  # Unicode whitespace that str.strip() removes
def test_whitespace_only_instructions_count_as_empty(instruction: str, images: int) -> None:
    assert build_messages(instruction, images)[0]["content"][0]["text"] == SYSTEM_PROMPT_TI2I
    # The text itself is kept as given: only the system prompt choice treats it as empty.
    assert build_messages(instruction, images)[1]["content"][-1] == {"type": "text", "text": instruction}


@given(non_empty_texts())
def test_non_empty_instruction_takes_t2i_only_without_images(instruction: str) -> None:
    assert select_system_prompt(instruction, has_images=False) == SYSTEM_PROMPT_T2I
    assert select_system_prompt(instruction, has_images=True) == SYSTEM_PROMPT_TI2I


def test_none_instruction_is_empty() -> None:
    messages = build_messages(None)
    assert messages[0]["content"][0]["text"] == SYSTEM_PROMPT_TI2I
    assert messages[1]["content"] == [{"type": "text", "text": ""}]


def test_images_come_before_the_text_and_no_generation_prompt() -> None:
    messages = build_messages("swap the words", ["first", "second"])
    assert [m["role"] for m in messages] == ["system", "user"]
    assert messages[1]["content"] == [
        {"type": "image", "image": "first"},
        {"type": "image", "image": "second"},
        {"type": "text", "text": "swap the words"},
    ]
    assert build_messages("x", 2)[1]["content"][:2] == [{"type": "image"}, {"type": "image"}]


def test_build_messages_returns_fresh_lists() -> None:
    first = build_messages("a")
    first[1]["content"].append({"type": "text", "text": "mutated"})
    assert build_messages("a")[1]["content"] == [{"type": "text", "text": "a"}]


@pytest.mark.parametrize("images", [-1, True, "two", b"png"])
def test_build_messages_rejects_bad_image_arguments(images: object) -> None:
    with pytest.raises((TypeError, ValueError)):
        build_messages("a", images)  # type: ignore[arg-type]


# Full rendered text, pinned literally: what the Qwen3-VL template yields for Boogu's messages.
T2I_INSTRUCTION = 'A bakery window with a sign that says "Fresh Bread"'
EDIT_INSTRUCTION = 'Change the text on the sign to "CLOSED"'


def test_render_t2i_row() -> None:
    text = render_text(build_messages(T2I_INSTRUCTION))
    assert text == (
        "<|im_start|>system\n"
        "You are a helpful assistant that generates high-quality images based on user instructions. "
        "The instructions are as follows.<|im_end|>\n"
        "<|im_start|>user\n"
        'A bakery window with a sign that says "Fresh Bread"<|im_end|>\n'
    )


def test_render_t2i_negative() -> None:
    assert render_text(build_messages("")) == (
        "<|im_start|>system\n"
        "Describe the key features of the input image (color, shape, size, texture, objects, background), "
        "then explain how the user's text instruction should alter or modify the image. Generate a new image "
        "that meets the user's requirements while maintaining consistency with the original input where "
        "appropriate.<|im_end|>\n"
        "<|im_start|>user\n"
        "<|im_end|>\n"
    )


def test_render_edit_row() -> None:
    assert render_text(build_messages(EDIT_INSTRUCTION, 1)) == (
        f"<|im_start|>system\n{REF_TI2I}<|im_end|>\n"
        '<|im_start|>user\n<image>Change the text on the sign to "CLOSED"<|im_end|>\n'
    )


def test_render_edit_negative() -> None:
    # Negatives are encoded text-only, so the edit negative has no image item at all.
    record = PromptRecord(EDIT_INSTRUCTION, ref_image=b"\x89PNG")
    assert render_text(record.negative_messages()) == (
        f"<|im_start|>system\n{REF_TI2I}<|im_end|>\n<|im_start|>user\n<|im_end|>\n"
    )
    assert render_text(record.messages()) == render_text(build_messages(EDIT_INSTRUCTION, 1))


def test_render_with_vision_tokens_and_string_content() -> None:
    vision = "<|vision_start|><|image_pad|><|vision_end|>"
    text = render_text(build_messages("hi", 1), image_token=vision)
    assert text.endswith(f"<|im_start|>user\n{vision}hi<|im_end|>\n")
    # The parquet layout stores content as one string; it renders as is.
    parquet_style = [{"role": "system", "content": "S"}, {"role": "user", "content": "<image>hi"}]
    assert (
        render_text(parquet_style)
        == "<|im_start|>system\nS<|im_end|>\n<|im_start|>user\n<image>hi<|im_end|>\n"
    )


@pytest.mark.parametrize(
    "messages",
    [
        [{"role": "assistant", "content": "no"}],
        [{"role": "system", "content": [{"type": "image"}]}],
        [{"role": "user", "content": [{"type": "video", "video": "v"}]}],
        [{"role": "user", "content": None}],
    ],
    ids=["assistant-turn", "image-in-system", "unknown-item", "null-content"],
)
def test_render_rejects_what_boogu_never_encodes(messages: list) -> None:
    with pytest.raises(ValueError, match="message 0"):
        render_text(messages)
