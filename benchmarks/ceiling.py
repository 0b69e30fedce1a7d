"""The ceiling of the scenes demo's LoRA: supervised flow matching on the RL prompts' own targets.

What the demo's LoRA on the demo's model can reach at a given compute, for the RL curves to be read
against (notes/rl-signal.md, "Ceiling"). The model, the LoRA and the evaluation are the demo's
(`scenes_task_config()`, the demo's settings when it was measured), built by the trainer itself
(`Trainer.__init__`: the scenes checkpoint, `prepare_policy`'s LoRA r8/α16 with its seeded init,
the `Evaluator`); only the objective differs. Instead of rewarding its own samples, the LoRA is
fine-tuned with the pretraining's flow-matching
loss (`boogu_tiny.scenes_pretrain.draw_flow_batch` and `flow_matching_loss`: a level of the
checkpoint's schedule per row, ``x_t = (1 - sigma) x0 + sigma eps`` at Boogu time ``t = 1 - sigma``,
target ``x0 - eps``, float32 MSE, the caption dropped for the empty negative with probability
``--cond-dropout`` as the pretraining did) on the rendered targets of the RL training prompts:

* **data**: the records the trainer's `PromptSampler` draws from (``demo_records(data.demo_prompts,
  "scenes")``: train-split scenes whose caption is not held out), each scene rendered exactly as its
  ``ground_truth`` JSON specifies, at the demo's 64², encoded to the posterior mean of the model's VAE
  (`scenes_pretrain.encode_images`, as the pretraining encoded its renders); the captions and the
  negative through the trainer's own prompt encoder (``trainer.local_engine.encode_prompts``);
* **optimizer**: AdamW on the LoRA parameters with the demo's ``optim.*`` (betas, eps, weight decay,
  grad clip; constant lr ``--lr``, default ``optim.lr``), ``--batch`` rows per step (default 64, the
  demo's 8 prompts x 8 images), rows drawn with replacement;
* **compute**: forward-equivalents as the trainer counts ``cum/fe`` (`ForwardCounter` on the
  policy, `forward_equivalents`: a transformer sample-forward 1, its backward 2, 3 with gradient
  checkpointing; the VAE and the text encoder are not counted, as the trainer does not count them):
  3 FE per row, 192 per step of 64, so the demo's 44160 FE are 230 steps;
* **evaluation**: held-out ``scene_exact`` by the trainer's `Evaluator` (``eval.*`` of the demo:
  400 held-out captions, ODE 20 steps, CFG 4, the evaluation's fixed seeds), with the LoRA off (the
  base) and at the first step whose cumulative FE reaches each of ``--fe-marks`` (default the
  quarters of ``--budget``); each mark is reported with its paired difference from the base and
  the standard error of that difference (`boogu_trainer.demo.paired_summary`).

    OMP_NUM_THREADS=1 uv run python benchmarks/ceiling.py [--seed 0] [--budget 44160]
        [--fe-marks 11040,22080,33120,44160] [--lr 1e-3] [--batch 64] [--cond-dropout 0.1]
        [--eval-prompts 400] [--eval-steps N] [--json PATH] [--quick]

``--quick`` (the smoke test) trains 4 steps of 8 rows on 64 records and evaluates 4 captions with 2
denoising steps: the plumbing only. Sets ``OMP_WAIT_POLICY=PASSIVE`` unless it is set (see
benchmarks/README.md).
"""

from __future__ import annotations

import os

# Before torch loads OpenMP: idle OpenMP threads sleep instead of spinning (see README).
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import argparse
import math
import statistics
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
from _common import environment, table, write_json

