"""Expected peak GPU memory of a recipe, before any weight is loaded (``trainer --plan RECIPE``).

What is counted, per GPU (bytes of live tensors; the CUDA caching allocator reserves some more,
hence the ``headroom`` fraction kept free when sizing micro-batches):

* **weights**: transformer, text encoder (``mllm/``) and VAE, in ``model.dtype``; parameter counts
  from each folder's ``config.json`` by building the model on ``torch.device("meta")``. With several
  ranks and ``distributed.fsdp`` the transformer (base and LoRA) is sharded over the ranks.
* **LoRA state** (float32): parameters, gradients, AdamW's two moments, and the EMA copy if enabled.
* **transformer activations**, simulated: the real forward (and, for training, the LoRA
  forward+backward, with or without gradient checkpointing) runs on the meta device under
  :class:`LiveBytes`, a dispatch mode that books every tensor the ops create and frees it when its
  storage dies. The attention is replaced by a stand-in with the fused kernels' memory (output and
  a float32 log-sum-exp saved, no ``L x L`` matrix) - what CUDA's flash / memory-efficient SDPA
  and the CPU flash kernel keep. Two batch sizes give ``fixed + per_sample · n``.
* **text encoder and VAE decode working memory**: the encoder's per-layer hidden states (it is called
  with ``output_hidden_states=True``) plus one layer's transients, estimated from its config; the VAE
  decode of one latent simulated on meta like the transformer.
* **where the text encoder lives** (`text_encoder_placement`): with ``rollout.engine=vllm_omni`` the
  worker encodes and the trainer holds no encoder weights; with the local engine they are resident,
  or, when they do not fit (``model.text_encoder_offload``), in host memory and moved in for each
  encode (their bytes then count in the encoder phase only).
* **the rotary cache**: the transformer keeps the rotary tensors of its last ``ROTARY_CACHE_SIZE``
  token layouts (float32 per position and head dim, five stages), counted as that many layouts of
  the largest call (`rotary_cache_bytes`).
* **the one-step pipeline** (``rollout.pipeline=one_step``): the next batch and the LoRA it was
  sampled with wait in pinned host memory until trained on; listed under host memory, not the GPU's.

The peak of a step is weights + LoRA state + the largest of the phases (rollout call, VAE decode,
encoder call, training micro-batch). ``tests/trainer/test_perf_plan.py`` checks the simulated
activations against the live bytes measured on CPU within 20%.
"""

from __future__ import annotations

import contextlib
import inspect
import json
import math
import os
import weakref
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from boogu_schedule import guidance_branches, uses_cfg

__all__ = [
    "FLOOR_BYTES_PER_PIXEL",
    "LiveBytes",
    "MemoryPlan",
    "PhaseMemory",
    "batch_memory_problem",
    "check_rollout_fits",
    "device_memory_bytes",
    "fused_attention_stand_in",
    "pipeline_batch_bytes",
    "plan_memory",
    "rank_text_encoder_placement",
    "rotary_cache_bytes",
    "text_encoder_placement",
    "train_micro_batch_rows",
    "transformer_activation_bytes",
    "vae_decode_bytes",
]

GiB = 1024**3
DEFAULT_TEXT_TOKENS = 256
"""Instruction tokens assumed per prompt (chat template included) when a recipe does not say."""
# ------------------------------------------------------------------------------------------------
# Live tensor bytes.


