"""The analytic FLOP count (boogu_adapters.model.flops) against torch's FlopCounterMode.

FlopCounterMode counts matmul-like ops and the fused SDPA ops (on CPU the forward dispatches to
``_scaled_dot_product_flash_attention_for_cpu``, whose backward recomputes Q·Kᵀ: 2.5x; on meta SDPA
decomposes into the math path's bmms: 2x). The model computes attention over padded widths when
lengths differ, while the count is per sample without padding, so every layout here has one sample
or equal lengths.
"""

from __future__ import annotations

import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode

from boogu_adapters.lora import add_lora
from boogu_adapters.model import (
    RELEASED_CONFIG,
    TINY_CONFIG,
    BooguImageTransformer2DModel,
    get_freqs_cis,
    randomize_parameters,
)
from boogu_adapters.model.flops import FlopModel, LoraSpec, lora_ranks, lora_ranks_from_model
from boogu_adapters.model.layout import TokenLayout


def _measure(cfg, device, batch, text, grid, refs, *, lora_rank=0, train=False, checkpointing=False):
    with torch.device(device):
        model = BooguImageTransformer2DModel(**cfg)
    if device == "cpu":
        randomize_parameters(model, 0)
    model.requires_grad_(False)
    if lora_rank:
        add_lora(model, rank=lora_rank)
    if checkpointing:
        model.enable_gradient_checkpointing()
    p, c = cfg["patch_size"], cfg["in_channels"]
    feat = cfg["instruction_feature_configs"]["instruction_feat_dim"]
    with torch.device(device):
        latents = torch.randn(batch, c, grid[0] * p, grid[1] * p)
        instruct = torch.randn(batch, text, feat)
        ref_latents = (
            [[torch.randn(c, h * p, w * p) for h, w in refs] for _ in range(batch)] if refs else None
        )
        timestep = torch.rand(batch)
    freqs = get_freqs_cis(model.config.axes_dim_rope, model.config.axes_lens, 10000)
    with FlopCounterMode(display=False) as counter, torch.set_grad_enabled(train):
        out = model(latents, timestep, instruct, freqs, None, ref_latents)
        if train:
            out.float().square().mean().backward()
    layout = TokenLayout([text] * batch, [grid] * batch, [list(refs)] * batch)
    ops = {str(op) for op in counter.get_flop_counts()["Global"]}
    return model, layout, counter.get_total_flops(), ops


@pytest.mark.parametrize(
    ("batch", "text", "grid", "refs"),
    [(1, 7, (4, 6), []), (2, 5, (6, 6), []), (1, 7, (4, 6), [(3, 5)]), (2, 4, (4, 4), [(2, 3), (2, 3)])],
    ids=["t2i", "t2i-batch2", "edit", "edit-batch2-two-refs"],
)
def test_forward_matches_flop_counter_on_cpu(batch, text, grid, refs):
    model, layout, measured, _ = _measure(TINY_CONFIG, "cpu", batch, text, grid, refs)
    assert FlopModel(model.config).forward(layout).total == pytest.approx(measured, rel=0.01)


@pytest.mark.parametrize("checkpointing", [False, True], ids=["plain", "checkpointing"])
def test_lora_training_matches_flop_counter_on_cpu(checkpointing):
    model, layout, measured, ops = _measure(
        TINY_CONFIG, "cpu", 1, 7, (4, 6), [(3, 5)], lora_rank=4, train=True, checkpointing=checkpointing
    )
    fused = any("attention" in op and "backward" in op for op in ops)
    counted = FlopModel(model.config, model).training(
        layout, gradient_checkpointing=checkpointing, attention_recompute=fused
    )
    assert counted.total == pytest.approx(measured, rel=0.01)
    assert counted.recompute.total > 0 if checkpointing else counted.recompute.total == 0


