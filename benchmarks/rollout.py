"""Rollout throughput of ``LocalRolloutEngine`` and the share of its wall time spent inside model forwards.

For the tiny random checkpoint (at the demo's 64x64 images) and for a mid-size random transformer
(TINY_CONFIG with hidden 256, 4 double- + 4 single-stream blocks, ~23 M parameters, at 512x512
images = 64x64 latents; the tiny checkpoint's Qwen3-VL encoder, VAE and processor), one realistic
request (default 2 prompts x 4 samples, 10 steps, text CFG 4.0, flow_sde with a window of 2) is
rolled out after a small warm-up rollout, and the benchmark prints:

* images/s, NFE (transformer sample-forwards) per image, prompt encodings per prompt and per sample;
* the share of the wall time spent inside the transformer, the text encoder and the VAE, measured
  by hooks on the modules themselves (target on the mid-size model: >= 85% together), next to the
  engine's own counters and timers, and where the rest goes.

    uv run python benchmarks/rollout.py [--models tiny mid] [--prompts 2] [--group-size 4]
        [--steps 10] [--size 512] [--checkpoint DIR] [--profile] [--json out.json]

The whole run takes about 2 minutes on 2 CPU cores (4 when other processes share them); most of it
is the mid-size rollout, and ``--size 256`` makes that about 4x quicker. The script sets
``OMP_WAIT_POLICY=PASSIVE`` unless it is set already (see benchmarks/README.md).
"""

from __future__ import annotations

import os

# Before torch loads OpenMP: idle OpenMP threads sleep instead of spinning. On a 2-core machine
# shared with other processes, spinning threads make small ops several times slower (see README).
# Set OMP_WAIT_POLICY=ACTIVE yourself to measure torch's default behaviour.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import argparse
import tempfile
import time

import torch
from _common import (
    ForwardClock,
    count_parameters,
    environment,
    load_tiny_parts,
    maybe_profile,
    share,
    table,
    tiny_checkpoint,
    watch_pipeline,
    watch_transformer_internals,
    with_mid_size_transformer,
    write_json,
)

from boogu_adapters.components import build_local_engine
from boogu_adapters.engines import EngineStats
from boogu_adapters.types import RolloutRequest
from boogu_schedule import WindowPlan
from boogu_trainer.data import demo_records

TARGET_SHARE = 0.85