class LiveBytes(TorchDispatchMode):
    """Books the bytes of every storage created by an op inside the mode; ``peak`` is the maximum.

    Tensors that exist before entering (parameters, inputs) are not counted. A storage is booked
    once (views share it) and unbooked when it is freed. Works on real devices and on meta.
    """

    def __init__(self) -> None:
        super().__init__()
        self.current = 0
        self.peak = 0
        self._seen: dict[int, int] = {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        # Outputs that alias an input (views, in-place results) allocate nothing.
        inputs = {
            t.untyped_storage()._cdata for t in tree_flatten((args, kwargs))[0] if isinstance(t, torch.Tensor)
        }
        out = func(*args, **kwargs)
        for t in tree_flatten(out)[0]:
            if isinstance(t, torch.Tensor):
                self._book(t, inputs)
        return out

    def _book(self, t: torch.Tensor, inputs: set[int]) -> None:
        storage = t.untyped_storage()
        key = storage._cdata
        if key in self._seen or key in inputs:
            return
        nbytes = storage.nbytes()
        self._seen[key] = nbytes
        self.current += nbytes
        self.peak = max(self.peak, self.current)
        weakref.finalize(storage, self._free, key)

    def _free(self, key: int) -> None:
        self.current -= self._seen.pop(key, 0)

    def reset_peak(self) -> None:
        self.peak = self.current


class _FusedAttention(torch.autograd.Function):
    """Shape-only SDPA with the fused kernels' memory: saves q, k, v, out and a float32 LSE."""

    @staticmethod
    def forward(ctx, query, key, value):
        out = query.new_empty((*query.shape[:-1], value.shape[-1]))
        lse = query.new_empty(query.shape[:-1], dtype=torch.float32)
        ctx.save_for_backward(query, key, value, out, lse)
        return out

    @staticmethod
    def backward(ctx, grad):
        query, key, value, _, _ = ctx.saved_tensors
        return torch.empty_like(query), torch.empty_like(key), torch.empty_like(value)


def _stand_in_sdpa(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, **kw):
    if torch.is_grad_enabled() and any(t.requires_grad for t in (query, key, value)):
        return _FusedAttention.apply(query, key, value)
    return query.new_empty((*query.shape[:-1], value.shape[-1]))


@contextlib.contextmanager
def fused_attention_stand_in() -> Iterator[None]:
    """Replace ``F.scaled_dot_product_attention`` with :func:`_stand_in_sdpa` (meta simulations)."""
    original = F.scaled_dot_product_attention
    F.scaled_dot_product_attention = _stand_in_sdpa
    try:
        yield
    finally:
        F.scaled_dot_product_attention = original


# ------------------------------------------------------------------------------------------------
# Transformer activations.


def _transformer_inputs(model: nn.Module, batch: int, text: int, grid: tuple[int, int], device, dtype):
    from boogu_adapters.model import get_freqs_cis

    cfg = model.config
    p, channels = cfg.patch_size, cfg.in_channels
    feat = model.preprocessed_instruction_feat_dim
    latents = torch.zeros(batch, channels, grid[0] * p, grid[1] * p, device=device, dtype=dtype)
    timestep = torch.zeros(batch, device=device, dtype=dtype)
    instruct = torch.zeros(batch, text, feat, device=device, dtype=dtype)
    freqs = get_freqs_cis(cfg.axes_dim_rope, cfg.axes_lens, 10000)
    return latents, timestep, instruct, freqs


def transformer_activation_bytes(
    model: nn.Module,
    *,
    batch: int,
    text_tokens: int,
    target_grid: tuple[int, int],
    train: bool,
    stand_in_attention: bool | None = None,
    reference_images: int = 0,
) -> int:
    """Peak live bytes of one forward (``train=False``: under no_grad) or forward + backward.

    ``model`` is a built ``BooguImageTransformer2DModel`` (meta or real) with any LoRA already
    injected and gradient checkpointing set as wanted; its activations use the dtype of
    ``x_embedder``. LoRA gradients are dropped as they are accumulated, so the result excludes
    the persistent gradients (:class:`MemoryPlan` counts those apart). The attention stand-in is
    used by default on meta only. ``reference_images``: reference latents per sample, each of the
    target's size (an edit row).
    """
    weight = model.x_embedder.weight
    device, dtype = weight.device, weight.dtype
    if stand_in_attention is None:
        stand_in_attention = device.type == "meta"
    inputs = _transformer_inputs(model, batch, text_tokens, target_grid, device, dtype)
    hooks = [
        p.register_post_accumulate_grad_hook(lambda p: setattr(p, "grad", None))
        for p in model.parameters()
        if p.requires_grad
    ]
    ctx = fused_attention_stand_in() if stand_in_attention else contextlib.nullcontext()
    try:
        with ctx, torch.set_grad_enabled(train), LiveBytes() as live:
            refs = None
            if reference_images:
                latents = inputs[0]
                refs = [[torch.zeros_like(latents[0])] * reference_images for _ in range(batch)]
            out = model(*inputs, None, ref_image_hidden_states=refs)
            if train:
                out.float().square().mean().backward()
            del out
        return live.peak
    finally:
        for h in hooks:
            h.remove()


def _build_transformer(
    config: dict[str, Any], dtype: torch.dtype, lora_rank: int, targets, checkpointing: bool
):
    from boogu_adapters.lora import add_lora, is_lora_param
    from boogu_adapters.model import BooguImageTransformer2DModel

    accepted = inspect.signature(BooguImageTransformer2DModel.__init__).parameters
    keys = {k: v for k, v in config.items() if k in accepted and k != "self"}
    with torch.device("meta"):
        model = BooguImageTransformer2DModel(**keys)
    nn.Module.to(model, dtype)  # ModelMixin.to would warn about keep-in-fp32 modules
    model.requires_grad_(False)
    if lora_rank:
        add_lora(model, rank=lora_rank, target_modules=targets, init_lora_weights=True, seed=None)
        for name, p in model.named_parameters():
            if is_lora_param(name):
                p.data = p.data.float()
    if checkpointing:
        model.enable_gradient_checkpointing()
    return model


@dataclass(frozen=True)
class PhaseMemory:
    """Working memory of one phase: ``fixed + per_item · items`` bytes, at ``items`` per call."""

    name: str
    fixed: float
    per_item: float
    items: int
    unit: str

    @property
    def bytes(self) -> float:
        return self.fixed + self.per_item * self.items

    def max_items(self, free_bytes: float) -> int:
        if self.per_item <= 0:
            return 0
        return max(int((free_bytes - self.fixed) // self.per_item), 0)


def _linear_fit(measure: Callable[[int], int], unit: int = 1) -> tuple[float, float]:
    """(fixed, per-item) from measurements at 1 and 2 items (``unit`` sample-forwards per item)."""
    one, two = measure(unit), measure(2 * unit)
    per = max(two - one, 0)
    return float(max(one - per, 0)), float(per)


def vae_decode_bytes(
    vae_config: dict[str, Any], height: int, width: int, dtype: torch.dtype
) -> tuple[float, float]:
    """(fixed, per image) live bytes of ``AutoencoderKL.decode`` at an output size, on meta."""
    from diffusers import AutoencoderKL

    keys = {k: v for k, v in vae_config.items() if not k.startswith("_")}
    with torch.device("meta"):
        vae = AutoencoderKL.from_config(keys)
    nn.Module.to(vae, dtype)
    vae.requires_grad_(False)
    factor = 2 ** (len(vae.config.block_out_channels) - 1)
    channels = vae.config.latent_channels

    def measure(n: int) -> int:
        z = torch.zeros(n, channels, height // factor, width // factor, device="meta", dtype=dtype)
        with fused_attention_stand_in(), torch.no_grad(), LiveBytes() as live:
            out = vae.decode(z).sample
            del out
        return live.peak

    return _linear_fit(measure)


def _encoder_bytes(mllm_config: dict[str, Any], tokens: int, bytes_per: int) -> tuple[float, float]:
    """(fixed, per prompt row): all hidden states kept plus one layer's transients (no LM head)."""
    text = mllm_config.get("text_config", mllm_config)
    hidden, inter = int(text["hidden_size"]), int(text["intermediate_size"])
    layers = int(text["num_hidden_layers"])
    heads = int(text.get("num_attention_heads", 1))
    kv = int(text.get("num_key_value_heads", heads))
    head_dim = int(text.get("head_dim", hidden // heads))
    per_token = (layers + 1) * hidden + 3 * inter + 2 * hidden + (heads + 2 * kv) * head_dim
    return 0.0, float(per_token * tokens * bytes_per)


def rotary_cache_bytes(
    transformer_config: dict[str, Any],
    *,
    rows: int,
    text_tokens: int,
    target_grid: tuple[int, int],
    reference_images: int = 0,
    dtype: torch.dtype = torch.bfloat16,
) -> int:
    """Bytes of one rotary-cache entry: the rotary tensors of one transformer call of ``rows`` rows.

    ``BooguImageTransformer2DModel._stage_rotary`` keeps, per token layout, ``(..., head_dim / 2, 2)``
    tensors in ``rotary_dtype(dtype)`` for the text (T), the target (I), the references (R x I), the
    whole image (I + R x I) and the joint sequence (T + I + R x I) of every row: per row
    ``2 T + 3 (R + 1) I`` positions (~6 MiB a row at 1024^2 in bf16, 12 for an edit row).
    """
    from boogu_adapters.model.rope import rotary_dtype

    cfg = transformer_config
    head_dim = int(cfg["hidden_size"]) // int(cfg["num_attention_heads"])
    image = target_grid[0] * target_grid[1]
    positions = 2 * text_tokens + 3 * (reference_images + 1) * image
    itemsize = torch.tensor([], dtype=rotary_dtype(dtype)).element_size()
    return rows * positions * head_dim * itemsize


def pipeline_batch_bytes(
    transformer_config: dict[str, Any],
    *,
    samples: int,
    window: int,
    height: int,
    width: int,
    text_tokens: int,
    negative: bool,
    reference_images: int = 0,
    dtype: torch.dtype = torch.bfloat16,
) -> int:
    """Bytes of a rolled-out batch as the trainer keeps it (`Trajectory`): float32 latents
    ``(B, W+1, C, h, w)``, means ``(B, W, C, h, w)`` and final latents, the prompt features (and the
    negative ones with CFG) and reference latents in the model dtype. Images (uint8) are not counted:
    they stay on the host for the rewards."""
    cfg = transformer_config
    latent = int(cfg.get("in_channels", 16)) * (height // 8) * (width // 8)
    feat = int(
        cfg.get("instruction_feature_configs", {}).get("instruction_feat_dim", cfg.get("hidden_size", 0))
    )
    itemsize = torch.tensor([], dtype=dtype).element_size()
    per_sample = (window + 1 + window + 1) * latent * 4 + 4 * window * 4
    per_sample += (2 if negative else 1) * text_tokens * (feat * itemsize + 8)
    per_sample += reference_images * latent * itemsize
    return samples * per_sample


def text_encoder_placement(config: Any, *, fits_resident: bool | None, device_type: str) -> str:
    """Where a rank keeps the text encoder's weights: ``'worker'`` (``rollout.engine=vllm_omni``: the
    worker encodes, the trainer loads none), ``'offloaded'`` (host memory, moved to the GPU for each
    encode) or ``'resident'`` (on the GPU). ``model.text_encoder_offload``: ``always``/``never``, or
    ``auto``: offloaded on CUDA when ``fits_resident`` is False (the plan of the run with it
    resident; None: not known, resident). The one rule for the trainer and the plan."""
    if config.rollout.engine != "local":
        return "worker"
    setting = config.model.text_encoder_offload
    if setting == "always":
        return "offloaded"
    if setting == "never" or device_type != "cuda":
        return "resident"
    return "offloaded" if fits_resident is False else "resident"


def _count_params(module: nn.Module) -> int:
    return sum(math.prod(p.shape) for p in module.parameters())


def _text_encoder_params(mllm_config: dict[str, Any]) -> int:
    from transformers import Qwen3VLConfig, Qwen3VLModel

    cfg = Qwen3VLConfig(**{k: v for k, v in mllm_config.items() if k not in ("model_type", "architectures")})
    with torch.device("meta"):
        model = Qwen3VLModel._from_config(cfg)
    return _count_params(model)


def _vae_params(vae_config: dict[str, Any]) -> int:
    from diffusers import AutoencoderKL

    with torch.device("meta"):
        vae = AutoencoderKL.from_config({k: v for k, v in vae_config.items() if not k.startswith("_")})
    return _count_params(vae)


# ------------------------------------------------------------------------------------------------
# The plan.


@dataclass
class MemoryPlan:
    """The expected peak memory of one rank, in bytes, and the micro-batches that fit."""

    world_size: int
    dtype: str
    gradient_checkpointing: bool
    static: dict[str, float] = field(default_factory=dict)
    phases: dict[str, PhaseMemory] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)
    gpu_memory: float | None = None
    headroom: float = 0.1
    train_without_checkpointing: PhaseMemory | None = None
    text_encoder: str = "resident"
    """Where the text encoder's weights are (`text_encoder_placement`): resident, offloaded, worker."""
    host: dict[str, float] = field(default_factory=dict)
    """Host memory the run holds beside the GPU's (pinned pipeline batches, an offloaded encoder)."""

    @property
    def static_total(self) -> float:
        return sum(self.static.values())

    @property
    def peak(self) -> float:
        return self.static_total + max((p.bytes for p in self.phases.values()), default=0.0)

    @property
    def peak_phase(self) -> str:
        return max(self.phases.values(), key=lambda p: p.bytes).name

    @property
    def fits(self) -> bool | None:
        """Whether the peak fits ``gpu_memory`` less the headroom (None: no GPU memory given)."""
        if self.gpu_memory is None:
            return None
        return self.peak <= self.gpu_memory * (1 - self.headroom)

    def max_micro_batch(self, phase: str) -> int | None:
        """The largest items per call of ``phase`` ('rollout' or 'train') fitting ``gpu_memory``."""
        if self.gpu_memory is None or phase not in self.phases:
            return None
        free = self.gpu_memory * (1 - self.headroom) - self.static_total
        return self.phases[phase].max_items(free)

    def render(self) -> str:
        def gib(x: float) -> str:
            return f"{x / GiB:8.2f} GiB"

        lines = [
            f"memory plan per GPU: {self.world_size} rank(s), model.dtype={self.dtype}, "
            f"gradient checkpointing {'on' if self.gradient_checkpointing else 'off'}",
            "  persistent:",
        ]
        lines += [f"    {k:34s} {gib(v)}" for k, v in self.static.items()]
        lines.append(f"    {'total':34s} {gib(self.static_total)}")
        lines.append("  working memory per phase (fixed + per item x items):")
        phases = list(self.phases.values())
        if self.train_without_checkpointing is not None:
            phases.append(self.train_without_checkpointing)
        for p in phases:
            lines.append(
                f"    {p.name:34s} {gib(p.bytes)}  ({p.fixed / GiB:.2f} + {p.per_item / GiB:.3f} x {p.items} {p.unit})"
            )
        lines.append(f"  expected peak: {gib(self.peak).strip()} (during {self.peak_phase})")
        if self.host:
            lines.append("  host memory (not on the GPU):")
            lines += [f"    {k:34s} {gib(v)}" for k, v in self.host.items()]
        if self.gpu_memory is not None:
            fits = self.fits
            lines.append(
                f"  GPU memory {self.gpu_memory / GiB:.0f} GiB ({self.headroom:.0%} kept free): "
                f"{'fits' if fits else 'DOES NOT FIT'}"
            )
            lines.append(
                f"  largest rollout.micro_batch_size: {self.max_micro_batch('rollout')} latents; "
                f"largest algorithm.train_micro_batch_size: {self.max_micro_batch('train')} samples"
            )
        lines += [f"  note: {n}" for n in self.notes]
        return "\n".join(lines)


def _read(path: Path) -> dict[str, Any]:
    return json.loads(path.read_text(encoding="utf-8"))


RELEASED_VAE_CONFIG: dict[str, Any] = {
    "in_channels": 3,
    "out_channels": 3,
    "latent_channels": 16,
    "block_out_channels": [128, 256, 512, 512],
    "down_block_types": ["DownEncoderBlock2D"] * 4,
    "up_block_types": ["UpDecoderBlock2D"] * 4,
    "layers_per_block": 2,
    "norm_num_groups": 32,
    "act_fn": "silu",
    "use_quant_conv": False,
    "use_post_quant_conv": False,
}
"""The FLUX.1 VAE (the release's ``vae/``), used when the recipe's folder is not on this machine."""

RELEASED_MLLM_CONFIG: dict[str, Any] = {
    "model_type": "qwen3_vl",
    "text_config": {
        "hidden_size": 4096,
        "intermediate_size": 12288,
        "num_hidden_layers": 36,
        "num_attention_heads": 32,
        "num_key_value_heads": 8,
        "head_dim": 128,
        "vocab_size": 151936,
    },
    "vision_config": {"out_hidden_size": 4096, "deepstack_visual_indexes": [8, 16, 24]},
}
"""Qwen3-VL-8B-Instruct's sizes (the release's ``mllm/``), used when the folder is not here."""


def _folder_configs(root: Path) -> tuple[dict[str, Any], dict[str, Any], dict[str, Any], str | None]:
    """(transformer, vae, mllm) configs of a checkpoint folder, or the released ones with a note."""
    files = [
        root / "transformer" / "config.json",
        root / "vae" / "config.json",
        root / "mllm" / "config.json",
    ]
    if all(f.is_file() for f in files):
        return _read(files[0]), _read(files[1]), _read(files[2]), None
    from boogu_adapters.model import RELEASED_CONFIG

    note = f"{root} has no transformer/, vae/ and mllm/ config.json here: the released configs are assumed"
    return dict(RELEASED_CONFIG), dict(RELEASED_VAE_CONFIG), RELEASED_MLLM_CONFIG, note


FLOOR_BYTES_PER_PIXEL = 4
"""What each image of a batch holds at once on its device, at least: the decoded image (uint8 RGB,
3 bytes a pixel) and the final latent (16 float32 channels at 1/8 of each side, 1 byte a pixel). The
rollout's trajectory, the conditioning and the activations come on top."""


def device_memory_bytes(device: torch.device | str) -> int | None:
    """The memory of ``device``: the host's RAM for the CPU, the GPU's for CUDA; None if unknown."""
    device = torch.device(device)
    if device.type == "cpu":
        try:
            return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
        except (ValueError, OSError, AttributeError):  # not a POSIX system that says
            return None
    if device.type == "cuda" and torch.cuda.is_available():
        index = device.index if device.index is not None else torch.cuda.current_device()
        return torch.cuda.get_device_properties(index).total_memory
    return None


def batch_memory_problem(images: int, height: int, width: int, device: torch.device | str) -> str | None:
    """Why ``images`` images of ``height x width`` generated at once cannot fit on ``device``, or None.

    A floor (`FLOOR_BYTES_PER_PIXEL`), checked in microseconds before anything is loaded or written:
    a batch refused here would fail for memory later, after the model loaded, or hang swapping."""
    need = images * height * width * FLOOR_BYTES_PER_PIXEL
    have = device_memory_bytes(device)
    if have is None or need <= have:
        return None
    return (
        f"{images} images of {height}x{width} at once need at least {need / GiB:,.1f} GiB for the images "
        f"and final latents alone, more than the {have / GiB:,.1f} GiB of memory of {torch.device(device)}"
    )


def check_rollout_fits(
    config: Any, device: torch.device | str, world_size: int = 1, edit: bool = False
) -> None:
    """Refuse a step whose rollout batch cannot fit on a rank's ``device`` (`batch_memory_problem`):
    each rank rolls out its share of ``data.prompts_per_step`` groups of ``algorithm.group_size`` at
    once. ``edit``: rows with references, whose outputs follow the references (16x16 at least), not
    ``sampler.height x width``. Raises `ConfigError` naming both keys."""
    from boogu_trainer.config import ConfigError

    groups, size = config.data.prompts_per_step, config.algorithm.group_size
    rows = -(-groups // max(world_size, 1)) * size
    height, width = (16, 16) if edit else (config.sampler.height, config.sampler.width)
    problem = batch_memory_problem(rows, height, width, device)
    if problem is not None:
        raise ConfigError(
            f"algorithm.group_size={size} with data.prompts_per_step={groups} on {world_size} rank(s): "
            f"a step rolls out {rows} images per rank; {problem}. Expected a batch that fits "
            "(trainer --plan RECIPE estimates a step's whole peak)"
        )


def train_micro_batch_rows(config: Any, world_size: int = 1) -> int:
    """Samples (rows) of one rank's largest training micro-batch, cut as the learner cuts them.

    The learner's mini-batches hold whole groups: a rank's groups (contiguous global indices) go to
    mini-batch ``index % m`` with ``m = min(algorithm.mini_batches, groups)``, so the largest holds
    ``ceil(groups / m)`` groups of ``group_size`` rows; ``algorithm.train_micro_batch_size`` then cuts
    it into chunks of at most that many rows (0: the whole mini-batch).
    """
    a = config.algorithm
    groups = max(config.data.prompts_per_step // world_size, 1)
    largest = -(-groups // min(a.mini_batches, groups)) * a.group_size
    return min(a.train_micro_batch_size, largest) if a.train_micro_batch_size else largest


def plan_memory(
    config: Any,
    *,
    world_size: int = 1,
    gpu_memory_gb: float | None = None,
    text_tokens: int = DEFAULT_TEXT_TOKENS,
    device_type: str | None = None,
    reference_images: int = 0,
    headroom: float = 0.1,
) -> MemoryPlan:
    """The memory plan of a :class:`~boogu_trainer.config.TrainerConfig` on ``world_size`` GPUs.

    Reads only the checkpoint folders' ``config.json`` files (the tiny checkpoint is built first when
    ``model.path`` is empty). ``device_type`` resolves ``model.dtype=auto`` (bfloat16 on cuda);
    default: the type of ``model.device`` as the trainer resolves it on this machine
    (``boogu_protocol.resolve_device_type``: ``auto`` is cuda when CUDA is available, else cpu; plan a
    GPU run from a machine without one with ``model.device=cuda``). ``reference_images``: reference images per
    prompt (edit data), each at the output size: their tokens join every transformer call.
    Rollout micro-batches count latents (one sample-forward per guidance branch when batched: x2 with
    CFG, x3 with Edit double guidance), training ones samples (the same rows).
    """
    from boogu_adapters.lora import add_lora  # noqa: F401  (fails early without peft)
    from boogu_protocol import resolve_device_type
    from boogu_trainer.config import check_world_layout, resolved_model_dtype

    # A layout the trainer refuses at start-up has no plan (and the groups per rank below assume it).
    check_world_layout(config, world_size)
    from boogu_trainer.models import base_model_path, gradient_checkpointing_on

    m = config.model
    root = base_model_path(config)
    if device_type is None:
        device_type = resolve_device_type(m.device)
    dtype_name = resolved_model_dtype(m.dtype, device_type)
    dtype = getattr(torch, dtype_name)
    nbytes = torch.tensor([], dtype=dtype).element_size()
    tcfg, vcfg, mcfg, folder_note = _folder_configs(root)
    checkpointing = gradient_checkpointing_on(m.gradient_checkpointing, int(tcfg.get("hidden_size", 0)))
    shard = world_size if (world_size > 1 and config.distributed.fsdp) else 1

    rank, targets = config.lora.rank, config.lora.target_modules
    model = _build_transformer(tcfg, dtype, rank, targets, checkpointing)
    from boogu_adapters.lora import is_lora_param

    lora_params = sum(math.prod(p.shape) for n, p in model.named_parameters() if is_lora_param(n))
    base_params = _count_params(model) - lora_params
    plan = MemoryPlan(
        world_size=world_size,
        dtype=dtype_name,
        gradient_checkpointing=bool(checkpointing),
        gpu_memory=None if gpu_memory_gb is None else gpu_memory_gb * GiB,
        headroom=headroom,
    )
    plan.static["transformer weights" + (f" (1/{shard})" if shard > 1 else "")] = base_params * nbytes / shard
    encoder_weights = float(_text_encoder_params(mcfg) * nbytes)
    local = config.rollout.engine == "local"
    if local:  # placed after the phases are known (`text_encoder_placement`)
        plan.static["text encoder weights"] = encoder_weights
    plan.static["VAE weights"] = _vae_params(vcfg) * nbytes
    lora_state = 4 + 4 + 8 + (4 if config.ema.enabled else 0)
    plan.static[f"LoRA r={rank}: params+grads+AdamW" + ("+EMA" if config.ema.enabled else "")] = (
        lora_params * lora_state / shard
    )

    s = config.sampler
    p = int(tcfg.get("patch_size", 2))
    grid = (s.height // 8 // p, s.width // 8 // p)
    batched = config.rollout.cfg_mode == "batched"
    # A batched sampling call holds one row per guidance branch (boogu_schedule.guidance_branches: two
    # with text CFG, three with Edit double guidance), for the rollouts' scales and the evaluation's.
    edit = reference_images > 0
    e = config.eval
    sampled_guidance = [(s.guidance_scale, s.image_guidance_scale)] + (
        [
            (
                s.guidance_scale if e.guidance_scale is None else e.guidance_scale,
                s.image_guidance_scale if e.image_guidance_scale is None else e.image_guidance_scale,
            )
        ]
        if e.every
        else []
    )
    branches = max(len(guidance_branches(g, ig, edit=edit)) for g, ig in sampled_guidance)
    cfg_rows = branches if batched else 1
    a = config.algorithm
    opts = a.forward_options
    # NFT and AWM train the conditional velocity unless `guided` (then every guidance row, as flow_grpo)
    rollout_branches = len(guidance_branches(s.guidance_scale, s.image_guidance_scale, edit=edit))
    train_rows = 1 if opts is not None and not opts.guided else (rollout_branches if batched else 1)
    per_rank = max(config.data.prompts_per_step * a.group_size // world_size, 1)
    if opts is not None:
        levels = opts.timesteps if opts.timesteps is not None else s.num_steps - 1
        latent = int(tcfg.get("in_channels", 16)) * (s.height // 8) * (s.width // 8) * 4
        from boogu_trainer.algorithms import algorithm_class  # the learners: only for a forward-process one

        plan.static.update(
            algorithm_class(a.name).planned_memory(lora_params * 4 / shard, per_rank, levels, latent)
        )
    rollout_items = config.rollout.micro_batch_size or per_rank
    train_items = train_micro_batch_rows(config, world_size)

    def act(train: bool, mdl: nn.Module) -> Callable[[int], int]:
        return lambda n: transformer_activation_bytes(
            mdl,
            batch=n,
            text_tokens=text_tokens,
            target_grid=grid,
            train=train,
            reference_images=reference_images,
        )

    fixed, per = _linear_fit(act(False, model), cfg_rows)
    plan.phases["rollout"] = PhaseMemory("rollout", fixed, per, rollout_items, "latents per call")
    fixed, per = _linear_fit(act(True, model), train_rows)
    plan.phases["train"] = PhaseMemory(
        "train",
        fixed,
        per,
        train_items,
        "samples per micro-batch" + (" (checkpointed)" if checkpointing else ""),
    )
    other = _build_transformer(tcfg, dtype, rank, targets, not checkpointing)
    fixed, per = _linear_fit(act(True, other), train_rows)
    plan.train_without_checkpointing = PhaseMemory(
        f"train, checkpointing {'off' if checkpointing else 'on'} (not used)",
        fixed,
        per,
        train_items,
        "samples",
    )
    fixed, per = vae_decode_bytes(vcfg, s.height, s.width, dtype)
    plan.phases["vae decode"] = PhaseMemory("vae decode", fixed, per, rollout_items, "images per decode")
    fixed, per = _encoder_bytes(mcfg, text_tokens, nbytes)
    prompts = max(config.data.prompts_per_step // world_size, 1) + 1
    if local:  # with vllm-omni the worker encodes
        plan.phases["text encoder"] = PhaseMemory("text encoder", fixed, per, prompts, "prompt rows")
    # The rotary cache: ROTARY_CACHE_SIZE layouts, bounded by the largest call this rank's transformer
    # makes (rollouts and evaluations run in the worker with vllm-omni).
    from boogu_adapters.model.transformer import ROTARY_CACHE_SIZE

    rows = max(rollout_items * cfg_rows if local else 0, train_items * train_rows)
    entry = rotary_cache_bytes(
        tcfg,
        rows=rows,
        text_tokens=text_tokens,
        target_grid=grid,
        reference_images=reference_images,
        dtype=dtype,
    )
    plan.static[f"rotary cache ({ROTARY_CACHE_SIZE} layouts x {rows} rows)"] = float(
        ROTARY_CACHE_SIZE * entry
    )
    if config.rollout.pipeline == "one_step":
        window = s.window_size if s.window_size is not None else s.num_steps - 1
        plan.host[f"one-step pipeline: next batch ({per_rank} samples, pinned)"] = float(
            pipeline_batch_bytes(
                tcfg,
                samples=per_rank,
                window=window,
                height=s.height,
                width=s.width,
                text_tokens=text_tokens,
                negative=uses_cfg(s.guidance_scale),
                reference_images=reference_images,
                dtype=dtype,
            )
        )
        plan.host["one-step pipeline: LoRA it was sampled with"] = float(lora_params * 4)
    plan.text_encoder = text_encoder_placement(config, fits_resident=plan.fits, device_type=device_type)
    if plan.text_encoder == "offloaded":
        del plan.static["text encoder weights"]
        phase = plan.phases["text encoder"]
        plan.phases["text encoder"] = PhaseMemory(
            "text encoder (weights moved in)",
            phase.fixed + encoder_weights,
            phase.per_item,
            phase.items,
            phase.unit,
        )
        plan.host["text encoder weights (offloaded)"] = encoder_weights
    placement = {
        "worker": "the vllm-omni worker encodes the prompts: no text encoder weights on the trainer's GPU",
        "offloaded": f"the text encoder ({encoder_weights / GiB:.1f} GiB) waits in host memory and is moved "
        "to the GPU for each encode (model.text_encoder_offload="
        f"{config.model.text_encoder_offload})",
        "resident": "the text encoder stays on the GPU (model.text_encoder_offload="
        f"{config.model.text_encoder_offload}; 'auto' offloads it when the run does not fit with it)",
    }[plan.text_encoder]
    plan.notes.append(placement)
    refs = f", {reference_images} reference image(s) of that size per sample" if reference_images else ""
    plan.notes.append(
        f"{text_tokens} instruction tokens assumed per prompt; target {s.height}x{s.width} "
        f"({grid[0] * grid[1]} tokens){refs}; CFG x{cfg_rows} sample-forwards per rollout latent, "
        f"x{train_rows} per training sample"
    )
    if folder_note:
        plan.notes.append(folder_note)
    plan.notes.append(
        "live tensor bytes; the CUDA caching allocator and NCCL buffers need some of the headroom"
    )
    return plan


def rank_text_encoder_placement(
    config: Any, device: torch.device, world_size: int = 1, reference_images: int = 0
) -> str:
    """Where this rank keeps the text encoder (`plan.text_encoder_placement`). With
    ``model.text_encoder_offload=auto`` on a CUDA device of known memory, the memory plan of this run
    on that GPU decides: offloaded when it does not fit with the encoder resident."""
    m = config.model
    if config.rollout.engine != "local" or m.text_encoder_offload != "auto" or device.type != "cuda":
        return text_encoder_placement(config, fits_resident=None, device_type=device.type)
    total = device_memory_bytes(device)
    if total is None:
        return "resident"
    plan = plan_memory(
        config,
        world_size=world_size,
        gpu_memory_gb=total / GiB,
        device_type="cuda",
        reference_images=reference_images,
    )
    return plan.text_encoder
