"""Parameterised building blocks of the Boogu-Image transformer (`docs/upstream-model.md` §3).

Every module here keeps the attribute names of the released state dict (§2.3-2.4), so the
released `transformer/` shards load into it unchanged. The numerics follow upstream's
pure-PyTorch (CPU / SDPA) path, including where each result is rounded to the working dtype
(§3.1, §3.3, §3.6). "Working dtype" is the dtype of the activations (bf16 in the released
pipeline, fp32 in tests). Section numbers (§) refer to `docs/upstream-model.md`.

Precision rule used throughout: where upstream upcasts to float32 we upcast to
``promote_types(dtype, float32)``. That is exactly float32 for bf16/fp16/fp32 inputs (so the
rounding matches upstream bit for bit) and keeps float64 inputs in float64, which lets the tests
compare a float64 model against a float64 reference without float32 noise.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

__all__ = [
    "CombinedTimestepCaptionEmbedding",
    "ContinuousLayerNormOut",
    "QKRMSNorm",
    "RMSNorm",
    "RMSNormZero",
    "SwiGLUFeedForward",
    "TimestepEmbedding",
    "ffn_inner_dim",
    "timestep_sinusoid",
]


def _compute_dtype(dtype: torch.dtype) -> torch.dtype:
    """At least float32: float32 for half types and float32, float64 stays float64."""
    return torch.promote_types(dtype, torch.float32)


class RMSNorm(nn.Module):
    """Block / embedder RMSNorm (§3.1, item 1): everything in float32, one cast at the end.

    ``y = (x · rsqrt(mean(x²) + eps) · w).to(x.dtype)`` with x and w upcast first. This is what
    upstream's triton kernel computes and what ``torch.nn.RMSNorm`` computes on recent torch CPU
    builds; §3.1 names this fp32-all form as the reference. Used for ``ffn_norm*``, ``norm2``,
    ``*_attn_norm``, adaLN ``.norm``, ``caption_embedder.0`` and the context refiner's ``norm1``.
    """

    def __init__(self, dim: int, eps: float = 1e-5) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = _compute_dtype(x.dtype)
        y = F.rms_norm(x.to(dtype), (x.shape[-1],), self.weight.to(dtype), self.eps)
        return y.to(x.dtype)

    def extra_repr(self) -> str:
        return f"{self.weight.shape[0]}, eps={self.eps}"


class QKRMSNorm(nn.Module):
    """Per-head query/key RMSNorm (§3.1, item 2, diffusers' ``RMSNorm`` rounding order).

    The variance is taken in float32 and ``x · rsqrt(var + eps)`` is formed with float32
    promotion, but - unlike :class:`RMSNorm` - the result is cast to the *weight* dtype before the
    weight multiply when the weight is a half type. With fp32 weights the output stays in the
    promoted dtype; the attention casts q/k back to the projection dtype after RoPE (§7.1).
    """

    def __init__(self, dim: int, eps: float = 1e-5) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        variance = x.to(_compute_dtype(x.dtype)).pow(2).mean(-1, keepdim=True)
        y = x * torch.rsqrt(variance + self.eps)
        if self.weight.dtype in (torch.float16, torch.bfloat16):
            y = y.to(self.weight.dtype)
        return y * self.weight

    def extra_repr(self) -> str:
        return f"{self.weight.shape[0]}, eps={self.eps}"


def ffn_inner_dim(dim: int, multiple_of: int, ffn_dim_multiplier: float | None) -> int:
    """SwiGLU hidden width (§2.2): ``4·dim``, optionally scaled, rounded up to ``multiple_of``."""
    inner = 4 * dim
    if ffn_dim_multiplier is not None:
        inner = int(ffn_dim_multiplier * inner)
    return multiple_of * math.ceil(inner / multiple_of)


class SwiGLUFeedForward(nn.Module):
    """``linear_2(silu(linear_1(x)) * linear_3(x))`` without biases (§3.3).

    ``linear_1`` is the gate, ``linear_3`` the up projection. The SiLU runs in float32 and is
    rounded to the working dtype before the product, as upstream's pure-torch ``swiglu`` does
    (the fused flash-attn kernel rounds once; that GPU-only variant is not reproduced).
    """

    def __init__(self, dim: int, inner_dim: int) -> None:
        super().__init__()
        self.linear_1 = nn.Linear(dim, inner_dim, bias=False)
        self.linear_2 = nn.Linear(inner_dim, dim, bias=False)
        self.linear_3 = nn.Linear(dim, inner_dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.linear_1(x), self.linear_3(x)
        activated = F.silu(gate.to(_compute_dtype(gate.dtype))).to(gate.dtype)
        return self.linear_2(activated * up)


class RMSNormZero(nn.Module):
    """adaLN-zero with four outputs (§3.2), upstream's ``LuminaRMSNormZero``.

    ``(c0, c1, c2, c3) = linear(silu(temb)).chunk(4)``; returns ``(norm(x)·(1 + c0), c1, c2, c3)``.
    The double-stream block reuses ``c1`` as a shift or gate for some instances (§4.2).
    """

    def __init__(self, dim: int, conditioning_dim: int, eps: float) -> None:
        super().__init__()
        self.linear = nn.Linear(conditioning_dim, 4 * dim, bias=True)
        self.norm = RMSNorm(dim, eps=eps)

    def forward(
        self, x: torch.Tensor, temb: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        # x: (N, L, D); temb: (N, T) -> four (N, D) modulation vectors
        c0, c1, c2, c3 = self.linear(F.silu(temb)).chunk(4, dim=1)
        return self.norm(x) * (1 + c0[:, None]), c1, c2, c3


class ContinuousLayerNormOut(nn.Module):
    """Output head ``norm_out`` (§3.4): scale-only adaLN over a parameter-free LayerNorm.

    ``linear_2(LayerNorm(x, eps=1e-6) · (1 + linear_1(silu(temb))))``; no shift, no gate.
    """

    def __init__(self, dim: int, conditioning_dim: int, out_dim: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.linear_1 = nn.Linear(conditioning_dim, dim, bias=True)
        self.norm = nn.LayerNorm(dim, eps=eps, elementwise_affine=False)
        self.linear_2 = nn.Linear(dim, out_dim, bias=True)

    def forward(self, x: torch.Tensor, temb: torch.Tensor) -> torch.Tensor:
        # x: (B, S, D); temb: (B, T) -> (B, S, out_dim)
        scale = self.linear_1(F.silu(temb).to(x.dtype))
        return self.linear_2(self.norm(x) * (1 + scale)[:, None, :])


def timestep_sinusoid(timestep: torch.Tensor, num_channels: int, scale: float) -> torch.Tensor:
    """Sinusoidal embedding of Boogu time t (§3.5), always computed in float32.

    ``f_k = exp(-ln(10000)·k/half)``, ``arg = (t·f_k)·scale`` and ``[cos(arg), sin(arg)]``
    (cos first). The multiplication order (t first, then the scale) is kept so the float32
    rounding matches upstream. Returns a float32 (B, num_channels) tensor.
    """
    half = num_channels // 2
    exponent = -math.log(10000) * torch.arange(half, dtype=torch.float32, device=timestep.device)
    frequencies = torch.exp(exponent / half)  # (half,)
    angles = (timestep[:, None].float() * frequencies[None, :]) * scale  # (B, half)
    return torch.cat([torch.cos(angles), torch.sin(angles)], dim=-1)


class TimestepEmbedding(nn.Module):
    """``linear_2(silu(linear_1(x)))``: no activation after ``linear_2`` (consumers apply SiLU)."""

    def __init__(self, in_channels: int, embed_dim: int) -> None:
        super().__init__()
        self.linear_1 = nn.Linear(in_channels, embed_dim, bias=True)
        self.act = nn.SiLU()
        self.linear_2 = nn.Linear(embed_dim, embed_dim, bias=True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear_2(self.act(self.linear_1(x)))


class _SinusoidalProjection(nn.Module):
    """Parameter-free ``time_proj`` child: Boogu t -> (B, num_channels) float32 sinusoid."""

    def __init__(self, num_channels: int, scale: float) -> None:
        super().__init__()
        self.num_channels = num_channels
        self.scale = scale

    def forward(self, timestep: torch.Tensor) -> torch.Tensor:
        return timestep_sinusoid(timestep, self.num_channels, self.scale)


class CombinedTimestepCaptionEmbedding(nn.Module):
    """``time_caption_embed`` (§3.5): timestep embedding and instruction-feature projection.

    Returns ``temb`` (B, T) with ``T = min(D, 1024)`` and the projected instruction tokens
    (B, L, D) = ``Linear(RMSNorm(instr))``.
    """

    def __init__(
        self,
        hidden_size: int,
        instruction_feat_dim: int,
        norm_eps: float,
        timestep_scale: float,
        frequency_embedding_size: int = 256,
    ) -> None:
        super().__init__()
        self.time_proj = _SinusoidalProjection(frequency_embedding_size, timestep_scale)
        self.timestep_embedder = TimestepEmbedding(frequency_embedding_size, min(hidden_size, 1024))
        self.caption_embedder = nn.Sequential(
            RMSNorm(instruction_feat_dim, eps=norm_eps),
            nn.Linear(instruction_feat_dim, hidden_size, bias=True),
        )

    def forward(
        self, timestep: torch.Tensor, instruction_hidden_states: torch.Tensor, dtype: torch.dtype
    ) -> tuple[torch.Tensor, torch.Tensor]:
        return self.timestep_embedding(timestep, dtype), self.caption_embedder(instruction_hidden_states)

    def timestep_embedding(self, timestep: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """``temb`` (B, T) alone (a forward that reuses its instruction tokens needs only this)."""
        # The sinusoid is float32 and is rounded to the latents' dtype before the MLP (§3.5).
        return self.timestep_embedder(self.time_proj(timestep).to(dtype))
