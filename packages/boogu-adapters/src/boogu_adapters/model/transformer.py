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
from collections import OrderedDict
from collections.abc import Sequence
from typing import Any, ClassVar

import torch
import torch.nn.functional as F
from diffusers.configuration_utils import ConfigMixin, register_to_config
from diffusers.loaders import PeftAdapterMixin
from diffusers.models.modeling_outputs import Transformer2DModelOutput
from diffusers.models.modeling_utils import ModelMixin
from diffusers.utils import USE_PEFT_BACKEND, logging, scale_lora_layers, unscale_lora_layers
from torch import nn

from .attention import AttentionPlan
from .blocks import (
    BooguImageContextRefinerTransformerBlock,
    BooguImageDoubleStreamTransformerBlock,
    BooguImageNoiseRefinerTransformerBlock,
    BooguImageRefImgRefinerTransformerBlock,
    BooguImageSingleStreamTransformerBlock,
)
from .layers import CombinedTimestepCaptionEmbedding, ContinuousLayerNormOut
from .layout import (
    StreamPacking,
    TokenLayout,
    host_to_device,
    length_mask,
    pad_sequences,
    patchify,
    unpatchify,
)
from .rope import RotaryTables, get_freqs_cis, rotary_dtype

__all__ = ["BooguImageTransformer2DModel", "InstructionCache"]

logger = logging.get_logger(__name__)

# RoPE base of every table (§6.1); upstream hard-codes it as well.
ROPE_THETA = 10000
# Rows of image_index_embedding: at most this many reference images per sample (§2.3).
MAX_REFERENCE_IMAGES = 5
# Per-layout rotary tensors kept (LRU): the layout of a rollout recurs on every denoising step
# and in the training recomputation; a few prompt groups in flight fit.
ROTARY_CACHE_SIZE = 8
_TABLES_CACHE_SIZE = 4


