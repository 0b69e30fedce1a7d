"""The reward seam: the `RewardFn` protocol, its error type, and the checks every reward shares.

A reward maps a batch of decoded images and the prompt records they were generated from to one
float32 score per image::

    images  (B, 3, H, W) torch.uint8, RGB, CPU
    records Sequence[PromptRecord], len B (record i produced image i)
    ->      (B,) torch.float32, CPU

A reward never replaces a non-finite score by a number: NaN/inf travel to
:class:`~boogu_trainer.rewards.composite.WeightedRewards`, which reports them per sample so the
loop can drop those samples' advantages and count the failures (docs/reliability.md).
"""

from __future__ import annotations

import abc
from collections.abc import Sequence
from typing import Literal, Protocol, runtime_checkable

import numpy as np
import torch

from boogu_data import PromptRecord
from boogu_trainer.rewards.text_score import ocr_text_score

__all__ = [
    "OnError",
    "RewardError",
    "RewardFn",
    "TranscriptionReward",
    "check_batch",
    "check_on_error",
    "images_to_numpy",
    "scores_tensor",
]

OnError = Literal["raise", "nan"]
"""What a reward does when one sample cannot be scored: raise `RewardError`, or score it NaN."""


class RewardError(RuntimeError):
    """A reward could not be computed: an endpoint still failing after its retries, an OCR engine
    error, or a reward function whose output is not one finite-or-not float per image."""


@runtime_checkable
class RewardFn(Protocol):
    """One named reward: ``reward(images, records) -> scores``.

    ``images`` is ``(B, 3, H, W)`` uint8 RGB on the CPU, ``records`` the B prompt records the images
    were generated from, and the result a ``(B,)`` float32 CPU tensor. Scores may be NaN/inf for a
    sample that could not be scored; they are reported, never silently replaced.

    A reward may also set ``pass_fail = True`` when its scores are only 0 or 1 (a verifier's
    verdict, as ``scene_exact``): the preflight then reads a probe on which every image got the same
    verdict as the sparseness such a reward has on a few few-step images, not as a broken reward.
    """

    name: str
    """Key under which the reward's scores are logged."""

    def __call__(self, images: torch.Tensor, records: Sequence[PromptRecord]) -> torch.Tensor: ...


class TranscriptionReward(abc.ABC):
    """A reward that reads the text in each image and scores it against ``record.ground_truth``.

    Subclasses (``ocr``, ``vlm_ocr``) only say how to read: `transcribe`. The score is the
    reference's `ocr_text_score`; a sample that could not be read (None) scores NaN.
    """

    name: str

    @abc.abstractmethod
    def transcribe(self, images: torch.Tensor) -> list[str | None]:
        """The text in each ``(3, H, W)`` uint8 image, "" when there is none, None when reading failed."""

    def __call__(self, images: torch.Tensor, records: Sequence[PromptRecord]) -> torch.Tensor:
        check_batch(images, records, self.name)
        texts = self.transcribe(images)
        scores = [
            float("nan") if text is None else ocr_text_score(text, record.ground_truth)
            for text, record in zip(texts, records, strict=True)
        ]
        return torch.tensor(scores, dtype=torch.float32)


def check_batch(images: object, records: Sequence[PromptRecord], reward: str) -> int:
    """Check the reward contract's inputs and return the batch size B.

    Raises ValueError naming ``reward`` and what was expected: a wrong layout or dtype would
    otherwise be scored silently (a float image in [0, 1] reads as black to a uint8 reward).
    """
    if not isinstance(images, torch.Tensor):
        raise ValueError(f"reward {reward!r}: images must be a torch.Tensor, got {type(images).__name__}")
    if images.dtype != torch.uint8:
        raise ValueError(f"reward {reward!r}: images must be torch.uint8 in [0, 255], got {images.dtype}")
    if images.ndim != 4 or images.shape[1] != 3:
        raise ValueError(f"reward {reward!r}: images must have shape (B, 3, H, W), got {tuple(images.shape)}")
    if images.shape[2] == 0 or images.shape[3] == 0:
        raise ValueError(f"reward {reward!r}: images must not be empty, got shape {tuple(images.shape)}")
    if isinstance(records, str | bytes) or not isinstance(records, Sequence):
        raise ValueError(f"reward {reward!r}: records must be a sequence of PromptRecord")
    if len(records) != images.shape[0]:
        raise ValueError(
            f"reward {reward!r}: got {images.shape[0]} images but {len(records)} records; "
            "record i must describe image i"
        )
    return int(images.shape[0])


def images_to_numpy(images: torch.Tensor) -> np.ndarray:
    """``(B, 3, H, W)`` uint8 tensor -> ``(B, H, W, 3)`` uint8 RGB array (what Pillow and OCR take)."""
    return np.ascontiguousarray(images.detach().cpu().permute(0, 2, 3, 1).numpy())


def scores_tensor(values: object, batch_size: int, reward: str) -> torch.Tensor:
    """Turn a reward's output (tensor, array or sequence of numbers) into a ``(B,)`` float32 tensor.

    NaN/inf pass through untouched. A wrong shape, a non-numeric or a bool/complex dtype raises
    `RewardError` naming the reward, since the scores cannot be attributed to images.
    """
    if isinstance(values, torch.Tensor):
        scores = values.detach().cpu()
    else:
        try:
            scores = torch.as_tensor(np.asarray(values, dtype=np.float64))
        except (TypeError, ValueError) as error:
            raise RewardError(
                f"reward {reward!r} returned {type(values).__name__}, which is not numeric: {error}"
            ) from None
    if (
        scores.dtype == torch.bool
        or scores.is_complex()
        or not (scores.is_floating_point() or _is_int(scores))
    ):
        raise RewardError(f"reward {reward!r} returned scores of dtype {scores.dtype}; expected real numbers")
    if tuple(scores.shape) != (batch_size,):
        raise RewardError(
            f"reward {reward!r} returned scores of shape {tuple(scores.shape)}; expected ({batch_size},), "
            "one score per image"
        )
    return scores.to(torch.float32)


def check_on_error(on_error: str, reward: str) -> OnError:
    if on_error not in ("raise", "nan"):
        raise ValueError(f"reward {reward!r}: on_error must be 'raise' or 'nan', got {on_error!r}")
    return on_error  # type: ignore[return-value]


def _is_int(tensor: torch.Tensor) -> bool:
    return tensor.dtype in (torch.uint8, torch.int8, torch.int16, torch.int32, torch.int64)