def test_lora_training_matches_flop_counter_on_meta():
    model, layout, measured, _ = _measure(TINY_CONFIG, "meta", 2, 6, (4, 4), [], lora_rank=8, train=True)
    assert FlopModel(model.config, model).training(
        layout, gradient_checkpointing=False
    ).total == pytest.approx(measured, rel=0.01)


def test_a_forward_that_reuses_its_text_path_matches_flop_counter_on_cpu():
    """A rollout's later steps skip the caption embedder and context refiner (``InstructionCache``):
    ``forward(layout, text_path=False)`` is what FlopCounterMode sees them compute."""
    from boogu_adapters.model.transformer import InstructionCache

    model = randomize_parameters(BooguImageTransformer2DModel(**TINY_CONFIG), 0)
    model.requires_grad_(False)
    add_lora(model, rank=4)
    batch, text, grid = 2, 6, (4, 4)
    p = TINY_CONFIG["patch_size"]
    latents = torch.randn(batch, TINY_CONFIG["in_channels"], grid[0] * p, grid[1] * p)
    instruct = torch.randn(batch, text, TINY_CONFIG["instruction_feature_configs"]["instruction_feat_dim"])
    freqs = get_freqs_cis(model.config.axes_dim_rope, model.config.axes_lens, 10000)
    cache = InstructionCache()
    measured = []
    for t in (0.2, 0.6):  # the first forward fills the cache, the second reuses it
        with FlopCounterMode(display=False) as counter, torch.no_grad():
            model(latents, torch.full((batch,), t), instruct, freqs, None, None, instruction_cache=cache)
        measured.append(counter.get_total_flops())
    assert cache.hits == 1
    layout = TokenLayout([text] * batch, [grid] * batch, [[]] * batch)
    flops = FlopModel(model.config, model)
    assert flops.forward(layout).total == pytest.approx(measured[0], rel=0.01)
    assert flops.forward(layout, text_path=False).total == pytest.approx(measured[1], rel=0.01)
    skipped = flops.forward(layout) - flops.forward(layout, text_path=False)
    assert skipped.total == measured[0] - measured[1] > 0
    assert skipped.attention_total == skipped.attention["context_refiner"] > 0
    assert skipped.linear["double_stream"] == skipped.linear["single_stream"] == 0


def test_released_forward_on_meta_4096_image_128_text_tokens():
    _, layout, measured, _ = _measure(RELEASED_CONFIG, "meta", 1, 128, (64, 64), [], lora_rank=64)
    counted = FlopModel(RELEASED_CONFIG, LoraSpec(rank=64)).forward(layout)
    assert counted.total == pytest.approx(measured, rel=0.01)
    assert FlopModel(RELEASED_CONFIG).forward(layout).total / 1e12 == pytest.approx(73.01, abs=0.01)
    assert counted.lora_total > 0 and counted.attention_total > 0


def test_ranks_from_peft_layers_equal_the_spec():
    model = BooguImageTransformer2DModel(**TINY_CONFIG)
    model.requires_grad_(False)
    add_lora(model, rank=4)
    spec = lora_ranks(TINY_CONFIG, 4, LoraSpec().target_modules)
    assert lora_ranks_from_model(model) == spec
    assert "time_caption_embed.timestep_embedder.linear_1" not in spec  # peft suffix rule (§2.7)
    assert "double_stream_layers.0.img_feed_forward.linear_1" in spec


def test_counts_are_per_sample_and_additive():
    flops = FlopModel(TINY_CONFIG, LoraSpec(rank=4))
    a = TokenLayout([5], [(4, 4)], [[]])
    b = TokenLayout([9], [(6, 2)], [[(2, 2)]])
    both = TokenLayout([5, 9], [(4, 4), (6, 2)], [[], [(2, 2)]])
    assert flops.forward(both).total == flops.forward(a).total + flops.forward(b).total
    train = flops.training(both, gradient_checkpointing=True)
    assert train.total == train.forward.total + train.backward.total + train.recompute.total
