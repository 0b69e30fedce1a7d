"""Boogu 3-axis rotary position embedding (`docs/upstream-model.md` §6).

Two halves:

* :func:`get_freqs_cis` builds the per-axis tables in upstream's public form (a list of complex128
  ``[axes_lens[k], axes_dim[k] / 2]`` tensors). Pipelines compute it once and pass it to
  ``forward``, exactly as with upstream's class.
* Inside the model the tables are used in *real* form: a rotary tensor is
  ``(..., head_dim / 2, 2)`` holding ``(cos θ, sin θ)`` per rotated pair, looked up in float64 and
  rounded once to ``rotary_dtype`` (float32 for bf16 / fp32 models, float64 for float64 models).
  The model caches the tables per device and the per-stage rotary tensors per token layout.

Positions (§6.2), per sample with ``Lc`` valid instruction tokens:
text token k -> (k, k, k); reference j with token grid (h_j, w_j) -> (s_j, r, c) with
``s_0 = Lc`` and ``s_{j+1} = s_j + max(h_j, w_j)``; the target -> (s_K, r, c) after all K
references. Axis 0 is the "sequence" axis, axes 1 and 2 are row and column.

Section numbers (§) refer to `docs/upstream-model.md`.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

__all__ = [
    "RotaryTables",
    "apply_rotary",
    "get_freqs_cis",
    "grid_positions",
    "rotary_dtype",
    "text_positions",
]


def get_freqs_cis(
    axes_dim: Sequence[int], axes_lens: Sequence[int], theta: float = 10000
) -> list[torch.Tensor]:
    """Per-axis RoPE tables in upstream's form (§6.1).

    For axis k with ``d_k = axes_dim[k]``: ``ω_j = 1 / theta^(2j / d_k)`` (j < d_k/2) in float64,
    ``angle[pos, j] = pos · ω_j`` for ``pos < axes_lens[k]`` and ``table = exp(i·angle)``.

    Returns a list of complex128 tensors of shape ``[axes_lens[k], axes_dim[k] // 2]``, the value
    to pass as ``freqs_cis`` to :meth:`BooguImageTransformer2DModel.forward`. Upstream computes
    these in float32 when MPS is available; this port always uses float64 (the model applies
    RoPE in float64, which MPS cannot run anyway).
    """
    tables = []
    for dim, length in zip(axes_dim, axes_lens, strict=True):
        if dim % 2:
            raise ValueError(f"every axes_dim entry must be even, got {dim} in {list(axes_dim)}")
        # Same operation order as upstream (diffusers' get_1d_rotary_pos_embed) so tables agree bit for bit.
        omega = 1.0 / (theta ** (torch.arange(0, dim, 2, dtype=torch.float64) / dim))  # (d_k/2,)
        angles = torch.outer(torch.arange(length), omega)  # (n_k, d_k/2) float64
        tables.append(torch.polar(torch.ones_like(angles), angles))  # complex128
    return tables


def text_positions(length: int, device: torch.device) -> torch.Tensor:
    """(length, 3) int64 positions ``(k, k, k)`` of the valid instruction tokens."""
    return torch.arange(length, device=device)[:, None].expand(length, 3)


def grid_positions(shift: int, rows: int, cols: int, device: torch.device) -> torch.Tensor:
    """(rows·cols, 3) int64 positions ``(shift, r, c)`` of a token grid in row-major order."""
    r = torch.arange(rows, device=device)[:, None].expand(rows, cols)
    c = torch.arange(cols, device=device)[None, :].expand(rows, cols)
    return torch.stack([torch.full_like(r, shift), r, c], dim=-1).reshape(rows * cols, 3)


class RotaryTables:
    """The per-axis tables in real float64 form on one device, with bounds checks.

    ``freqs_cis`` is upstream's list of complex tables (see :func:`get_freqs_cis`). ``lookup``
    turns int64 positions ``(..., 3)`` into a rotary tensor ``(..., head_dim / 2, 2)`` float64.
    The model builds one per (``freqs_cis`` tensors, device) and caches it (``tables_for``).
    """

    def __init__(self, freqs_cis: Sequence[torch.Tensor], head_dim: int, device: torch.device) -> None:
        if len(freqs_cis) != 3:
            raise ValueError(f"freqs_cis must hold 3 per-axis tables, got {len(freqs_cis)}")
        self.tables = []
        for table in freqs_cis:
            if not torch.is_complex(table) or table.ndim != 2:
                raise ValueError(
                    "each freqs_cis table must be a complex [axes_lens[k], axes_dim[k] // 2] tensor "
                    f"(see get_freqs_cis), got dtype {table.dtype} and shape {tuple(table.shape)}"
                )
            # (n_k, d_k/2, 2) float64 = (cos θ, sin θ) per pair
            self.tables.append(torch.view_as_real(table.to(device)).to(torch.float64))
        pairs = sum(t.shape[1] for t in self.tables)
        if 2 * pairs != head_dim:
            raise ValueError(
                f"freqs_cis tables rotate {2 * pairs} dims but the attention head dim is {head_dim}; "
                "build them with get_freqs_cis(config.axes_dim_rope, config.axes_lens)"
            )
        self.axis_lengths = [t.shape[0] for t in self.tables]

    def check_range(self, max_position: Sequence[int]) -> None:
        """Raise if a position does not fit its table (upstream fails inside ``torch.gather``)."""
        for axis, (highest, length) in enumerate(zip(max_position, self.axis_lengths, strict=True)):
            if highest >= length:
                raise ValueError(
                    f"RoPE axis {axis} needs position {highest} but its table has {length} entries "
                    f"(config.axes_lens); use shorter instructions, fewer or smaller images, "
                    "or larger axes_lens"
                )

    def lookup(self, positions: torch.Tensor) -> torch.Tensor:
        """positions (..., 3) int64 -> rotary (..., head_dim / 2, 2) float64."""
        return torch.cat([table[positions[..., axis]] for axis, table in enumerate(self.tables)], dim=-2)


def rotary_dtype(dtype: torch.dtype) -> torch.dtype:
    """Dtype RoPE is applied in for activations of ``dtype``.

    float32 for 16-bit models (bf16 / fp16, the GPU product path): one fused float32 multiply
    instead of float64 arithmetic, which moves a few bf16 q/k elements per 10^5 by one ulp.
    float64 for fp32 and float64 models: upstream's complex128 product rounded once (§6.3), so
    fp32 results stay bit-identical to upstream's (``tests/adapters/test_tiny_upstream.py``).
    """
    return torch.float32 if dtype in (torch.bfloat16, torch.float16) else torch.float64


def _rotate_real(x: torch.Tensor, rotary: torch.Tensor) -> torch.Tensor:
    """Real-arithmetic form of the rotation (what inductor fuses into one kernel)."""
    pairs = x.unflatten(-1, (-1, 2))  # (N, L, H, d/2, 2)
    x_even, x_odd = pairs[..., 0], pairs[..., 1]
    cos, sin = rotary[:, :, None, :, 0], rotary[:, :, None, :, 1]  # (N, L, 1, d/2)
    return torch.stack([x_even * cos - x_odd * sin, x_even * sin + x_odd * cos], dim=-1).flatten(-2)


def apply_rotary(x: torch.Tensor, rotary: torch.Tensor) -> torch.Tensor:
    """Rotate interleaved pairs ``(x[2i], x[2i+1])`` of every head (§6.3).

    x: (N, L, H, d); rotary: (N, L, d/2, 2) real ``(cos θ, sin θ)``. The product is taken in
    ``rotary_dtype(x.dtype)`` (a rotary of another dtype is cast first) and returned in that dtype;
    the caller casts once, as upstream does after its complex product.

    Eager runs one complex multiply (``x_pair · e^{iθ}``: a cast and one elementwise kernel,
    bit-identical on CPU to the real formula ``(e·c − o·s, e·s + o·c)``); under ``torch.compile``
    the real formula is traced instead, which inductor fuses (it does not lower complex ops).
    """
    dtype = rotary_dtype(x.dtype)
    x = x.to(dtype)
    rotary = rotary.to(dtype)
    if torch.compiler.is_compiling():
        return _rotate_real(x, rotary)
    product = _as_complex(x.unflatten(-1, (-1, 2))) * _as_complex(rotary)[:, :, None]
    return torch.view_as_real(product).flatten(-2)


def _as_complex(pairs: torch.Tensor) -> torch.Tensor:
    """``view_as_complex`` of a (..., 2) real tensor, copying only if its strides forbid the view."""
    if pairs.stride(-1) != 1 or pairs.storage_offset() % 2 or any(s % 2 for s in pairs.stride()[:-1]):
        pairs = pairs.contiguous()
    return torch.view_as_complex(pairs)
