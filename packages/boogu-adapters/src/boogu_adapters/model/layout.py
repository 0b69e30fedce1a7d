"""Token layout of one Boogu forward: patchify, per-sample lengths, padding and stream packing.

`docs/upstream-model.md` §5.2, steps 3, 6-8 and 11 (section numbers below are that page's). Each
sample b has three ragged segments:

* ``Lc_b`` valid instruction tokens (right-padded in the input, §5.1);
* ``K_b`` reference images (0-5), image j a ``(h_j, w_j)`` token grid;
* one target image, a ``(h, w)`` token grid.

The image stream of a sample is ``[ref_1 ... ref_K ; target]`` (``I_b`` tokens), the joint
sequence is ``[text ; ref_1 ... ref_K ; target]`` (``S_b = Lc_b + I_b`` tokens). Instruction
padding never enters the joint sequence (§7.2 step 2). Batched tensors are right-padded
with zeros and carry a bool mask; nothing reads a padded slot, so results per sample do not
depend on the rest of the batch.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from .rope import grid_positions, text_positions

__all__ = [
    "StreamPacking",
    "TokenLayout",
    "host_to_device",
    "length_mask",
    "pad_sequences",
    "patchify",
    "unpatchify",
]


def patchify(latent: torch.Tensor, patch_size: int) -> torch.Tensor:
    """(C, H, W) -> (H/p · W/p, p·p·C) tokens, row-major over the patch grid (§5.2 step 3).

    Within a token the channel index is fastest: element ``(i·p + j)·C + c`` holds channel c at
    row offset i, column offset j (einops ``c (h p1) (w p2) -> (h w) (p1 p2 c)``; *not* Flux's
    ``(c p1 p2)`` order).
    """
    channels, height, width = latent.shape
    rows, cols = height // patch_size, width // patch_size
    grid = latent.reshape(channels, rows, patch_size, cols, patch_size)
    return grid.permute(1, 3, 2, 4, 0).reshape(rows * cols, patch_size * patch_size * channels)


def unpatchify(tokens: torch.Tensor, rows: int, cols: int, patch_size: int) -> torch.Tensor:
    """Inverse of :func:`patchify`: (rows·cols, p·p·C) -> (C, rows·p, cols·p)."""
    channels = tokens.shape[-1] // (patch_size * patch_size)
    grid = tokens.reshape(rows, cols, patch_size, patch_size, channels)
    return grid.permute(4, 0, 2, 1, 3).reshape(channels, rows * patch_size, cols * patch_size)


def host_to_device(tensor: torch.Tensor, device: torch.device) -> torch.Tensor:
    """Move a small host tensor (indices, masks) to ``device`` without blocking the host.

    On CUDA it is copied from pinned memory with ``non_blocking=True`` (the caching host allocator
    keeps the buffer alive until the copy is done); other devices get a plain ``to``. The
    forward builds its index and mask tensors this way or from ``arange`` and Python ints, never
    with ``torch.tensor(list, device=cuda)`` (a synchronous copy).
    """
    device = torch.device(device)
    if tensor.device == device:
        return tensor
    if device.type == "cuda":
        return tensor.pin_memory().to(device, non_blocking=True)
    return tensor.to(device, non_blocking=device.type != "cpu")


def length_mask(lengths: Sequence[int], width: int, device: torch.device) -> torch.Tensor:
    """(N, width) bool, row n True on its first ``lengths[n]`` slots; built on the host, then moved."""
    mask = torch.arange(width)[None, :] < torch.tensor(list(lengths), dtype=torch.long)[:, None]
    return host_to_device(mask, device)


def pad_sequences(
    sequences: Sequence[torch.Tensor], width: int | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Right-pad (L_i, *F) tensors with zeros to (N, width, *F) plus a (N, width) bool mask.

    ``width`` defaults to the longest sequence.
    """
    lengths = [seq.shape[0] for seq in sequences]
    width = max(lengths) if width is None else width
    padded = torch.nn.utils.rnn.pad_sequence(list(sequences), batch_first=True)
    if padded.shape[1] < width:
        extra = [0, 0] * (padded.ndim - 2) + [0, width - padded.shape[1]]
        padded = F.pad(padded, extra)
    return padded, length_mask(lengths, width, sequences[0].device)


def _take_rows(x: torch.Tensor, index: torch.Tensor, keep: torch.Tensor) -> torch.Tensor:
    """out[b, s] = x[b, index[b, s]] where keep[b, s], else 0. x: (B, L, *F); index/keep: (B, S)."""
    rows = torch.arange(x.shape[0], device=x.device)[:, None]
    taken = x[rows, index]
    keep = keep.reshape(*keep.shape, *([1] * (x.ndim - 2)))
    # torch.where rather than a multiply: a non-finite value in a padded slot must not leak.
    return torch.where(keep, taken, torch.zeros((), dtype=x.dtype, device=x.device))