from boogu_adapters.encoding import vae_to_latents
from boogu_adapters.lora import adapters_disabled
from boogu_adapters.step import pad_features
from boogu_data import PromptRecord
from boogu_data.scenes import Scene
from boogu_schedule import derive_seed, make_generator
from boogu_tiny.scenes_pretrain import (
    PretrainConfig,
    _images,
    draw_flow_batch,
    encode_images,
    flow_matching_loss,
    training_sigmas,
)
from boogu_trainer.config import TrainerConfig, config_to_dict, load_config, scenes_task_config
from boogu_trainer.demo import paired_summary
from boogu_trainer.metrics import forward_equivalents
from boogu_trainer.perf import unwrap_transformer
from boogu_trainer.trainer import Trainer

BUDGET_FE = 44160
"""The demo's compute: 30 DiffusionNFT steps of 64 images at 23 FE (algorithms_scenes.BUDGET_FE)."""
QUARTERS = 4
QUICK_OVERRIDES = ["data.demo_prompts=64", "eval.num_prompts=4", "eval.num_steps=2"]
"""``--quick``: 64 training records, 4 held-out captions, 2 denoising steps per evaluation."""


@dataclass(frozen=True)
class TrainingSet:
    """The RL training prompts as flow-matching data: one row per record."""

    latents: torch.Tensor
    """(N, C, h, w) float32 Boogu latents of the records' rendered scenes."""
    hidden: torch.Tensor
    """(N + 1, L, D) caption features, right-padded; the last row is the records' negative."""
    mask: torch.Tensor
    """(N + 1, L) int64 attention mask of ``hidden``."""
    captions: int
    """Distinct captions among the N records."""


def run_config(
    seed: int, run_dir: str, eval_prompts: int | None, quick: bool, eval_steps: int | None = None
) -> TrainerConfig:
    """The demo's config, with this seed, a throw-away run folder and the evaluation's prompt count
    and denoising steps (None: the demo's)."""
    overrides = [
        f"seed={seed}",
        f"logging.run_dir={run_dir}",
        f"logging.name=ceiling_s{seed}",
        "preflight=false",
        *(QUICK_OVERRIDES if quick else []),
    ]
    if eval_prompts is not None:
        overrides.append(f"eval.num_prompts={eval_prompts}")
    if eval_steps is not None:
        overrides.append(f"eval.num_steps={eval_steps}")
    return load_config(None, overrides, base=scenes_task_config())


def training_set(trainer: Trainer) -> TrainingSet:
    """Render, encode and caption the records the trainer's `PromptSampler` draws its prompts from."""
    records: list[PromptRecord] = trainer.data.records
    sampler = trainer.config.sampler
    if sampler.height != sampler.width:
        raise ValueError(f"the scenes render square images; sampler is {sampler.height}x{sampler.width}")
    # Each record carries its scene as JSON (boogu_data.scenes.Scene.to_json): render that very scene.
    scenes = [Scene.from_json(r.ground_truth) for r in records]
    vae = trainer.parts.vae
    latents = vae_to_latents(vae, encode_images(vae, _images(scenes, sampler.height))).float()
    negatives = {r.negative for r in records}
    if len(negatives) != 1:
        raise ValueError(f"the records carry {len(negatives)} different negatives; one is expected")
    # Through the trainer's prompt encoder, each distinct prompt once, as the rollout engine encodes.
    captions = sorted({r.instruction for r in records})
    encode = trainer.local_engine.encode_prompts
    positive, negative = encode(captions, None), encode(list(negatives), None)
    length = max(positive[0].shape[1], negative[0].shape[1])
    (hidden, mask), (neg_hidden, neg_mask) = (pad_features(h, m, length) for h, m in (positive, negative))
    row = {caption: i for i, caption in enumerate(captions)}
    index = torch.tensor([row[r.instruction] for r in records])
    return TrainingSet(
        latents=latents,
        hidden=torch.cat([hidden[index], neg_hidden]),
        mask=torch.cat([mask[index], neg_mask]),
        captions=len(captions),
    )


