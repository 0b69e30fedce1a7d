"""Numerical parity of our transformer port with upstream's ``boogu`` package (opt-in).

Skipped unless ``BOOGU_UPSTREAM_SRC`` names a directory holding upstream's ``boogu/`` package
(several directories may be joined with ``os.pathsep``, e.g. to add ``einops``). Upstream is
imported from there, never installed or vendored. It runs on this workspace's torch and
diffusers (outside upstream's pins; docs/upstream-model.md §1) and on its CPU path (SDPA,
``torch.nn.RMSNorm``, pure-torch SwiGLU), which is the path we port. Example::

    git -C <upstream clone> archive HEAD boogu | tar -x -C /tmp/upsrc
    uv pip install --target /tmp/upextra einops
    BOOGU_UPSTREAM_SRC=/tmp/upsrc:/tmp/upextra uv run pytest tests/adapters/test_model_upstream_parity.py

Both models get the same random weights through a safetensors file (every parameter randomised:
upstream's zero-initialised head would make both outputs exactly 0).
"""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from boogu_adapters.model import (
    LORA_TARGET_MODULES,
    TINY_CONFIG,
    BooguImageTransformer2DModel,
    get_freqs_cis,
    randomize_parameters,
)
from tests.upstream import import_upstream

upstream_transformer, upstream_rope = import_upstream(
    "boogu.models.transformers.transformer_boogu",
    "boogu.models.transformers.rope",
    cpu_only="its CUDA kernels round differently (docs/upstream-model.md §3.6)",
)

UpstreamModel = upstream_transformer.BooguImageTransformer2DModel
PARITY_RTOL = 1e-5  # the acceptance bar: max |ours - upstream| / max |upstream| in float32


def rel_err(ours, theirs) -> float:
    if isinstance(ours, (list, tuple)):
        return max(rel_err(a, b) for a, b in zip(ours, theirs, strict=True))
    return ((ours.double() - theirs.double()).abs().max() / theirs.double().abs().max()).item()


# TINY_CONFIG, and a deeper one shaped like the release: 2-layer refiners, 2 double + 2 single
# blocks, 4 query heads per kv head, three equal RoPE axes.
CONFIGS = {
    "tiny": TINY_CONFIG,
    "deeper": {
        **TINY_CONFIG,
        "hidden_size": 96,
        "num_attention_heads": 4,
        "num_kv_heads": 1,
        "axes_dim_rope": (8, 8, 8),
        "num_layers": 4,
        "num_double_stream_layers": 2,
        "num_refiner_layers": 2,
    },
}


@pytest.fixture(scope="module", params=list(CONFIGS))
def pair(request, tmp_path_factory):
    """(ours, upstream) models holding identical random weights, loaded from safetensors."""
    config = CONFIGS[request.param]
    ours = randomize_parameters(BooguImageTransformer2DModel(**config).eval(), 2024, std=0.1)
    path = tmp_path_factory.mktemp("weights") / "transformer.safetensors"
    save_file({k: v.contiguous() for k, v in ours.state_dict().items()}, path)
    upstream = UpstreamModel(**config).eval()
    result = upstream.load_state_dict(load_file(path), strict=True)
    assert not result.missing_keys and not result.unexpected_keys
    ours.load_state_dict(load_file(path), strict=True)
    return ours, upstream


@pytest.fixture(scope="module")
def freqs(pair):
    config = pair[0].config
    ours = get_freqs_cis(config.axes_dim_rope, config.axes_lens, 10000)
    theirs = upstream_rope.BooguImageRotaryPosEmbed.get_freqs_cis(
        config.axes_dim_rope, config.axes_lens, 10000
    )
    for a, b in zip(ours, theirs, strict=True):
        assert a.dtype == b.dtype == torch.complex128 and torch.equal(a, b)
    return ours


