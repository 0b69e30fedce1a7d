"""A Qwen3-VL processor without the video processor, so it works where torchvision does not.

transformers' stock ``Qwen3VLProcessor`` always builds a video processor, and every Qwen3-VL video
processor needs torchvision. Boogu never encodes video, so this subclass drops it and keeps the
tokenizer, the image processor (``Qwen2VLImageProcessorPil`` when torchvision is missing) and the
chat template. Token ids, pixel values and grids are exactly the stock processor's.

This file is self-contained on purpose (it imports only transformers): the tiny-checkpoint builder
registers the class for ``AutoProcessor``, which copies this very file into the checkpoint's
``processor/`` folder so that ``AutoProcessor.from_pretrained(..., trust_remote_code=True)`` works
for third-party loaders too. :func:`boogu_adapters.loading.load_processor` never needs that: it
uses the class directly and executes nothing from the checkpoint.
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


ImageOnlyQwen3VLProcessor.register_for_auto_class("AutoProcessor")