def evaluate(trainer: Trainer, step: int) -> list[float]:
    """Each held-out caption's gold score (``scene_exact``), in the evaluator's prompt order."""
    trainer.transformer.eval()
    return [float(p["gold"]) for p in trainer.evaluator.evaluate(step=step).prompts]


def run(args: argparse.Namespace, run_dir: str) -> dict[str, Any]:
    config = run_config(args.seed, run_dir, args.eval_prompts, args.quick, args.eval_steps)
    t0 = time.perf_counter()
    trainer = Trainer(config)
    try:
        train_captions = {r.instruction for r in trainer.data.records}
        overlap = train_captions & {r.instruction for r in trainer.evaluator.records}
        if overlap:
            raise ValueError(f"{len(overlap)} held-out captions are training captions, e.g. {min(overlap)!r}")
        data = training_set(trainer)
        setup_s = time.perf_counter() - t0
        print(
            f"{len(trainer.data.records)} training records ({data.captions} captions), latents "
            f"{tuple(data.latents.shape[1:])}, {len(trainer.evaluator.records)} held-out captions; "
            f"setup {setup_s:.0f} s",
            flush=True,
        )
        t0 = time.perf_counter()
        with adapters_disabled(trainer.transformer):
            base = evaluate(trainer, 0)
        base_s = time.perf_counter() - t0
        print(f"base: held-out scene_exact {statistics.fmean(base):.3f} ({base_s:.0f} s)", flush=True)
        curve, evaluations = train(trainer, data, args, base)
    finally:
        trainer.close()
    return {
        "config": config,
        "records": len(trainer.data.records),
        "captions": data.captions,
        "eval_prompts": len(base),
        "eval_sampler": {  # the evaluator's own (eval.guidance_scale, else the rollouts' CFG)
            "num_steps": trainer.evaluator.eval_config.num_steps,
            "guidance_scale": trainer.evaluator.guidance_scale,
            "seed": trainer.evaluator.seed,
            "kind": "ode",
        },
        "base": statistics.fmean(base),
        "base_gold": base,
        "evaluations": evaluations,
        "curve": curve,
        "setup_s": setup_s,
        "base_eval_s": base_s,
    }


