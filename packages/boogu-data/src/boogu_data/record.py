"""`PromptRecord`: one prompt of a dataset, as the trainer consumes it."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from boogu_data.template import IMAGE_PLACEHOLDER, Message, build_messages

__all__ = ["DatasetKind", "PromptRecord"]

DatasetKind = Literal["t2i", "edit"]


@dataclass(frozen=True, slots=True)
class PromptRecord:
    """One prompt: what to encode, what to reward, and where it came from.

    The system prompts are not stored: they follow from the instruction and the image by upstream's
    rule, so :meth:`messages` and :meth:`negative_messages` rebuild them (readers check that a file's
    system prompts agree with the rule).
    """

    instruction: str
    """The user's text, without any image placeholder."""
    negative: str = ""
    """The negative instruction for text CFG; upstream's default is ``""``."""
    ground_truth: str = ""
    """What the reward compares against (for OCR: the text the image must show)."""
    data_source: str = ""
    """Dataset name; rewards are dispatched on it (e.g. ``"flow_grpo/ocr"``)."""
    ability: str = ""
    """Task label carried by the reference layout (``"ocr"``, ``"image_edit"``)."""
    ref_image: bytes | None = field(default=None, repr=False)
    """Encoded reference image (PNG, JPEG, ...) for an edit prompt; None for text-to-image."""
    split: str = "train"
    """Dataset split this row belongs to."""
    index: int = 0
    """Row index within its split, as written by the converter."""

    def __post_init__(self) -> None:
        for name in ("instruction", "negative", "ground_truth", "data_source", "ability", "split"):
            value = getattr(self, name)
            if not isinstance(value, str):
                raise TypeError(f"PromptRecord.{name} must be a str, got {type(value).__name__}")
            _check_utf8(name, value)
        for name in ("instruction", "negative"):
            # A literal placeholder in the text could not be told apart from an image item once
            # written, so it is refused rather than silently turned into one.
            if IMAGE_PLACEHOLDER in getattr(self, name):
                raise ValueError(
                    f"PromptRecord.{name} must not contain the image placeholder {IMAGE_PLACEHOLDER!r}; "
                    "pass the image as ref_image"
                )
        if self.ref_image is not None and (not isinstance(self.ref_image, bytes) or not self.ref_image):
            raise TypeError("PromptRecord.ref_image must be non-empty bytes or None")
        if isinstance(self.index, bool) or not isinstance(self.index, int) or self.index < 0:
            raise ValueError(f"PromptRecord.index must be an int >= 0, got {self.index!r}")

    @property
    def kind(self) -> DatasetKind:
        """``"edit"`` when the record carries a reference image, else ``"t2i"``."""
        return "t2i" if self.ref_image is None else "edit"

    def messages(self, image: object = None) -> list[Message]:
        """Chat messages for the positive encoding (the reference image, if any, then the text).

        ``image`` puts the caller's decoded reference image (e.g. a PIL image) into the image item;
        without it the item is a bare placeholder.
        """
        if self.ref_image is None:
            if image is not None:
                raise ValueError("this record has no reference image; image must be None")
            return build_messages(self.instruction, 0)
        return build_messages(self.instruction, 1 if image is None else [image])

    def negative_messages(self) -> list[Message]:
        """Chat messages for the negative encoding, always text-only (docs/conventions.md, item 3)."""
        return build_messages(self.negative, 0)


def _check_utf8(name: str, value: str) -> None:
    # Parquet strings are UTF-8; a lone surrogate would only fail later, deep inside pyarrow.
    if value.isascii():
        return
    try:
        value.encode("utf-8")
    except UnicodeEncodeError as error:
        raise ValueError(f"PromptRecord.{name} is not valid Unicode text: {error}") from None
