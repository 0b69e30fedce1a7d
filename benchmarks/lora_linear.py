"""One LoRA-adapted linear, fused accumulate vs peft's forward: time per call and the aten ops it runs.

peft's LoRA ``Linear`` computes ``result + lora_B(lora_A(x)) * scaling``; the default here
(``boogu_adapters.lora.FusedLoraLinear``) computes ``addmm(result, x @ A^T, B^T, alpha=scaling)``.
For one adapted linear at a block-like shape (default: a single-stream block's ``to_q`` / ``to_out``
at the released width, 3360 -> 3360, LoRA rank 64) it prints, in one run:

* the time per call of a no-grad forward and of a forward + backward of a given output gradient
  (gradients to ``lora_A`` and ``lora_B`` only, as in training), fused and peft, interleaved, and the ratio peft / fused;
* the aten ops of each, from a ``TorchDispatchMode`` trace: the total count and the ops whose output
  is a full-width ``(tokens, out)`` activation (each one is a pass over the output in memory);
* a roofline estimate of the forward on an H200 in bf16 (not a measurement): base GEMM alone, peft's
  branch, the fused one.

    uv run python benchmarks/lora_linear.py [--tokens 1024] [--in-features 3360] [--out-features 3360]
        [--rank 64] [--dtype float32|bfloat16] [--repeats 5] [--json out.json]

On a CPU the GEMMs dominate and the ratio is small; on a GPU the full-width elementwise passes cost
about as much as a rank-64 GEMM's read of the output (docs/gpu-path.md has a roofline estimate).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from collections import Counter
from typing import Any

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from boogu_adapters.lora import add_lora, is_lora_param

FORWARDS = ("fused", "peft")


class _Adapted(torch.nn.Module):
    def __init__(self, in_features: int, out_features: int):
        super().__init__()
        self.to_q = torch.nn.Linear(in_features, out_features)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.to_q(x)


def adapted_linear(
    in_features: int, out_features: int, rank: int, dtype: torch.dtype, forward: str, seed: int = 0
) -> torch.nn.Module:
    """A ``to_q`` linear with LoRA ``rank`` (alpha 2·rank), ``lora_B`` non-zero so the branch acts,
    base frozen; the same weights for the same seed whatever ``forward`` is."""
    torch.manual_seed(seed)
    module = _Adapted(in_features, out_features)
    add_lora(module, rank=rank, alpha=2 * rank, target_modules=["to_q"], seed=seed, forward=forward)
    with torch.no_grad():
        for name, p in module.named_parameters():
            if "lora_B" in name:
                p.normal_(0.0, 0.02, generator=torch.Generator().manual_seed(seed + 1))
    return module.to(dtype)


class OpTrace(TorchDispatchMode):
    """Every aten op run under it, and which of them produce a tensor of ``full_width`` elements."""

    def __init__(self, full_width: int):
        super().__init__()
        self.full_width = full_width
        self.ops: Counter[str] = Counter()
        self.full: Counter[str] = Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        name = str(func.overloadpacket.__name__)
        self.ops[name] += 1
        outs = out if isinstance(out, (tuple, list)) else (out,)
        moves_data = name not in ("view", "_unsafe_view", "reshape", "t", "transpose", "detach", "alias")
        if moves_data and any(isinstance(o, torch.Tensor) and o.numel() == self.full_width for o in outs):
            self.full[name] += 1
        return out


def roofline_us(
    tokens: int, k: int, n: int, r: int, tflops: float, tb_s: float, size: int = 2
) -> dict[str, float]:
    """Roofline time (us) of one adapted linear's forward, each kernel ``max(FLOPs / peak, bytes /
    bandwidth)``, ``size`` bytes per element (bf16): the base GEMM alone, with peft's branch
    (``lora_A``, ``lora_B``, ``mul``, ``add``) and with the fused one (``mm``, ``addmm``)."""

    def kernel(flops: float, elements: float) -> float:
        return max(flops / (tflops * 1e12), elements * size / (tb_s * 1e12)) * 1e6

    out = tokens * n
    base = kernel(2 * tokens * k * n, tokens * k + k * n + out)
    lora_a = kernel(2 * tokens * k * r, tokens * k + k * r + tokens * r)
    peft = (
        base
        + lora_a
        + kernel(2 * tokens * r * n, tokens * r + r * n + out)
        + kernel(0, 2 * out)
        + kernel(0, 3 * out)
    )
    fused = base + lora_a + kernel(2 * tokens * r * n, tokens * r + r * n + 2 * out)
    return {"base": base, "peft": peft, "fused": fused}


def trace(module: torch.nn.Module, x: torch.Tensor, grad: torch.Tensor, backward: bool) -> dict[str, Any]:
    """The aten ops of one call; with ``backward`` the backward of ``grad`` (given, so that no loss's
    ops are counted) too."""
    with OpTrace(grad.numel()) as t:
        if backward:
            module(x).backward(grad)
        else:
            with torch.no_grad():
                module(x)
    module.zero_grad(set_to_none=True)
    return {"ops": sum(t.ops.values()), "full_width_ops": dict(t.full), "by_op": dict(sorted(t.ops.items()))}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tokens", type=int, default=1024)
    p.add_argument("--in-features", type=int, default=3360)
    p.add_argument("--out-features", type=int, default=3360)
    p.add_argument("--rank", type=int, default=64)
    p.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32")
    p.add_argument("--repeats", type=int, default=5, help="timed calls of each kind (after one warm-up)")
    p.add_argument("--device", default="cpu")
    p.add_argument("--json")
    args = p.parse_args()
    dtype = getattr(torch, args.dtype)
    device = torch.device(args.device)
    modules = {
        f: adapted_linear(args.in_features, args.out_features, args.rank, dtype, f).to(device)
        for f in FORWARDS
    }
    x = torch.randn(1, args.tokens, args.in_features, generator=torch.Generator().manual_seed(2)).to(
        device, dtype
    )
    with torch.no_grad():
        diff = (modules["fused"](x).float() - modules["peft"](x).float()).abs().max().item()
    grad = torch.randn(1, args.tokens, args.out_features, generator=torch.Generator().manual_seed(3)).to(
        device, dtype
    )

    def sync() -> None:
        if device.type == "cuda":
            torch.cuda.synchronize(device)

    x_grad = x.detach().requires_grad_(True)  # in training a block's activations carry a gradient

    def call(forward: str, backward: bool) -> float:
        module = modules[forward]
        sync()
        start = time.perf_counter()
        if backward:
            module(x_grad).backward(grad)
        else:
            with torch.no_grad():
                module(x)
        sync()
        seconds = time.perf_counter() - start
        module.zero_grad(set_to_none=True)
        return seconds

    out: dict[str, Any] = {
        "device": str(device),
        "torch": torch.__version__,
        "threads": torch.get_num_threads(),
        "shape": {"tokens": args.tokens, "in": args.in_features, "out": args.out_features, "rank": args.rank},
        "dtype": args.dtype,
        "max_abs_diff_fused_vs_peft": diff,
        "cases": {},
    }
    print(
        f"adapted linear {args.in_features}->{args.out_features}, rank {args.rank}, {args.tokens} tokens, "
        f"{args.dtype}, {device}, {torch.get_num_threads()} threads; |fused - peft| max {diff:.2e}"
    )
    for backward in (False, True):
        kind = "forward_backward" if backward else "forward"
        for f in FORWARDS:
            call(f, backward)  # warm-up
        times: dict[str, list[float]] = {f: [] for f in FORWARDS}
        for _ in range(args.repeats):  # interleaved: load from other processes hits both alike
            for f in FORWARDS:
                times[f].append(call(f, backward))
        row: dict[str, Any] = {f: {"ms_median": 1e3 * statistics.median(times[f])} for f in FORWARDS}
        for f in FORWARDS:
            row[f].update(trace(modules[f], x_grad if backward else x, grad, backward))
        row["ratio_peft_over_fused"] = row["peft"]["ms_median"] / row["fused"]["ms_median"]
        out["cases"][kind] = row
        for f in FORWARDS:
            r = row[f]
            print(
                f"{kind:17s} {f:5s} {r['ms_median']:9.2f} ms  {r['ops']:3d} aten ops  "
                f"full-width {sum(r['full_width_ops'].values())} {r['full_width_ops']}"
            )
        print(f"{kind:17s} peft / fused = {row['ratio_peft_over_fused']:.3f}")
    # An H200's bf16 dense peak and HBM bandwidth (datasheet), at a 1024^2 rollout call's tokens.
    gpu_tokens = 4 * (4096 + 128)
    roof = roofline_us(gpu_tokens, args.in_features, args.out_features, args.rank, 989.0, 4.8)
    out["roofline_h200_bf16_us"] = {"tokens": gpu_tokens, **roof}
    print(
        f"roofline, H200 bf16, {gpu_tokens} tokens: base {roof['base']:.0f} us, peft +"
        f"{roof['peft'] / roof['base'] - 1:.0%}, fused +{roof['fused'] / roof['base'] - 1:.0%} (an estimate, not a measurement)"
    )
    grads = [n for n, p in modules["fused"].named_parameters() if p.requires_grad]
    assert grads and all(is_lora_param(n) for n in grads)
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(out, fh, indent=2)


if __name__ == "__main__":
    main()