def make_inputs(seed, text_lengths, target_sizes, reference_sizes, width, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    ins = torch.randn(len(text_lengths), width, 64, generator=g).to(dtype)
    mask = (torch.arange(width)[None] < torch.tensor(text_lengths)[:, None]).long()
    targets = [torch.randn(16, h, w, generator=g).to(dtype) for h, w in target_sizes]
    refs = [
        None if s is None else [torch.randn(16, h, w, generator=g).to(dtype) for h, w in s]
        for s in reference_sizes
    ]
    t = torch.rand(len(text_lengths), generator=g).to(dtype)
    return targets, t, ins, mask, refs


CASES = {
    "t2i-tensor": ([9, 5], [(8, 12), (8, 12)], None),
    "t2i-ragged-list": ([3, 11, 6], [(8, 8), (6, 10), (4, 4)], [None, None, None]),
    "ti2i-one-ref": ([6, 2], [(8, 8), (8, 8)], [[(8, 8)], [(6, 8)]]),
    "ti2i-mixed": ([11, 3, 7], [(8, 8), (6, 10), (4, 4)], [[(8, 8)], None, [(4, 6), (10, 4)]]),
}


@pytest.mark.parametrize("case", list(CASES))
def test_float32_forward_matches_upstream(pair, freqs, case):
    ours, upstream = pair
    text_lengths, target_sizes, reference_sizes = CASES[case]
    targets, t, ins, mask, refs = make_inputs(
        7, text_lengths, target_sizes, reference_sizes or [None], width=12
    )
    hidden = torch.stack(targets) if case.endswith("tensor") else targets
    refs = refs if reference_sizes is not None else None
    with torch.no_grad():
        a = ours(hidden, t, ins, freqs, mask, refs)
        b = upstream(hidden, t, ins, freqs, mask, ref_image_hidden_states=refs)
    assert type(a) is type(b)
    err = rel_err(a, b)
    print(f"D={ours.config.hidden_size} {case}: max relative error vs upstream {err:.3e}")
    assert err < PARITY_RTOL


def test_bfloat16_forward_matches_upstream(pair, freqs):
    ours, upstream = (m.to(torch.bfloat16) for m in pair)
    try:
        targets, t, ins, mask, refs = make_inputs(
            8, [6, 4], [(8, 8), (8, 8)], [[(8, 8)], [(4, 8), (8, 4)]], 8, torch.bfloat16
        )
        with torch.no_grad():
            a = ours(targets, t, ins, freqs, mask, refs)
            b = upstream(targets, t, ins, freqs, mask, ref_image_hidden_states=refs)
        mismatches = sum(int((x != y).sum()) for x, y in zip(a, b, strict=True))
        print(f"bf16: max relative error {rel_err(a, b):.3e}, {mismatches} differing elements")
        assert rel_err(a, b) < 1e-2  # bf16 rounding order is ported too; allow a few ulps of drift
    finally:
        for m in pair:
            m.to(torch.float32)


def test_gradients_match_upstream(pair, freqs):
    ours, upstream = pair
    targets, t, ins, mask, refs = make_inputs(9, [5, 3], [(4, 6), (6, 4)], [[(4, 4)], None], 6)
    grads = []
    for model in (ours, upstream):
        model.zero_grad()
        out = model(targets, t, ins, freqs, mask, ref_image_hidden_states=refs)
        sum(o.square().mean() for o in out).backward()
        grads.append({n: p.grad.clone() for n, p in model.named_parameters()})
        model.zero_grad()
    assert grads[0].keys() == grads[1].keys()
    worst = max(rel_err(grads[0][n], grads[1][n]) for n in grads[0] if grads[1][n].abs().max() > 0)
    print(f"gradients: max relative error {worst:.3e}")
    assert worst < 1e-4


def test_checkpoint_folders_load_both_ways(pair, tmp_path):
    ours, upstream = pair
    ours.save_pretrained(tmp_path / "ours")
    upstream.save_pretrained(tmp_path / "upstream")
    from_ours = UpstreamModel.from_pretrained(tmp_path / "ours")
    from_upstream = BooguImageTransformer2DModel.from_pretrained(tmp_path / "upstream")
    for model in (from_ours, from_upstream):
        state = model.state_dict()
        assert all(torch.equal(state[k], v) for k, v in ours.state_dict().items())
    public = lambda config: json.loads(json.dumps({k: v for k, v in config.items() if not k.startswith("_")}))  # noqa: E731
    assert public(from_upstream.config) == public(ours.config) == public(from_ours.config)


def test_lora_wraps_the_same_modules(pair):
    from peft import LoraConfig
    from peft.tuners.lora import LoraLayer

    wrapped = []
    for model in pair:
        model = type(model)(**model.config)
        model.add_adapter(LoraConfig(r=2, target_modules=list(LORA_TARGET_MODULES)))
        wrapped.append({n for n, m in model.named_modules() if isinstance(m, LoraLayer)})
    assert wrapped[0] == wrapped[1]
