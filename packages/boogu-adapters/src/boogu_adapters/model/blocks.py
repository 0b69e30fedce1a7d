"""Transformer blocks (`docs/upstream-model.md` §2.3 module tree, §4 forward passes).

Class names follow upstream so that ``_no_split_modules`` / ``_repeated_blocks`` of the model
keep their meaning (device maps, regional compile). The four refiner / single-stream classes are
the same block; only the ``modulation`` flag differs (the context refiner has none).
Section numbers (§) refer to `docs/upstream-model.md`.
"""

from __future__ import annotations

import torch
from torch import nn

from .attention import BooguImageAttention, BooguImageDoubleStreamAttention
from .layers import RMSNorm, RMSNormZero, SwiGLUFeedForward, ffn_inner_dim
from .layout import StreamPacking

__all__ = [
    "BooguImageContextRefinerTransformerBlock",
    "BooguImageDoubleStreamTransformerBlock",
    "BooguImageNoiseRefinerTransformerBlock",
    "BooguImageRefImgRefinerTransformerBlock",
    "BooguImageSingleStreamTransformerBlock",
    "BooguImageTransformerBlock",
]

# Conditioning width T of every adaLN input (§2.2): min(D, 1024).
_MAX_CONDITIONING_DIM = 1024


def _xavier(*linears: nn.Linear) -> None:
    for linear in linears:
        nn.init.xavier_uniform_(linear.weight)


def _zero(*linears: nn.Linear) -> None:
    for linear in linears:
        nn.init.zeros_(linear.weight)
        nn.init.zeros_(linear.bias)


