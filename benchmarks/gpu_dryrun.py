"""The GPU path on fake CUDA: every algorithm's rollout, update and evaluation at the released size.

For each algorithm (flow_grpo, grpo_guard, diffusion_nft, awm) and each task (T2I, edit) it builds the
model of ``--preset`` on fake CUDA in bf16 (``boogu_dryrun``: tensors with shapes, dtypes and
devices but no memory), and runs the shipped recipe's training step (one rollout with the local
engine, one update, the weight sync) and one evaluation call, with the recipe's micro-batches, on
``--world-size`` ranks (FSDP2 on the fake process group when more than one). A case fails on what a
GPU would refuse: a CPU/CUDA mix, a random op on another device's generator, a CPU tensor in a
collective. It reports the host reads inside the rollout/update loops (those by design listed by
name), the peak live memory of each phase, and ``trainer --plan``'s figure for the same phase.

    python3 benchmarks/gpu_dryrun.py [--preset released|mid|tiny] [--world-size N]
        [--cases flow_grpo-t2i,awm-edit,...] [--sampler-steps K] [--set KEY=VALUE ...] [--json out.json]

Batch per rank: the fewest prompts whose calls have the recipe's shapes (one rollout micro-batch,
whole training micro-batches; ``dryrun.shape_preserving_prompts``); the evaluation call takes
``dryrun.EVAL_STEPS`` denoising steps. ``--sampler-steps`` shortens the rollout too (each step is the
same call); the default keeps the recipe's. What this cannot show (speed, kernels, NCCL itself, the
backward's own kernels and FSDP2's reduce-scatters, which run in the autograd engine that needs a
driver) is listed in docs/gpu-path.md.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

REPO = Path(__file__).resolve().parents[1]
ALGORITHMS = ("flow_grpo", "grpo_guard", "diffusion_nft", "awm")
TASKS = ("t2i", "edit")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--preset", choices=("released", "mid", "tiny"), default="released")
    parser.add_argument("--world-size", type=int, default=1)
    parser.add_argument(
        "--cases",
        default="",
        help="comma-separated <algorithm>-<t2i|edit> names (default: all eight)",
    )
    parser.add_argument(
        "--sampler-steps", type=int, default=None, help="rollout denoising steps (default: the recipe's)"
    )
    parser.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="a trainer config override on top of each case's recipe, e.g. sampler.image_guidance_scale=2 "
        "(repeatable)",
    )
    parser.add_argument(
        "--tiny-checkpoint", default=None, help="the tiny checkpoint (processor, scheduler); built if missing"
    )
    parser.add_argument("--json", default=None, help="write the report here")
    args = parser.parse_args(argv)
    if args.world_size < 1:
        parser.error(f"--world-size must be >= 1, got {args.world_size}")
    bad = [item for item in args.set if "=" not in item or not item.partition("=")[0]]
    if bad:
        parser.error(f"--set: expected KEY=VALUE (a trainer config key), got {bad}")
    names = [f"{a}-{t}" for a in ALGORITHMS for t in TASKS]
    args.case_list = [c for c in args.cases.split(",") if c] or names
    unknown = [c for c in args.case_list if c not in names]
    if unknown:
        parser.error(f"--cases: unknown {unknown}; expected names among {names}")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    import boogu_dryrun as dryrun
    from boogu_tiny.checkpoints import ensure_tiny_checkpoint

    preset = dryrun.presets()[args.preset]
    report: dict = {
        "preset": args.preset,
        "world_size": args.world_size,
        "sampler_steps": args.sampler_steps,
        "overrides": args.set,
        "cases": {},
    }
    with tempfile.TemporaryDirectory(prefix="gpu_dryrun-") as tmp:
        tiny = ensure_tiny_checkpoint(Path(args.tiny_checkpoint or Path(tmp) / "Boogu-Image"))
        overrides = [f"sampler.num_steps={args.sampler_steps}"] if args.sampler_steps else []
        overrides += args.set
        print(
            f"{'case':22s} {'ok':>3s} {'s':>6s} {'loop reads':>10s} {'by design':>9s} "
            f"{'rollout GiB (plan)':>19s} {'train GiB (plan)':>17s} {'step GiB (plan)':>16s}"
        )
        for name in args.case_list:
            algorithm, task = name.rsplit("-", 1)
            t0 = time.perf_counter()
            result = dryrun.run_case(
                algorithm,
                task == "edit",
                preset=preset,
                repo=REPO,
                tiny_root=tiny,
                work=Path(tmp) / name,
                world_size=args.world_size,
                overrides=overrides,
            )
            entry = result.as_json()
            report["cases"][name] = entry
            reads = entry["host_reads"] or {}
            by_design = sum(v["count"] for v in reads.get("by_design", {}).values())

            def pair(key: str, result: dryrun.CaseResult = result) -> str:
                got, plan = result.peaks.get(key), result.plan.get(key)
                return "-" if got is None else f"{got:.1f} ({plan:.1f})" if plan else f"{got:.1f}"

            print(
                f"{name:22s} {'yes' if result.ok else 'NO':>3s} {time.perf_counter() - t0:6.1f} "
                f"{entry['host_reads_in_loops'] if entry['host_reads_in_loops'] is not None else '-':>10} "
                f"{by_design:>9d} {pair('rollout'):>19s} {pair('train'):>17s} {pair('step'):>16s}",
                flush=True,
            )
            if not result.ok:
                print(f"    {result.error}", flush=True)
                if result.traceback:
                    print("    " + result.traceback.strip().splitlines()[-1], flush=True)
    failed = [n for n, c in report["cases"].items() if not c["ok"]]
    ratios = {
        n: {
            k: round(c["peaks_gb"][k] / c["plan_gb"][k], 3)
            for k in ("rollout", "train")
            if c["plan_gb"].get(k)
        }
        for n, c in report["cases"].items()
        if c["ok"]
    }
    report["measured_over_plan"] = ratios
    for n, r in ratios.items():
        print(f"measured / plan  {n:22s} " + "  ".join(f"{k} {v:.2f}" for k, v in r.items()))
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=2) + "\n")
    print(
        f"{len(report['cases']) - len(failed)}/{len(report['cases'])} cases passed"
        + (f"; failed: {failed}" if failed else "")
    )
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
