"""The fused LoRA forward (`boogu_adapters.lora.FusedLoraLinear`) against peft's and a float64 reference.

peft computes ``result + lora_B(lora_A(x)) * scaling`` (three full-width passes after the base GEMM);
the fused forward accumulates ``x @ A^T @ B^T`` into the base output with one ``addmm`` whose ``alpha``
is the scaling. Same parameters, same values within float rounding, fewer ops.
"""

from __future__ import annotations

import copy
from collections import Counter

import pytest
import torch
from peft import LoraConfig, inject_adapter_in_model
from peft.tuners.lora import Linear as PeftLoraLinear
from torch.utils._python_dispatch import TorchDispatchMode

from boogu_adapters.lora import (
    FusedLoraLinear,
    adapters_disabled,
    add_lora,
    compute_lora_in_input_dtype,
    lora_state_dict,
    set_lora_forward,
)
from boogu_adapters.model import TINY_CONFIG, BooguImageTransformer2DModel, randomize_parameters

IN, OUT, RANK, ALPHA = 24, 40, 4, 12.0  # scaling 3


class Block(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.to_q = torch.nn.Linear(IN, OUT)

    def forward(self, x):
        return self.to_q(x)


def _adapted(dtype: torch.dtype, *, cast_in_input_dtype: bool, forward: str = "fused") -> Block:
    """A linear with bias, LoRA with a non-zero ``lora_B``, base in ``dtype``, float32 LoRA masters
    (what the trainer holds)."""
    torch.manual_seed(0)
    block = Block()
    add_lora(
        block,
        rank=RANK,
        alpha=ALPHA,
        target_modules=["to_q"],
        init_lora_weights=True,
        seed=1,
        forward=forward,
    )
    with torch.no_grad():
        block.to_q.lora_B.default.weight.normal_(0, 0.3, generator=torch.Generator().manual_seed(2))
    block.to(dtype)
    for name, p in block.named_parameters():
        if "lora_" in name:
            p.data = p.data.float()
    if cast_in_input_dtype:
        compute_lora_in_input_dtype(block)
    return block


def _run(block: Block, x: torch.Tensor, grad: torch.Tensor):
    x = x.detach().requires_grad_(True)
    y = block(x)
    y.backward(grad)
    layer = block.to_q
    grads = (x.grad, layer.lora_A.default.weight.grad, layer.lora_B.default.weight.grad)
    return y, grads


def _reference(block: Block, x: torch.Tensor, grad: torch.Tensor):
    """Output and gradients (x, A, B) of ``W x + b + s B A x`` in float64, written out."""
    layer = block.to_q
    w, b = layer.base_layer.weight.double(), layer.base_layer.bias.double()
    a, bb = layer.lora_A.default.weight.double(), layer.lora_B.default.weight.double()
    s = ALPHA / RANK
    x64, g = x.double().reshape(-1, IN), grad.double().reshape(-1, OUT)
    h = x64 @ a.T
    y = x64 @ w.T + b + s * (h @ bb.T)
    grad_x = g @ w + s * (g @ bb) @ a
    grad_a = s * (g @ bb).T @ x64
    grad_b = s * g.T @ h
    return y.reshape(*x.shape[:-1], OUT), (grad_x.reshape(x.shape), grad_a, grad_b)


@pytest.mark.parametrize(
    ("dtype", "cast_in_input_dtype", "tol"),
    [
        (torch.float32, False, 1e-5),
        # bf16 base, LoRA products in bf16 (the trainer's setting): peft rounds lora_B's output, the
        # mul and the add (3 bf16 roundings), the fused addmm once; a few bf16 ulps apart.
        (torch.bfloat16, True, 3e-2),
        # bf16 base, peft's default cast: the branch in float32, one bf16 rounding at the end in both.
        (torch.bfloat16, False, 2e-2),
    ],
)
def test_fused_forward_equals_peft_and_a_float64_reference(dtype, cast_in_input_dtype, tol):
    fused = _adapted(dtype, cast_in_input_dtype=cast_in_input_dtype)
    peft = copy.deepcopy(fused)
    assert set_lora_forward(peft, "peft") == 1
    assert type(fused.to_q) is FusedLoraLinear and type(peft.to_q) is PeftLoraLinear
    g = torch.Generator().manual_seed(3)
    x = torch.randn(2, 5, IN, generator=g).to(dtype)
    grad = torch.randn(2, 5, OUT, generator=g).to(dtype)
    y_fused, grads_fused = _run(fused, x, grad)
    y_peft, grads_peft = _run(peft, x, grad)
    y_ref, grads_ref = _reference(fused, x, grad)
    assert y_fused.dtype == y_peft.dtype == dtype
    assert (
        [g.dtype for g in grads_fused]
        == [g.dtype for g in grads_peft]
        == [dtype, torch.float32, torch.float32]
    )
    # Relative to the largest magnitude of each tensor: bf16 rounds each element to 2^-8 of itself.
    for got, want, name in zip((y_fused, *grads_fused), (y_peft, *grads_peft), ("y", "x", "A", "B")):
        scale = want.double().abs().max()
        torch.testing.assert_close(got.double() / scale, want.double() / scale, rtol=0, atol=tol, msg=name)
    for got, want, name in zip((y_fused, *grads_fused), (y_ref, *grads_ref), ("y", "x", "A", "B")):
        scale = want.abs().max()
        torch.testing.assert_close(
            got.double() / scale, want / scale, rtol=0, atol=tol, msg=f"{name} vs float64"
        )


def test_fused_forward_equals_peft_through_the_tiny_transformer():
    """Every targeted linear of the model, fp32: output and every LoRA gradient as peft's."""
    fused = randomize_parameters(BooguImageTransformer2DModel(**TINY_CONFIG), 0)
    add_lora(fused, rank=4, alpha=8, init_lora_weights=True, seed=0)
    with torch.no_grad():
        for name, p in fused.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.05, generator=torch.Generator().manual_seed(len(name)))
    peft = copy.deepcopy(fused)
    layers = set_lora_forward(peft, "peft")
    assert layers > 20 and sum(isinstance(m, FusedLoraLinear) for m in fused.modules()) == layers
    g = torch.Generator().manual_seed(0)
    args = (
        torch.randn(2, 16, 8, 8, generator=g),
        torch.tensor([0.3, 0.7]),
        torch.randn(2, 5, 64, generator=g),
        None,
        torch.tensor([[1, 1, 1, 1, 1], [1, 1, 1, 0, 0]]),
    )
    outs = []
    for model in (fused, peft):
        out = model(*args)
        out.square().mean().backward()
        outs.append((out, {n: p.grad for n, p in model.named_parameters() if p.grad is not None}))
    (y_fused, g_fused), (y_peft, g_peft) = outs
    torch.testing.assert_close(y_fused, y_peft, rtol=1e-5, atol=1e-6)
    assert g_fused.keys() == g_peft.keys() and len(g_fused) > layers  # the unused reference refiner has none
    for name in g_fused:
        torch.testing.assert_close(g_fused[name], g_peft[name], rtol=1e-4, atol=1e-7, msg=name)


