"""The transformer's GPU path at the released size: throughput, MFU, memory, SDPA kernels, compile, LoRA dtype.

One run on a lent GPU answers what CPU runs cannot: for a random-weight transformer of the released
config (10.3B parameters, bf16; the single-stream layers halved until it fits) at 1024x1024 (4096
image tokens + 128 text tokens) it measures, in one process:

* ``rollout``: a no-grad forward of ``--batch`` latents with batched CFG (2x the sample-forwards), as
  the rollout engine runs it; sample-forwards/s, the images/s of a 10-step CFG rollout, TFLOPs/s and
  MFU (model FLOPs from ``boogu_adapters.model.flops``, peak from ``boogu_trainer.perf``);
* ``lora``: the same rollout forward with the adapters off (``rollout_adapters_off``: the base
  model, what the LoRA branch costs on top of it) and with peft's own LoRA forward instead of the
  fused one (``rollout_peft_lora``, ``lora.set_lora_forward``); ``lora_overhead`` has the ratios;
* ``train_bf16_lora`` / ``train_fp32_lora``: one training forward + backward with LoRA rank 64 and
  gradient checkpointing, with the LoRA products in bf16 (``compute_lora_in_input_dtype``, what the
  trainer does) and in float32 (peft's default cast), both with float32 master weights;
* ``compiled``: the rollout forward again after ``enable_regional_compile`` (compile time apart);
* ``kernels``: which SDPA backend each attention call of one eager forward can use (flash,
  memory-efficient, cuDNN, math: ``torch.backends.cuda.can_use_*``) and the attention kernels the
  profiler saw;
* peak memory of each case.

The random weights are drawn on ``--device`` (a CUDA generator there: no CPU draw and copy of 10.3B
parameters), and ``--json`` is rewritten (atomically) after every case, so a run cut short by a
timeout keeps the cases it finished.

    python3 benchmarks/gpu_path.py [--preset released|mid|tiny] [--size 1024] [--text-tokens 128]
        [--batch 2] [--cases rollout,lora,train,kernels,compiled] [--device cuda] [--json out.json]

On CPU (``--device cpu --preset tiny``) it runs the same code at toy sizes: a smoke test only.
"""

from __future__ import annotations

import argparse
import json
import os
import time
from collections import Counter
from typing import Any

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import torch
import torch.nn.functional as F
from _common import MID_SIZE_OVERRIDES, write_json_atomic

from boogu_adapters.lora import adapters_disabled, add_lora, compute_lora_in_input_dtype, set_lora_forward
from boogu_adapters.model import (
    RELEASED_CONFIG,
    TINY_CONFIG,
    BooguImageTransformer2DModel,
    count_parameters,
    get_freqs_cis,
    randomize_parameters,
)
from boogu_adapters.model.flops import FlopModel, LoraSpec
from boogu_adapters.model.layout import TokenLayout
from boogu_schedule import make_generator
from boogu_trainer.perf import peak_tflops

MID = {**TINY_CONFIG, **MID_SIZE_OVERRIDES}
PRESETS = {"released": RELEASED_CONFIG, "mid": MID, "tiny": TINY_CONFIG}


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _peak_gb(device: torch.device) -> float | None:
    return torch.cuda.max_memory_allocated(device) / 2**30 if device.type == "cuda" else None


def _reset_peak(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)


def build(config: dict[str, Any], device: torch.device, dtype: torch.dtype, rank: int):
    """The preset on ``device`` in ``dtype`` with random weights and LoRA ``rank`` (float32 masters);
    the single-stream layers are halved until it fits."""
    cfg = dict(config)
    while True:
        try:
            with torch.device("meta"):
                model = BooguImageTransformer2DModel(**cfg)
            model = model.to_empty(device=device).to(dtype)
            with torch.no_grad():  # on the device: a CPU draw of the released size took ~55 s
                randomize_parameters(model, make_generator(0, device))
            add_lora(model, rank=rank, alpha=2 * rank, init_lora_weights=True, seed=0)
            for name, p in model.named_parameters():
                if "lora_" in name:
                    p.data = p.data.float()
            return model.eval(), cfg
        except torch.OutOfMemoryError:
            double = cfg["num_double_stream_layers"]
            if cfg["num_layers"] <= double + 1:
                raise
            cfg["num_layers"] = double + (cfg["num_layers"] - double) // 2
            model = None
            _reset_peak(device)
            print(f"out of memory: retrying with {cfg['num_layers']} layers")


