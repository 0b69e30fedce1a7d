"""The OCR score: how well a transcription matches the text an image should show.

This is the reference's formula (verl-omni ``genrm_ocr.py::compute_score_ocr``, itself from
flow_grpo ``ocr.py``), reimplemented; both the local-OCR and the VLM-OCR rewards use it:

1. Fold both strings: remove every whitespace character (``re`` ``\\s``), then lower-case.
2. ``d = 0`` if the folded ground truth occurs in the folded transcription, else
   ``d = Levenshtein(transcription, ground_truth)``.
3. ``d = min(d, len(ground_truth))``: hallucinated extra text costs at most the whole score.
4. ``score = 1 - d / len(ground_truth)``, in [0, 1]. An empty ground truth scores 1 only for an
   empty transcription (a "remove the text" edit), else 0.

Lengths count Unicode code points, as the reference's ``Levenshtein.distance`` does.
"""

from __future__ import annotations

import re

__all__ = ["fold_text", "levenshtein", "ocr_text_score"]

_WHITESPACE = re.compile(r"\s+")


def fold_text(text: str) -> str:
    """Remove all whitespace, then lower-case (the reference's order, ``str.lower`` not ``casefold``)."""
    return _WHITESPACE.sub("", text).lower()


def levenshtein(a: str, b: str, max_distance: int | None = None) -> int:
    """Edit distance (unit-cost insertions, deletions, substitutions) between ``a`` and ``b``.

    With ``max_distance`` the search stops as soon as the distance is known to exceed it and returns
    ``max_distance + 1`` instead: callers that clamp the distance anyway (the OCR score) then pay
    O(len(b)) for a long hallucinated transcription instead of O(len(a) * len(b)).
    """
    if max_distance is not None and max_distance < 0:
        raise ValueError(f"max_distance must be >= 0, got {max_distance}")
    if len(a) < len(b):
        a, b = b, a  # the DP rows run over the shorter string
    if max_distance is not None and len(a) - len(b) > max_distance:
        return max_distance + 1  # the length gap alone needs that many insertions
    previous = list(range(len(b) + 1))
    for i, char_a in enumerate(a, start=1):
        current = [i]
        for j, char_b in enumerate(b, start=1):
            current.append(
                min(
                    previous[j] + 1,  # delete char_a
                    current[j - 1] + 1,  # insert char_b
                    previous[j - 1] + (char_a != char_b),  # substitute (or match)
                )
            )
        # Row minima never decrease, so once every cell exceeds the cap the answer does too.
        if max_distance is not None and min(current) > max_distance:
            return max_distance + 1
        previous = current
    if max_distance is not None:
        return min(previous[-1], max_distance + 1)  # the last row can end above the cap
    return previous[-1]


def ocr_text_score(transcription: str, ground_truth: str) -> float:
    """1 - normalised edit distance between a transcription and the ground truth, in [0, 1].

    Case and whitespace are folded; a transcription that contains the ground truth scores 1; an
    empty transcription scores 0 (unless the ground truth is empty too, which then scores 1).
    Cost: O(len(transcription) * len(ground_truth)) in pure Python, microseconds for sign-sized text.
    """
    truth = fold_text(ground_truth)
    text = fold_text(transcription)
    if not truth:
        return 1.0 if not text else 0.0
    if truth in text:
        return 1.0
    distance = min(levenshtein(text, truth, max_distance=len(truth)), len(truth))
    return 1.0 - distance / len(truth)