def train(
    trainer: Trainer, data: TrainingSet, args: argparse.Namespace, base: list[float]
) -> tuple[dict[str, list[float]], list[dict[str, Any]]]:
    """Flow matching of the trainer's LoRA to the budget, evaluated at each FE mark; (per-step curve,
    evaluations)."""
    transformer = trainer.transformer
    params = [p for p in transformer.parameters() if p.requires_grad]  # the LoRA (prepare_policy)
    o = trainer.config.optim
    optimizer = torch.optim.AdamW(params, lr=args.lr, betas=o.betas, eps=o.eps, weight_decay=o.weight_decay)
    generator = make_generator(derive_seed(args.seed, "ceiling"))
    sigma_levels = training_sigmas(trainer.parts.schedule_config)
    freqs = trainer.local_engine.freqs_cis
    empty = data.hidden.shape[0] - 1
    # The trainer's own counter on the policy and its FE rule (StepMetrics._compute).
    counter = trainer.step_metrics.forwards
    checkpointing = bool(getattr(unwrap_transformer(transformer), "gradient_checkpointing", False))
    curve: dict[str, list[float]] = {"loss": [], "cum_fe": [], "cum_time_s": []}
    evaluations: list[dict[str, Any]] = []
    cum_fe, cum_time, step = 0.0, 0.0, 0
    marks = list(args.fe_marks)
    while cum_fe < args.budget:
        counter.take()  # an evaluation's forwards are not training compute
        t0 = time.perf_counter()
        transformer.train()
        batch = draw_flow_batch(data.latents, args.batch, sigma_levels, args.cond_dropout, empty, generator)
        with counter.counting("train"):
            loss = flow_matching_loss(transformer, batch, data.hidden, data.mask, freqs)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
        value = loss.item()  # host sync, once per step
        if not math.isfinite(value):
            raise FloatingPointError(f"step {step + 1}: non-finite flow-matching loss {value}")
        torch.nn.utils.clip_grad_norm_(params, o.grad_clip)
        optimizer.step()
        step += 1
        cum_time += time.perf_counter() - t0
        cum_fe += forward_equivalents(counter.take(), checkpointing=checkpointing)["total"]
        curve["loss"].append(value)
        curve["cum_fe"].append(cum_fe)
        curve["cum_time_s"].append(cum_time)
        if step % 10 == 0:
            print(
                f"step {step}: loss {statistics.fmean(curve['loss'][-10:]):.4f}, cum/fe {cum_fe:.0f}",
                flush=True,
            )
        crossed = [m for m in marks if cum_fe >= m]
        if crossed:  # one evaluation for every mark this step reached
            marks = marks[len(crossed) :]
            t0 = time.perf_counter()
            gold = evaluate(trainer, step)
            eval_s = time.perf_counter() - t0
            summary = paired_summary(base, gold)
            for mark in crossed:
                evaluations.append(
                    {
                        "mark_fe": mark,
                        "step": step,
                        "cum_fe": cum_fe,
                        "cum_time_s": cum_time,
                        "gold": summary["trained"],
                        "gain": summary["diff"],
                        "se_gain": summary["se_diff"],
                        "train_loss": statistics.fmean(curve["loss"][-10:]),
                        "eval_s": eval_s if mark == crossed[0] else 0.0,
                        "prompts_gold": gold,
                    }
                )
            print(
                f"mark {crossed[-1]:.0f} FE (step {step}, cum/fe {cum_fe:.0f}): held-out scene_exact "
                f"{summary['trained']:.3f}, gain {summary['diff']:+.3f} (se {summary['se_diff']:.3f})",
                flush=True,
            )
    return curve, evaluations


def fe_marks(text: str | None, budget: float) -> list[float]:
    """``--fe-marks``: ascending positive FE counts, the last the budget (default: its quarters)."""
    if text is None:
        return [budget * (k + 1) / QUARTERS for k in range(QUARTERS)]
    marks = [float(v) for v in text.split(",") if v.strip()]
    if not marks or any(m <= 0 for m in marks) or marks != sorted(set(marks)) or marks[-1] > budget:
        raise ValueError(
            f"--fe-marks {text!r}: expected ascending positive FE counts up to --budget {budget:g}"
        )
    return marks if marks[-1] == budget else [*marks, budget]


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    demo = scenes_task_config()
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--seed",
        type=int,
        default=0,
        help="the LoRA init, the evaluation's seeds and the draws (default %(default)s)",
    )
    parser.add_argument(
        "--budget",
        type=float,
        default=BUDGET_FE,
        help="forward-equivalents to train for (default %(default)g)",
    )
    parser.add_argument(
        "--fe-marks",
        default=None,
        help="comma-separated FE counts to evaluate at, the budget added if missing (default: its quarters)",
    )
    parser.add_argument(
        "--lr",
        type=float,
        default=demo.optim.lr,
        help="AdamW learning rate (default %(default)g, the demo's optim.lr)",
    )
    parser.add_argument(
        "--batch",
        type=int,
        default=demo.data.prompts_per_step * demo.algorithm.group_size,
        help="rows per optimizer step (default %(default)s, the demo's images per step)",
    )
    parser.add_argument(
        "--cond-dropout",
        type=float,
        default=PretrainConfig.cond_dropout,
        help="probability of training a row on the empty negative instead of its caption (default %(default)g, the pretraining's)",
    )
    parser.add_argument(
        "--eval-prompts",
        type=int,
        default=None,
        help="held-out captions per evaluation (default: the demo's eval.num_prompts)",
    )
    parser.add_argument(
        "--eval-steps",
        type=int,
        default=None,
        help="denoising steps of each evaluation (default: the demo's eval.num_steps; the algorithm "
        "curves of benchmarks/algorithms.py --task scenes judge with 10)",
    )
    parser.add_argument("--json", help="also write the figures and settings to this JSON file")
    parser.add_argument(
        "--quick",
        action="store_true",
        help="smoke run: 4 steps of 8 rows on 64 records, 4 held-out captions with 2 denoising steps",
    )
    args = parser.parse_args(argv)
    if args.quick:
        args.budget, args.batch = 96.0, 8  # 4 steps of 8 rows at 3 FE: one per quarter
    if args.batch < 1 or args.budget <= 0 or not 0 <= args.cond_dropout < 1 or args.lr <= 0:
        parser.error("--batch must be >= 1, --budget and --lr > 0, --cond-dropout in [0, 1)")
    if args.eval_steps is not None and args.eval_steps < 1:
        parser.error(f"--eval-steps must be >= 1, got {args.eval_steps}")
    try:
        args.fe_marks = fe_marks(args.fe_marks, args.budget)
    except ValueError as error:
        parser.error(str(error))
    return args