class StreamPacking:
    """Per-sample concatenation of two right-padded streams with their padding squeezed out.

        ``merge(a, b)`` with a: (B, La, *F) holding ``first_lengths[b]`` valid rows and b: (B, Lb, *F)
        holding ``second_lengths[b]`` valid rows gives (B, S, *F) with row b =
        ``[a[b, :la_b] ; b[b, :lb_b] ; zeros]`` and ``S = width`` (default ``max(la_b + lb_b)``; the
    regional-compile bucket rounds it up). ``split`` is its
        inverse and returns zero-padded (B, La, *F) and (B, Lb, *F) tensors. Index tensors are built
        once per forward; both directions are single gathers, so they stay cheap inside every block.
    """

    def __init__(
        self,
        first_lengths: Sequence[int],
        first_width: int,
        second_lengths: Sequence[int],
        second_width: int,
        device: torch.device,
        width: int | None = None,
    ) -> None:
        if max(first_lengths) > first_width or max(second_lengths) > second_width:
            raise ValueError("stream lengths exceed the padded widths")
        self.first_width, self.second_width = first_width, second_width
        self.lengths = [a + b for a, b in zip(first_lengths, second_lengths, strict=True)]
        self.width = max(self.lengths) if width is None else width
        if self.width < max(self.lengths):
            raise ValueError(f"joint width {self.width} is below the longest joint row {max(self.lengths)}")
        # Index tensors are built on the host and moved once (no blocking copy, no device read).
        la = torch.tensor(list(first_lengths), dtype=torch.long)[:, None]  # (B, 1)
        lb = torch.tensor(list(second_lengths), dtype=torch.long)[:, None]
        s = torch.arange(self.width)[None, :]  # (1, S)
        mask = s < la + lb  # (B, S) valid joint slots
        # Index into cat([a, b], dim=1): first-stream rows, then second-stream rows after La.
        merge_index = torch.where(mask, torch.where(s < la, s, first_width + s - la), 0)
        t = torch.arange(first_width)[None, :]
        first_keep = t < la
        u = torch.arange(second_width)[None, :]
        second_keep = u < lb
        moved = [
            host_to_device(x, device)
            for x in (
                mask,
                merge_index,
                first_keep,
                torch.where(first_keep, t, 0),
                second_keep,
                torch.where(second_keep, la + u, 0),
            )
        ]
        self.mask, self._merge_index, self._first_keep, self._first_index = moved[:4]
        self._second_keep, self._second_index = moved[4:]
        self.plan = None
        """The joint stage's ``AttentionPlan`` when the model set one; None = masked attention."""

    def merge(self, first: torch.Tensor, second: torch.Tensor) -> torch.Tensor:
        """(B, La, *F), (B, Lb, *F) -> (B, S, *F) joint rows ``[first valid ; second valid]``."""
        return _take_rows(torch.cat([first, second], dim=1), self._merge_index, self.mask)

    def split(self, joint: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(B, S, *F) -> ((B, La, *F), (B, Lb, *F)), zero-padded; inverse of :meth:`merge`."""
        first = _take_rows(joint, self._first_index, self._first_keep)
        second = _take_rows(joint, self._second_index, self._second_keep)
        return first, second


@dataclass(frozen=True)
class TokenLayout:
    """Per-sample segment sizes of one forward call (all in tokens, after patchify)."""

    text_lengths: list[int]
    """``Lc_b``: valid instruction tokens per sample."""
    target_grids: list[tuple[int, int]]
    """``(h, w)`` token grid of each sample's target."""
    reference_grids: list[list[tuple[int, int]]]
    """``(h_j, w_j)`` token grids of each sample's references, in order (empty for T2I)."""

    @property
    def target_lengths(self) -> list[int]:
        return [h * w for h, w in self.target_grids]

    @property
    def reference_lengths(self) -> list[list[int]]:
        return [[h * w for h, w in grids] for grids in self.reference_grids]

    @property
    def image_lengths(self) -> list[int]:
        """``I_b = Σ_j h_j·w_j + h·w``: tokens of the image stream ``[refs ; target]``."""
        return [
            sum(refs) + tgt for refs, tgt in zip(self.reference_lengths, self.target_lengths, strict=True)
        ]

    @property
    def joint_lengths(self) -> list[int]:
        """``S_b = Lc_b + I_b``: tokens of the joint sequence ``[text ; refs ; target]``."""
        return [lc + img for lc, img in zip(self.text_lengths, self.image_lengths, strict=True)]

    def segment_positions(self, device: torch.device) -> list[list[torch.Tensor]]:
        """RoPE positions (§6.2) as, per sample, ``[text, ref_1, ..., ref_K, target]``.

        Each entry is an (n, 3) int64 tensor. The axis-0 offset starts at ``Lc`` and advances by
        ``max(h_j, w_j)`` after each reference; the target takes the offset after the last one.
        """
        result = []
        for lc, refs, (rows, cols) in zip(
            self.text_lengths, self.reference_grids, self.target_grids, strict=True
        ):
            segments = [text_positions(lc, device)]
            shift = lc
            for ref_rows, ref_cols in refs:
                segments.append(grid_positions(shift, ref_rows, ref_cols, device))
                shift += max(ref_rows, ref_cols)
            segments.append(grid_positions(shift, rows, cols, device))
            result.append(segments)
        return result

    def max_positions(self) -> tuple[int, int, int]:
        """Largest position used on each RoPE axis (for the table-size check)."""
        axis0, rows, cols = 0, 0, 0
        for lc, refs, (h, w) in zip(self.text_lengths, self.reference_grids, self.target_grids, strict=True):
            shift = lc + sum(max(rh, rw) for rh, rw in refs)
            axis0 = max(axis0, shift, lc - 1)
            rows = max(rows, h - 1, lc - 1, *(rh - 1 for rh, _ in refs))
            cols = max(cols, w - 1, lc - 1, *(rw - 1 for _, rw in refs))
        return axis0, rows, cols
