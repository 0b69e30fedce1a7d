"""``ocr``: the reference's OCR score, read by a local OCR engine (RapidOCR on onnxruntime).

RapidOCR ships its detector and recogniser models inside the wheel (PP-OCRv6 det/rec, about
30 MB) and never downloads them when they are present, so the reward runs offline. It is imported
lazily: importing the rewards package costs nothing when OCR is not used.
"""

from __future__ import annotations

import logging
import threading
from typing import Any

import numpy as np
import torch

from boogu_trainer.rewards.base import RewardError, TranscriptionReward, check_on_error, images_to_numpy
from boogu_trainer.rewards.registry import register_reward

__all__ = ["OcrReward", "ocr_engine"]

logger = logging.getLogger(__name__)

_ENGINES: dict[tuple[int, float, int], Any] = {}
_ENGINES_LOCK = threading.Lock()


def ocr_engine(det_limit_side_len: int = 512, min_confidence: float = 0.5, num_threads: int = 2) -> Any:
    """The process-wide RapidOCR engine for these settings, created on first use and then reused.

    * ``det_limit_side_len``: the detector sees the image resized so that its *longer* side is at
      most this (``limit_type="max"``). RapidOCR's default (shorter side scaled *up* to 736) makes
      a 64-px strip cost seconds per image; 512 keeps a 512² image at ~0.1–1 s on two cores.
    * ``min_confidence``: recognised lines below this confidence are dropped (RapidOCR's
      ``text_score``; 0.5 is also PaddleOCR's ``drop_score``, which flow_grpo's OCR reward used).
    * ``num_threads``: onnxruntime intra-op threads; small, because the trainer's torch threads
      share the same cores.
    """
    key = (int(det_limit_side_len), float(min_confidence), int(num_threads))
    with _ENGINES_LOCK:
        engine = _ENGINES.get(key)
        if engine is None:
            from rapidocr import RapidOCR  # ~3 s import: only when OCR is really used

            engine = RapidOCR(
                params={
                    "Det.limit_type": "max",
                    "Det.limit_side_len": key[0],
                    "Global.text_score": key[1],
                    # Generated images are upright; the angle classifier would only cost time.
                    "Global.use_cls": False,
                    # "error", not "warning": RapidOCR warns on every image without text, which
                    # early in training is most of them.
                    "Global.log_level": "error",
                    "EngineConfig.onnxruntime.intra_op_num_threads": key[2],
                    "EngineConfig.onnxruntime.inter_op_num_threads": 1,
                }
            )
            _ENGINES[key] = engine
        return engine


@register_reward("ocr")
class OcrReward(TranscriptionReward):
    """How well the image shows ``record.ground_truth``, read by a local OCR engine.

    Measures: 1 - normalised edit distance between the recognised text and the ground truth (case
    and whitespace folded, ground truth contained -> 1), the reference's OCR score
    (`ocr_text_score`); an image where no text is found scores 0.
    Range: [0, 1].
    Cost: one RapidOCR pass per image on the CPU: ~0.2–0.3 s for a 256×64 text strip and
    ~0.4–0.8 s for a 512² image on two busy shared cores; the engine loads once per process
    (~2.5 s, import and models).
    """

    name = "ocr"

    def __init__(
        self,
        *,
        det_limit_side_len: int = 512,
        min_confidence: float = 0.5,
        num_threads: int = 2,
        on_error: str = "raise",
    ) -> None:
        if (
            isinstance(det_limit_side_len, bool)
            or not isinstance(det_limit_side_len, int)
            or det_limit_side_len < 32
        ):
            raise ValueError(f"ocr: det_limit_side_len must be an int >= 32, got {det_limit_side_len!r}")
        if (
            isinstance(min_confidence, bool)
            or not isinstance(min_confidence, int | float)
            or not 0 <= min_confidence <= 1
        ):
            raise ValueError(f"ocr: min_confidence must be in [0, 1], got {min_confidence!r}")
        if isinstance(num_threads, bool) or not isinstance(num_threads, int) or num_threads < 1:
            raise ValueError(f"ocr: num_threads must be an int >= 1, got {num_threads!r}")
        self.det_limit_side_len = det_limit_side_len
        self.min_confidence = float(min_confidence)
        self.num_threads = num_threads
        self.on_error = check_on_error(on_error, self.name)

    def transcribe(self, images: torch.Tensor) -> list[str | None]:
        """The text recognised in each ``(3, H, W)`` uint8 image ("" when none is found).

        A sample whose OCR pass raised is None when ``on_error="nan"``; with ``"raise"`` the error
        is re-raised as `RewardError` naming the sample.
        """
        engine = ocr_engine(self.det_limit_side_len, self.min_confidence, self.num_threads)
        texts: list[str | None] = []
        for i, rgb in enumerate(images_to_numpy(images)):
            # RapidOCR takes a NumPy image as OpenCV's BGR (it only converts PIL/paths from RGB).
            bgr = np.ascontiguousarray(rgb[..., ::-1])
            try:
                result = engine(bgr)
            except Exception as error:
                if self.on_error == "raise":
                    raise RewardError(f"ocr: the OCR engine failed on sample {i}: {error!r}") from error
                logger.warning("ocr: the OCR engine failed on sample %d (scored NaN): %r", i, error)
                texts.append(None)
                continue
            # Lines come sorted top-to-bottom, left-to-right; the joiner does not matter to the
            # score, which drops whitespace.
            texts.append(" ".join(result.txts) if result.txts else "")
        return texts
