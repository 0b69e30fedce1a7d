"""The Boogu chat template: upstream's two system prompts, its selection rule, and ChatML rendering.

Boogu-Image encodes every instruction (positive, negative, empty) as a two-turn Qwen3-VL chat: a
system turn holding one of two fixed prompts, and a user turn holding the reference images first and
then the instruction text. Which system prompt is used is decided per encoding by upstream's
``BooguImagePipeline._apply_chat_template`` under the pipeline default
``system_prompt_follows_task_type=False`` (docs/upstream-model.md §9.2):

=========================  ====================  ==============
images in this encoding?   instruction empty?    system prompt
=========================  ====================  ==============
no                         no                    T2I
no                         yes                   TI2I
yes                        no                    TI2I
yes                        yes                   TI2I
=========================  ====================  ==============

The second row is the *empty-instruction quirk*: the default negative ``""`` of a pure text-to-image
run is encoded with the image-editing (TI2I) system prompt. It is deliberate here. The released
model was trained and is sampled this way, and a template that differs from it shifts the prompt
embedding distribution and collapses OCR rewards. Do not "fix" it.

"Empty" means ``instruction is None or instruction.strip() == ""``, exactly Python's ``str.strip``
as upstream calls it, so whitespace-only instructions (including Unicode whitespace) count as empty.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, Final

__all__ = [
    "IMAGE_PLACEHOLDER",
    "SYSTEM_PROMPT_DROP",
    "SYSTEM_PROMPT_T2I",
    "SYSTEM_PROMPT_TI2I",
    "build_messages",
    "is_empty_instruction",
    "render_text",
    "select_system_prompt",
]

# Verbatim from upstream `BooguImagePipeline.__init__` (`SYSTEM_PROMPT_4_T2I_UNIFIED`), ASCII,
# 123 characters, sha256 1c3cf698...4e9b. Tests pin the length and the digest.
SYSTEM_PROMPT_T2I: Final[str] = (
    "You are a helpful assistant that generates high-quality images based on user instructions. "
    "The instructions are as follows."
)

# Verbatim from upstream (`SYSTEM_PROMPT_4_TI2I_UNIFIED`), ASCII, 304 characters,
# sha256 4b2e8ed6...8862. Upstream's SYSTEM_PROMPT_DROP, SYSTEM_PROMPT_4_TI2I and
# SYSTEM_PROMPT_4_I2I are all this same string.
SYSTEM_PROMPT_TI2I: Final[str] = (
    "Describe the key features of the input image (color, shape, size, texture, objects, background), "
    "then explain how the user's text instruction should alter or modify the image. Generate a new "
    "image that meets the user's requirements while maintaining consistency with the original input "
    "where appropriate."
)

# Upstream's name for the prompt an empty instruction gets; the same text as SYSTEM_PROMPT_TI2I.
SYSTEM_PROMPT_DROP: Final[str] = SYSTEM_PROMPT_TI2I

# How an image item appears in text: in the user turn of a parquet row (the reference integration's
# and verl's convention) and in `render_text` output.
IMAGE_PLACEHOLDER: Final[str] = "<image>"

Message = dict[str, Any]


def is_empty_instruction(instruction: str | None) -> bool:
    """True when upstream treats ``instruction`` as empty: None, ``""`` or whitespace only."""
    return instruction is None or instruction.strip() == ""


def select_system_prompt(instruction: str | None, has_images: bool) -> str:
    """The system prompt upstream Boogu uses for one encoding (see the module docstring's table).

    Only a non-empty instruction encoded without images takes the T2I prompt; everything else,
    including the empty default negative of a T2I run, takes the TI2I prompt.
    """
    if not has_images and not is_empty_instruction(instruction):
        return SYSTEM_PROMPT_T2I
    return SYSTEM_PROMPT_TI2I


def build_messages(instruction: str | None, images: int | Sequence[Any] = 0) -> list[Message]:
    """Boogu chat messages for one encoding, in the form ``processor.apply_chat_template`` takes.

    Args:
        instruction: the user's text; None is treated as ``""`` (upstream does the same).
        images: how many reference images this encoding carries, or the images themselves (PIL
            images, bytes, anything the caller's processor accepts). Given a count, the image items
            are bare ``{"type": "image"}`` placeholders, enough for :func:`render_text`.

    Returns:
        ``[system, user]``. The user content lists the images first, then one text item, as upstream
        does. No assistant turn or generation prompt is added: upstream tokenises with the default
        ``add_generation_prompt=False``.
    """
    if isinstance(images, bool) or not isinstance(images, int | Sequence) or isinstance(images, str | bytes):
        raise TypeError(f"images must be a count or a sequence of images, got {type(images).__name__}")
    if isinstance(images, int):
        if images < 0:
            raise ValueError(f"images must be >= 0, got {images}")
        image_items: list[dict[str, Any]] = [{"type": "image"} for _ in range(images)]
    else:
        image_items = [{"type": "image", "image": image} for image in images]
    if instruction is not None and not isinstance(instruction, str):
        raise TypeError(f"instruction must be a str or None, got {type(instruction).__name__}")
    text = "" if instruction is None else instruction
    system = select_system_prompt(text, has_images=bool(image_items))
    return [
        {"role": "system", "content": [{"type": "text", "text": system}]},
        {"role": "user", "content": [*image_items, {"type": "text", "text": text}]},
    ]


def render_text(messages: Sequence[Mapping[str, Any]], *, image_token: str = IMAGE_PLACEHOLDER) -> str:
    """Render system/user messages as the ChatML text the Qwen3-VL chat template produces.

    Each turn becomes ``<|im_start|>{role}\\n{content}<|im_end|>\\n``; text items are concatenated
    as they are, and each image item becomes ``image_token``. With the default ``"<image>"`` this
    pins the full prompt text in tests without a tokenizer; pass
    ``"<|vision_start|><|image_pad|><|vision_end|>"`` for what the real template emits before the
    processor expands the image pads. Content may also be a plain string (the parquet layout).
    No generation prompt is appended, matching upstream's encoding.

    Raises:
        ValueError: for roles other than system and user (Boogu never encodes them), image items in
            a system turn, or content items that are neither text nor image.
    """
    parts: list[str] = []
    for position, message in enumerate(messages):
        role = message.get("role")
        if role not in ("system", "user"):
            raise ValueError(f"message {position}: role must be 'system' or 'user', got {role!r}")
        content = message.get("content")
        if isinstance(content, str):
            body = content
        elif isinstance(content, Sequence):
            body = "".join(_render_item(item, role, position, image_token) for item in content)
        else:
            raise ValueError(
                f"message {position}: content must be a string or a list of items, got {type(content).__name__}"
            )
        parts.append(f"<|im_start|>{role}\n{body}<|im_end|>\n")
    return "".join(parts)


def _render_item(item: Mapping[str, Any], role: str, position: int, image_token: str) -> str:
    # Same tests as the Qwen3-VL template: an item is an image if its type says so or it carries an
    # "image" key, otherwise text if it carries "text".
    if item.get("type") == "image" or "image" in item:
        if role == "system":
            raise ValueError(f"message {position}: image items are only allowed in the user turn")
        return image_token
    if "text" in item:
        text = item["text"]
        if not isinstance(text, str):
            raise ValueError(f"message {position}: text item must hold a str, got {type(text).__name__}")
        return text
    raise ValueError(f"message {position}: content item must be text or image, got keys {sorted(item)}")