def main(argv: Sequence[str] | None = None) -> None:
    args = parse_args(argv)
    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory() as tmp:  # the trainer's run folder: nothing is written there
        result = run(args, tmp)
    total = time.perf_counter() - t0
    config: TrainerConfig = result.pop("config")
    e = result["eval_sampler"]
    print()
    print(
        f"ceiling, seed {args.seed}: flow matching of the demo's LoRA (r{config.lora.rank}/α{config.lora.alpha:g}) on "
        f"{result['records']} RL training records ({result['captions']} captions), batch {args.batch}, lr {args.lr:g}, "
        f"cond dropout {args.cond_dropout:g}; held-out scene_exact on {result['eval_prompts']} captions "
        f"(ODE {e['num_steps']} steps, CFG {e['guidance_scale']:g})"
    )
    rows = [("base", "0", "0", f"{result['base']:.3f}", "", "")]
    rows += [
        (
            f"{ev['mark_fe']:.0f} FE",
            str(ev["step"]),
            f"{ev['cum_fe']:.0f}",
            f"{ev['gold']:.3f}",
            f"{ev['gain']:+.3f}",
            f"{ev['se_gain']:.3f}",
        )
        for ev in result["evaluations"]
    ]
    print(table(rows, ("mark", "step", "cum/fe", "held-out exact", "gain", "se of gain")))
    train_s = result["curve"]["cum_time_s"][-1]
    eval_s = result["base_eval_s"] + sum(ev["eval_s"] for ev in result["evaluations"])
    print(f"total wall time {total:.0f} s: training {train_s:.0f} s, evaluations {eval_s:.0f} s")
    write_json(
        args.json,
        {
            "benchmark": "ceiling",
            "settings": {
                "seed": args.seed,
                "budget_fe": args.budget,
                "fe_marks": args.fe_marks,
                # as text: write_json rounds floats to 4 decimals (eps 1e-8 would read 0)
                "lr": f"{args.lr:g}",
                "batch": args.batch,
                "cond_dropout": args.cond_dropout,
                "quick": args.quick,
                "optim": {
                    "betas": [f"{b:g}" for b in config.optim.betas],
                    "eps": f"{config.optim.eps:g}",
                    "weight_decay": f"{config.optim.weight_decay:g}",
                    "grad_clip": config.optim.grad_clip,
                },
                "fe_rule": "forward_equivalents of the transformer's sample-forwards: forward 1, backward 2 (3 with gradient checkpointing); VAE and text encoder not counted",
                # the run folder as "runs": the temporary one the trainer was given is gone
                "config": config_to_dict(
                    run_config(args.seed, "runs", args.eval_prompts, args.quick, args.eval_steps)
                ),
            },
            **result,
            "total_wall_s": total,
            "environment": environment(),
        },
    )


if __name__ == "__main__":
    main()
