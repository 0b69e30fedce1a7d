"""Ready-made configs, the LoRA target list and a parameter randomiser for tests and tiny models."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from boogu_schedule import make_generator

from .layers import QKRMSNorm, RMSNorm

__all__ = ["LORA_TARGET_MODULES", "RELEASED_CONFIG", "TINY_CONFIG", "randomize_parameters"]

RELEASED_CONFIG: dict[str, Any] = {
    "patch_size": 2,
    "in_channels": 16,
    "hidden_size": 3360,
    "num_layers": 40,
    "num_double_stream_layers": 8,
    "num_refiner_layers": 2,
    "num_attention_heads": 28,
    "num_kv_heads": 7,
    "multiple_of": 256,
    "axes_dim_rope": (40, 40, 40),
    "axes_lens": (2048, 1664, 1664),
    "instruction_feature_configs": {
        "instruction_feat_dim": 4096,
        "num_instruction_feature_layers": 1,
        "reduce_type": "mean",
    },
    "timestep_scale": 1000.0,
}
"""The released Boogu-Image-0.1 ``transformer/config.json`` values (docs/upstream-model.md §2.1;
Base, Edit, Turbo share it). ``BooguImageTransformer2DModel(**RELEASED_CONFIG)`` has 942 tensors
and 10,292,556,288 parameters; build it under ``torch.device("meta")`` unless you have ~41 GB.
Treat it as read-only: copy it (``{**RELEASED_CONFIG, ...}``) to change a value."""

TINY_CONFIG: dict[str, Any] = {
    "patch_size": 2,
    "in_channels": 16,  # the FLUX VAE's latent channels, as released
    "hidden_size": 64,
    "num_layers": 2,  # 1 double-stream + 1 single-stream block
    "num_double_stream_layers": 1,
    "num_refiner_layers": 1,
    "num_attention_heads": 4,  # head dim 16
    "num_kv_heads": 2,  # keeps GQA (2 query heads per kv head)
    "multiple_of": 32,  # FFN width 4·64 = 256
    "axes_dim_rope": (4, 6, 6),  # sums to the head dim; unequal on purpose, to catch axis mix-ups
    "axes_lens": (2048, 1664, 1664),  # released lengths: long prompts and large latents still fit
    "instruction_feature_configs": {
        "instruction_feat_dim": 64,  # = hidden size of the tiny Qwen3-VL text model
        "num_instruction_feature_layers": 1,
        "reduce_type": "mean",
    },
    "timestep_scale": 1000.0,
}
"""A 0.56 M-parameter (561,920) config with every kind of block, for CPU tests and the tiny checkpoint.

``BooguImageTransformer2DModel(**TINY_CONFIG)`` runs a 16-token target in milliseconds on CPU.
It takes instruction features of width 64 and the released RoPE table lengths. Fresh weights
output exactly zero (upstream's init); call :func:`randomize_parameters` first when a test needs
a signal. Treat it as read-only: copy it (``{**TINY_CONFIG, "hidden_size": 128}``) to vary it."""

LORA_TARGET_MODULES: tuple[str, ...] = (
    "to_q",
    "to_k",
    "to_v",
    "to_out.0",
    "img_to_q",
    "img_to_k",
    "img_to_v",
    "instruct_to_q",
    "instruct_to_k",
    "instruct_to_v",
    "img_out",
    "instruct_out",
    "feed_forward.linear_1",
    "feed_forward.linear_2",
    "feed_forward.linear_3",
    "img_feed_forward.linear_1",
    "img_feed_forward.linear_2",
    "img_feed_forward.linear_3",
    "instruct_feed_forward.linear_1",
    "instruct_feed_forward.linear_2",
    "instruct_feed_forward.linear_3",
)
"""The recommended attention + FFN LoRA targets (docs/upstream-model.md §2.7), for
``peft.LoraConfig(target_modules=...)``.

PEFT matches a name or a dotted suffix, so ``to_q`` does not hit ``img_to_q`` and
``feed_forward.linear_1`` does not hit ``img_feed_forward.linear_1``; bare ``linear_1`` is avoided
because it would also hit the timestep embedder and ``norm_out``. The verl-omni recipes use this
list without the three ``instruct_feed_forward`` entries."""


def randomize_parameters(
    model: nn.Module, generator: torch.Generator | int | None = 0, std: float = 0.02
) -> nn.Module:
    """Overwrite every parameter of ``model`` with seeded noise, in place; returns ``model``.

    Upstream zero-initialises every adaLN linear and the output head, so a fresh model outputs
    exactly 0 (docs/upstream-model.md §2.5) and tests on it prove nothing. Here RMSNorm weights become
    ``1 + std·N(0, 1)`` (so norms keep their scale) and every other parameter ``std·N(0, 1)``,
    the zero-initialised ones included. Values are drawn in float32 on the generator's device in
    ``named_parameters()`` order: with a CPU generator (an int seed, or None for the global RNG) a
    seed gives the same weights on any device and dtype; a CUDA generator draws on that GPU (other
    values, and no CPU draw and copy of every tensor: ~55 s for the released 10.3B parameters).
    Call it before adding LoRA adapters unless the adapters should be randomised too.

    Args:
        model: any module, typically a ``BooguImageTransformer2DModel``; not on the meta device.
        generator: a ``torch.Generator`` (CPU or the model's GPU), or an int seed (CPU), or None for
            the global CPU RNG.
        std: standard deviation of the noise.
    """
    if isinstance(generator, int):
        generator = make_generator(generator)
    device = generator.device if generator is not None else torch.device("cpu")
    norm_weights = {
        id(module.weight)
        for module in model.modules()
        if isinstance(module, (RMSNorm, QKRMSNorm, nn.RMSNorm))
    }
    with torch.no_grad():
        for name, param in model.named_parameters():
            if param.is_meta:
                raise ValueError(f"cannot randomise meta parameter {name}; materialise the model first")
            noise = torch.randn(param.shape, generator=generator, dtype=torch.float32, device=device) * std
            if id(param) in norm_weights:
                noise += 1.0
            param.copy_(noise)
    return model
