"""Tests of our Boogu-Image transformer port (`boogu_adapters.model`, `docs/upstream-model.md`).

The model is checked against an independent float64 reference written below from that page (§3-§7;
section numbers in this file are its): one sample at a time, no padding, no batching, explicit
loops for the layouts. A float64 copy of the model must match it to ~1e-12 and the float32 model
to ~1e-6, for every block and for whole T2I / edit forwards. Batching, padding and reference-image
handling are then checked as invariances, and the released parameter tree against a committed
inventory.

Run ``uv run python tests/adapters/test_model.py --write-inventory`` to regenerate
``released_inventory.txt`` from ``shared/spec/released_inventory.json``: the released transformer config
with its 942 tensor names and shapes, read from upstream on the meta device, kept in the project's
``shared/`` folder beside the checkout (not in the repository; the test skips without it).
"""

from __future__ import annotations

import copy
import inspect
import json
import math
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from boogu_adapters.model import (
    LORA_TARGET_MODULES,
    RELEASED_CONFIG,
    TINY_CONFIG,
    BooguImageTransformer2DModel,
    count_parameters,
    get_freqs_cis,
    patchify,
    randomize_parameters,
    unpatchify,
)

REPO_ROOT = Path(__file__).resolve().parents[2]
INVENTORY_PATH = Path(__file__).with_name("released_inventory.txt")
SHARED_INVENTORY = REPO_ROOT.parent / "shared" / "spec" / "released_inventory.json"
F64 = torch.float64

# ---------------------------------------------------------------------------- inventory


def render_inventory(spec: dict) -> str:
    """The committed inventory text for a `released_inventory.json` mapping."""
    lines = [
        "# Boogu-Image-0.1 released transformer: state-dict inventory (docs/upstream-model.md §2.4).",
        "# Generated from shared/spec/released_inventory.json by",
        "#   uv run python tests/adapters/test_model.py --write-inventory",
        "# Do not edit by hand. Format: one tensor per line, '<name> <comma-separated shape>'.",
        "# config: " + json.dumps(spec["config"], sort_keys=True),
        "# num_params: " + str(spec["num_params"]),
    ]
    lines += [f"{name} {','.join(map(str, shape))}" for name, shape in spec["tensors"].items()]
    return "\n".join(lines) + "\n"


def read_inventory() -> tuple[dict, int, dict[str, list[int]]]:
    """(config, num_params, {name: shape}) from the committed inventory."""
    config, num_params, tensors = None, None, {}
    for line in INVENTORY_PATH.read_text().splitlines():
        if line.startswith("# config: "):
            config = json.loads(line.removeprefix("# config: "))
        elif line.startswith("# num_params: "):
            num_params = int(line.removeprefix("# num_params: "))
        elif line and not line.startswith("#"):
            name, shape = line.split(" ")
            tensors[name] = [int(s) for s in shape.split(",")]
    assert config is not None and num_params is not None
    return config, num_params, tensors


def test_committed_inventory_matches_shared_spec():
    if not SHARED_INVENTORY.exists():
        pytest.skip(f"{SHARED_INVENTORY} not present (CI without shared/)")
    assert INVENTORY_PATH.read_text() == render_inventory(json.loads(SHARED_INVENTORY.read_text()))


def test_released_config_parameter_tree_on_meta():
    config, num_params, tensors = read_inventory()
    assert config == json.loads(json.dumps(RELEASED_CONFIG))  # tuples vs lists aside
    with torch.device("meta"):
        model = BooguImageTransformer2DModel(**config)
    state = {name: list(tensor.shape) for name, tensor in model.state_dict().items()}
    assert len(state) == len(tensors) == 942
    assert state == tensors  # names and shapes
    assert list(state) == list(tensors)  # and the released order
    assert count_parameters(model) == num_params == 10_292_556_288
    assert not list(model.buffers())
    # The registered config round-trips the released keys (what save_pretrained writes).
    registered = {k: v for k, v in model.config.items() if not k.startswith("_")}
    for key, value in config.items():
        assert json.loads(json.dumps(registered[key])) == value, key


def test_init_signature_defaults_match_upstream():
    # §2.1, "signature default" column.
    expected = {
        "patch_size": 2,
        "in_channels": 16,
        "out_channels": None,
        "hidden_size": 2304,
        "num_layers": 26,
        "num_double_stream_layers": 2,
        "num_refiner_layers": 2,
        "num_attention_heads": 24,
        "num_kv_heads": 8,
        "multiple_of": 256,
        "ffn_dim_multiplier": None,
        "norm_eps": 1e-5,
        "axes_dim_rope": (40, 40, 40),
        "axes_lens": (2048, 1664, 1664),
        "instruction_feature_configs": {
            "instruction_feat_dim": 1024,
            "reduce_type": "mean",
            "num_instruction_feat_layers": 1,
        },
        "prompt_tuning_configs": {"use_prompt_tuning": False},
        "timestep_scale": 1.0,
    }
    params = inspect.signature(BooguImageTransformer2DModel.__init__).parameters
    assert {k: p.default for k, p in params.items() if k != "self"} == expected
    forward_params = inspect.signature(BooguImageTransformer2DModel.forward).parameters
    # Upstream's positional signature, unchanged; ours adds only keyword-only extras.
    forward = [k for k, p in forward_params.items() if p.kind is not inspect.Parameter.KEYWORD_ONLY]
    extras = [k for k, p in forward_params.items() if p.kind is inspect.Parameter.KEYWORD_ONLY]
    assert extras == ["instruction_lengths", "instruction_cache"]
    assert all(forward_params[k].default is None for k in extras)
    assert forward == [
        "self",
        "hidden_states",
        "timestep",
        "instruction_hidden_states",
        "freqs_cis",
        "instruction_attention_mask",
        "ref_image_hidden_states",
        "attention_kwargs",
        "return_dict",
    ]
    assert inspect.signature(BooguImageTransformer2DModel.forward).parameters["return_dict"].default is False