class _FullWidthOps(TorchDispatchMode):
    """The aten ops (views aside) that write a tensor of ``numel`` elements: passes over the output."""

    def __init__(self, numel: int):
        super().__init__()
        self.numel, self.ops = numel, Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        name = func.overloadpacket.__name__
        if (
            isinstance(out, torch.Tensor)
            and out.numel() == self.numel
            and name not in ("view", "_unsafe_view", "t")
        ):
            self.ops[name] += 1
        return out


def test_fused_forward_makes_two_full_width_passes_where_peft_makes_four():
    """The default forward of `add_lora`: the base GEMM and one accumulate write the (tokens, out)
    output; peft also writes lora_B's output, then a mul and an add over it."""
    x = torch.randn(3, 7, IN)
    counts = {}
    for forward in ("fused", "peft"):
        block = _adapted(torch.float32, cast_in_input_dtype=True, forward=forward)
        with torch.no_grad(), _FullWidthOps(3 * 7 * OUT) as trace:
            block(x)
        counts[forward] = dict(trace.ops)
    default = _adapted(torch.float32, cast_in_input_dtype=True)  # add_lora's default is the fused one
    with torch.no_grad(), _FullWidthOps(3 * 7 * OUT) as trace:
        default(x)
    assert dict(trace.ops) == counts["fused"] == {"addmm": 2}
    assert counts["peft"] == {"addmm": 1, "mm": 1, "mul": 1, "add": 1}


