"""Building the models a run uses: the base model from ``model.*``, and the policy (base + LoRA).

One module for the trainer, ``plan`` and ``boogu-sample``, so that a run, its memory plan and its
samples load the same weights in the same dtype:

* `load_base_parts`: the base model folder (``model.path``, or the tiny checkpoint), in
  ``model.dtype`` on the run's device;
* `prepare_policy`: the frozen base with the LoRA of ``lora.*`` (float32 master weights, products in
  the activations' dtype), gradient checkpointing and regional compile as ``model.*`` says.
"""

from __future__ import annotations

from pathlib import Path

import torch

from boogu_adapters.loading import BooguParts, load_boogu
from boogu_adapters.lora import (
    add_lora,
    compute_lora_in_input_dtype,
    expected_lora_shapes,
    is_lora_param,
    lora_module,
    lora_pair_keys,
)
from boogu_trainer.config import ConfigError, TrainerConfig, resolved_model_dtype
from boogu_trainer.preflight import lora_targets_error

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


CHECKPOINTING_MIN_HIDDEN_SIZE = 1024
"""``model.gradient_checkpointing: null`` turns checkpointing on from this hidden size up."""


def gradient_checkpointing_on(setting: bool | None, hidden_size: int) -> bool:
    """Whether a transformer of ``hidden_size`` trains with gradient checkpointing under
    ``model.gradient_checkpointing`` (``setting``): true or false as given; null (the default) on for
    hidden sizes >= 1024 (the released model; the tiny test models stay off). The one rule for the
    trainer (`prepare_policy`) and the memory plan."""
    if setting is not None:
        return bool(setting)
    return hidden_size >= CHECKPOINTING_MIN_HIDDEN_SIZE


def resolve_dtype(spec: str, device: torch.device) -> torch.dtype:
    """``model.dtype`` on ``device``: 'auto' is bfloat16 on CUDA and float32 elsewhere."""
    return DTYPES[resolved_model_dtype(spec, device.type)]


def enable_tf32(config: TrainerConfig, device: torch.device) -> None:
    """TF32 for the float32 matmuls and convolutions left on CUDA (``model.tf32``)."""
    if device.type == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = config.model.tf32
        torch.backends.cudnn.allow_tf32 = config.model.tf32


def base_model_name(config: TrainerConfig) -> str:
    """``model.path``, or the tiny checkpoint's folder as configured (not built): what a LoRA records."""
    if config.model.path:
        return config.model.path
    m = config.model
    return {"scenes": m.tiny_scenes_path, "scenes_edit": m.tiny_scenes_edit_path}.get(m.tiny, m.tiny_path)


def base_model_path(config: TrainerConfig) -> Path:
    """The base model folder of a run: ``model.path``, or the tiny checkpoint (built if needed)."""
    if config.model.path:
        return Path(config.model.path).expanduser()
    from boogu_tiny.checkpoints import (
        ensure_tiny_checkpoint,
        ensure_trained_checkpoint,
        ensure_trained_edit_checkpoint,
    )

    folder = Path(base_model_name(config)).expanduser()
    if config.model.tiny == "scenes":
        return Path(ensure_trained_checkpoint(folder))
    if config.model.tiny == "scenes_edit":
        return Path(ensure_trained_edit_checkpoint(folder))
    return Path(ensure_tiny_checkpoint(folder))


def load_base_parts(
    config: TrainerConfig, device: torch.device, text_encoder_placement: str = "resident"
) -> BooguParts:
    """The run's base model (no LoRA), in ``model.dtype`` on ``device``; the text encoder as
    ``text_encoder_placement`` says (`text_encoder_device`)."""
    m = config.model
    return load_boogu(
        base_model_path(config),
        transformer=m.transformer,
        trust_remote_code=m.trust_remote_code,
        dtype=resolve_dtype(m.dtype, device),
        device=device,
        text_encoder_device=text_encoder_device(text_encoder_placement, device),
    )


def text_encoder_device(placement: str, device: torch.device) -> torch.device:
    """Where the text encoder's weights are loaded for a placement (`plan.text_encoder_placement`):
    ``worker``: nowhere (meta; the rollout worker encodes), ``offloaded``: host memory, ``resident``:
    the run's device."""
    return {"worker": torch.device("meta"), "offloaded": torch.device("cpu")}.get(placement, device)


def check_lora_rank(transformer: torch.nn.Module, rank: int, target_modules) -> None:
    """Refuse a ``lora.rank`` above every targeted module's ``min(in, out)``: ``B @ A`` can have no
    higher rank there, so the excess only adds parameters (and a huge value would only fail for
    memory, in the middle of building the adapter). Raises `ConfigError`."""
    shapes = {name: tuple(p.shape) for name, p in transformer.named_parameters()}
    expected = expected_lora_shapes(shapes, target_modules, 1)  # lora_A (1, in), lora_B (out, 1)
    modules = {lora_module(key) for key in expected}
    useful = {m: min(expected[lora_pair_keys(m)[0]][1], expected[lora_pair_keys(m)[1]][0]) for m in modules}
    if useful and rank > max(useful.values()):
        widest = max(useful, key=useful.__getitem__)
        raise ConfigError(
            f"lora.rank={rank}: expected at most {useful[widest]}, the largest min(in, out) of the "
            f"{len(useful)} targeted modules ({widest}); a higher rank adds parameters, not expressiveness"
        )


def prepare_policy(transformer: torch.nn.Module, config: TrainerConfig) -> torch.nn.Module:
    """Freeze the base, add the LoRA of ``lora.*`` (seeded by ``seed``), then gradient checkpointing and
    regional compile from ``model.*``; returns ``transformer`` (changed in place)."""
    for p in transformer.parameters():
        p.requires_grad_(False)
    lora = config.lora
    check_lora_rank(transformer, lora.rank, lora.target_modules)
    try:
        add_lora(
            transformer,
            rank=lora.rank,
            alpha=lora.alpha,
            target_modules=lora.target_modules,
            init_lora_weights=True if lora.init == "default" else "gaussian",
            seed=config.seed,
        )
    except ValueError as e:  # no module matched: the preflight's named stop, whatever preflight says
        error = lora_targets_error(transformer, lora.target_modules, e)
        if error is None:
            raise
        raise error from e
    # float32 master weights for the adapters even when the base runs in bf16; their products run in
    # the activations' dtype (bf16 on GPU), like the base layers'.
    for name, p in transformer.named_parameters():
        if is_lora_param(name):
            p.data = p.data.float()
    compute_lora_in_input_dtype(transformer)
    if gradient_checkpointing_on(config.model.gradient_checkpointing, transformer.config.hidden_size):
        transformer.enable_gradient_checkpointing()
    if config.model.compile:
        if not hasattr(transformer, "enable_regional_compile"):
            raise ValueError(
                f"model.compile=true needs the native transformer (model.transformer=native), "
                f"got {type(transformer).__name__}"
            )
        # Per block, after LoRA and checkpointing and before FSDP: keys and hooks stay as they are.
        transformer.enable_regional_compile(bucket=config.model.compile_bucket)
    return transformer