class BooguImageTransformerBlock(nn.Module):
    """Sequential attention + SwiGLU block (§4.1).

    With modulation (noise / reference refiners, single-stream blocks)::

        n, g_msa, s_mlp, g_mlp = norm1(x, temb)
        x = x + tanh(g_msa) · norm2(attn(n))
        x = x + tanh(g_mlp) · ffn_norm2(feed_forward(ffn_norm1(x) · (1 + s_mlp)))

    Without (context refiner; ``temb`` unused): the same with ``norm1`` a plain RMSNorm and no
    gates or scale. Gates pass through tanh; there are no shifts.
    """

    def __init__(
        self,
        dim: int,
        num_attention_heads: int,
        num_kv_heads: int,
        multiple_of: int,
        ffn_dim_multiplier: float | None,
        norm_eps: float,
        modulation: bool = True,
    ) -> None:
        super().__init__()
        self.modulation = modulation
        self.attn = BooguImageAttention(dim, num_attention_heads, num_kv_heads)
        self.feed_forward = SwiGLUFeedForward(dim, ffn_inner_dim(dim, multiple_of, ffn_dim_multiplier))
        if modulation:
            self.norm1: nn.Module = RMSNormZero(dim, min(dim, _MAX_CONDITIONING_DIM), norm_eps)
        else:
            self.norm1 = RMSNorm(dim, eps=norm_eps)
        self.ffn_norm1 = RMSNorm(dim, eps=norm_eps)
        self.norm2 = RMSNorm(dim, eps=norm_eps)
        self.ffn_norm2 = RMSNorm(dim, eps=norm_eps)
        self.reset_parameters()

    def reset_parameters(self) -> None:
        """Upstream's init (§2.5): xavier linears, zero adaLN (so a fresh block is identity-gated)."""
        _xavier(self.attn.to_q, self.attn.to_k, self.attn.to_v, self.attn.to_out[0])
        _xavier(self.feed_forward.linear_1, self.feed_forward.linear_2, self.feed_forward.linear_3)
        if self.modulation:
            _zero(self.norm1.linear)

    def forward(
        self,
        x: torch.Tensor,
        key_mask: torch.Tensor,
        rotary: torch.Tensor,
        temb: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """x: (N, L, D); key_mask: (N, L) bool; rotary: (N, L, d/2, 2) float64; temb: (N, T)."""
        if not self.modulation:
            x = x + self.norm2(self.attn(self.norm1(x), key_mask, rotary))
            return x + self.ffn_norm2(self.feed_forward(self.ffn_norm1(x)))
        if temb is None:
            raise ValueError("temb is required by a modulated block")
        normed, gate_msa, scale_mlp, gate_mlp = self.norm1(x, temb)
        x = x + gate_msa.unsqueeze(1).tanh() * self.norm2(self.attn(normed, key_mask, rotary))
        mlp_out = self.feed_forward(self.ffn_norm1(x) * (1 + scale_mlp.unsqueeze(1)))
        return x + gate_mlp.unsqueeze(1).tanh() * self.ffn_norm2(mlp_out)


class BooguImageNoiseRefinerTransformerBlock(BooguImageTransformerBlock):
    """Refines the noisy target tokens alone (modulated)."""


class BooguImageRefImgRefinerTransformerBlock(BooguImageTransformerBlock):
    """Refines each reference image alone, with its sample's timestep embedding (modulated)."""


class BooguImageContextRefinerTransformerBlock(BooguImageTransformerBlock):
    """Refines the instruction tokens alone (built with ``modulation=False``)."""


class BooguImageSingleStreamTransformerBlock(BooguImageTransformerBlock):
    """Main block over the joint ``[text ; refs ; target]`` sequence (modulated)."""


class BooguImageDoubleStreamTransformerBlock(nn.Module):
    """ "Parallel" two-stream block (§4.2); every modulation reads the block input.

    Image stream ``img`` = ``[refs ; target]``, instruction stream ``ins``::

        img_n1, g_msa, s_mlp, g_mlp = img_norm1(img0);  img_n2, sh_mlp, _, _ = img_norm2(img0)
        img_n3, g_self, _, _ = img_norm3(img0)
        ins_n1, ig_msa, is_mlp, ig_mlp = instruct_norm1(ins0);  ins_n2, ish_mlp, _, _ = instruct_norm2(ins0)
        ins_a, img_a = joint_attention(img_n1, ins_n1)
        img = img0 + tanh(g_msa)·img_attn_norm(img_a) + tanh(g_self)·img_self_attn_norm(img_self_attn(img_n3))
        img = img + tanh(g_mlp)·img_ffn_norm2(img_ff(img_ffn_norm1((1 + s_mlp)·img_n2 + sh_mlp)))
        ins = ins0 + tanh(ig_msa)·instruct_attn_norm(ins_a)
        ins = ins + tanh(ig_mlp)·instruct_ffn_norm2(instruct_ff(instruct_ffn_norm1((1 + is_mlp)·ins_n2 + ish_mlp)))

    (the residual additions happen one at a time, in that order). Instruction tokens have no
    self-attention of their own. Only the modulated variant exists in the release, so only it is
    built.
    """

    def __init__(
        self,
        dim: int,
        num_attention_heads: int,
        num_kv_heads: int,
        multiple_of: int,
        ffn_dim_multiplier: float | None,
        norm_eps: float,
    ) -> None:
        super().__init__()
        inner = ffn_inner_dim(dim, multiple_of, ffn_dim_multiplier)
        cond = min(dim, _MAX_CONDITIONING_DIM)
        self.img_instruct_attn = BooguImageDoubleStreamAttention(dim, num_attention_heads, num_kv_heads)
        self.img_self_attn = BooguImageAttention(dim, num_attention_heads, num_kv_heads)
        self.img_feed_forward = SwiGLUFeedForward(dim, inner)
        self.img_norm1 = RMSNormZero(dim, cond, norm_eps)
        self.img_norm2 = RMSNormZero(dim, cond, norm_eps)
        self.img_norm3 = RMSNormZero(dim, cond, norm_eps)
        self.img_ffn_norm1 = RMSNorm(dim, eps=norm_eps)
        self.img_attn_norm = RMSNorm(dim, eps=norm_eps)
        self.img_self_attn_norm = RMSNorm(dim, eps=norm_eps)
        self.img_ffn_norm2 = RMSNorm(dim, eps=norm_eps)
        self.instruct_feed_forward = SwiGLUFeedForward(dim, inner)
        self.instruct_norm1 = RMSNormZero(dim, cond, norm_eps)
        self.instruct_norm2 = RMSNormZero(dim, cond, norm_eps)
        self.instruct_ffn_norm1 = RMSNorm(dim, eps=norm_eps)
        self.instruct_attn_norm = RMSNorm(dim, eps=norm_eps)
        self.instruct_ffn_norm2 = RMSNorm(dim, eps=norm_eps)
        self.reset_parameters()

    def reset_parameters(self) -> None:
        """Upstream's init (§2.5): xavier attention / FFN / processor linears, zero adaLN."""
        joint, proj = self.img_instruct_attn, self.img_instruct_attn.processor
        _xavier(joint.to_out[0], proj.img_to_q, proj.img_to_k, proj.img_to_v)
        _xavier(proj.instruct_to_q, proj.instruct_to_k, proj.instruct_to_v, proj.instruct_out, proj.img_out)
        attn = self.img_self_attn
        _xavier(attn.to_q, attn.to_k, attn.to_v, attn.to_out[0])
        for ff in (self.img_feed_forward, self.instruct_feed_forward):
            _xavier(ff.linear_1, ff.linear_2, ff.linear_3)
        _zero(self.img_norm1.linear, self.img_norm2.linear, self.img_norm3.linear)
        _zero(self.instruct_norm1.linear, self.instruct_norm2.linear)

    def forward(
        self,
        img: torch.Tensor,
        instruct: torch.Tensor,
        img_mask: torch.Tensor,
        img_rotary: torch.Tensor,
        packing: StreamPacking,
        joint_rotary: torch.Tensor,
        temb: torch.Tensor,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """img: (B, I, D) with img_mask (B, I) and img_rotary (B, I, d/2, 2);
        instruct: (B, L, D); packing joins instruct and img into the joint sequence whose
        rotary is joint_rotary (B, S, d/2, 2); temb: (B, T). Returns updated (img, instruct)."""
        img_n1, img_gate_msa, img_scale_mlp, img_gate_mlp = self.img_norm1(img, temb)
        img_n2, img_shift_mlp, _, _ = self.img_norm2(img, temb)
        img_n3, img_gate_self, _, _ = self.img_norm3(img, temb)
        ins_n1, ins_gate_msa, ins_scale_mlp, ins_gate_mlp = self.instruct_norm1(instruct, temb)
        ins_n2, ins_shift_mlp, _, _ = self.instruct_norm2(instruct, temb)

        ins_attn, img_attn = self.img_instruct_attn(img_n1, ins_n1, packing, joint_rotary)
        img_self = self.img_self_attn(img_n3, img_mask, img_rotary)

        img = img + img_gate_msa.unsqueeze(1).tanh() * self.img_attn_norm(img_attn)
        img = img + img_gate_self.unsqueeze(1).tanh() * self.img_self_attn_norm(img_self)
        # The MLP reads the *block input*, modulated twice (§4.2): (1 + d0) inside img_norm2,
        # then (1 + s_mlp) and + shift, then RMS-normalised again by img_ffn_norm1.
        img_mlp_in = (1 + img_scale_mlp.unsqueeze(1)) * img_n2 + img_shift_mlp.unsqueeze(1)
        img_mlp = self.img_feed_forward(self.img_ffn_norm1(img_mlp_in))
        img = img + img_gate_mlp.unsqueeze(1).tanh() * self.img_ffn_norm2(img_mlp)

        instruct = instruct + ins_gate_msa.unsqueeze(1).tanh() * self.instruct_attn_norm(ins_attn)
        ins_mlp_in = (1 + ins_scale_mlp.unsqueeze(1)) * ins_n2 + ins_shift_mlp.unsqueeze(1)
        ins_mlp = self.instruct_feed_forward(self.instruct_ffn_norm1(ins_mlp_in))
        instruct = instruct + ins_gate_mlp.unsqueeze(1).tanh() * self.instruct_ffn_norm2(ins_mlp)
        return img, instruct