def test_fused_layers_keep_peft_parameters_keys_merge_and_switch():
    fused = _adapted(torch.float32, cast_in_input_dtype=False)
    peft = copy.deepcopy(fused)
    set_lora_forward(peft, "peft")
    assert isinstance(fused.to_q, PeftLoraLinear)  # peft's own class underneath: merge, unmerge, scale
    assert list(fused.state_dict()) == list(peft.state_dict())
    assert lora_state_dict(fused).keys() == lora_state_dict(peft).keys()
    assert [n for n, p in fused.named_parameters() if p.requires_grad] == [
        "to_q.lora_A.default.weight",
        "to_q.lora_B.default.weight",
    ]
    x = torch.randn(4, IN)
    with torch.no_grad():
        adapted = fused(x)
        with adapters_disabled(fused):
            torch.testing.assert_close(fused(x), fused.to_q.base_layer(x), rtol=0, atol=0)
        fused.to_q.merge()  # W + s B A in the base weight; the forward is then the base layer's
        torch.testing.assert_close(fused(x), adapted, rtol=1e-5, atol=1e-5)
        fused.to_q.unmerge()
        torch.testing.assert_close(fused(x), adapted, rtol=1e-5, atol=1e-5)
    assert set_lora_forward(fused, "peft") == 1 and type(fused.to_q) is PeftLoraLinear
    assert set_lora_forward(fused, "fused") == 1 and type(fused.to_q) is FusedLoraLinear
    with pytest.raises(ValueError, match="expected 'fused' or 'peft'"):
        set_lora_forward(fused, "triton")


@pytest.mark.parametrize("feature", [{"lora_dropout": 0.5}, {"use_dora": True}, {"lora_bias": True}])
def test_what_the_fused_forward_cannot_do_goes_to_peft(feature):
    """Dropout, DoRA and a lora_B bias change the branch: the fused class hands those to peft's forward
    (the fused formula would drop them and differ)."""
    torch.manual_seed(0)
    block = Block()
    config = LoraConfig(r=RANK, lora_alpha=ALPHA, target_modules=["to_q"], init_lora_weights=False, **feature)
    inject_adapter_in_model(config, block)
    if feature.get("use_dora"):  # DoRA starts at plain LoRA's output (magnitude = the norm): move it
        with torch.no_grad():
            block.to_q.lora_magnitude_vector["default"].weight.mul_(1.5)
    peft = copy.deepcopy(block)
    assert set_lora_forward(block, "fused") == 1 and type(block.to_q) is FusedLoraLinear
    block.train(), peft.train()
    x = torch.randn(6, IN)
    torch.manual_seed(5)
    got = block(x)
    torch.manual_seed(5)
    want = peft(x)
    torch.testing.assert_close(got, want, rtol=0, atol=0)
    plain = torch.nn.functional.linear(x, block.to_q.base_layer.weight, block.to_q.base_layer.bias)
    a, b = block.to_q.lora_A.default.weight, block.to_q.lora_B.default.weight
    branch = x @ a.T @ b.T * block.to_q.scaling["default"]
    assert not torch.allclose(got, plain + branch), (
        "the feature must change the output for this to test anything"
    )
