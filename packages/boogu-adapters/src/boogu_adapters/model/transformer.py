"""``BooguImageTransformer2DModel``: our pure-PyTorch port of the Boogu-Image-0.1 DiT.

Contract: `docs/upstream-model.md` (section numbers below refer to it). The parameter tree
is the released checkpoint's (942 tensors, 10,292,556,288 parameters for the released config,
§2.4), so the released ``transformer/`` safetensors load unchanged, and ``forward`` keeps
upstream's signature, so the class drops in wherever upstream's is used.

Time and output convention (§5.3, §1) - the opposite of diffusers' SD3/Flux:

* ``timestep`` is Boogu time ``t`` in [0, 1], 0 = pure noise, 1 = clean data, with
  ``x_t = t·x0 + (1 - t)·eps``. The sinusoid multiplies it by ``timestep_scale`` (1000).
  A diffusers flow-matching scheduler's ``sigma`` maps to ``t = 1 - sigma``.
* The output is the Boogu velocity ``x0 - eps`` (diffusers schedulers expect ``eps - x0``:
  negate once).

Data flow of one forward (§5): instruction features -> context refiner; target patches ->
``x_embedder`` -> noise refiner; each reference image -> ``ref_image_patch_embedder`` + its
slot's ``image_index_embedding`` -> reference refiner (alone, with its sample's temb);
double-stream blocks over (image stream ``[refs ; target]``, instruction stream); fuse into
``[text ; refs ; target]`` with the instruction padding removed; single-stream blocks;
``norm_out``; unpatchify the target tokens only.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any, ClassVar

import torch
from diffusers.configuration_utils import ConfigMixin, register_to_config
from diffusers.loaders import PeftAdapterMixin
from diffusers.models.modeling_outputs import Transformer2DModelOutput
from diffusers.models.modeling_utils import ModelMixin
from diffusers.utils import USE_PEFT_BACKEND, logging, scale_lora_layers, unscale_lora_layers
from torch import nn

from .blocks import (
    BooguImageContextRefinerTransformerBlock,
    BooguImageDoubleStreamTransformerBlock,
    BooguImageNoiseRefinerTransformerBlock,
    BooguImageRefImgRefinerTransformerBlock,
    BooguImageSingleStreamTransformerBlock,
)
from .layers import CombinedTimestepCaptionEmbedding, ContinuousLayerNormOut
from .layout import StreamPacking, TokenLayout, pad_sequences, patchify, unpatchify
from .rope import RotaryTables, get_freqs_cis

__all__ = ["BooguImageTransformer2DModel"]

logger = logging.get_logger(__name__)

# RoPE base of every table (§6.1); upstream hard-codes it as well.
ROPE_THETA = 10000
# Rows of image_index_embedding: at most this many reference images per sample (§2.3).
MAX_REFERENCE_IMAGES = 5

LatentInput = torch.Tensor | Sequence[torch.Tensor]
"""Latents as a (B, C, H, W) tensor or a list of (C, H_b, W_b) tensors (sizes may differ)."""


def instruction_feature_dim(instruction_feature_configs: dict[str, Any]) -> int:
    """Width F of the instruction features after layer reduction (§2.6).

    Like upstream it reads the layer count from ``num_instruction_feat_layers`` (default 1), not
    from ``num_instruction_feature_layers``, the key the released config and pipeline use
    (§2.6): harmless for the release (1 layer, "mean"), and needed for identical shapes.
    """
    layers = max(int(instruction_feature_configs.get("num_instruction_feat_layers", 1)), 1)
    feat_dim = int(instruction_feature_configs.get("instruction_feat_dim", 4096))
    reduce_type = str(instruction_feature_configs.get("reduce_type", "concat")).lower()
    if "cat" in reduce_type:
        return layers * feat_dim
    if "mean" in reduce_type:
        return feat_dim
    raise ValueError(
        f"instruction_feature_configs.reduce_type={reduce_type!r} is not supported; "
        "use a value containing 'cat' or 'mean'"
    )


class BooguImageTransformer2DModel(ModelMixin, ConfigMixin, PeftAdapterMixin):
    """Boogu-Image mixed double-/single-stream diffusion transformer (10.29 B parameters released).

    ``__init__`` takes upstream's config keys with upstream's defaults (§2.1); the released
    checkpoint's ``transformer/config.json`` sets ``hidden_size=3360, num_layers=40,
    num_double_stream_layers=8, num_attention_heads=28, num_kv_heads=7, timestep_scale=1000``
    and ``instruction_feat_dim=4096``. ``num_layers`` counts double- and single-stream blocks
    together. ``prompt_tuning_configs`` is stored only (upstream never uses it either).

    Gradient checkpointing (``enable_gradient_checkpointing()``) recomputes every block in the
    backward pass, refiners included (upstream checkpoints only the main blocks; the values are
    identical, the memory lower). LoRA goes through diffusers' ``PeftAdapterMixin``
    (``add_adapter``, ``load_lora_adapter``...); see ``LORA_TARGET_MODULES`` in this package.
    """

    _supports_gradient_checkpointing = True
    _no_split_modules: ClassVar[list[str]] = [
        "BooguImageTransformerBlock",
        "BooguImageNoiseRefinerTransformerBlock",
        "BooguImageRefImgRefinerTransformerBlock",
        "BooguImageContextRefinerTransformerBlock",
        "BooguImageSingleStreamTransformerBlock",
        "BooguImageDoubleStreamTransformerBlock",
    ]
    # As upstream: the noise/reference refiners and double-stream blocks stay out of regional compile.
    _repeated_blocks: ClassVar[list[str]] = [
        "BooguImageTransformerBlock",
        "BooguImageContextRefinerTransformerBlock",
        "BooguImageSingleStreamTransformerBlock",
    ]
    _skip_layerwise_casting_patterns: ClassVar[list[str]] = ["x_embedder", "norm", "embedding"]

    @register_to_config
    def __init__(
        self,
        patch_size: int = 2,
        in_channels: int = 16,
        out_channels: int | None = None,
        hidden_size: int = 2304,
        num_layers: int = 26,
        num_double_stream_layers: int = 2,
        num_refiner_layers: int = 2,
        num_attention_heads: int = 24,
        num_kv_heads: int = 8,
        multiple_of: int = 256,
        ffn_dim_multiplier: float | None = None,
        norm_eps: float = 1e-5,
        axes_dim_rope: tuple[int, int, int] = (40, 40, 40),
        axes_lens: tuple[int, int, int] = (2048, 1664, 1664),
        # Upstream's defaults, kept as dict literals so the registered config matches upstream's;
        # they are never mutated.
        instruction_feature_configs: dict[str, Any] = {  # noqa: B006
            "instruction_feat_dim": 1024,
            "reduce_type": "mean",
            "num_instruction_feat_layers": 1,
        },
        prompt_tuning_configs: dict[str, Any] = {"use_prompt_tuning": False},  # noqa: B006
        timestep_scale: float = 1.0,
    ) -> None:
        super().__init__()
        if hidden_size % num_attention_heads:
            raise ValueError(
                f"hidden_size={hidden_size} must be divisible by num_attention_heads={num_attention_heads}"
            )
        head_dim = hidden_size // num_attention_heads
        if head_dim != sum(axes_dim_rope):
            raise ValueError(
                f"hidden_size // num_attention_heads = {head_dim} must equal sum(axes_dim_rope) = "
                f"{sum(axes_dim_rope)} (axes_dim_rope={list(axes_dim_rope)})"
            )
        if num_attention_heads % num_kv_heads:
            raise ValueError(
                f"num_attention_heads={num_attention_heads} must be a multiple of num_kv_heads={num_kv_heads}"
            )
        if num_double_stream_layers > num_layers:
            raise ValueError(
                f"num_double_stream_layers={num_double_stream_layers} cannot exceed num_layers={num_layers}"
            )
        if (
            "num_instruction_feature_layers" in instruction_feature_configs
            and "num_instruction_feat_layers" not in instruction_feature_configs
            and instruction_feature_configs["num_instruction_feature_layers"] != 1
        ):
            logger.warning(
                "instruction_feature_configs.num_instruction_feature_layers=%s is ignored, as upstream "
                "does: the layer count is read from num_instruction_feat_layers (default 1)",
                instruction_feature_configs["num_instruction_feature_layers"],
            )

        self.out_channels = out_channels or in_channels
        self.head_dim = head_dim
        self.preprocessed_instruction_feat_dim = instruction_feature_dim(instruction_feature_configs)
        conditioning_dim = min(hidden_size, 1024)
        patch_dim = patch_size * patch_size * in_channels
        block_args = (
            hidden_size,
            num_attention_heads,
            num_kv_heads,
            multiple_of,
            ffn_dim_multiplier,
            norm_eps,
        )

        # Registration order follows the released state dict (§2.3).
        self.x_embedder = nn.Linear(patch_dim, hidden_size, bias=True)
        self.ref_image_patch_embedder = nn.Linear(patch_dim, hidden_size, bias=True)
        self.time_caption_embed = CombinedTimestepCaptionEmbedding(
            hidden_size, self.preprocessed_instruction_feat_dim, norm_eps, timestep_scale
        )
        self.noise_refiner = nn.ModuleList(
            [BooguImageNoiseRefinerTransformerBlock(*block_args) for _ in range(num_refiner_layers)]
        )
        self.ref_image_refiner = nn.ModuleList(
            [BooguImageRefImgRefinerTransformerBlock(*block_args) for _ in range(num_refiner_layers)]
        )
        self.context_refiner = nn.ModuleList(
            [
                BooguImageContextRefinerTransformerBlock(*block_args, modulation=False)
                for _ in range(num_refiner_layers)
            ]
        )
        self.double_stream_layers = nn.ModuleList(
            [BooguImageDoubleStreamTransformerBlock(*block_args) for _ in range(num_double_stream_layers)]
        )
        self.single_stream_layers = nn.ModuleList(
            [
                BooguImageSingleStreamTransformerBlock(*block_args)
                for _ in range(num_layers - num_double_stream_layers)
            ]
        )
        self.norm_out = ContinuousLayerNormOut(
            hidden_size, conditioning_dim, patch_size * patch_size * self.out_channels, eps=1e-6
        )
        # One learned vector per reference-image slot, added before the reference refiner.
        self.image_index_embedding = nn.Parameter(torch.empty(MAX_REFERENCE_IMAGES, hidden_size))
        self.gradient_checkpointing = False
        self._reset_top_level_parameters()

    def _reset_top_level_parameters(self) -> None:
        """Upstream's init of the non-block parameters (§2.5); blocks initialise themselves.

        The output head and every adaLN linear start at zero, so a fresh model outputs exactly 0;
        use :func:`boogu_adapters.model.randomize_parameters` for tests that need a signal.
        """
        for embedder in (self.x_embedder, self.ref_image_patch_embedder):
            nn.init.xavier_uniform_(embedder.weight)
            nn.init.zeros_(embedder.bias)
        timestep_mlp = self.time_caption_embed.timestep_embedder
        for linear in (timestep_mlp.linear_1, timestep_mlp.linear_2):
            nn.init.normal_(linear.weight, std=0.02)
            nn.init.zeros_(linear.bias)
        caption_linear = self.time_caption_embed.caption_embedder[1]
        nn.init.trunc_normal_(caption_linear.weight, std=0.02)
        nn.init.zeros_(caption_linear.bias)
        for linear in (self.norm_out.linear_1, self.norm_out.linear_2):
            nn.init.zeros_(linear.weight)
            nn.init.zeros_(linear.bias)
        nn.init.normal_(self.image_index_embedding, std=0.02)

    @property
    def layers(self) -> list[nn.Module]:
        """Double-stream then single-stream blocks (upstream exposes this plain list too)."""
        return [*self.double_stream_layers, *self.single_stream_layers]

    # ------------------------------------------------------------------ inputs

    def preprocess_instruction_hidden_states(
        self, instruction_hidden_states: torch.Tensor | Sequence[torch.Tensor]
    ) -> torch.Tensor:
        """Reduce per-layer MLLM features to one (B, L, F) tensor (§2.6).

        A tensor is used as is; a list/tuple must hold ``num_instruction_feat_layers`` tensors,
        joined along the features ("cat") or averaged ("mean").
        """
        configs = self.config.instruction_feature_configs
        if isinstance(instruction_hidden_states, torch.Tensor):
            features = instruction_hidden_states
        elif isinstance(instruction_hidden_states, (list, tuple)):
            expected = max(int(configs.get("num_instruction_feat_layers", 1)), 1)
            if len(instruction_hidden_states) != expected:
                raise ValueError(
                    f"instruction_hidden_states holds {len(instruction_hidden_states)} layers, "
                    f"the config expects {expected} (instruction_feature_configs.num_instruction_feat_layers)"
                )
            reduce_type = str(configs.get("reduce_type", "concat")).lower()
            if "cat" in reduce_type:
                features = torch.cat(list(instruction_hidden_states), dim=-1)
            else:
                features = torch.stack(list(instruction_hidden_states)).mean(dim=0)
        else:
            raise TypeError(
                "instruction_hidden_states must be a tensor or a list of per-layer tensors, "
                f"got {type(instruction_hidden_states).__name__}"
            )
        if features.ndim != 3 or features.shape[-1] != self.preprocessed_instruction_feat_dim:
            raise ValueError(
                f"instruction features must be (B, L, {self.preprocessed_instruction_feat_dim}), "
                f"got {tuple(features.shape)}"
            )
        return features

    def _text_lengths(
        self, mask: torch.Tensor | None, batch: int, width: int, device: torch.device
    ) -> list[int]:
        """Valid instruction tokens per sample; the mask must be right-padded (§5.1)."""
        if mask is None:
            return [width] * batch
        if tuple(mask.shape) != (batch, width):
            raise ValueError(
                f"instruction_attention_mask must be (B, L) = {(batch, width)}, got {tuple(mask.shape)}"
            )
        valid = mask.to(device=device, dtype=torch.bool)
        lengths = valid.sum(dim=1)
        # Upstream silently assumes right padding (valid tokens first); a left-padded mask would
        # give wrong text positions and keep padding in the joint sequence. Refuse it instead.
        if not torch.equal(valid, torch.arange(width, device=device)[None, :] < lengths[:, None]):
            raise ValueError(
                "instruction_attention_mask must be right-padded: each row's valid (1) tokens must "
                "come first, followed only by padding (0)"
            )
        return lengths.tolist()

    def _collect_images(
        self,
        hidden_states: LatentInput,
        ref_image_hidden_states: Sequence[Sequence[torch.Tensor] | torch.Tensor | None] | None,
    ) -> tuple[list[torch.Tensor], list[list[torch.Tensor]]]:
        """Validate latents; return targets [(C, H, W)] and, per sample, references [(C, h, w)]."""
        p, channels = self.config.patch_size, self.config.in_channels
        if isinstance(hidden_states, torch.Tensor):
            if hidden_states.ndim != 4:
                raise ValueError(f"hidden_states must be (B, C, H, W), got {tuple(hidden_states.shape)}")
            targets = list(hidden_states.unbind(0))
        else:
            targets = list(hidden_states)
        if not targets:
            raise ValueError("hidden_states is empty")
        batch = len(targets)
        if ref_image_hidden_states is None:
            references: list[list[torch.Tensor]] = [[] for _ in range(batch)]
        else:
            if len(ref_image_hidden_states) != batch:
                raise ValueError(
                    f"ref_image_hidden_states has {len(ref_image_hidden_states)} entries for a batch of {batch}"
                )
            references = [[] if refs is None else list(refs) for refs in ref_image_hidden_states]

        def check(latent: torch.Tensor, what: str) -> None:
            if latent.ndim != 3 or latent.shape[0] != channels or latent.shape[1] % p or latent.shape[2] % p:
                raise ValueError(
                    f"{what} must be ({channels}, H, W) with H and W multiples of patch_size={p}, "
                    f"got {tuple(latent.shape)}"
                )

        for b, target in enumerate(targets):
            check(target, f"hidden_states[{b}]")
        for b, refs in enumerate(references):
            if len(refs) > MAX_REFERENCE_IMAGES:
                raise ValueError(
                    f"sample {b} has {len(refs)} reference images; at most {MAX_REFERENCE_IMAGES} are supported"
                )
            for j, ref in enumerate(refs):
                check(ref, f"ref_image_hidden_states[{b}][{j}]")
        return targets, references

    def _timestep(self, timestep: torch.Tensor | float, batch: int, device: torch.device) -> torch.Tensor:
        """(B,) Boogu times; a scalar or a single value is broadcast to the batch."""
        timestep = torch.as_tensor(timestep, device=device)
        if timestep.ndim == 0 or tuple(timestep.shape) == (1,):
            return timestep.reshape(1).expand(batch)
        if tuple(timestep.shape) != (batch,):
            raise ValueError(f"timestep must be (B,) = ({batch},), got {tuple(timestep.shape)}")
        return timestep

    # ------------------------------------------------------------------ forward

    def _run_block(self, block: nn.Module, *args: Any) -> Any:
        if torch.is_grad_enabled() and self.gradient_checkpointing:
            return self._gradient_checkpointing_func(block, *args)
        return block(*args)

    def forward(
        self,
        hidden_states: LatentInput,
        timestep: torch.Tensor,
        instruction_hidden_states: torch.Tensor | Sequence[torch.Tensor],
        freqs_cis: Sequence[torch.Tensor] | None,
        instruction_attention_mask: torch.Tensor | None,
        ref_image_hidden_states: Sequence[Sequence[torch.Tensor] | None] | None = None,
        attention_kwargs: dict[str, Any] | None = None,
        return_dict: bool = False,
    ) -> torch.Tensor | list[torch.Tensor] | Transformer2DModelOutput:
        """Predict the Boogu velocity ``x0 - eps`` of the target latents.

        Args:
            hidden_states: noisy target latents, (B, C, H, W) or a list of (C, H_b, W_b);
                H, W multiples of ``patch_size``.
            timestep: (B,) Boogu time t in [0, 1] (0 = noise, 1 = data); a scalar or (1,) value
                is broadcast.
            instruction_hidden_states: (B, L, F) MLLM features, right-padded, or a list of
                per-layer tensors (§2.6).
            freqs_cis: per-axis complex RoPE tables from :func:`get_freqs_cis`
                ``(config.axes_dim_rope, config.axes_lens, 10000)``; None builds them here.
            instruction_attention_mask: (B, L), 1/True = valid token, valid tokens first;
                None = every token valid.
            ref_image_hidden_states: None, or per sample None / a list of up to 5 (C, h_j, w_j)
                reference latents (scaled like the target).
            attention_kwargs: only ``"scale"`` is read: the LoRA scale (PEFT backend).
            return_dict: False (default, as upstream) returns the bare tensor or list - not a
                tuple; True wraps it in ``Transformer2DModelOutput(sample=...)``.

        Returns:
            The velocity of the target only, (B, C_out, H, W) for tensor input, else a list of
            (C_out, H_b, W_b).
        """
        lora_scale = 1.0
        if attention_kwargs is not None:
            attention_kwargs = dict(attention_kwargs)
            lora_scale = attention_kwargs.pop("scale", 1.0)
            if not USE_PEFT_BACKEND and lora_scale != 1.0:
                logger.warning("attention_kwargs['scale'] has no effect without the PEFT backend")
        if USE_PEFT_BACKEND:
            scale_lora_layers(self, lora_scale)
        try:
            output = self._forward(
                hidden_states,
                timestep,
                instruction_hidden_states,
                freqs_cis,
                instruction_attention_mask,
                ref_image_hidden_states,
            )
        finally:
            if USE_PEFT_BACKEND:
                unscale_lora_layers(self, lora_scale)
        if isinstance(hidden_states, torch.Tensor):
            output = torch.stack(output, dim=0)
        return Transformer2DModelOutput(sample=output) if return_dict else output

    def _forward(
        self,
        hidden_states: LatentInput,
        timestep: torch.Tensor,
        instruction_hidden_states: torch.Tensor | Sequence[torch.Tensor],
        freqs_cis: Sequence[torch.Tensor] | None,
        instruction_attention_mask: torch.Tensor | None,
        ref_image_hidden_states: Sequence[Sequence[torch.Tensor] | None] | None,
    ) -> list[torch.Tensor]:
        config = self.config
        p = config.patch_size
        targets, references = self._collect_images(hidden_states, ref_image_hidden_states)
        batch, device, dtype = len(targets), targets[0].device, targets[0].dtype

        # 1-2. Instruction features and embeddings (§2.6, §3.5).
        instruct = self.preprocess_instruction_hidden_states(instruction_hidden_states)
        if instruct.shape[0] != batch:
            raise ValueError(f"instruction_hidden_states has batch {instruct.shape[0]}, the latents {batch}")
        text_width = instruct.shape[1]
        layout = TokenLayout(
            text_lengths=self._text_lengths(instruction_attention_mask, batch, text_width, device),
            target_grids=[(t.shape[1] // p, t.shape[2] // p) for t in targets],
            reference_grids=[[(r.shape[1] // p, r.shape[2] // p) for r in refs] for refs in references],
        )
        temb, instruct = self.time_caption_embed(self._timestep(timestep, batch, device), instruct, dtype)
        # temb: (B, T); instruct: (B, L, D)

        # 3-4. Rotary tensors of every stage from one position assignment (§6.2).
        if freqs_cis is None:
            freqs_cis = get_freqs_cis(config.axes_dim_rope, config.axes_lens, ROPE_THETA)
        tables = RotaryTables(freqs_cis, self.head_dim, device)
        tables.check_range(layout.max_positions())
        positions = layout.segment_positions(device)  # per sample [text, ref_1..ref_K, target]
        text_rotary = tables.lookup(pad_sequences([seg[0] for seg in positions], text_width)[0])
        target_rotary = tables.lookup(pad_sequences([seg[-1] for seg in positions])[0])
        image_rotary = tables.lookup(pad_sequences([torch.cat(seg[1:]) for seg in positions])[0])
        joint_rotary = tables.lookup(pad_sequences([torch.cat(seg) for seg in positions])[0])
        # Padded slots hold position (0, 0, 0), the identity rotation; they are masked anyway.

        # 5. Context refiner over the instruction tokens alone (no temb).
        text_mask = (
            torch.arange(text_width, device=device)[None, :]
            < torch.tensor(layout.text_lengths, device=device)[:, None]
        )
        for block in self.context_refiner:
            instruct = self._run_block(block, instruct, text_mask, text_rotary)

        # 6. Target tokens -> x_embedder -> noise refiner.
        target_tokens, target_mask = pad_sequences([patchify(t, p) for t in targets])  # (B, Tmax, P)
        target = self.x_embedder(target_tokens)
        for block in self.noise_refiner:
            target = self._run_block(block, target, target_mask, target_rotary, temb)

        # 6'. References: one row per image across the batch, each refined alone (§5.2 step 6).
        refined_refs = self._embed_and_refine_references(references, positions, tables, temb)

        # Image stream per sample: [ref_1 ... ref_K ; target], valid tokens only.
        image_rows = []
        for b in range(batch):
            parts = [*refined_refs[b], target[b, : layout.target_lengths[b]]]
            image_rows.append(torch.cat(parts))
        image, image_mask = pad_sequences(image_rows)  # (B, Imax, D)

        # 7. Double-stream blocks. The packing joins [valid text ; image] per sample.
        packing = StreamPacking(layout.text_lengths, text_width, layout.image_lengths, image.shape[1], device)
        for block in self.double_stream_layers:
            image, instruct = self._run_block(
                block, image, instruct, image_mask, image_rotary, packing, joint_rotary, temb
            )

        # 8-9. Fuse into the joint sequence (instruction padding dropped) and run single-stream blocks.
        joint = packing.merge(instruct, image)  # (B, Smax, D)
        for block in self.single_stream_layers:
            joint = self._run_block(block, joint, packing.mask, joint_rotary, temb)

        # 10-11. Output head, then keep the target's tokens only: the last T_b valid ones.
        joint = self.norm_out(joint, temb)  # (B, Smax, p·p·C_out)
        outputs = []
        for b, (rows, cols) in enumerate(layout.target_grids):
            end = layout.joint_lengths[b]
            outputs.append(unpatchify(joint[b, end - rows * cols : end], rows, cols, p))
        return outputs

    def _embed_and_refine_references(
        self,
        references: list[list[torch.Tensor]],
        positions: list[list[torch.Tensor]],
        tables: RotaryTables,
        temb: torch.Tensor,
    ) -> list[list[torch.Tensor]]:
        """Embed and refine every reference image; returns, per sample, [(n_j, D)] refined tokens.

        All references of the batch form one temporary batch (one row per image, padded to the
        longest). Row j of sample b gets ``image_index_embedding[j]`` (added after the patch
        embedder, before the refiner), its own RoPE slice and sample b's temb: a reference
        attends only to its own tokens and sees the target's timestep (§5.2 step 6).
        """
        p = self.config.patch_size
        owners = [b for b, refs in enumerate(references) for _ in refs]
        if not owners:
            return [[] for _ in references]
        slots = [j for refs in references for j in range(len(refs))]
        tokens, mask = pad_sequences([patchify(ref, p) for refs in references for ref in refs])
        rotary = tables.lookup(pad_sequences([pos for segs in positions for pos in segs[1:-1]])[0])
        device = tokens.device
        slot_index = torch.tensor(slots, device=device)
        hidden = self.ref_image_patch_embedder(tokens) + self.image_index_embedding[slot_index][:, None, :]
        ref_temb = temb[torch.tensor(owners, device=device)]
        for block in self.ref_image_refiner:
            hidden = self._run_block(block, hidden, mask, rotary, ref_temb)
        lengths = mask.sum(dim=1).tolist()
        result: list[list[torch.Tensor]] = [[] for _ in references]
        for row, owner in enumerate(owners):
            result[owner].append(hidden[row, : lengths[row]])
        return result


def count_parameters(module: nn.Module) -> int:
    """Total number of parameter elements (works on the meta device)."""
    return sum(math.prod(param.shape) for param in module.parameters())
