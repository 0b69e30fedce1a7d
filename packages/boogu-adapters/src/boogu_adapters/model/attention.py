"""Attention modules: single-stream self-attention and the double-stream joint attention.

`docs/upstream-model.md` §7.1 (single stream) and §7.2 (double stream), whose section numbers the
comments below use. Both are pure PyTorch (``F.scaled_dot_product_attention``, GQA through
``enable_gqa``, mask-free wherever the layout allows: :class:`AttentionPlan`) and keep
upstream's parameter names: upstream builds them from diffusers' ``Attention``, whose children
are ``to_q/to_k/to_v``, ``norm_q/norm_k`` and ``to_out = [Linear, Dropout]``. The joint attention has no ``to_q/to_k/to_v``; its per-stream
projections sit under a child named ``processor`` (upstream registers its attention processor,
an ``nn.Module``, under that name), so checkpoints and LoRA keys read
``img_instruct_attn.processor.img_to_q`` and so on.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import nn

from .layers import QKRMSNorm
from .layout import host_to_device
from .rope import apply_rotary

if TYPE_CHECKING:
    from .layout import StreamPacking

__all__ = [
    "MAX_LENGTH_GROUPS",
    "AttentionPlan",
    "BooguImageAttention",
    "BooguImageDoubleStreamAttention",
    "BooguImageDoubleStreamProjections",
]

MAX_LENGTH_GROUPS = 8
"""Most distinct valid lengths a stage runs as per-length mask-free SDPA calls; with more, one
masked call is cheaper than that many small launches (``AttentionPlan``)."""


class AttentionPlan:
    """How the SDPA calls of one stage run, fixed once per forward from host-side lengths.

    A stage is N rows right-padded to ``width`` with ``lengths[n]`` valid tokens (keys and
    queries). Modes, all computing §7.1's function on the valid rows:

    * ``"dense"``: nothing is padded; one SDPA call without a mask.
    * ``"grouped"``: rows are grouped by valid length (at most ``max_groups`` groups); each group
      runs SDPA without a mask on its ``[rows, :length]`` slice (a view when the rows are a
      contiguous range, an index otherwise) - varlen attention, so CUDA can use the flash kernel.
      Padded query rows get zeros (never read); a row with no valid token is all zeros.
    * ``"masked"``: one SDPA call with the (N, width) key mask (the fallback for many distinct
      lengths, and the path compiled blocks take: a mask is a tensor input, lengths would be
      Python constants baked into the graph).

    ``mask`` (N, width) bool is built without a blocking host-to-device copy when not given.
    """

    def __init__(
        self,
        lengths: Sequence[int],
        width: int,
        device: torch.device,
        mask: torch.Tensor | None = None,
        *,
        masked: bool = False,
        max_groups: int = MAX_LENGTH_GROUPS,
    ) -> None:
        self.lengths = [int(n) for n in lengths]
        self.width = int(width)
        if any(n < 0 or n > self.width for n in self.lengths):
            raise ValueError(f"lengths {self.lengths} do not fit the padded width {self.width}")
        self._mask = mask
        self._device = device
        distinct = sorted(set(self.lengths), reverse=True)
        self.groups: list[tuple[int, slice | torch.Tensor]] = []
        if masked or len(distinct) > max_groups:
            self.mode = "masked"
        elif distinct == [self.width]:
            self.mode = "dense"
        else:
            self.mode = "grouped"
            for length in distinct:
                rows = [n for n, m in enumerate(self.lengths) if m == length]
                if rows[-1] - rows[0] + 1 == len(rows):
                    index: slice | torch.Tensor = slice(rows[0], rows[-1] + 1)
                else:
                    index = host_to_device(torch.tensor(rows), device)
                self.groups.append((length, index))

    @property
    def mask(self) -> torch.Tensor:
        """(N, width) bool, True = a valid key."""
        if self._mask is None:
            from .layout import length_mask

            self._mask = length_mask(self.lengths, self.width, self._device)
        return self._mask

    def __repr__(self) -> str:
        return f"AttentionPlan(mode={self.mode!r}, width={self.width}, lengths={self.lengths})"


def _masked_sdpa(
    query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, key_mask: torch.Tensor, scale: float
) -> torch.Tensor:
    """SDPA with a (N, L) key mask; q: (N, H, L, d), k/v: (N, H_kv, L, d) -> (N, H, L, d)."""
    # A row with no valid key at all (e.g. an empty instruction in the context refiner) would be
    # NaN in SDPA, and a NaN - even in a slot nobody reads - poisons gradients. Let such rows see
    # every key instead; their outputs are still never read.
    key_mask = key_mask | ~key_mask.any(dim=-1, keepdim=True)
    groups = query.shape[1] // key.shape[1]
    if groups > 1 and query.is_cuda:
        # With enable_gqa CUDA's SDPA dispatch leaves only the math kernel for a masked call;
        # materialised K/V heads keep the memory-efficient kernel (§7.1 step 6: head h reads h // g).
        key = key.repeat_interleave(groups, dim=1)
        value = value.repeat_interleave(groups, dim=1)
        groups = 1
    return F.scaled_dot_product_attention(
        query, key, value, attn_mask=key_mask[:, None, None, :], scale=scale, enable_gqa=groups > 1
    )


def _planned_sdpa(
    query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, plan: AttentionPlan, scale: float
) -> torch.Tensor:
    """SDPA following ``plan``; q: (N, H, L, d), k/v: (N, H_kv, L, d) -> (N, L, H, d)."""
    gqa = query.shape[1] != key.shape[1]
    if plan.mode == "masked":
        return _masked_sdpa(query, key, value, plan.mask, scale).transpose(1, 2)
    if plan.mode == "dense":
        return F.scaled_dot_product_attention(query, key, value, scale=scale, enable_gqa=gqa).transpose(1, 2)
    batch, heads, length, head_dim = query.shape
    out = query.new_zeros(batch, length, heads, head_dim)
    for valid, rows in plan.groups:
        if valid == 0:
            continue  # nothing to attend to: the row stays zero (and NaN-free)
        part = F.scaled_dot_product_attention(
            query[rows, :, :valid], key[rows, :, :valid], value[rows, :, :valid], scale=scale, enable_gqa=gqa
        )
        out[rows, :valid] = part.transpose(1, 2)
    return out


def _multi_head_attention(
    attn: BooguImageAttention | BooguImageDoubleStreamAttention,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    rotary: torch.Tensor,
    key_mask: torch.Tensor | AttentionPlan,
) -> torch.Tensor:
    """qk-norm, RoPE, GQA and SDPA on projected q/k/v; returns merged heads (N, L, H·d).

    query: (N, L, H·d); key/value: (N, L, H_kv·d); rotary: (N, L, d/2, 2) real;
    key_mask: an :class:`AttentionPlan`, or a (N, L) bool tensor (True = a key that may be
    attended to; the masked path). Padded *query* rows are never read: the masked path computes
    them like upstream, the planned paths leave zeros.
    """
    batch, length, _ = query.shape
    dtype = query.dtype
    head_dim = attn.head_dim
    query = attn.norm_q(query.unflatten(-1, (-1, head_dim)))  # (N, L, H, d)
    key = attn.norm_k(key.unflatten(-1, (-1, head_dim)))  # (N, L, H_kv, d)
    value = value.unflatten(-1, (-1, head_dim))
    # RoPE in rotary_dtype (§6.3), rounded to the qk-norm's output dtype and then to the
    # projection dtype, the same two casts upstream makes (they differ only if norm weights and
    # projections are kept in different dtypes).
    query = apply_rotary(query, rotary).to(query.dtype).to(dtype)
    key = apply_rotary(key, rotary).to(key.dtype).to(dtype)

    query, key, value = (t.transpose(1, 2) for t in (query, key, value))  # (N, heads, L, d)
    # GQA: query head h reads kv head h // (H / H_kv) (§7.1 step 6), via enable_gqa (no copies).
    if isinstance(key_mask, AttentionPlan):
        out = _planned_sdpa(query, key, value, key_mask, attn.scale)
    else:
        out = _masked_sdpa(query, key, value, key_mask, attn.scale).transpose(1, 2)
    return out.reshape(batch, length, -1).type_as(query)


class BooguImageAttention(nn.Module):
    """Self-attention of the refiners, single-stream blocks and the double-stream image branch.

    ``to_out[0](SDPA(RoPE(norm_q(to_q x)), RoPE(norm_k(to_k x)), to_v x))``, no biases, GQA with
    ``num_kv_heads`` key/value heads and softmax scale ``head_dim ** -0.5`` (§7.1).
    """

    def __init__(self, dim: int, num_attention_heads: int, num_kv_heads: int, eps: float = 1e-5) -> None:
        super().__init__()
        self.heads = num_attention_heads
        self.head_dim = dim // num_attention_heads
        self.scale = self.head_dim**-0.5
        self.norm_q = QKRMSNorm(self.head_dim, eps=eps)
        self.norm_k = QKRMSNorm(self.head_dim, eps=eps)
        self.to_q = nn.Linear(dim, num_attention_heads * self.head_dim, bias=False)
        self.to_k = nn.Linear(dim, num_kv_heads * self.head_dim, bias=False)
        self.to_v = nn.Linear(dim, num_kv_heads * self.head_dim, bias=False)
        self.to_out = nn.ModuleList(
            [nn.Linear(num_attention_heads * self.head_dim, dim, bias=False), nn.Dropout(0.0)]
        )

    def forward(
        self, x: torch.Tensor, key_mask: torch.Tensor | AttentionPlan, rotary: torch.Tensor
    ) -> torch.Tensor:
        # x: (N, L, D); key_mask: a plan or (N, L) bool; rotary: (N, L, d/2, 2) -> (N, L, D)
        out = _multi_head_attention(self, self.to_q(x), self.to_k(x), self.to_v(x), rotary, key_mask)
        return self.to_out[1](self.to_out[0](out))


class BooguImageDoubleStreamProjections(nn.Module):
    """Per-stream projections of the joint attention (state-dict child ``processor``).

    ``img_to_*`` project image tokens, ``instruct_to_*`` instruction tokens; ``img_out`` and
    ``instruct_out`` are the per-stream output projections applied before the shared ``to_out.0``.
    """

    def __init__(self, dim: int, num_attention_heads: int, num_kv_heads: int) -> None:
        super().__init__()
        head_dim = dim // num_attention_heads
        q_dim, kv_dim = num_attention_heads * head_dim, num_kv_heads * head_dim
        self.img_to_q = nn.Linear(dim, q_dim, bias=False)
        self.img_to_k = nn.Linear(dim, kv_dim, bias=False)
        self.img_to_v = nn.Linear(dim, kv_dim, bias=False)
        self.instruct_to_q = nn.Linear(dim, q_dim, bias=False)
        self.instruct_to_k = nn.Linear(dim, kv_dim, bias=False)
        self.instruct_to_v = nn.Linear(dim, kv_dim, bias=False)
        self.instruct_out = nn.Linear(q_dim, q_dim, bias=False)
        self.img_out = nn.Linear(q_dim, q_dim, bias=False)


class BooguImageDoubleStreamAttention(nn.Module):
    """Joint attention over ``[instruction ; image]`` with per-stream projections (§7.2).

    Instruction tokens are projected by ``processor.instruct_to_*``, image tokens by
    ``processor.img_to_*``; per sample the valid instruction tokens and the image tokens are
    joined with the instruction padding removed, share ``norm_q``/``norm_k``, get the joint RoPE
    and attend together. The result is split back per stream; an instruction token's output is
    ``to_out.0(instruct_out(·))`` and an image token's ``to_out.0(img_out(·))``.
    """

    def __init__(self, dim: int, num_attention_heads: int, num_kv_heads: int, eps: float = 1e-5) -> None:
        super().__init__()
        self.heads = num_attention_heads
        self.head_dim = dim // num_attention_heads
        self.scale = self.head_dim**-0.5
        self.norm_q = QKRMSNorm(self.head_dim, eps=eps)
        self.norm_k = QKRMSNorm(self.head_dim, eps=eps)
        self.to_out = nn.ModuleList(
            [nn.Linear(num_attention_heads * self.head_dim, dim, bias=False), nn.Dropout(0.0)]
        )
        self.processor = BooguImageDoubleStreamProjections(dim, num_attention_heads, num_kv_heads)

    def forward(
        self,
        img: torch.Tensor,
        instruct: torch.Tensor,
        packing: StreamPacking,
        joint_rotary: torch.Tensor,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """img: (B, I, D); instruct: (B, L, D); packing joins instruct (first) and img (second);
        joint_rotary: (B, S, d/2, 2). Returns (instruct_out (B, L, D), img_out (B, I, D)),
        zero at padded slots."""
        proj = self.processor
        q_width, kv_width = proj.img_to_q.out_features, proj.img_to_k.out_features
        # Project each stream with its own weights, then join q|k|v in one gather.
        img_qkv = torch.cat([proj.img_to_q(img), proj.img_to_k(img), proj.img_to_v(img)], dim=-1)
        ins_qkv = torch.cat(
            [proj.instruct_to_q(instruct), proj.instruct_to_k(instruct), proj.instruct_to_v(instruct)], dim=-1
        )
        joint_qkv = packing.merge(ins_qkv, img_qkv)  # (B, S, q + 2·kv)
        query, key, value = joint_qkv.split([q_width, kv_width, kv_width], dim=-1)
        # The packing carries the joint stage's plan when the model built one (eager), else its mask.
        key_mask = packing.mask if packing.plan is None else packing.plan
        joint = _multi_head_attention(self, query, key, value, joint_rotary, key_mask)  # (B, S, H·d)
        ins_part, img_part = packing.split(joint)
        # The shared to_out.0 is per token, so applying it to each stream equals applying it to the
        # re-joined sequence as upstream does; padded slots stay exactly zero (no biases).
        ins_out = self.to_out[1](self.to_out[0](proj.instruct_out(ins_part)))
        img_out = self.to_out[1](self.to_out[0](proj.img_out(img_part)))
        return ins_out, img_out