def inputs(model, batch: int, size: int, text_tokens: int, device: torch.device, dtype: torch.dtype):
    """A CFG-batched forward's inputs: 2*batch latents (positive, negative), one text length each half."""
    c = model.config
    side = size // 8  # latent side (VAE factor 8); tokens = (side / 2)^2
    g = torch.Generator(device=device).manual_seed(0)
    x = torch.randn(2 * batch, c.in_channels, side, side, generator=g, device=device).to(dtype)
    t = torch.full((2 * batch,), 0.5, device=device, dtype=dtype)
    feat = model.preprocessed_instruction_feat_dim
    hidden = torch.randn(2 * batch, text_tokens, feat, generator=g, device=device).to(dtype)
    neg = max(text_tokens // 8, 1)
    lengths = [text_tokens] * batch + [neg] * batch
    mask = (
        torch.arange(text_tokens, device=device)[None] < torch.tensor(lengths, device=device)[:, None]
    ).long()
    layout = TokenLayout(
        text_lengths=lengths,
        target_grids=[(side // 2, side // 2)] * (2 * batch),
        reference_grids=[[]] * (2 * batch),
    )
    return (x, t, hidden, mask), lengths, layout


def timed(fn, device: torch.device, repeats: int) -> float:
    fn()  # warm-up
    _sync(device)
    start = time.perf_counter()
    for _ in range(repeats):
        fn()
    _sync(device)
    return (time.perf_counter() - start) / repeats


def sdpa_backends(device: torch.device):
    """Wrap F.scaled_dot_product_attention to record which backends each call could use."""
    seen: Counter[str] = Counter()
    original = F.scaled_dot_product_attention

    def wrapper(q, k, v, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, enable_gqa=False):
        usable = []
        if device.type == "cuda":
            params = torch.backends.cuda.SDPAParams(q, k, v, attn_mask, dropout_p, is_causal, enable_gqa)
            for name, check in (
                ("flash", torch.backends.cuda.can_use_flash_attention),
                ("efficient", torch.backends.cuda.can_use_efficient_attention),
                ("cudnn", getattr(torch.backends.cuda, "can_use_cudnn_attention", None)),
            ):
                if check is not None and check(params, False):
                    usable.append(name)
        key = f"L={q.shape[-2]} mask={'yes' if attn_mask is not None else 'no'} gqa={enable_gqa} -> {'+'.join(usable) or ('math' if device.type == 'cuda' else 'cpu')}"
        seen[key] += 1
        return original(
            q,
            k,
            v,
            attn_mask=attn_mask,
            dropout_p=dropout_p,
            is_causal=is_causal,
            scale=scale,
            enable_gqa=enable_gqa,
        )

    return seen, original, wrapper


def profiled_attention_kernels(fn, device: torch.device) -> dict[str, int]:
    if device.type != "cuda":
        return {}
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn()
        _sync(device)
    kernels: Counter[str] = Counter()
    for evt in prof.key_averages():
        name = evt.key.lower()
        if any(s in name for s in ("flash", "fmha", "attention", "cudnn", "softmax")):
            kernels[evt.key[:90]] += evt.count
    return dict(kernels.most_common(12))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--preset", choices=sorted(PRESETS), default="released")
    p.add_argument("--size", type=int, default=1024)
    p.add_argument("--text-tokens", type=int, default=128)
    p.add_argument(
        "--batch", type=int, default=2, help="latents per forward (CFG doubles the sample-forwards)"
    )
    p.add_argument("--rank", type=int, default=64)
    p.add_argument("--repeats", type=int, default=3)
    # The cases run in this order, cheapest first: a timeout (gpu_check.sh's phase limit) cuts the
    # compile, the most uncertain, and the JSON keeps the ones before it.
    p.add_argument("--cases", default="rollout,lora,train,kernels,compiled")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--json")
    args = p.parse_args()
    cases = set(args.cases.split(","))
    device = torch.device(args.device)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    if device.type == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = True
        torch.backends.cudnn.allow_tf32 = True

    model, cfg = build(PRESETS[args.preset], device, dtype, args.rank)
    freqs = get_freqs_cis(cfg["axes_dim_rope"], cfg["axes_lens"], 10000)
    (x, t, hidden, mask), lengths, layout = inputs(
        model, args.batch, args.size, args.text_tokens, device, dtype
    )
    flops = FlopModel(cfg, LoraSpec(rank=args.rank))
    peak = peak_tflops(device, dtype, None)
    fwd_flops = flops.forward(layout).total
    out: dict[str, Any] = {
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "torch": torch.__version__,
        "preset": args.preset,
        "layers": cfg["num_layers"],
        "transformer_params": count_parameters(model),
        "size": args.size,
        "image_tokens": layout.target_lengths[0],
        "text_tokens": args.text_tokens,
        "sample_forwards_per_call": 2 * args.batch,
        "peak_tflops": peak,
        "forward_tflops_per_call": fwd_flops / 1e12,
        "cases": {},
    }
    write_json_atomic(args.json, out)  # the setup's figures even if the first case never ends

    def forward():
        with torch.no_grad():
            return model(x, t, hidden, freqs, mask, instruction_lengths=lengths)

    def record(name: str, seconds: float, flop: float, extra: dict | None = None) -> None:
        row = {
            "seconds": seconds,
            "tflops_per_s": flop / seconds / 1e12,
            "mfu": flop / seconds / 1e12 / peak,
            "peak_memory_gb": _peak_gb(device),
            **(extra or {}),
        }
        out["cases"][name] = row
        write_json_atomic(args.json, out)
        print(
            f"{name:18s} {seconds * 1e3:9.1f} ms  {row['tflops_per_s']:8.1f} TFLOP/s  MFU {row['mfu']:6.1%}  "
            f"peak {row['peak_memory_gb'] or 0:6.1f} GB  {extra or ''}",
            flush=True,
        )

    compute_lora_in_input_dtype(model)  # the trainer's setting; train_fp32_lora undoes it below
    if "rollout" in cases:
        _reset_peak(device)
        s = timed(forward, device, args.repeats)
        per_image = 10 * s / args.batch  # 10 CFG steps, batch latents per call
        record("rollout", s, fwd_flops, {"rollout_images_per_s": 1 / per_image})

    if "lora" in cases:
        _reset_peak(device)
        with adapters_disabled(model):  # the base model: FLOPs without the LoRA branch
            record(
                "rollout_adapters_off",
                timed(forward, device, args.repeats),
                FlopModel(cfg).forward(layout).total,
            )
        set_lora_forward(model, "peft")
        try:
            _reset_peak(device)
            record("rollout_peft_lora", timed(forward, device, args.repeats), fwd_flops)
        finally:
            set_lora_forward(model, "fused")
        rows = out["cases"]
        if "rollout" in rows:
            base = rows["rollout_adapters_off"]["seconds"]
            out["lora_overhead"] = {
                "fused_over_off": rows["rollout"]["seconds"] / base,
                "peft_over_off": rows["rollout_peft_lora"]["seconds"] / base,
                "peft_over_fused": rows["rollout_peft_lora"]["seconds"] / rows["rollout"]["seconds"],
            }
            print("LoRA rollout cost:", out["lora_overhead"], flush=True)
            write_json_atomic(args.json, out)

    if "train" in cases:
        model.enable_gradient_checkpointing()
        model.train()
        train = flops.training(
            layout, gradient_checkpointing=True, attention_recompute=device.type == "cuda"
        ).total

        def step():
            out_ = model(x, t, hidden, freqs, mask, instruction_lengths=lengths)
            out_.float().square().mean().backward()
            model.zero_grad(set_to_none=True)

        _reset_peak(device)
        record("train_bf16_lora", timed(step, device, args.repeats), train)
        if dtype != torch.float32:
            from boogu_adapters.lora import _tuner_layers

            for layer in _tuner_layers(model):  # back to peft's own cast: LoRA products in float32
                layer.cast_input_dtype_enabled = True
            _reset_peak(device)
            record("train_fp32_lora", timed(step, device, args.repeats), train)
            compute_lora_in_input_dtype(model)
        model.disable_gradient_checkpointing()
        model.eval()

    if "kernels" in cases:
        seen, original, wrapper = sdpa_backends(device)
        F.scaled_dot_product_attention = wrapper
        try:
            forward()
        finally:
            F.scaled_dot_product_attention = original
        out["sdpa_calls"] = dict(seen)
        out["attention_kernels"] = profiled_attention_kernels(forward, device)
        write_json_atomic(args.json, out)
        print("SDPA calls (shape, mask, GQA -> usable backends):")
        for key, count in seen.items():
            print(f"sdpa {count:3d} x {key}")
        for name, count in out["attention_kernels"].items():
            print(f"kernel {count:4d} x {name}")

    if "compiled" in cases:
        start = time.perf_counter()
        model.enable_regional_compile(bucket=64)
        forward()
        _sync(device)
        out["compile_seconds"] = time.perf_counter() - start
        write_json_atomic(args.json, out)
        _reset_peak(device)
        s = timed(forward, device, args.repeats)
        eager = out["cases"].get("rollout", {}).get("seconds")
        record("compiled", s, fwd_flops, {"speedup_vs_eager": eager / s if eager else None})

    print(json.dumps(out, indent=2))
    write_json_atomic(args.json, out)


if __name__ == "__main__":
    main()