@pytest.mark.parametrize(
    ("override", "message"),
    [
        ({"axes_dim_rope": (4, 6, 8)}, "sum\\(axes_dim_rope\\)"),
        ({"num_double_stream_layers": 3}, "num_double_stream_layers"),
        ({"num_kv_heads": 3}, "num_kv_heads"),
    ],
)
def test_config_validation(override, message):
    with pytest.raises(ValueError, match=message):
        BooguImageTransformer2DModel(**{**TINY_CONFIG, **override})


# ---------------------------------------------------------------------------- float64 reference
# Written from docs/upstream-model.md only; every function works on one sample, W is a float64 state dict.


def ref_linear(x, W, name, bias=False):
    y = x @ W[name + ".weight"].T
    return y + W[name + ".bias"] if bias else y


def ref_rms(x, weight, eps=1e-5):
    return x / torch.sqrt(x.pow(2).mean(-1, keepdim=True) + eps) * weight


def ref_angles(positions, axes_dim, theta=10000.0):
    """(n, 3) positions -> (n, d/2) rotation angles; axis k owns a contiguous block of pairs."""
    blocks = []
    for axis, dim in enumerate(axes_dim):
        omega = theta ** (-2.0 * torch.arange(dim // 2, dtype=F64) / dim)
        blocks.append(positions[:, axis : axis + 1].to(F64) * omega)
    return torch.cat(blocks, dim=-1)


def ref_rotate(x, angles):
    """x (n, H, d): rotate interleaved pairs (x[2i], x[2i+1]) by angles (n, d/2)."""
    cos, sin = torch.cos(angles)[:, None], torch.sin(angles)[:, None]
    out = torch.empty_like(x)
    out[..., 0::2] = x[..., 0::2] * cos - x[..., 1::2] * sin
    out[..., 1::2] = x[..., 0::2] * sin + x[..., 1::2] * cos
    return out


def ref_attention_core(q, k, v, W, prefix, angles, cfg):
    """Projected q (n, H·d), k/v (n, Hkv·d) -> (n, H·d): qk-norm, RoPE, GQA softmax attention."""
    heads, kv_heads = cfg["num_attention_heads"], cfg["num_kv_heads"]
    d = cfg["hidden_size"] // heads
    n = q.shape[0]
    q = ref_rotate(ref_rms(q.view(n, heads, d), W[prefix + "norm_q.weight"]), angles)
    k = ref_rotate(ref_rms(k.view(n, kv_heads, d), W[prefix + "norm_k.weight"]), angles)
    v = v.view(n, kv_heads, d)
    out = torch.empty(n, heads, d, dtype=F64)
    for h in range(heads):
        g = h // (heads // kv_heads)
        weights = torch.softmax(q[:, h] @ k[:, g].T / math.sqrt(d), dim=-1)
        out[:, h] = weights @ v[:, g]
    return out.reshape(n, heads * d)


def ref_self_attention(x, W, prefix, angles, cfg):
    q, k, v = (ref_linear(x, W, prefix + name) for name in ("to_q", "to_k", "to_v"))
    return ref_linear(ref_attention_core(q, k, v, W, prefix, angles, cfg), W, prefix + "to_out.0")


def ref_ffn(x, W, prefix):
    hidden = F.silu(ref_linear(x, W, prefix + "linear_1")) * ref_linear(x, W, prefix + "linear_3")
    return ref_linear(hidden, W, prefix + "linear_2")


def ref_adaln(x, temb, W, prefix):
    c = ref_linear(F.silu(temb), W, prefix + "linear", bias=True).chunk(4)
    return ref_rms(x, W[prefix + "norm.weight"]) * (1 + c[0]), c[1], c[2], c[3]


def ref_block(x, temb, W, prefix, angles, cfg):
    """§4.1; modulated unless temb is None (context refiner)."""
    if temb is None:
        x = x + ref_rms(
            ref_self_attention(ref_rms(x, W[prefix + "norm1.weight"]), W, prefix + "attn.", angles, cfg),
            W[prefix + "norm2.weight"],
        )
        return x + ref_rms(
            ref_ffn(ref_rms(x, W[prefix + "ffn_norm1.weight"]), W, prefix + "feed_forward."),
            W[prefix + "ffn_norm2.weight"],
        )
    n, g_msa, s_mlp, g_mlp = ref_adaln(x, temb, W, prefix + "norm1.")
    x = x + torch.tanh(g_msa) * ref_rms(
        ref_self_attention(n, W, prefix + "attn.", angles, cfg), W[prefix + "norm2.weight"]
    )
    mlp_in = ref_rms(x, W[prefix + "ffn_norm1.weight"]) * (1 + s_mlp)
    return x + torch.tanh(g_mlp) * ref_rms(
        ref_ffn(mlp_in, W, prefix + "feed_forward."), W[prefix + "ffn_norm2.weight"]
    )


def ref_double_block(img, ins, temb, W, prefix, img_angles, joint_angles, cfg):
    """§4.2 and §7.2; ins holds the valid instruction tokens only."""
    rms = lambda x, name: ref_rms(x, W[prefix + name + ".weight"])  # noqa: E731
    img_n1, g_msa, s_mlp, g_mlp = ref_adaln(img, temb, W, prefix + "img_norm1.")
    img_n2, sh_mlp, _, _ = ref_adaln(img, temb, W, prefix + "img_norm2.")
    img_n3, g_self, _, _ = ref_adaln(img, temb, W, prefix + "img_norm3.")
    ins_n1, ig_msa, is_mlp, ig_mlp = ref_adaln(ins, temb, W, prefix + "instruct_norm1.")
    ins_n2, ish_mlp, _, _ = ref_adaln(ins, temb, W, prefix + "instruct_norm2.")

    attn, proc = prefix + "img_instruct_attn.", prefix + "img_instruct_attn.processor."
    q = torch.cat([ref_linear(ins_n1, W, proc + "instruct_to_q"), ref_linear(img_n1, W, proc + "img_to_q")])
    k = torch.cat([ref_linear(ins_n1, W, proc + "instruct_to_k"), ref_linear(img_n1, W, proc + "img_to_k")])
    v = torch.cat([ref_linear(ins_n1, W, proc + "instruct_to_v"), ref_linear(img_n1, W, proc + "img_to_v")])
    joint = ref_attention_core(q, k, v, W, attn, joint_angles, cfg)
    lc = ins.shape[0]
    ins_a = ref_linear(ref_linear(joint[:lc], W, proc + "instruct_out"), W, attn + "to_out.0")
    img_a = ref_linear(ref_linear(joint[lc:], W, proc + "img_out"), W, attn + "to_out.0")
    img_s = ref_self_attention(img_n3, W, prefix + "img_self_attn.", img_angles, cfg)

    img = img + torch.tanh(g_msa) * rms(img_a, "img_attn_norm")
    img = img + torch.tanh(g_self) * rms(img_s, "img_self_attn_norm")
    img_mlp = ref_ffn(rms((1 + s_mlp) * img_n2 + sh_mlp, "img_ffn_norm1"), W, prefix + "img_feed_forward.")
    img = img + torch.tanh(g_mlp) * rms(img_mlp, "img_ffn_norm2")
    ins = ins + torch.tanh(ig_msa) * rms(ins_a, "instruct_attn_norm")
    ins_mlp = ref_ffn(
        rms((1 + is_mlp) * ins_n2 + ish_mlp, "instruct_ffn_norm1"), W, prefix + "instruct_feed_forward."
    )
    return img, ins + torch.tanh(ig_mlp) * rms(ins_mlp, "instruct_ffn_norm2")


def ref_patchify(latent, p):
    """(C, H, W) -> tokens; token (r, c) element (i·p + j)·C + ch = latent[ch, r·p + i, c·p + j]."""
    channels, height, width = latent.shape
    rows, cols = height // p, width // p
    tokens = torch.empty(rows * cols, p * p * channels, dtype=latent.dtype)
    for r in range(rows):
        for c in range(cols):
            for i in range(p):
                for j in range(p):
                    start = (i * p + j) * channels
                    tokens[r * cols + c, start : start + channels] = latent[:, r * p + i, c * p + j]
    return tokens


def ref_unpatchify(tokens, rows, cols, p):
    channels = tokens.shape[1] // (p * p)
    latent = torch.empty(channels, rows * p, cols * p, dtype=tokens.dtype)
    for r in range(rows):
        for c in range(cols):
            for i in range(p):
                for j in range(p):
                    start = (i * p + j) * channels
                    latent[:, r * p + i, c * p + j] = tokens[r * cols + c, start : start + channels]
    return latent


def ref_grid_positions(shift, rows, cols):
    return torch.tensor([[shift, r, c] for r in range(rows) for c in range(cols)], dtype=torch.int64).reshape(
        -1, 3
    )


def ref_timestep_embedding(t, W, scale):
    """§3.5: the sinusoid is computed in float32 (as upstream), the MLP in float64."""
    k = torch.arange(128, dtype=torch.float32)
    frequencies = torch.exp(-math.log(10000) * k / 128)
    angles = (torch.tensor([t], dtype=torch.float32)[:, None] * frequencies[None, :]) * scale
    sinusoid = torch.cat([torch.cos(angles), torch.sin(angles)], dim=-1).to(F64)[0]
    hidden = F.silu(ref_linear(sinusoid, W, "time_caption_embed.timestep_embedder.linear_1", bias=True))
    return ref_linear(hidden, W, "time_caption_embed.timestep_embedder.linear_2", bias=True)


def ref_forward(W, cfg, target, t, instruction, references):
    """One sample of §5: target (C, H, W), instruction (Lc, F) valid tokens, references [(C, h, w)]."""
    p, axes, eps = cfg["patch_size"], cfg["axes_dim_rope"], 1e-5
    temb = ref_timestep_embedding(t, W, cfg["timestep_scale"])
    lc = instruction.shape[0]
    ins = ref_linear(
        ref_rms(instruction, W["time_caption_embed.caption_embedder.0.weight"], eps),
        W,
        "time_caption_embed.caption_embedder.1",
        bias=True,
    )

    # Positions (§6.2).
    text_pos = torch.arange(lc)[:, None].repeat(1, 3)
    ref_pos, shift = [], lc
    for ref in references:
        rows, cols = ref.shape[1] // p, ref.shape[2] // p
        ref_pos.append(ref_grid_positions(shift, rows, cols))
        shift += max(rows, cols)
    rows, cols = target.shape[1] // p, target.shape[2] // p
    target_pos = ref_grid_positions(shift, rows, cols)
    ang = lambda pos: ref_angles(pos, axes)  # noqa: E731

    for i in range(cfg["num_refiner_layers"]):
        ins = ref_block(ins, None, W, f"context_refiner.{i}.", ang(text_pos), cfg)
    tgt = ref_linear(ref_patchify(target, p), W, "x_embedder", bias=True)
    for i in range(cfg["num_refiner_layers"]):
        tgt = ref_block(tgt, temb, W, f"noise_refiner.{i}.", ang(target_pos), cfg)
    refined = []
    for j, (ref, pos) in enumerate(zip(references, ref_pos, strict=True)):
        hidden = (
            ref_linear(ref_patchify(ref, p), W, "ref_image_patch_embedder", bias=True)
            + W["image_index_embedding"][j]
        )
        for i in range(cfg["num_refiner_layers"]):
            hidden = ref_block(hidden, temb, W, f"ref_image_refiner.{i}.", ang(pos), cfg)
        refined.append(hidden)

    img = torch.cat([*refined, tgt])
    img_pos = torch.cat([*ref_pos, target_pos])
    joint_pos = torch.cat([text_pos, img_pos])
    for i in range(cfg["num_double_stream_layers"]):
        img, ins = ref_double_block(
            img, ins, temb, W, f"double_stream_layers.{i}.", ang(img_pos), ang(joint_pos), cfg
        )
    joint = torch.cat([ins, img])
    for i in range(cfg["num_layers"] - cfg["num_double_stream_layers"]):
        joint = ref_block(joint, temb, W, f"single_stream_layers.{i}.", ang(joint_pos), cfg)

    scale = ref_linear(F.silu(temb), W, "norm_out.linear_1", bias=True)
    normed = (joint - joint.mean(-1, keepdim=True)) / torch.sqrt(
        joint.var(-1, unbiased=False, keepdim=True) + 1e-6
    )
    out = ref_linear(normed * (1 + scale), W, "norm_out.linear_2", bias=True)
    return ref_unpatchify(out[-rows * cols :], rows, cols, p)


# ---------------------------------------------------------------------------- fixtures and inputs

# Large enough that every gate and modulation matters (tanh(c) ~ 0.5), small enough to stay tame.
TEST_STD = 0.1


@pytest.fixture(scope="module")
def model() -> BooguImageTransformer2DModel:
    return randomize_parameters(BooguImageTransformer2DModel(**TINY_CONFIG).eval(), 1234, std=TEST_STD)


@pytest.fixture(scope="module")
def model64(model) -> BooguImageTransformer2DModel:
    return copy.deepcopy(model).to(F64)


@pytest.fixture(scope="module")
def freqs() -> list[torch.Tensor]:
    return get_freqs_cis(TINY_CONFIG["axes_dim_rope"], TINY_CONFIG["axes_lens"], 10000)


def weights64(module) -> dict[str, torch.Tensor]:
    return {name: tensor.detach().to(F64) for name, tensor in module.state_dict().items()}


def make_batch(seed, text_lengths, target_sizes, reference_sizes, pad_to=None, dtype=torch.float32):
    """Random inputs: right-padded instructions, list targets, per-sample reference lists."""
    g = torch.Generator().manual_seed(seed)
    width = pad_to or max(max(text_lengths), 1)
    feat = TINY_CONFIG["instruction_feature_configs"]["instruction_feat_dim"]
    instruction = torch.randn(len(text_lengths), width, feat, generator=g, dtype=dtype)
    mask = torch.arange(width)[None, :] < torch.tensor(text_lengths)[:, None]
    targets = [torch.randn(16, h, w, generator=g, dtype=dtype) for h, w in target_sizes]
    references = [
        None if sizes is None else [torch.randn(16, h, w, generator=g, dtype=dtype) for h, w in sizes]
        for sizes in reference_sizes
    ]
    timestep = torch.rand(len(text_lengths), generator=g, dtype=dtype)
    return targets, timestep, instruction, mask, references


def rel_err(actual, expected) -> float:
    if isinstance(actual, (list, tuple)):
        return max(rel_err(a, e) for a, e in zip(actual, expected, strict=True))
    return ((actual.to(F64) - expected.to(F64)).abs().max() / expected.to(F64).abs().max()).item()


# ---------------------------------------------------------------------------- components


def test_fresh_model_outputs_exactly_zero_and_randomize(freqs):
    fresh = BooguImageTransformer2DModel(**TINY_CONFIG)
    targets, t, ins, mask, refs = make_batch(0, [3, 5], [(4, 4), (4, 6)], [None, [(4, 4)]])
    with torch.no_grad():
        out = fresh(targets, t, ins, freqs, mask, refs)
    assert all(torch.count_nonzero(o) == 0 for o in out)  # §2.5: zero-init head and adaLN

    a = randomize_parameters(BooguImageTransformer2DModel(**TINY_CONFIG), 7)
    b = randomize_parameters(BooguImageTransformer2DModel(**TINY_CONFIG), torch.Generator().manual_seed(7))
    for (name, pa), pb in zip(a.named_parameters(), b.parameters(), strict=True):
        assert torch.equal(pa, pb), name
        assert torch.count_nonzero(pa) == pa.numel(), name
    assert torch.allclose(a.norm_out.linear_2.weight.std(), torch.tensor(0.02), rtol=0.2)
    assert torch.allclose(a.single_stream_layers[0].ffn_norm1.weight.mean(), torch.tensor(1.0), atol=0.02)
    with torch.no_grad():
        assert all(o.abs().max() > 1e-3 for o in a(targets, t, ins, freqs, mask, refs))


def test_get_freqs_cis_tables():
    axes_dim, axes_lens = (4, 6, 8), (11, 7, 5)
    tables = get_freqs_cis(axes_dim, axes_lens, 10000)
    assert [t.dtype for t in tables] == [torch.complex128] * 3
    assert [tuple(t.shape) for t in tables] == [(11, 2), (7, 3), (5, 4)]
    for table, dim in zip(tables, axes_dim, strict=True):
        for pos in range(table.shape[0]):
            for j in range(dim // 2):
                angle = pos / 10000 ** (2 * j / dim)
                assert abs(table[pos, j].item() - complex(math.cos(angle), math.sin(angle))) < 1e-12


def test_patchify_is_channel_fastest_and_inverts():
    latent = torch.randn(16, 6, 10, dtype=F64)
    tokens = patchify(latent, 2)
    assert tokens.shape == (15, 64)
    assert torch.equal(tokens, ref_patchify(latent, 2))
    # Token (1, 2), row offset 1, column offset 0, channel 5 -> element (1·2 + 0)·16 + 5.
    assert tokens[1 * 5 + 2, 2 * 16 + 5] == latent[5, 3, 4]
    assert torch.equal(unpatchify(tokens, 3, 5, 2), latent)


def _rotary(positions_per_row, width):
    """Padded (N, width, d/2, 2) float64 rotary built from reference angles (not model code)."""
    rows = []
    for pos in positions_per_row:
        ang = ref_angles(pos, TINY_CONFIG["axes_dim_rope"])
        ang = F.pad(ang, (0, 0, 0, width - ang.shape[0]))
        rows.append(torch.stack([torch.cos(ang), torch.sin(ang)], dim=-1))
    return torch.stack(rows)


@pytest.mark.parametrize("kind", ["noise_refiner", "context_refiner", "single_stream_layers"])
def test_sequential_block_matches_reference(model64, kind):
    block = getattr(model64, kind)[0]
    W = {f"{kind}.0." + k: v for k, v in weights64(block).items()}
    g = torch.Generator().manual_seed(3)
    lengths, width = [5, 3], 6
    x = torch.randn(2, width, 64, generator=g, dtype=F64)
    temb = torch.randn(2, 64, generator=g, dtype=F64)
    mask = torch.arange(width)[None] < torch.tensor(lengths)[:, None]
    positions = [ref_grid_positions(4, 1, n) for n in lengths]
    with torch.no_grad():
        out = block(x, mask, _rotary(positions, width), None if kind == "context_refiner" else temb)
    for b, n in enumerate(lengths):
        expected = ref_block(
            x[b, :n],
            None if kind == "context_refiner" else temb[b],
            W,
            f"{kind}.0.",
            ref_angles(positions[b], TINY_CONFIG["axes_dim_rope"]),
            TINY_CONFIG,
        )
        torch.testing.assert_close(out[b, :n], expected, rtol=1e-12, atol=1e-12)


def test_double_stream_block_matches_reference(model64):
    from boogu_adapters.model.layout import StreamPacking

    block = model64.double_stream_layers[0]
    W = {"double_stream_layers.0." + k: v for k, v in weights64(block).items()}
    g = torch.Generator().manual_seed(4)
    text_lengths, text_width, img_lengths, img_width = [4, 2], 5, [6, 9], 9
    ins = torch.randn(2, text_width, 64, generator=g, dtype=F64)
    img = torch.randn(2, img_width, 64, generator=g, dtype=F64)
    temb = torch.randn(2, 64, generator=g, dtype=F64)
    img_mask = torch.arange(img_width)[None] < torch.tensor(img_lengths)[:, None]
    img_pos = [ref_grid_positions(lc, 3, n // 3) for lc, n in zip(text_lengths, img_lengths, strict=True)]
    joint_pos = [
        torch.cat([torch.arange(lc)[:, None].repeat(1, 3), p])
        for lc, p in zip(text_lengths, img_pos, strict=True)
    ]
    packing = StreamPacking(text_lengths, text_width, img_lengths, img_width, torch.device("cpu"))
    with torch.no_grad():
        img_out, ins_out = block(
            img,
            ins,
            img_mask,
            _rotary(img_pos, img_width),
            packing,
            _rotary(joint_pos, max(packing.lengths)),
            temb,
        )
    axes = TINY_CONFIG["axes_dim_rope"]
    for b, (lc, n) in enumerate(zip(text_lengths, img_lengths, strict=True)):
        exp_img, exp_ins = ref_double_block(
            img[b, :n],
            ins[b, :lc],
            temb[b],
            W,
            "double_stream_layers.0.",
            ref_angles(img_pos[b], axes),
            ref_angles(joint_pos[b], axes),
            TINY_CONFIG,
        )
        torch.testing.assert_close(img_out[b, :n], exp_img, rtol=1e-12, atol=1e-12)
        torch.testing.assert_close(ins_out[b, :lc], exp_ins, rtol=1e-12, atol=1e-12)


# ---------------------------------------------------------------------------- whole forward

CASES = {
    # name: (text lengths, target latent sizes, reference latent sizes per sample)
    "t2i": ([7, 3], [(8, 8), (6, 10)], [None, None]),
    "edit": ([5, 8], [(8, 8), (4, 6)], [[(8, 8)], [(4, 6), (10, 4)]]),
    "mixed": ([6, 2, 4], [(4, 4), (8, 6), (6, 6)], [[(6, 4), (4, 8), (4, 4)], None, [(8, 8)]]),
    "empty-text": ([0, 4], [(4, 4), (4, 4)], [[(4, 4)], None]),
}


@pytest.mark.parametrize("case", list(CASES))
def test_forward_matches_float64_reference(model, model64, freqs, case):
    text_lengths, target_sizes, reference_sizes = CASES[case]
    targets, t, ins, mask, refs = make_batch(
        11, text_lengths, target_sizes, reference_sizes, pad_to=9, dtype=F64
    )
    W = weights64(model64)
    expected = [
        ref_forward(W, TINY_CONFIG, targets[b], t[b].item(), ins[b, :n], refs[b] or [])
        for b, n in enumerate(text_lengths)
    ]
    with torch.no_grad():
        out64 = model64(targets, t, ins, freqs, mask, refs)
        # float32 model on the float32-rounded inputs (the reference saw the same values in float64).
        f32 = lambda x: None if x is None else x.float()  # noqa: E731
        out32 = model(
            [f32(x) for x in targets],
            t.float(),
            ins.float(),
            freqs,
            mask,
            [None if r is None else [f32(x) for x in r] for r in refs],
        )
    for b in range(len(text_lengths)):
        assert out64[b].shape == expected[b].shape == targets[b].shape
        torch.testing.assert_close(out64[b], expected[b], rtol=1e-10, atol=1e-10)
    # float32 vs float64 differ only by rounding; 1e-5 relative to the output scale is the parity bar.
    assert rel_err(out32, expected) < 1e-5
    assert min(o.abs().max().item() for o in expected) > 0.1  # a real signal, not a zero output


def test_reference_images_enter_through_refiner_and_order_matters(model, freqs):
    targets, t, ins, mask, refs = make_batch(5, [6], [(6, 6)], [[(6, 6), (4, 8)]])
    with torch.no_grad():
        with_refs = model(targets, t, ins, freqs, mask, refs)[0]
        swapped = model(targets, t, ins, freqs, mask, [refs[0][::-1]])[0]
        without = model(targets, t, ins, freqs, mask, None)[0]
        first_only = model(targets, t, ins, freqs, mask, [refs[0][:1]])[0]
    # Each change of the references changes the target's velocity noticeably.
    for other in (swapped, without, first_only):
        assert rel_err(other, with_refs) > 1e-3
    # An explicit list of Nones or empty lists is the same as no references at all.
    with torch.no_grad():
        assert torch.equal(model(targets, t, ins, freqs, mask, [None])[0], without)
        assert torch.equal(model(targets, t, ins, freqs, mask, [[]])[0], without)


def test_ragged_batch_equals_per_sample_runs(model, freqs):
    text_lengths, target_sizes, reference_sizes = (
        [9, 2, 5, 7],
        [(4, 6), (8, 8), (6, 4), (4, 4)],
        [
            [(4, 4), (6, 8)],
            None,
            [(8, 4)],
            [(4, 4), (4, 4), (6, 6), (4, 6), (8, 8)],  # the maximum of 5 references
        ],
    )
    targets, t, ins, mask, refs = make_batch(21, text_lengths, target_sizes, reference_sizes, pad_to=12)
    with torch.no_grad():
        batched = model(targets, t, ins, freqs, mask, refs)
        for b, n in enumerate(text_lengths):
            # Alone, with no instruction padding at all.
            single = model(
                [targets[b]], t[b : b + 1], ins[b : b + 1, :n], freqs, mask[b : b + 1, :n], [refs[b]]
            )
            assert rel_err(batched[b], single[0]) < 1e-5


def test_instruction_padding_invariance(model, freqs):
    targets, t, ins, mask, refs = make_batch(8, [4, 6], [(6, 6), (6, 6)], [[(4, 4)], None])
    g = torch.Generator().manual_seed(9)
    # Extra padding filled with large garbage: masked keys and squeezed-out tokens must not leak.
    garbage = 50 * torch.randn(2, 7, ins.shape[-1], generator=g)
    padded_ins = torch.cat([ins, garbage], dim=1)
    padded_mask = torch.cat([mask, torch.zeros(2, 7, dtype=torch.bool)], dim=1)
    # Also overwrite the existing padding slots of sample 0 (4 valid of 6).
    padded_ins[0, 4:6] = -30.0
    with torch.no_grad():
        base = model(torch.stack(targets), t, ins, freqs, mask, refs)
        padded = model(torch.stack(targets), t, padded_ins, freqs, padded_mask.long(), refs)
    assert rel_err(padded, base) < 1e-6


def test_output_forms_and_timestep_broadcast(model, freqs):
    targets, t, ins, mask, _ = make_batch(2, [3, 3], [(4, 6), (4, 6)], [None, None])
    stacked = torch.stack(targets)
    with torch.no_grad():
        as_list = model(targets, t, ins, freqs, mask)
        as_tensor = model(stacked, t, ins, freqs, mask)
        wrapped = model(stacked, t, ins, freqs, mask, return_dict=True)
        positional = model(stacked, t, ins, freqs, mask, None, None, False)
        no_freqs = model(stacked, t, ins, None, mask)
        same_t = model(stacked, t[:1].expand(2), ins, freqs, mask)
        scalar_t = model(stacked, t[0], ins, freqs, mask)
        one_t = model(stacked, t[:1], ins, freqs, mask)
    assert isinstance(as_list, list) and len(as_list) == 2
    assert isinstance(as_tensor, torch.Tensor) and as_tensor.shape == (2, 16, 4, 6)
    assert torch.equal(wrapped.sample, as_tensor) and torch.equal(positional, as_tensor)
    assert torch.equal(torch.stack(as_list), as_tensor)
    assert torch.equal(no_freqs, as_tensor)
    assert torch.equal(scalar_t, same_t) and torch.equal(one_t, same_t)


@pytest.mark.parametrize(("reduce_type", "feat_dim"), [("cat", 32), ("mean", 64)])
def test_instruction_feature_layers(freqs, reduce_type, feat_dim):
    features = {
        "instruction_feat_dim": feat_dim,
        "num_instruction_feat_layers": 2,
        "reduce_type": reduce_type,
    }
    layered = randomize_parameters(
        BooguImageTransformer2DModel(**{**TINY_CONFIG, "instruction_feature_configs": features}),
        3,
        std=TEST_STD,
    )
    assert layered.time_caption_embed.caption_embedder[0].weight.shape == (64,)
    g = torch.Generator().manual_seed(1)
    layers = [torch.randn(1, 5, feat_dim, generator=g) for _ in range(2)]
    joined = torch.cat(layers, -1) if reduce_type == "cat" else (layers[0] + layers[1]) / 2
    target, t = [torch.randn(16, 4, 4, generator=g)], torch.tensor([0.5])
    with torch.no_grad():
        from_layers = layered(target, t, layers, freqs, None)[0]
        from_tensor = layered(target, t, joined, freqs, None)[0]
    torch.testing.assert_close(from_layers, from_tensor, rtol=1e-6, atol=1e-6)
    with pytest.raises(ValueError, match="holds 1 layers"):
        layered(target, t, layers[:1], freqs, None)


def test_input_validation(model, freqs):
    targets, t, ins, mask, _ = make_batch(1, [3, 4], [(4, 4), (4, 4)], [None, None], pad_to=5)
    ref = torch.randn(16, 4, 4)
    with pytest.raises(ValueError, match="right-padded"):
        model(targets, t, ins, freqs, mask.flip(1))
    with pytest.raises(ValueError, match="at most 5"):
        model(targets, t, ins, freqs, mask, [[ref] * 6, None])
    with pytest.raises(ValueError, match="multiples of patch_size"):
        model([torch.randn(16, 5, 4), targets[1]], t, ins, freqs, mask)
    with pytest.raises(ValueError, match=r"\(B, L, 64\)"):
        model(targets, t, ins[..., :32], freqs, mask)
    with pytest.raises(ValueError, match="1 entries for a batch of 2"):
        model(targets, t, ins, freqs, mask, [None])
    with pytest.raises(ValueError, match="timestep"):
        model(targets, torch.rand(3), ins, freqs, mask)
    with pytest.raises(ValueError, match="RoPE axis 0 needs position 4"):
        model(targets, t, ins, [f[:3] for f in freqs], mask)
    with pytest.raises(ValueError, match="head dim"):
        model(targets, t, ins, get_freqs_cis((4, 4, 4), (64, 64, 64)), mask)


# ---------------------------------------------------------------------------- LoRA, checkpointing, I/O


def expected_lora_modules(cfg) -> set[str]:
    """Module paths the §2.7 target list must wrap, enumerated from the module tree."""
    attention = ["to_q", "to_k", "to_v", "to_out.0"]
    ffn = ["linear_1", "linear_2", "linear_3"]
    groups = {
        "noise_refiner": cfg["num_refiner_layers"],
        "ref_image_refiner": cfg["num_refiner_layers"],
        "context_refiner": cfg["num_refiner_layers"],
        "single_stream_layers": cfg["num_layers"] - cfg["num_double_stream_layers"],
    }
    names = set()
    for group, count in groups.items():
        for i in range(count):
            names |= {f"{group}.{i}.attn.{a}" for a in attention}
            names |= {f"{group}.{i}.feed_forward.{f}" for f in ffn}
    processor = [
        "img_to_q",
        "img_to_k",
        "img_to_v",
        "instruct_to_q",
        "instruct_to_k",
        "instruct_to_v",
        "img_out",
        "instruct_out",
    ]
    for i in range(cfg["num_double_stream_layers"]):
        prefix = f"double_stream_layers.{i}."
        names.add(prefix + "img_instruct_attn.to_out.0")
        names |= {prefix + "img_instruct_attn.processor." + name for name in processor}
        names |= {prefix + "img_self_attn." + a for a in attention}
        names |= {
            prefix + f"{stream}.{f}" for stream in ("img_feed_forward", "instruct_feed_forward") for f in ffn
        }
    return names


def test_lora_attaches_to_intended_layers_only(model, freqs):
    from peft import LoraConfig
    from peft.tuners.lora import LoraLayer

    lora_model = copy.deepcopy(model)
    lora_model.add_adapter(LoraConfig(r=2, lora_alpha=2, target_modules=list(LORA_TARGET_MODULES)))
    wrapped = {name for name, module in lora_model.named_modules() if isinstance(module, LoraLayer)}
    assert wrapped == expected_lora_modules(TINY_CONFIG)
    # `to_q` must not match `img_to_q` a second time: the joint projection is wrapped exactly once.
    img_to_q = lora_model.double_stream_layers[0].img_instruct_attn.processor.img_to_q
    assert isinstance(img_to_q, LoraLayer) and type(img_to_q.base_layer) is torch.nn.Linear
    for untouched in (
        "time_caption_embed.timestep_embedder.linear_1",
        "norm_out.linear_1",
        "x_embedder",
        "single_stream_layers.0.norm1.linear",
    ):
        assert untouched not in wrapped

    targets, t, ins, mask, refs = make_batch(6, [4], [(4, 4)], [[(4, 4)]])
    with torch.no_grad():
        base = model(targets, t, ins, freqs, mask, refs)[0]
        assert torch.equal(lora_model(targets, t, ins, freqs, mask, refs)[0], base)  # lora_B starts at 0
        g = torch.Generator().manual_seed(0)
        for name, param in lora_model.named_parameters():
            if "lora_B" in name:
                param.copy_(0.1 * torch.randn(param.shape, generator=g))
        adapted = lora_model(targets, t, ins, freqs, mask, refs)[0]
        scaled_off = lora_model(targets, t, ins, freqs, mask, refs, attention_kwargs={"scale": 0.0})[0]
        again = lora_model(targets, t, ins, freqs, mask, refs)[0]
        lora_model.disable_adapters()
        disabled = lora_model(targets, t, ins, freqs, mask, refs)[0]
    assert rel_err(adapted, base) > 1e-3
    torch.testing.assert_close(scaled_off, base, rtol=0, atol=1e-6)
    assert torch.equal(again, adapted)  # the LoRA scale is restored after the call
    assert torch.equal(disabled, base)


def test_gradient_checkpointing_gives_same_gradients(model, freqs):
    targets, t, ins, mask, refs = make_batch(12, [5, 3], [(4, 6), (6, 4)], [[(4, 4)], None])

    def gradients(m):
        m.zero_grad()
        out = m(targets, t, ins, freqs, mask, refs)
        sum(o.square().mean() for o in out).backward()
        return {name: p.grad.clone() for name, p in m.named_parameters()}

    plain_model = copy.deepcopy(model).train()
    checkpointed = copy.deepcopy(model).train()
    calls = []

    def counting_checkpoint(block, *args):
        calls.append(type(block).__name__)
        return torch.utils.checkpoint.checkpoint(block.__call__, *args, use_reentrant=False)

    checkpointed.enable_gradient_checkpointing(counting_checkpoint)
    plain, ckpt = gradients(plain_model), gradients(checkpointed)
    # Every block is checkpointed once: the three refiners, then the double- and single-stream blocks.
    assert len(calls) == 3 * TINY_CONFIG["num_refiner_layers"] + TINY_CONFIG["num_layers"]
    assert plain.keys() == ckpt.keys()
    assert all(g.abs().max() > 0 for g in plain.values())
    for name in plain:
        torch.testing.assert_close(ckpt[name], plain[name], rtol=1e-6, atol=1e-9, msg=name)
    with torch.no_grad():  # no recomputation machinery without grad
        calls.clear()
        checkpointed(targets, t, ins, freqs, mask, refs)
    assert calls == []


def test_save_and_load_roundtrip(model, freqs, tmp_path):
    model.save_pretrained(tmp_path)
    saved = json.loads((tmp_path / "config.json").read_text())
    assert saved["_class_name"] == "BooguImageTransformer2DModel"
    assert saved["instruction_feature_configs"] == TINY_CONFIG["instruction_feature_configs"]
    loaded = BooguImageTransformer2DModel.from_pretrained(tmp_path).eval()
    original = model.state_dict()
    assert all(torch.equal(tensor, original[name]) for name, tensor in loaded.state_dict().items())
    targets, t, ins, mask, refs = make_batch(13, [4], [(4, 4)], [[(4, 4)]])
    with torch.no_grad():
        out_loaded = loaded(targets, t, ins, freqs, mask, refs)[0]
        out_original = model(targets, t, ins, freqs, mask, refs)[0]
    # Bit-identical weights, but safetensors hands out 8-byte-aligned (mmap) storage, which sends
    # the CPU BLAS down a different kernel path: rounding-level differences only.
    assert rel_err(out_loaded, out_original) < 1e-6


if __name__ == "__main__":
    if sys.argv[1:] != ["--write-inventory"]:
        sys.exit("usage: uv run python tests/adapters/test_model.py --write-inventory")
    INVENTORY_PATH.write_text(render_inventory(json.loads(SHARED_INVENTORY.read_text())))
    print(f"wrote {INVENTORY_PATH}")
