"""Our own pure-PyTorch port of the Boogu-Image-0.1 transformer (`docs/upstream-model.md`).

``BooguImageTransformer2DModel`` has the released checkpoint's exact parameter tree and
upstream's ``forward`` signature; ``get_freqs_cis`` builds the RoPE tables it takes. Time runs
from 0 (noise) to 1 (data) and the output is the Boogu velocity ``x0 - eps``.

Example::

    model = BooguImageTransformer2DModel(**TINY_CONFIG)
    randomize_parameters(model, 0)
    freqs = get_freqs_cis(model.config.axes_dim_rope, model.config.axes_lens, 10000)
    v = model(latents, t, instruction_embeds, freqs, instruction_mask)  # (B, 16, H, W)
"""

from .layout import patchify, unpatchify
from .presets import LORA_TARGET_MODULES, RELEASED_CONFIG, TINY_CONFIG, randomize_parameters
from .rope import get_freqs_cis
from .transformer import MAX_REFERENCE_IMAGES, ROPE_THETA, BooguImageTransformer2DModel, count_parameters

__all__ = [
    "LORA_TARGET_MODULES",
    "MAX_REFERENCE_IMAGES",
    "RELEASED_CONFIG",
    "ROPE_THETA",
    "TINY_CONFIG",
    "BooguImageTransformer2DModel",
    "count_parameters",
    "get_freqs_cis",
    "patchify",
    "randomize_parameters",
    "unpatchify",
]
