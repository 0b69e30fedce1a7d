"""A Qwen3-VL processor without the video processor, so it works where torchvision does not.

Checkpoints name transformers' stock ``Qwen3VLProcessor`` (``model_index.json`` and the
``processor_class`` of every file in ``processor/``), and the tiny checkpoint writes the same
files. Without torchvision transformers 5.x cannot build that class at all: its
``from_pretrained`` resolves the video processor through ``AutoVideoProcessor``, whose Qwen
entries are torchvision-only (``transformers.Qwen3VLVideoProcessor`` is a placeholder that
raises), and even ``Qwen3VLProcessor(image_processor, tokenizer, None)`` fails, because
``ProcessorMixin.__init__`` type-checks every sub-processor against ``VideoProcessorMixin``, which
transformers exports only when torchvision is installed.

Boogu never encodes video, so this subclass drops the video processor from its signature
(``ProcessorMixin`` loads and checks only the sub-processors its ``__init__`` names) and keeps the
tokenizer, the image processor (``Qwen2VLImageProcessorPil`` when torchvision is missing) and the
chat template. It loads the released folder as is, ignoring ``video_preprocessor_config.json``;
token ids, pixel values and grids are exactly the stock processor's. Nothing is registered with
the Auto classes and nothing is written into checkpoints.
"""

from __future__ import annotations

from typing import Any

from transformers import Qwen3VLProcessor

__all__ = ["ImageOnlyQwen3VLProcessor"]


class ImageOnlyQwen3VLProcessor(Qwen3VLProcessor):
    """``Qwen3VLProcessor`` with ``video_processor=None`` (no torchvision needed)."""

    def __init__(
        self, image_processor: Any = None, tokenizer: Any = None, chat_template: Any = None, **kwargs
    ):
        # ProcessorMixin derives the sub-processors it loads and saves from this signature, so
        # leaving video_processor out of it keeps from_pretrained from ever building one.
        kwargs.pop("video_processor", None)
        super().__init__(image_processor, tokenizer, None, chat_template=chat_template, **kwargs)
        self.video_processor = None