def make_request(records, args, size: int, *, warmup: bool = False) -> RolloutRequest:
    if warmup:
        # Every code path once (encode, CFG forward, SDE window, ODE step, decode) at the timed
        # resolution, for a fraction of the cost: 1 prompt x 2 samples, 2 steps, a window of 1.
        return RolloutRequest(
            records=records[:1],
            group_size=2,
            num_steps=2,
            guidance_scale=args.guidance,
            sampler="flow_sde",
            noise_level=args.noise_level,
            window=WindowPlan(kind="fixed", size=1, start=0),
            height=size,
            width=size,
            seed=args.seed + 1,
        )
    return RolloutRequest(
        records=records,
        group_size=args.group_size,
        num_steps=args.steps,
        guidance_scale=args.guidance,
        sampler="flow_sde",
        noise_level=args.noise_level,
        window=WindowPlan(
            kind="random", size=args.window, window_range=(0, max(args.window + 1, args.steps // 2))
        ),
        height=size,
        width=size,
        seed=args.seed,
    )


def bench_model(name: str, parts, args, size: int) -> dict:
    device = torch.device(args.device)
    engine = build_local_engine(parts, device=device)
    records = demo_records(args.prompts)
    clock = ForwardClock(device)
    watch_pipeline(clock, parts)
    watch_transformer_internals(clock)
    # Label the encoder's rows: the engine encodes positives with a per-prompt image list and the
    # negatives text-only (images=None).
    prompt_encoder = engine.encode_prompts

    def labelled_encoder(instructions, images):
        with clock.in_phase("negative" if images is None else "positive"):
            return prompt_encoder(instructions, images)

    engine.encode_prompts = labelled_encoder

    t0 = time.perf_counter()
    engine.generate(make_request(records, args, size, warmup=True))
    warmup_s = time.perf_counter() - t0
    clock.reset()
    engine.stats = EngineStats()
    prompt_encoder.seconds = 0.0
    engine.codec.seconds = 0.0

    request = make_request(records, args, size)
    with maybe_profile(args.profile, clock) as prof:
        t0 = time.perf_counter()
        traj = engine.generate(request)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        wall = time.perf_counter() - t0
    clock.remove()

    stats = engine.stats
    images = traj.batch_size
    t_tf, t_enc, t_vae = (clock.total(c) for c in ("transformer", "encoder", "vae"))
    model = t_tf + t_enc + t_vae
    eng_tf, eng_enc, eng_dec = (stats.seconds.get(k, 0.0) for k in ("transformer", "encode", "decode"))
    encoder_rows = clock.total("encoder", field="rows")
    fig = {
        "model": name,
        "transformer_parameters": count_parameters(parts.transformer),
        "image_size": size,
        "latent_size": size // parts.vae_scale_factor,
        "prompts": len(records),
        "group_size": args.group_size,
        "images": images,
        "steps": args.steps,
        "guidance_scale": args.guidance,
        "window_size": traj.window_size,
        "warmup_s": warmup_s,
        "wall_s": wall,
        "images_per_s": images / wall,
        # NFE: transformer sample-forwards (a CFG step costs 2 per image), counted by the hook.
        "nfe_per_image": clock.total("transformer", field="rows") / images,
        "nfe_per_image_engine": stats.transformer_sample_forwards / images,
        "nfe_per_image_trajectory": traj.nfe_per_image,
        "transformer_calls": clock.total("transformer", field="calls"),
        "transformer_calls_engine": stats.transformer_calls,
        # Encoder: forward calls per request, and prompt rows encoded per prompt (positives and the
        # distinct negatives), per sample; the engine's counters alongside.
        "encoder_calls": clock.total("encoder", field="calls"),
        "encoder_calls_engine": stats.encoder_calls,
        # Prompt encodings (rows through the text encoder): positives per prompt (1.0 = once per
        # prompt, not per sample), the distinct negatives (the default "" is shared by all), and
        # all rows per prompt and per sample.
        "positive_encodings_per_prompt": clock.total("encoder", "positive", "rows") / len(records),
        "negative_encodings": clock.total("encoder", "negative", "rows"),
        "prompt_encodings_per_prompt": encoder_rows / len(records),
        "prompt_encodings_per_sample": encoder_rows / images,
        "prompts_encoded_engine": stats.prompts_encoded + stats.negatives_encoded,
        "seconds": {
            "transformer_forward": t_tf,
            "encoder_forward": t_enc,
            "vae": t_vae,
            "model_total": model,
            "engine_transformer": eng_tf,
            "engine_encode": eng_enc,
            "engine_decode": eng_dec,
            "encoder_own_timer": prompt_encoder.seconds,
            "codec_own_timer": engine.codec.seconds,
        },
        "share": {
            "transformer": share(t_tf, wall),
            "encoder": share(t_enc, wall),
            "vae": share(t_vae, wall),
            "model_total": share(model, wall),
            "engine_timers_total": share(eng_tf + eng_enc + eng_dec, wall),
        },
        # Where the non-model time goes (seconds), from the difference of the two clocks.
        "outside_models_s": {
            "cfg_and_casts_around_transformer": eng_tf - t_tf,
            "tokenise_and_gather_around_encoder": eng_enc - t_enc,
            "postprocess_around_vae": eng_dec - t_vae,
            "denoising_loop_rest": wall - eng_tf - eng_enc - eng_dec,
        },
        # Inside the transformer forward: its float64 RoPE and its attention kernels.
        "transformer_internals_s": {
            "rope": clock.inner_total("transformer", "rope"),
            "sdpa": clock.inner_total("transformer", "sdpa"),
        },
        "target_share": TARGET_SHARE,
        "meets_target": share(model, wall) >= TARGET_SHARE,
    }
    if "report" in prof:
        fig["profile"] = prof["report"]
    return fig


def print_model(fig: dict) -> None:
    s, sec = fig["share"], fig["seconds"]
    print(
        f"\n== {fig['model']}: {fig['transformer_parameters'] / 1e6:.2f} M-parameter transformer, "
        f"{fig['image_size']}x{fig['image_size']} images ({fig['latent_size']}^2 latents), "
        f"{fig['prompts']} prompts x {fig['group_size']}, {fig['steps']} steps, CFG {fig['guidance_scale']}, "
        f"flow_sde window {fig['window_size']} =="
    )
    print(f"warm-up {fig['warmup_s']:.1f} s; timed rollout {fig['wall_s']:.2f} s for {fig['images']} images")
    print(
        table(
            [
                ("images/s", f"{fig['images_per_s']:.3f}", ""),
                (
                    "NFE per image (hook / engine / trajectory)",
                    f"{fig['nfe_per_image']:.1f}",
                    f"{fig['nfe_per_image_engine']:.1f} / {fig['nfe_per_image_trajectory']:.1f}",
                ),
                (
                    "transformer calls (hook / engine)",
                    str(fig["transformer_calls"]),
                    str(fig["transformer_calls_engine"]),
                ),
                (
                    "encoder forward calls (hook / engine)",
                    str(fig["encoder_calls"]),
                    str(fig["encoder_calls_engine"]),
                ),
                (
                    "prompt encodings per prompt",
                    f"{fig['prompt_encodings_per_prompt']:.2f}",
                    f"positives {fig['positive_encodings_per_prompt']:.2f}/prompt + "
                    f"{fig['negative_encodings']} shared negative",
                ),
                (
                    "prompt encodings per sample",
                    f"{fig['prompt_encodings_per_sample']:.3f}",
                    f"engine: {fig['prompts_encoded_engine']} rows",
                ),
            ],
            ("figure", "value", "engine / note"),
        )
    )
    rows = [
        (
            "transformer forward",
            f"{sec['transformer_forward']:.3f}",
            f"{s['transformer']:.1%}",
            f"{sec['engine_transformer']:.3f}",
        ),
        (
            "encoder forward",
            f"{sec['encoder_forward']:.3f}",
            f"{s['encoder']:.1%}",
            f"{sec['engine_encode']:.3f}",
        ),
        ("VAE decode/encode", f"{sec['vae']:.3f}", f"{s['vae']:.1%}", f"{sec['engine_decode']:.3f}"),
        ("inside models, total", f"{sec['model_total']:.3f}", f"{s['model_total']:.1%}", ""),
        ("wall", f"{fig['wall_s']:.3f}", "100.0%", ""),
    ]
    print(table(rows, ("time inside", "s (hooks)", "share of wall", "engine timer s")))
    rest = fig["outside_models_s"]
    print(
        "outside the models: "
        + ", ".join(f"{k} {v * 1000:.0f} ms ({share(v, fig['wall_s']):.1%})" for k, v in rest.items())
    )
    inner = fig["transformer_internals_s"]
    print(
        "inside the transformer forward: "
        + ", ".join(
            f"{k} {v:.3f} s ({share(v, sec['transformer_forward']):.1%} of it)" for k, v in inner.items()
        )
    )
    verdict = "meets" if fig["meets_target"] else "MISSES"
    print(f"model share {s['model_total']:.1%}: {verdict} the {fig['target_share']:.0%} target")
    if "profile" in fig:
        print(fig["profile"])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", nargs="+", choices=["tiny", "mid"], default=["tiny", "mid"])
    parser.add_argument(
        "--checkpoint", help="tiny checkpoint folder (built there if missing; default: a temp dir)"
    )
    parser.add_argument("--prompts", type=int, default=2, help="prompts per request")
    parser.add_argument("--group-size", type=int, default=4, help="samples per prompt")
    parser.add_argument("--steps", type=int, default=10, help="denoising steps")
    parser.add_argument("--guidance", type=float, default=4.0, help="text CFG scale (1.0: CFG off)")
    parser.add_argument("--noise-level", type=float, default=0.7)
    parser.add_argument("--window", type=int, default=2, help="SDE window size")
    parser.add_argument(
        "--size", type=int, default=512, help="mid-size model image side in pixels (latent = size/8)"
    )
    parser.add_argument(
        "--tiny-size", type=int, default=64, help="tiny checkpoint image side (the demo's 64)"
    )
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--threads", type=int, default=0, help="torch CPU threads (0: torch's default)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--profile",
        action="store_true",
        help="cProfile the code outside the model calls during the timed rollout (slows it)",
    )
    parser.add_argument("--json", help="also write the figures to this JSON file")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)

    figures: dict = {"environment": environment(), "request": vars(args).copy(), "models": {}}
    with tempfile.TemporaryDirectory() as tmp:
        path = tiny_checkpoint(args.checkpoint, tmp)
        parts = load_tiny_parts(path, args.device)
        for name in args.models:
            model_parts = parts if name == "tiny" else with_mid_size_transformer(parts)
            size = args.tiny_size if name == "tiny" else args.size
            fig = bench_model(name, model_parts, args, size)
            print_model(fig)
            figures["models"][name] = {k: v for k, v in fig.items() if k != "profile"}
    print(f"\n{figures['environment']}")
    write_json(args.json, figures)


if __name__ == "__main__":
    main()
