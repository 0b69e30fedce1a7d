"""The transformer's GPU fast paths, proven on CPU (`docs/gpu-path.md`, "Transformer fast paths").

* Attention plans (mask-free dense / per-length grouped / masked) equal the old masked path with
  ``repeat_interleave`` GQA, in values and gradients, fp32 and float64.
* RoPE tables and per-layout rotary tensors are cached; bf16 RoPE runs in float32.
* Given ``instruction_lengths`` a forward reads nothing back from the device.
* Regional compile equals eager (forward, backward, LoRA + checkpointing) and does not recompile
  for new prompt lengths in the same bucket or new timesteps.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode

from boogu_adapters.model import (
    TINY_CONFIG,
    BooguImageTransformer2DModel,
    get_freqs_cis,
    randomize_parameters,
)
from boogu_adapters.model import attention as attention_module
from boogu_adapters.model import transformer as transformer_module
from boogu_adapters.model.attention import MAX_LENGTH_GROUPS, AttentionPlan
from boogu_adapters.model.rope import apply_rotary

F64 = torch.float64


@pytest.fixture(scope="module")
def freqs():
    return get_freqs_cis(TINY_CONFIG["axes_dim_rope"], TINY_CONFIG["axes_lens"], 10000)


@pytest.fixture(scope="module")
def model():
    return randomize_parameters(BooguImageTransformer2DModel(**TINY_CONFIG).eval(), 5, std=0.1)


def make_batch(seed, text_lengths, target_sizes, reference_sizes, width=None, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    width = width or max(max(text_lengths), 1)
    ins = torch.randn(len(text_lengths), width, 64, generator=g).to(dtype)
    mask = (torch.arange(width)[None] < torch.tensor(text_lengths)[:, None]).long()
    targets = [torch.randn(16, h, w, generator=g).to(dtype) for h, w in target_sizes]
    refs = [
        None if s is None else [torch.randn(16, h, w, generator=g).to(dtype) for h, w in s]
        for s in reference_sizes
    ]
    t = torch.rand(len(text_lengths), generator=g).to(dtype)
    return targets, t, ins, mask, refs


def _old_masked_sdpa(query, key, value, key_mask, scale):
    """The pre-plan attention: K/V copied with repeat_interleave, one masked SDPA call."""
    key_mask = key_mask | ~key_mask.any(dim=-1, keepdim=True)
    groups = query.shape[1] // key.shape[1]
    key, value = key.repeat_interleave(groups, dim=1), value.repeat_interleave(groups, dim=1)
    return F.scaled_dot_product_attention(
        query, key, value, attn_mask=key_mask[:, None, None, :], scale=scale
    )


@pytest.fixture
def old_attention(monkeypatch):
    """Context manager-free switch: every plan masked, masked SDPA as before the fast paths."""

    def force_masked(*args, **kwargs):
        return AttentionPlan(*args, **{**kwargs, "masked": True})

    def apply():
        monkeypatch.setattr(transformer_module, "AttentionPlan", force_masked)
        monkeypatch.setattr(attention_module, "_masked_sdpa", _old_masked_sdpa)

    return apply


CASES = {
    # text lengths, targets, references; width pads the instruction further
    "ragged-t2i": ([7, 3, 7, 1], [(8, 8), (6, 10), (8, 8), (4, 4)], [None] * 4),
    "edit": ([5, 8], [(8, 8), (4, 6)], [[(8, 8)], [(4, 6), (10, 4)]]),
    "empty-instruction": ([0, 4, 0], [(4, 4), (4, 4), (6, 4)], [[(4, 4)], None, [(4, 4), (4, 4)]]),
    "same-size": ([6, 6], [(8, 8), (8, 8)], [None, None]),
}


def _forward_and_grads(model, batch, freqs):
    targets, t, ins, mask, refs = batch
    model.zero_grad()
    out = model(targets, t, ins, freqs, mask, refs)
    sum((o * torch.linspace(-1, 1, o.numel(), dtype=o.dtype).reshape(o.shape)).sum() for o in out).backward()
    grads = {
        n: torch.zeros_like(p) if p.grad is None else p.grad.clone() for n, p in model.named_parameters()
    }
    model.zero_grad()
    return [o.detach() for o in out], grads


@pytest.mark.parametrize("dtype", [torch.float32, F64])
@pytest.mark.parametrize("case", list(CASES))
def test_planned_attention_equals_old_masked_path(model, freqs, old_attention, dtype, case):
    net = copy.deepcopy(model).to(dtype)
    batch = make_batch(3, *CASES[case], width=10, dtype=dtype)
    new_out, new_grads = _forward_and_grads(net, batch, freqs)
    old_attention()
    old_out, old_grads = _forward_and_grads(net, batch, freqs)
    tol = 1e-12 if dtype == F64 else 2e-6
    for a, b in zip(new_out, old_out, strict=True):
        assert torch.isfinite(a).all()
        torch.testing.assert_close(a, b, rtol=0, atol=tol * max(b.abs().max().item(), 1.0))
    for name, g in old_grads.items():
        assert torch.isfinite(new_grads[name]).all(), name
        scale = max(g.abs().max().item(), 1e-3)
        torch.testing.assert_close(new_grads[name], g, rtol=0, atol=tol * scale * 10, msg=name)


def test_attention_plan_modes():
    cpu = torch.device("cpu")
    assert AttentionPlan([5, 5, 5], 5, cpu).mode == "dense"
    plan = AttentionPlan([5, 5, 3, 5, 0], 5, cpu)
    assert plan.mode == "grouped"
    (len5, rows5), (len3, rows3), (len0, rows0) = plan.groups
    assert (len5, len3, len0) == (5, 3, 0)
    assert torch.equal(rows5, torch.tensor([0, 1, 3]))  # not a contiguous range: an index
    assert rows3 == slice(2, 3) and rows0 == slice(4, 5)  # contiguous ranges: views
    assert torch.equal(plan.mask, torch.arange(5)[None] < torch.tensor([5, 5, 3, 5, 0])[:, None])
    many = list(range(MAX_LENGTH_GROUPS + 1))
    assert AttentionPlan(many, max(many), cpu).mode == "masked"  # too many distinct lengths
    assert AttentionPlan(many[:MAX_LENGTH_GROUPS], MAX_LENGTH_GROUPS, cpu).mode == "grouped"
    assert AttentionPlan([5, 5], 5, cpu, masked=True).mode == "masked"
    with pytest.raises(ValueError, match="do not fit"):
        AttentionPlan([6], 5, cpu)


def test_plans_follow_the_layout(model, freqs, monkeypatch):
    made = []

    def recording(*args, **kwargs):
        plan = AttentionPlan(*args, **kwargs)
        made.append(plan.mode)
        return plan

    monkeypatch.setattr(transformer_module, "AttentionPlan", recording)
    targets, t, ins, mask, refs = make_batch(1, [6, 6], [(8, 8), (8, 8)], [None, None])
    with torch.no_grad():
        model(targets, t, ins, freqs, mask, refs)
    # text, target, image, joint: one plan per stage per forward, all mask-free (normal RL case)
    assert made == ["dense"] * 4
    made.clear()
    targets, t, ins, mask, refs = make_batch(1, [6, 3], [(8, 8), (8, 8)], [[(4, 4)], [(4, 4)]], width=9)
    with torch.no_grad():
        model(targets, t, ins, freqs, mask, refs)
    assert made == ["grouped", "dense", "dense", "dense", "grouped"]  # text, target, refs, image, joint


def test_rotary_tables_and_layouts_are_cached(freqs):
    net = randomize_parameters(BooguImageTransformer2DModel(**TINY_CONFIG).eval(), 1)
    targets, t, ins, mask, refs = make_batch(2, [5, 3], [(8, 8), (8, 8)], [None, [(4, 4)]], width=6)
    with torch.no_grad():
        first = net(targets, t, ins, freqs, mask, refs)
        (tables_entry,) = net._tables_cache.values()
        (rotary_entry,) = net._rotary_cache.values()
        second = net(targets, t + 0.25, ins, freqs, mask, refs)  # another step, same layout
        assert len(net._tables_cache) == 1 and len(net._rotary_cache) == 1
        assert next(iter(net._rotary_cache.values()))[1] is rotary_entry[1]
        assert next(iter(net._tables_cache.values()))[1] is tables_entry[1]
        assert net.last_layout.text_lengths == [5, 3]
        assert net.last_layout.reference_grids == [[], [(2, 2)]]
        wide = torch.randn(1, 12, 64)
        for n in range(1, 12):  # new layouts: the LRU keeps the last ROTARY_CACHE_SIZE
            net([targets[0]], t[:1], wide[:1, :n], freqs, None, None)
        assert len(net._rotary_cache) == transformer_module.ROTARY_CACHE_SIZE
    assert not torch.equal(first[0], second[0])


def test_rope_dtypes_and_bf16_rounding():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(2, 300, 4, 16, generator=g, dtype=F64)
    angles = torch.rand(2, 300, 8, generator=g, dtype=F64) * 100
    rotary = torch.stack([angles.cos(), angles.sin()], dim=-1)
    pairs = x.unflatten(-1, (-1, 2))
    c, s = rotary[:, :, None, :, 0], rotary[:, :, None, :, 1]
    expected = torch.stack([pairs[..., 0] * c - pairs[..., 1] * s, pairs[..., 0] * s + pairs[..., 1] * c], -1)
    expected = expected.flatten(-2)
    # float64 and fp32 models: float64 product (upstream's complex128, rounded once).
    assert apply_rotary(x, rotary).dtype == F64
    torch.testing.assert_close(apply_rotary(x, rotary), expected, rtol=0, atol=1e-14)
    assert torch.equal(
        apply_rotary(x.float(), rotary).float(), apply_rotary(x.float().double(), rotary).float()
    )
    # bf16: float32 product; differs from the float64 path in very few elements, by one ulp.
    xb = x.bfloat16()
    fast = apply_rotary(xb, rotary.float())
    assert fast.dtype == torch.float32
    slow = apply_rotary(xb.double(), rotary).bfloat16()
    differ = (fast.bfloat16() != slow).sum().item()
    assert differ <= 1e-3 * slow.numel()
    torch.testing.assert_close(fast.bfloat16().double(), slow.double(), rtol=2**-7, atol=1e-6)
    # the real formula (what compiled regions trace) equals the complex multiply
    from boogu_adapters.model.rope import _rotate_real

    assert torch.equal(_rotate_real(xb.float(), rotary.float()), fast)


# ---------------------------------------------------------------------------- host syncs

_SYNC_OPS = {
    torch.ops.aten._local_scalar_dense.default,
    torch.ops.aten.item.default,
    torch.ops.aten.equal.default,
    torch.ops.aten.is_nonzero.default,
    torch.ops.aten.nonzero.default,
    torch.ops.aten.masked_select.default,
}


class NoHostReads(TorchDispatchMode):
    """Fails on every op that needs a device value on the host; records blocking H2D copies."""

    def __init__(self):
        super().__init__()
        self.blocking_copies = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in _SYNC_OPS or func.overloadpacket in {torch.ops.aten.item, torch.ops.aten.equal}:
            raise AssertionError(f"host read of a device value: {func}")
        if func is torch.ops.aten._to_copy.default:
            src, dst = args[0].device, kwargs.get("device")
            moves_off_host = dst is not None and src.type == "cpu" and torch.device(dst).type != "cpu"
            if moves_off_host and not kwargs.get("non_blocking", False):
                self.blocking_copies.append(func)
        return func(*args, **kwargs)


def _refuse_tolist(self, *args, **kwargs):
    raise AssertionError("Tensor.tolist() in the forward")


def test_forward_with_instruction_lengths_reads_nothing_back(model, freqs, monkeypatch):
    lengths = [5, 0, 3]
    targets, t, ins, mask, refs = make_batch(4, lengths, [(8, 8), (4, 4), (6, 4)], [[(4, 4)], None, [(4, 4)]])
    with torch.no_grad():
        expected = model(targets, t, ins, freqs, mask, refs)
        monkeypatch.setattr(torch.Tensor, "tolist", _refuse_tolist)
        # The sentinel works: without lengths the mask is read (one host read).
        with pytest.raises(AssertionError, match=r"host read|tolist"), NoHostReads():
            model(targets, t, ins, freqs, mask, refs)
        # CPU: without a mask there is nothing to check, so nothing is read.
        with NoHostReads():
            out = model(targets, t, ins, freqs, None, refs, instruction_lengths=lengths)
    for a, b in zip(out, expected, strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-6)


def test_forward_on_a_device_makes_no_sync_and_no_blocking_copy(freqs, monkeypatch):
    """The meta device stands in for CUDA: any host read fails there, and copies are seen."""
    monkeypatch.setattr(torch.Tensor, "tolist", _refuse_tolist)
    with torch.device("meta"):
        net = BooguImageTransformer2DModel(**TINY_CONFIG)
    meta = torch.device("meta")
    lengths = [5, 0, 3]
    targets, t, ins, mask, refs = make_batch(4, lengths, [(8, 8), (4, 4), (6, 4)], [[(4, 4)], None, [(4, 4)]])
    to_meta = lambda x: x.to(meta)  # noqa: E731
    inputs = (
        [to_meta(x) for x in targets],
        to_meta(t),
        to_meta(ins),
        [to_meta(f) for f in freqs],
        to_meta(mask),
        [None if r is None else [to_meta(x) for x in r] for r in refs],
    )
    mode = NoHostReads()
    with torch.no_grad(), mode:
        out = net(*inputs, instruction_lengths=lengths)
    assert [tuple(o.shape) for o in out] == [tuple(x.shape) for x in targets]
    assert mode.blocking_copies == []
    assert net.last_layout.text_lengths == lengths


def test_instruction_lengths_are_checked_against_a_cpu_mask(model, freqs):
    targets, t, ins, mask, refs = make_batch(4, [5, 3], [(4, 4), (4, 4)], [None, None])
    with torch.no_grad():
        a = model(targets, t, ins, freqs, mask, refs, instruction_lengths=[5, 3])
        b = model(targets, t, ins, freqs, mask, refs)
        assert all(torch.equal(x, y) for x, y in zip(a, b, strict=True))
        with pytest.raises(ValueError, match="do not match"):
            model(targets, t, ins, freqs, mask, refs, instruction_lengths=[5, 2])
        with pytest.raises(ValueError, match="must hold 2 ints"):
            model(targets, t, ins, freqs, mask, refs, instruction_lengths=[5])
        with pytest.raises(ValueError, match="right-padded"):
            model(targets, t, ins, freqs, mask.flip(1), refs)


# ---------------------------------------------------------------------------- instruction cache


def test_instruction_cache_reuses_the_text_path_bitwise_only_while_inputs_and_weights_hold(freqs):
    """A rollout's later steps take the caption embedder and context refiner from its first step:
    the same output bits, and a recompute whenever the features, the weights or the LoRA switch move."""
    from boogu_adapters.lora import adapters_disabled, add_lora
    from boogu_adapters.model.transformer import InstructionCache

    net = randomize_parameters(BooguImageTransformer2DModel(**TINY_CONFIG).eval(), 3, std=0.1)
    add_lora(net, rank=2, seed=0)
    with torch.no_grad():
        for name, p in net.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.1, generator=torch.Generator().manual_seed(len(name)))
    targets, t, ins, mask, refs = make_batch(6, [5, 3], [(4, 4), (4, 4)], [None, [(2, 2)]], width=6)
    lengths = [5, 3]
    cache = InstructionCache()

    def run(features, step, use_cache=True):
        out = net(
            targets,
            t * step,
            features,
            freqs,
            mask,
            refs,
            instruction_lengths=lengths,
            instruction_cache=cache if use_cache else None,
        )
        return torch.stack(out)

    with torch.no_grad():
        first = run(ins, 1.0)
        assert not net.last_text_path_reused and cache.hits == 0
        for step in (0.5, 0.25):  # later denoising steps: another timestep, same features object
            reused = run(ins, step)
            assert net.last_text_path_reused
            assert torch.equal(reused, run(ins, step, use_cache=False))
        assert cache.hits == 2
        assert not torch.equal(first, reused)  # the timestep still acts (the cache is not the output)
        # Equal values in another tensor object: recomputed (the identity is the promise).
        run(ins.clone(), 0.5)
        assert not net.last_text_path_reused and cache.hits == 2
        # An in-place change of the features, a weight update, the LoRA switched off: each recomputes.
        ins_changed = ins.clone()
        run(ins_changed, 0.5)
        ins_changed.mul_(2.0)
        changed = run(ins_changed, 0.5)
        assert not net.last_text_path_reused and torch.equal(changed, run(ins_changed, 0.5, use_cache=False))
        run(ins, 0.5)
        refiner_weight = next(net.context_refiner.parameters())
        refiner_weight.add_(0.01)
        updated = run(ins, 0.5)
        assert not net.last_text_path_reused and torch.equal(updated, run(ins, 0.5, use_cache=False))
        run(ins, 0.5)
        assert net.last_text_path_reused
        with adapters_disabled(net):
            base = run(ins, 0.5)
            assert not net.last_text_path_reused and torch.equal(base, run(ins, 0.5, use_cache=False))
        run(ins, 0.5)
        assert not net.last_text_path_reused  # back on: the entry holds the base's tokens
    # With autograd on the cache is neither read nor filled: the gradient must reach the LoRA.
    hits = cache.hits
    trained = run(ins, 0.5)
    assert not net.last_text_path_reused and cache.hits == hits and trained.requires_grad
    trained.square().mean().backward()
    lora_a = next(p for n, p in net.context_refiner.named_parameters() if "lora_A" in n)
    assert lora_a.grad is not None and lora_a.grad.abs().sum() > 0


# ---------------------------------------------------------------------------- regional compile


@pytest.mark.slow  # ~45 s on 2 CPU cores: inductor compiles the 3 block graphs' forwards
def test_regional_compile_matches_eager_without_recompiles(freqs):
    """Forward, recompiles, then backward with LoRA layers and gradient checkpointing (one test:
    inductor's C++ compile dominates the run time)."""
    from peft import LoraConfig

    from boogu_adapters.model import LORA_TARGET_MODULES

    torch._dynamo.reset()
    eager = BooguImageTransformer2DModel(**TINY_CONFIG)
    eager.add_adapter(LoraConfig(r=2, target_modules=list(LORA_TARGET_MODULES)))
    randomize_parameters(eager, 11, std=0.1)  # LoRA B included, so the adapters act
    compiled = copy.deepcopy(eager)
    compiled.enable_regional_compile(bucket=16)
    assert list(compiled.state_dict()) == list(eager.state_dict())  # LoRA keys unchanged
    assert any("lora_A" in k for k in compiled.state_dict())
    assert compiled._compile_bucket == 16

    def run(net, lengths, seed, grad=False):
        targets, t, ins, mask, refs = make_batch(
            seed, lengths, [(8, 8), (8, 8)], [None, [(4, 4)]], width=max(lengths)
        )
        net.zero_grad()
        with torch.set_grad_enabled(grad):
            out = net(targets, t, ins, freqs, mask, refs, instruction_lengths=lengths)
            if grad:
                sum(o.square().mean() for o in out).backward()
        grads = (
            {n: torch.zeros_like(p) if p.grad is None else p.grad.clone() for n, p in net.named_parameters()}
            if grad
            else None
        )
        return out, grads

    out_c, _ = run(compiled, [7, 3], 0)  # warm-up: compiles the graphs
    out_e, _ = run(eager, [7, 3], 0)
    for a, b in zip(out_c, out_e, strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-5 * b.abs().max().item())
    with torch._dynamo.config.patch(error_on_recompile=True):
        for lengths, seed in (([9, 2], 1), ([4, 8], 2), ([1, 1], 3)):  # same bucket, new t
            out_c, _ = run(compiled, lengths, seed)
            out_e, _ = run(eager, lengths, seed)
            for a, b in zip(out_c, out_e, strict=True):
                torch.testing.assert_close(a, b, rtol=0, atol=1e-5 * b.abs().max().item())

    # Backward through the compiled blocks (with gradient checkpointing): dynamo's graphs and AOT
    # autograd's joint graphs, with the aot_eager backend. Inductor's C++ code for the backward takes
    # ~65 s to build on 2 cores (the forward's ~40 s) and is not the code a GPU runs (Triton).
    compiled.enable_regional_compile(bucket=16, backend="aot_eager")
    compiled.enable_gradient_checkpointing()
    eager.enable_gradient_checkpointing()
    _, g_c = run(compiled, [7, 3], 4, grad=True)
    _, g_e = run(eager, [7, 3], 4, grad=True)
    for name, g in g_e.items():
        torch.testing.assert_close(
            g_c[name], g, rtol=0, atol=1e-5 * max(g.abs().max().item(), 1e-6), msg=name
        )
    compiled.disable_regional_compile()
    assert compiled._compile_bucket is None
    assert all(b._compiled_call_impl is None for b in compiled.single_stream_layers)
