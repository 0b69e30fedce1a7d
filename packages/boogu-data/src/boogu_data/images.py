"""Reference-image rules: what a stored image must satisfy, and the edit converter's letterboxing.

Boogu generates an edit at the reference's own size (upstream ``align_res``, docs/upstream-model.md
§9.6), and its VAE path floors sides to multiples of 16 and caps the area at 2048². A stored
reference that already satisfies both is used as it is, so the trained resolution is the one in the
file rather than a silently resized one.
"""

from __future__ import annotations

import io
import warnings
from typing import Final

from PIL import Image, ImageOps

__all__ = ["MAX_IMAGE_PIXELS", "SIZE_MULTIPLE", "check_image", "letterbox_png", "size_problem"]

SIZE_MULTIPLE: Final[int] = 16
"""Image sides must be multiples of this (VAE factor 8 times patch size 2)."""
MAX_IMAGE_PIXELS: Final[int] = 2048 * 2048
"""Largest image area Boogu generates at (upstream ``max_input_image_pixels`` default)."""


def check_image(data: bytes, *, decode: bool = True) -> tuple[int, int]:
    """Check Boogu's size rules on encoded image bytes and, by default, decode them fully.

    The size is checked from the header before any pixel is decoded, so an oversized image (or a
    decompression bomb) is refused without being loaded. With ``decode=False`` only the header is
    read: truncated or corrupt pixel data then goes unnoticed until the caller decodes it.

    Returns:
        ``(width, height)``.

    Raises:
        ValueError: the bytes are not a decodable image, or a side is not a multiple of 16, or the
            area is over 2048².
    """
    try:
        with warnings.catch_warnings():
            # Pillow warns on large images; our own area limit below is much stricter.
            warnings.simplefilter("ignore", Image.DecompressionBombWarning)
            with Image.open(io.BytesIO(data)) as image:
                width, height = image.size
                problem = size_problem(width, height)
                if problem is None and decode:
                    image.load()
    except (OSError, SyntaxError, ValueError, Image.DecompressionBombError) as error:
        raise ValueError(f"not a decodable image ({type(error).__name__}: {error})") from None
    if problem is not None:
        raise ValueError(problem)
    return width, height


def size_problem(width: int, height: int) -> str | None:
    """Why a ``width``×``height`` image breaks Boogu's size rules, or None when it does not."""
    if width <= 0 or height <= 0 or width % SIZE_MULTIPLE or height % SIZE_MULTIPLE:
        return f"image is {width}x{height}; both sides must be positive multiples of {SIZE_MULTIPLE}"
    if width * height > MAX_IMAGE_PIXELS:
        return f"image is {width}x{height} = {width * height} pixels; the area must be at most 2048x2048"
    return None


def letterbox_png(image: Image.Image, size: int) -> bytes:
    """Fit ``image`` inside a white ``size``×``size`` square, centred, and return it as PNG bytes.

    The reference edit converter does the same (RGB, fit with LANCZOS, paste centred on white):
    one fixed square pins every sample of a run to one output resolution, which batching needs.
    We also apply the EXIF orientation first, as upstream's ``inference.py`` does, so a phone photo
    is used the way it is displayed.
    """
    if size <= 0 or size % SIZE_MULTIPLE or size * size > MAX_IMAGE_PIXELS:
        raise ValueError(f"size must be a positive multiple of {SIZE_MULTIPLE} and at most 2048, got {size}")
    image = ImageOps.exif_transpose(image).convert("RGB")
    fitted = ImageOps.contain(image, (size, size), method=Image.Resampling.LANCZOS)
    canvas = Image.new("RGB", (size, size), (255, 255, 255))
    canvas.paste(fitted, ((size - fitted.width) // 2, (size - fitted.height) // 2))
    buffer = io.BytesIO()
    # No metadata is written and zlib is deterministic, so the same pixels give the same bytes.
    canvas.save(buffer, format="PNG")
    return buffer.getvalue()