def _round_up(value: int, multiple: int) -> int:
    return -(-value // multiple) * multiple


class InstructionCache:
    """The text path of a forward (§5.2 steps 2 and 5: caption embedder, then context refiner), kept
    for the next forwards over the same instruction features.

    That path sees neither the timestep nor the latents, so the denoising steps of one rollout
    compute the same tokens at every step. Pass one cache per conditioning to every forward of the
    rollout (``instruction_cache=``): the first forward stores its refined tokens, the later ones
    reuse them while the features are the same tensor object, unmodified, with the same lengths and
    widths, and the weights of the path (parameters, their in-place updates, LoRA switches and
    scales) are unchanged; anything else recomputes and replaces the entry. A reused value is the
    very tensor the first forward computed from the same inputs, so results are bitwise those of a
    forward without the cache. Forwards with autograd on never read or fill it (the gradient must
    reach the path's LoRA weights).
    """

    def __init__(self) -> None:
        self._key: tuple[Any, ...] | None = None
        self._features: Any = None
        self._tokens: torch.Tensor | None = None
        self.hits = 0
        """Forwards that reused the stored tokens."""

    def _get(self, features: Any, key: tuple[Any, ...]) -> torch.Tensor | None:
        if self._tokens is None or self._features is not features or self._key != key:
            return None
        self.hits += 1
        return self._tokens

    def _put(self, features: Any, key: tuple[Any, ...], tokens: torch.Tensor) -> None:
        # Holding ``features`` keeps its id from being reused by another tensor while the entry lives.
        self._key, self._features, self._tokens = key, features, tokens


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
        self._init_fast_path_state()

    def _init_fast_path_state(self) -> None:
        """Host-side caches and regional-compile state (not parameters, not in the state dict)."""
        self._tables_cache: OrderedDict[Any, tuple[Any, RotaryTables]] = OrderedDict()
        self._rotary_cache: OrderedDict[Any, tuple[RotaryTables, dict[str, Any]]] = OrderedDict()
        self._compile_bucket: int | None = None
        self._compiled_stages: frozenset[str] = frozenset()
        self.last_layout: TokenLayout | None = None
        """Host-side layout of the most recent forward (segment sizes; for FLOP accounting)."""
        self.last_text_path_reused = False
        """Whether the most recent forward took its text path from an `InstructionCache`."""
        self.pad_reference_stage = False
        """Run the reference stage on a one-token placeholder when a batch has no reference image.

        Under FSDP2 every reference-refiner block is a unit whose forward all-gathers and whose
        backward reduce-scatters; a rank with edit rows and a rank without would issue different
        collectives and hang. With this on (``shard_transformer`` sets it), every forward runs the
        reference stage, and the placeholder's output joins the target as ``0 * sum(out)``: the
        velocity is unchanged and every reference parameter gets a (zero) gradient on every rank."""
        self.placeholder_running = False
        """True while the placeholder reference stage runs (hooks that watch which modules ran skip it)."""

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
        self,
        mask: torch.Tensor | None,
        batch: int,
        width: int,
        instruction_lengths: Sequence[int] | None = None,
    ) -> list[int]:
        """Valid instruction tokens per sample; the mask must be right-padded (§5.1).

        Given ``instruction_lengths`` (host ints) the lengths are taken from it and a mask on a
        device is trusted, never read back (no device-to-host sync); a CPU mask is still checked
        against it. Without them the mask is read once (one sync on a GPU).
        """
        if mask is not None and tuple(mask.shape) != (batch, width):
            raise ValueError(
                f"instruction_attention_mask must be (B, L) = {(batch, width)}, got {tuple(mask.shape)}"
            )
        if instruction_lengths is not None:
            lengths = [int(n) for n in instruction_lengths]
            if len(lengths) != batch or any(n < 0 or n > width for n in lengths):
                raise ValueError(
                    f"instruction_lengths must hold {batch} ints in [0, {width}], got {list(instruction_lengths)}"
                )
            if (
                mask is not None
                and mask.device.type == "cpu"
                and not torch.equal(mask.to(torch.bool), length_mask(lengths, width, mask.device))
            ):
                raise ValueError(
                    f"instruction_lengths={lengths} do not match instruction_attention_mask (which must be "
                    "right-padded: each row's valid (1) tokens first, then only padding (0))"
                )
            return lengths
        if mask is None:
            return [width] * batch
        valid = mask.to(torch.bool)
        counts = valid.sum(dim=1)
        right_padded = (valid == (torch.arange(width, device=valid.device)[None, :] < counts[:, None])).all(
            dim=1
        )
        # One host read for both (a single sync on a GPU; pass instruction_lengths to avoid it).
        counts_host, ok_host = torch.stack([counts, right_padded.to(counts.dtype)]).tolist()
        # Upstream silently assumes right padding (valid tokens first); a left-padded mask would
        # give wrong text positions and keep padding in the joint sequence. Refuse it instead.
        if not all(ok_host):
            raise ValueError(
                "instruction_attention_mask must be right-padded: each row's valid (1) tokens must "
                "come first, followed only by padding (0)"
            )
        return [int(n) for n in counts_host]

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
        if not isinstance(timestep, torch.Tensor):
            timestep = torch.as_tensor(timestep)
        timestep = host_to_device(timestep, device)
        if timestep.ndim == 0 or tuple(timestep.shape) == (1,):
            return timestep.reshape(1).expand(batch)
        if tuple(timestep.shape) != (batch,):
            raise ValueError(f"timestep must be (B,) = ({batch},), got {tuple(timestep.shape)}")
        return timestep

    # ------------------------------------------------------------------ fast-path state

    def _rotary_tables(self, freqs_cis: Sequence[torch.Tensor] | None, device: torch.device) -> RotaryTables:
        """Real float64 tables of ``freqs_cis`` on ``device``, built once per (tensors, device)."""
        if freqs_cis is None:
            key: Any = ("default", device)
        else:
            freqs_cis = tuple(freqs_cis)
            key = (tuple(id(t) for t in freqs_cis), tuple(t._version for t in freqs_cis), device)
        hit = self._tables_cache.get(key)
        if hit is not None:
            self._tables_cache.move_to_end(key)
            return hit[1]
        if freqs_cis is None:
            config = self.config
            freqs_cis = tuple(get_freqs_cis(config.axes_dim_rope, config.axes_lens, ROPE_THETA))
        tables = RotaryTables(freqs_cis, self.head_dim, device)
        # The entry keeps the freqs tensors alive, so their ids in the key cannot be reused.
        self._tables_cache[key] = (freqs_cis, tables)
        while len(self._tables_cache) > _TABLES_CACHE_SIZE:
            self._tables_cache.popitem(last=False)
        return tables

    def _stage_rotary(
        self, tables: RotaryTables, layout: TokenLayout, text_width: int, joint_width: int, dtype: torch.dtype
    ) -> dict[str, torch.Tensor | None]:
        """Rotary tensors of every stage for ``layout`` (§6.2), cached per layout signature (LRU).

        Keys ``text`` (B, text_width), ``target`` (B, Tmax), ``references`` (R, Rmax) or None,
        ``image`` (B, Imax) and ``joint`` (B, joint_width), each ``(..., d/2, 2)`` in
        ``rotary_dtype(dtype)``. Positions are built on the host, moved without a blocking copy
        and looked up in the float64 tables; each value is rounded once to the compute dtype.
        """
        signature = (
            tuple(layout.text_lengths),
            tuple(layout.target_grids),
            tuple(tuple(grids) for grids in layout.reference_grids),
        )
        key = (id(tables), signature, text_width, joint_width, rotary_dtype(dtype))
        hit = self._rotary_cache.get(key)
        if hit is not None and hit[0] is tables:
            self._rotary_cache.move_to_end(key)
            return hit[1]
        tables.check_range(layout.max_positions())
        device = tables.tables[0].device
        compute = rotary_dtype(dtype)
        positions = layout.segment_positions(torch.device("cpu"))  # per sample [text, refs..., target]

        def lookup(rows: list[torch.Tensor], width: int | None = None) -> torch.Tensor:
            padded = pad_sequences(rows, width)[0]  # host (N, W, 3); padded slots (0, 0, 0) = identity
            return tables.lookup(host_to_device(padded, device)).to(compute)

        ref_rows = [pos for segs in positions for pos in segs[1:-1]]
        rotary = {
            "text": lookup([seg[0] for seg in positions], text_width),
            "target": lookup([seg[-1] for seg in positions]),
            "references": lookup(ref_rows) if ref_rows else None,
            "image": lookup([torch.cat(seg[1:]) for seg in positions]),
            "joint": lookup([torch.cat(seg) for seg in positions], joint_width),
        }
        self._rotary_cache[key] = (tables, rotary)
        while len(self._rotary_cache) > ROTARY_CACHE_SIZE:
            self._rotary_cache.popitem(last=False)
        return rotary

    def _stage_key_mask(self, stage: str, plan: AttentionPlan) -> AttentionPlan | torch.Tensor:
        """What a stage's blocks get: the plan (eager) or its mask tensor (compiled blocks)."""
        return plan.mask if stage in self._compiled_stages else plan

    # ------------------------------------------------------------------ regional compile

    def enable_regional_compile(
        self, bucket: int = 64, *, include_double_stream: bool = True, **compile_kwargs: Any
    ) -> None:
        """``torch.compile`` every repeated block in place, and bucket the sequence widths.

        Each block instance of ``_repeated_blocks`` (context refiner, single-stream) - and of the
        double-stream blocks unless ``include_double_stream=False`` - is compiled with
        ``block.compile(**compile_kwargs)``: module names, state-dict and LoRA keys are unchanged
        (no ``OptimizedModule`` wrapper), and the instances of one class share one graph. The
        padded instruction width and the joint width are rounded up to multiples of ``bucket``,
        and compiled blocks take the masked attention path (masks are tensor inputs), so a new
        prompt length in the same bucket, or a new timestep, reuses the graphs. The noise and
        reference refiners stay eager. Calling it again re-compiles with the new arguments; it
        composes with gradient checkpointing and peft LoRA layers. Undo: ``disable_regional_compile``.
        """
        if bucket < 1:
            raise ValueError(f"bucket must be a positive int, got {bucket}")
        stages = {"context": self.context_refiner, "single": self.single_stream_layers}
        if include_double_stream:
            stages["double"] = self.double_stream_layers
        self.disable_regional_compile()
        for blocks in stages.values():
            for block in blocks:
                block.compile(**compile_kwargs)
        self._compile_bucket = bucket
        self._compiled_stages = frozenset(stages)

    def disable_regional_compile(self) -> None:
        """Back to eager blocks and unbucketed widths (a no-op when compile is off)."""
        for blocks in (self.context_refiner, self.single_stream_layers, self.double_stream_layers):
            for block in blocks:
                block._compiled_call_impl = None
        self._compile_bucket = None
        self._compiled_stages = frozenset()

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
        *,
        instruction_lengths: Sequence[int] | None = None,
        instruction_cache: InstructionCache | None = None,
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
            instruction_lengths: keyword-only, ours: the valid tokens per sample as host ints
                (``mask.sum(1)``). Given, the mask on a GPU is never read back, and a forward
                makes no device-to-host sync; a CPU mask is checked against it (ValueError).
            instruction_cache: keyword-only, ours: an :class:`InstructionCache` shared by the
                forwards of one rollout over the same instruction features (without autograd), so
                the caption embedder and context refiner run once instead of once per step.

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
                instruction_lengths,
                instruction_cache,
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
        instruction_lengths: Sequence[int] | None = None,
        instruction_cache: InstructionCache | None = None,
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
            text_lengths=self._text_lengths(
                instruction_attention_mask, batch, text_width, instruction_lengths
            ),
            target_grids=[(t.shape[1] // p, t.shape[2] // p) for t in targets],
            reference_grids=[[(r.shape[1] // p, r.shape[2] // p) for r in refs] for refs in references],
        )
        self.last_layout = layout
        bucket = self._compile_bucket
        if bucket is not None and text_width % bucket:
            # Regional compile: a bucketed width keeps shapes fixed across prompt lengths. The
            # extra slots are padding like any other (masked, then squeezed out by the packing).
            instruct = F.pad(instruct, (0, 0, 0, _round_up(text_width, bucket) - text_width))
            text_width = instruct.shape[1]
        timestep = self._timestep(timestep, batch, device)
        cache = None if instruction_cache is None or torch.is_grad_enabled() else instruction_cache
        cache_key = (
            None
            if cache is None
            else self._text_path_key(instruction_hidden_states, layout, text_width, dtype)
        )
        refined = None if cache is None else cache._get(instruction_hidden_states, cache_key)
        self.last_text_path_reused = refined is not None
        if refined is None:
            temb, instruct = self.time_caption_embed(timestep, instruct, dtype)
        else:
            temb = self.time_caption_embed.timestep_embedding(timestep, dtype)
        # temb: (B, T); instruct: (B, L, D)

        # 3-4. Rotary tensors of every stage from one position assignment (§6.2), cached per layout;
        # attention plans of every stage from the host-side lengths.
        joint_width = max(layout.joint_lengths)
        if bucket is not None:
            joint_width = _round_up(joint_width, bucket)
        tables = self._rotary_tables(freqs_cis, device)
        rotary = self._stage_rotary(tables, layout, text_width, joint_width, dtype)
        # Padded slots hold position (0, 0, 0), the identity rotation; they are masked anyway.

        # 5. Context refiner over the instruction tokens alone (no temb).
        if refined is None:
            text_plan = AttentionPlan(
                layout.text_lengths, text_width, device, masked="context" in self._compiled_stages
            )
            text_key = self._stage_key_mask("context", text_plan)
            for block in self.context_refiner:
                instruct = self._run_block(block, instruct, text_key, rotary["text"])
            if cache is not None:
                cache._put(instruction_hidden_states, cache_key, instruct)
        else:
            instruct = refined

        # 6. Target tokens -> x_embedder -> noise refiner.
        target_tokens, target_mask = pad_sequences([patchify(t, p) for t in targets])  # (B, Tmax, P)
        target_plan = AttentionPlan(layout.target_lengths, target_tokens.shape[1], device, target_mask)
        target = self.x_embedder(target_tokens)
        for block in self.noise_refiner:
            target = self._run_block(block, target, target_plan, rotary["target"], temb)

        # 6'. References: one row per image across the batch, each refined alone (§5.2 step 6).
        refined_refs = self._embed_and_refine_references(references, layout, rotary["references"], temb)
        if self.pad_reference_stage and not any(references):
            target = target + self._placeholder_reference_stage(temb, rotary["target"], target.dtype)

        # Image stream per sample: [ref_1 ... ref_K ; target], valid tokens only.
        image_rows = []
        for b in range(batch):
            parts = [*refined_refs[b], target[b, : layout.target_lengths[b]]]
            image_rows.append(torch.cat(parts))
        image, image_mask = pad_sequences(image_rows)  # (B, Imax, D)
        image_plan = AttentionPlan(
            layout.image_lengths, image.shape[1], device, image_mask, masked="double" in self._compiled_stages
        )
        image_key = self._stage_key_mask("double", image_plan)

        # 7. Double-stream blocks. The packing joins [valid text ; image] per sample.
        packing = StreamPacking(
            layout.text_lengths, text_width, layout.image_lengths, image.shape[1], device, width=joint_width
        )
        joint_plan = AttentionPlan(packing.lengths, joint_width, device, packing.mask)
        packing.plan = None if "double" in self._compiled_stages else joint_plan
        for block in self.double_stream_layers:
            image, instruct = self._run_block(
                block, image, instruct, image_key, rotary["image"], packing, rotary["joint"], temb
            )

        # 8-9. Fuse into the joint sequence (instruction padding dropped) and run single-stream blocks.
        joint = packing.merge(instruct, image)  # (B, S, D)
        joint_key = self._stage_key_mask("single", joint_plan)
        for block in self.single_stream_layers:
            joint = self._run_block(block, joint, joint_key, rotary["joint"], temb)

        # 10-11. Output head, then keep the target's tokens only: the last T_b valid ones.
        joint = self.norm_out(joint, temb)  # (B, S, p·p·C_out)
        outputs = []
        joint_lengths = layout.joint_lengths  # a property that sums over the batch: read it once
        for b, (rows, cols) in enumerate(layout.target_grids):
            end = joint_lengths[b]
            outputs.append(unpatchify(joint[b, end - rows * cols : end], rows, cols, p))
        return outputs

    def _text_path_key(
        self,
        features: torch.Tensor | Sequence[torch.Tensor],
        layout: TokenLayout,
        text_width: int,
        dtype: torch.dtype,
    ) -> tuple[Any, ...]:
        """What the text path's output depends on besides the identity of the features object
        (`InstructionCache`): the features' in-place version counters, lengths, widths, dtype,
        compile state, and the state of its weights: each parameter object and its version counter
        (an optimizer step or a weight load bumps it), each LoRA layer's switch, forward kind, active
        adapters and scales (``adapters_disabled``, ``set_lora_forward``, ``scale_lora_layers``)."""
        tensors = [features] if isinstance(features, torch.Tensor) else list(features)
        weights = []
        for module in (self.time_caption_embed.caption_embedder, self.context_refiner):
            weights.extend((id(p), p._version) for p in module.parameters())
            for layer in module.modules():
                if hasattr(layer, "disable_adapters") and hasattr(layer, "scaling"):
                    weights.append(
                        (
                            type(layer),  # the LoRA forward (fused or peft's: lora.set_lora_forward)
                            layer.disable_adapters,
                            tuple(layer.active_adapters),
                            tuple(layer.scaling.items()),
                        )
                    )
        return (
            tuple(t._version for t in tensors),
            tuple(layout.text_lengths),
            text_width,
            dtype,
            self._compile_bucket,
            self._compiled_stages,
            tuple(weights),
        )

    def _embed_and_refine_references(
        self,
        references: list[list[torch.Tensor]],
        layout: TokenLayout,
        rotary: torch.Tensor | None,
        temb: torch.Tensor,
    ) -> list[list[torch.Tensor]]:
        """Embed and refine every reference image; returns, per sample, [(n_j, D)] refined tokens.

        All references of the batch form one temporary batch (one row per image, padded to the
        longest; ``rotary`` is its (R, Rmax, d/2, 2) slice). Row j of sample b gets
        ``image_index_embedding[j]`` (added after the patch embedder, before the refiner), its own
        RoPE slice and sample b's temb: a reference attends only to its own tokens and sees the
        target's timestep (§5.2 step 6). Lengths come from the grids, never from a device tensor.
        """
        p = self.config.patch_size
        owners = [b for b, refs in enumerate(references) for _ in refs]
        if not owners:
            return [[] for _ in references]
        slots = [j for refs in references for j in range(len(refs))]
        lengths = [n for per_sample in layout.reference_lengths for n in per_sample]
        tokens, mask = pad_sequences([patchify(ref, p) for refs in references for ref in refs])
        plan = AttentionPlan(lengths, tokens.shape[1], tokens.device, mask)
        device = tokens.device
        slot_index = host_to_device(torch.tensor(slots), device)
        hidden = self.ref_image_patch_embedder(tokens) + self.image_index_embedding[slot_index][:, None, :]
        ref_temb = temb[host_to_device(torch.tensor(owners), device)]
        for block in self.ref_image_refiner:
            hidden = self._run_block(block, hidden, plan, rotary, ref_temb)
        result: list[list[torch.Tensor]] = [[] for _ in references]
        for row, owner in enumerate(owners):
            result[owner].append(hidden[row, : lengths[row]])
        return result

    def _placeholder_reference_stage(
        self, temb: torch.Tensor, target_rotary: torch.Tensor, dtype: torch.dtype
    ) -> torch.Tensor:
        """A scalar zero computed through the whole reference stage (see ``pad_reference_stage``):
        one all-zero patch through ``ref_image_patch_embedder``, slot 0's index embedding and every
        reference-refiner block, with the first target token's rotary and the first sample's temb."""
        p = self.config.patch_size
        tokens = temb.new_zeros(1, 1, p * p * self.config.in_channels, dtype=dtype)
        plan = AttentionPlan([1], 1, tokens.device)
        self.placeholder_running = True
        try:
            hidden = self.ref_image_patch_embedder(tokens) + self.image_index_embedding[:1, None, :]
            for block in self.ref_image_refiner:  # one token: no gradient checkpointing
                hidden = block(hidden, plan, target_rotary[:1, :1], temb[:1])
        finally:
            self.placeholder_running = False
        return hidden.sum() * 0


def count_parameters(module: nn.Module) -> int:
    """Total number of parameter elements (works on the meta device)."""
    return sum(math.prod(param.shape) for param in module.parameters())
