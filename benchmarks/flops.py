"""Analytic FLOPs of the Boogu transformer and of one FlowGRPO trained image (the reference recipe).

    uv run python benchmarks/flops.py [--preset released|tiny] [--image-tokens 4096] [--text-tokens 128]
        [--negative-text-tokens N] [--lora-rank 64] [--steps 10] [--window 2] [--no-cfg]
        [--no-checkpointing] [--peak-tflops 989.4] [--json out.json]

Counts come from ``boogu_adapters.model.flops`` (per sample, no padding; checked against
``torch.utils.flop_counter.FlopCounterMode`` in ``tests/adapters/test_flops.py``). One trained image
of the reference recipe (examples/flowgrpo_trainer/boogu_image/boogu_image_ocr_lora.yaml) costs:

* rollout: ``steps`` denoising steps, each a positive and (CFG) a negative sample-forward, with the
  LoRA attached (the policy samples itself);
* training: each of the ``window`` SDE steps recomputes the log-prob with CFG, i.e. 2 training
  sample-forwards, each with its LoRA backward and gradient checkpointing's recompute.

``tflops_per_trained_image`` is their sum; ``ideal_images_per_s`` divides the peak (default one
H200, 989.4 dense bf16 TFLOPs) by it: the rate at 100% MFU. The image grid is taken square
(``--image-tokens`` must be a square number of tokens after 2x2 patchify: 4096 = 1024x1024 pixels).
"""

from __future__ import annotations

import argparse
import json
import math
import sys

from boogu_adapters.model import RELEASED_CONFIG, TINY_CONFIG
from boogu_adapters.model.flops import BLOCK_GROUPS, FlopModel, LoraSpec
from boogu_adapters.model.layout import TokenLayout


def _layout(text: int, tokens: int) -> TokenLayout:
    side = math.isqrt(tokens)
    if side * side != tokens:
        raise SystemExit(f"--image-tokens {tokens} is not a square number of tokens")
    return TokenLayout(text_lengths=[text], target_grids=[(side, side)], reference_grids=[[]])


def per_image_flops(
    preset: str = "released",
    *,
    image_tokens: int = 4096,
    text_tokens: int = 128,
    negative_text_tokens: int | None = None,
    lora_rank: int = 64,
    steps: int = 10,
    window: int = 2,
    cfg: bool = True,
    checkpointing: bool = True,
) -> tuple[float, float]:
    """FLOPs of one trained image: ``(rollout, training)`` (the defaults: the reference recipe)."""
    config = RELEASED_CONFIG if preset == "released" else TINY_CONFIG
    model = FlopModel(config, LoraSpec(rank=lora_rank) if lora_rank else None)
    pos = _layout(text_tokens, image_tokens)
    neg = _layout(negative_text_tokens or text_tokens, image_tokens)
    rollout = steps * (model.forward(pos).total + (model.forward(neg).total if cfg else 0))
    train_pos = model.training(pos, gradient_checkpointing=checkpointing).total
    train_neg = model.training(neg, gradient_checkpointing=checkpointing).total if cfg else 0
    return rollout, window * (train_pos + train_neg)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--preset", choices=["released", "tiny"], default="released")
    parser.add_argument("--image-tokens", type=int, default=4096)
    parser.add_argument("--text-tokens", type=int, default=128)
    parser.add_argument(
        "--negative-text-tokens", type=int, help="CFG negative prompt tokens (default: = text)"
    )
    parser.add_argument("--lora-rank", type=int, default=64, help="0: no LoRA")
    parser.add_argument("--steps", type=int, default=10, help="rollout denoising steps")
    parser.add_argument("--window", type=int, default=2, help="trained SDE steps per rollout")
    parser.add_argument("--no-cfg", action="store_true", help="guidance 1.0: no negative forwards")
    parser.add_argument("--no-checkpointing", action="store_true", help="no gradient-checkpointing recompute")
    parser.add_argument(
        "--peak-tflops", type=float, default=989.4, help="device peak for the ideal rate (H200)"
    )
    parser.add_argument("--json", help="also write the figures to this JSON file")
    args = parser.parse_args(argv)

    config = RELEASED_CONFIG if args.preset == "released" else TINY_CONFIG
    lora = LoraSpec(rank=args.lora_rank) if args.lora_rank else None
    model = FlopModel(config, lora)
    pos = _layout(args.text_tokens, args.image_tokens)
    checkpointing = not args.no_checkpointing
    fwd = model.forward(pos)
    base_fwd = FlopModel(config, None).forward(pos)
    train_pos = model.training(pos, gradient_checkpointing=checkpointing)
    fused = model.training(pos, gradient_checkpointing=checkpointing, attention_recompute=True)
    cfg = not args.no_cfg
    rollout, train = per_image_flops(
        args.preset,
        image_tokens=args.image_tokens,
        text_tokens=args.text_tokens,
        negative_text_tokens=args.negative_text_tokens,
        lora_rank=args.lora_rank,
        steps=args.steps,
        window=args.window,
        cfg=cfg,
        checkpointing=checkpointing,
    )
    per_image = rollout + train

    tf = 1e12
    print(
        f"preset {args.preset}: {args.image_tokens} image + {args.text_tokens} text tokens, LoRA r={args.lora_rank}"
    )
    print(f"{'group':20s} {'linear':>10s} {'attention':>10s} {'lora':>10s}   (forward TFLOPs)")
    for g in BLOCK_GROUPS:
        print(f"{g:20s} {fwd.linear[g] / tf:10.3f} {fwd.attention[g] / tf:10.3f} {fwd.lora[g] / tf:10.3f}")
    print(
        f"{'total':20s} {fwd.linear_total / tf:10.3f} {fwd.attention_total / tf:10.3f} {fwd.lora_total / tf:10.3f}"
    )
    rows = [
        ("forward (with LoRA)", fwd.total),
        ("forward (base model only)", base_fwd.total),
        ("training backward", train_pos.backward.total),
        ("checkpointing recompute", train_pos.recompute.total),
        ("training sample-forward total", train_pos.total),
        ("  same, attention bwd 2.5x (fused)", fused.total),
        (f"rollout per image ({args.steps} steps{' x2 CFG' if cfg else ''})", rollout),
        (f"training per image ({args.window} steps{' x2 CFG' if cfg else ''})", train),
        ("per trained image", per_image),
    ]
    print()
    for name, value in rows:
        print(f"{name:40s} {value / tf:10.2f} TFLOPs")
    ideal = args.peak_tflops * tf / per_image
    print(f"{'ideal images/s at 100% MFU':40s} {ideal:10.4f}  ({args.peak_tflops:g} TFLOPs peak, one device)")
    result = {
        "preset": args.preset,
        "image_tokens": args.image_tokens,
        "text_tokens": args.text_tokens,
        "lora_rank": args.lora_rank,
        "forward_tflops": fwd.total / tf,
        "forward_base_tflops": base_fwd.total / tf,
        "backward_tflops": train_pos.backward.total / tf,
        "recompute_tflops": train_pos.recompute.total / tf,
        "train_sample_forward_tflops": train_pos.total / tf,
        "rollout_tflops_per_image": rollout / tf,
        "train_tflops_per_image": train / tf,
        "tflops_per_trained_image": per_image / tf,
        "ideal_images_per_s": ideal,
        "peak_tflops": args.peak_tflops,
        "forward_breakdown": fwd.as_dict(),
    }
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
