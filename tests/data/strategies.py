"""Hypothesis strategies for boogu-data tests: prompt text, small reference images, records.

Kept beside the data tests (not in tests/strategies.py, which holds the tensor strategies) so the
two can evolve without conflicts.
"""

from __future__ import annotations

import io

from hypothesis import strategies as st
from PIL import Image

from boogu_data import IMAGE_PLACEHOLDER, PromptRecord

# Every character Python's str.strip() removes; all of them lie below U+3001.
WHITESPACE = "".join(chr(code) for code in range(0x3001) if chr(code).isspace())

# Text that has broken converters and templates before: quotes, line breaks, right-to-left and CJK
# scripts, emoji, NUL, Unicode whitespace, and the reference's "Picture 1: " prefix.
TRICKY_TEXTS = [
    "",
    " ",
    "\u3000\t\n",
    'A neon sign that says "OPEN 24/7"',
    'He said "\u201cquoted\u201d" and "again"',
    "line one\nline two\r\nline three",
    "\u0645\u0631\u062d\u0628\u0627 \u0628\u0627\u0644\u0639\u0627\u0644\u0645",  # Arabic
    "\u4e00\u5f35\u5beb\u8457\u300c\u6b61\u8fce\u300d\u7684\u62db\u724c",  # CJK
    "\U0001f600 emoji \u200d zero-width joiner",
    "NUL\x00inside",
    "Picture 1: not an image",
]


def prompt_texts(max_size: int = 60) -> st.SearchStrategy[str]:
    """Any Unicode text a prompt can hold (no surrogates, no literal image placeholder)."""
    return st.one_of(st.sampled_from(TRICKY_TEXTS), st.text(max_size=max_size)).filter(
        lambda text: IMAGE_PLACEHOLDER not in text
    )


def whitespace_texts() -> st.SearchStrategy[str]:
    """Empty or whitespace-only text: upstream treats it as an empty instruction."""
    return st.text(alphabet=WHITESPACE, max_size=8)


def non_empty_texts() -> st.SearchStrategy[str]:
    """Text with at least one non-whitespace character."""
    return prompt_texts().filter(lambda text: text.strip() != "")


@st.composite
def small_images(draw: st.DrawFn) -> bytes:
    """An encoded image with sides in {16, 32, 48} and random pixels, as PNG (any mode) or JPEG."""
    width = draw(st.sampled_from([16, 32, 48]))
    height = draw(st.sampled_from([16, 32, 48]))
    mode = draw(st.sampled_from(["RGB", "L", "RGBA"]))
    bands = len(mode)
    pixels = draw(st.binary(min_size=width * height * bands, max_size=width * height * bands))
    image = Image.frombytes(mode, (width, height), pixels)
    image_format = draw(st.sampled_from(["PNG", "JPEG"])) if mode != "RGBA" else "PNG"
    buffer = io.BytesIO()
    image.save(buffer, format=image_format)
    return buffer.getvalue()


@st.composite
def prompt_records(draw: st.DrawFn, kind: str = "t2i") -> PromptRecord:
    """A valid record of ``kind``: arbitrary text fields, an image only for ``"edit"``."""
    return PromptRecord(
        instruction=draw(prompt_texts()),
        negative=draw(prompt_texts(max_size=20)),
        ground_truth=draw(prompt_texts(max_size=20)),
        data_source=draw(st.sampled_from(["flow_grpo/ocr", "flow_grpo/ocr_edit", ""]) | st.text(max_size=10)),
        ability=draw(st.sampled_from(["ocr", "image_edit", ""])),
        ref_image=draw(small_images()) if kind == "edit" else None,
        split=draw(st.sampled_from(["train", "test"]) | st.text(max_size=8)),
        index=draw(st.integers(min_value=0, max_value=2**62)),
    )
