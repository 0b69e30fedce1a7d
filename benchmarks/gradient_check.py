"""Is the update direction signal? Two instruments on a recipe's gradient, for any learner and reward.

1. **Signal-to-noise: the cosine across batches.** Roll out ``--groups`` independent prompt groups
   at the checkpoint (every group its own prompt, its own rollout seeds), and take each group's
   gradient of the learner's loss as the first optimizer step of an update would see it
   (`Learner.gradient`: same loss, same weighting, on-policy, before AdamW). A batch of N images is
   the mean of N / group_size group gradients; for each N of ``--sizes`` the groups are split into
   K disjoint batches and the mean pairwise cosine of their gradients is printed. Pure noise gives
   ~0 (spread ~1/sqrt(P) over P parameters); signal makes it grow with N. From all groups at once
   it also estimates the signal's squared norm ``S = |E g|^2`` (unbiased: ``(|sum g_i|^2 - sum
   |g_i|^2) / (G (G - 1))``) and the noise ``V = E|g_i - E g|^2``, so the cosine expected of two
   batches of m groups is ``S / (S + V / m)``, and ``V / S`` groups give a cosine of 1/2.

2. **Uphill: one step along the estimated gradient.** The mean of all the group gradients (>= 1024
   images by default) gives a direction ``u = -g / |g|`` (descent on the loss: ascent on the
   reward, if the estimator is right). The LoRA is moved by ``+eps u`` and ``-eps u`` and the
   expected training reward of the base, +eps and -eps is measured on the same ``--eval-groups``
   prompt groups with the same rollout seeds (the recipe's own sampler: what the gradient is of).
   An estimator that is right gives ``reward(+eps) > reward(-eps)`` by more than 2 standard errors
   of the paired difference; a flipped advantage or log-prob sign reverses it. ``--eps`` is the
   step's L2 norm over the LoRA parameters (the report also gives it in lengths of AdamW's first
   step at the recipe's lr, ``lr * sqrt(P)``, P the parameters the gradient moves). Both sides
   falling below the base says the reward is curved on that scale: the step is too long to see the
   slope, and so is an optimizer step of that length.

The gradients are not kept whole when they would not fit in memory (`GroupGradients`): the signal,
the noise and the mean direction come from exact running sums, and the cosine table from a
CountSketch of each gradient (``--sketch``).

Each group's advantages are normalised as the recipe does it within a rollout call of
``data.prompts_per_step`` prompts (`RolloutScorer.run`); a batch-wide std then scales the groups
of one call alike, which changes no cosine. Nothing is trained: the weights are put back bitwise
after each perturbation.

    uv run python benchmarks/gradient_check.py                       # the scenes task (the first demo's recipe)
    uv run python benchmarks/gradient_check.py examples/tiny_scenes/scenes_demo.yaml   # today's demo
    uv run python benchmarks/gradient_check.py --learner flow_grpo   # the scenes comparison's FlowGRPO
    uv run python benchmarks/gradient_check.py my_recipe.yaml --set optim.lr=3e-4 --json out.json
    uv run python benchmarks/gradient_check.py examples/tiny_scenes/scenes_demo.yaml \
        --resume runs/<run>/checkpoints/<step>   # at a trained checkpoint instead of the base

With a recipe, its own model, reward and sampler are used (so the check runs on your reward);
without one, the scenes task's config (`scenes_task_config`: the demo's settings when these
figures were measured, now ``examples/tiny_scenes/scenes_quick.yaml``; ``--learner demo``) with the learner's settings from
`algorithms_scenes.ALGORITHMS`.
"""

from __future__ import annotations

import argparse
import itertools
import math
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
from _common import environment, table, write_json

from boogu_trainer.checkpoint import CheckpointError, verify_checkpoint
from boogu_trainer.config import TrainerConfig, load_config, scenes_task_config
from boogu_trainer.trainer import Trainer

AUTO_SKETCH = 65536
"""Buckets of the gradients' CountSketch when they do not fit in memory: cosines read to ~0.004."""
EVAL_STEP_OFFSET = 1_000_000
"""Rollout seeds of the uphill evaluation: steps far from the gradient's (which use 0, 1, ...)."""


# ----------------------------------------------------------------------------------------------
# The measurements


class GroupGradients:
    """The group gradients, kept one at a time as what the instruments read from them.

    Exact, whatever the size: the count, the sum ``sum g_i`` (float64, P) and ``sum |g_i|^2``, from
    which the signal ``S``, the noise ``V`` and the mean direction follow. For the cosine table, the
    gradients themselves (``sketch=0``), or, when G x P float32 would not fit in memory (the 10B
    model's LoRA), a CountSketch of each (``sketch`` buckets: coordinate i is added with a random
    sign ``s(i)`` to bucket ``h(i)``, both drawn once from ``seed``), whose inner products are
    unbiased estimates of the gradients' (variance ``(|a|^2 |b|^2 + <a, b>^2) / sketch``): a cosine
    is then read to about ``1 / sqrt(sketch)``, and averaging over the pairs of a table row shrinks
    that further.
    """

    def __init__(self, parameters: int, *, sketch: int = 0, seed: int = 0) -> None:
        self.parameters, self.sketch = parameters, sketch
        self.count = 0
        self.total = torch.zeros(parameters, dtype=torch.float64)
        self.square_sum = 0.0
        self.moved = torch.zeros(parameters, dtype=torch.bool)
        self._vectors: list[torch.Tensor] = []
        if sketch:
            generator = torch.Generator().manual_seed(seed)
            self._bucket = torch.randint(sketch, (parameters,), generator=generator)
            self._sign = torch.randint(2, (parameters,), generator=generator).float() * 2 - 1

    def add(self, gradient: torch.Tensor) -> None:
        g = gradient.detach().float().cpu().reshape(-1)
        if g.numel() != self.parameters:
            raise ValueError(f"a gradient of {g.numel()} entries, expected {self.parameters}")
        self.count += 1
        self.total += g.double()
        self.square_sum += float(g.double().square().sum())
        self.moved |= g != 0
        if self.sketch:
            g = torch.zeros(self.sketch).index_add_(0, self._bucket, g * self._sign)
        self._vectors.append(g)

    def signal_and_noise(self) -> tuple[float, float]:
        """Unbiased estimates of ``S = |E g|^2`` and ``V = E|g - E g|^2`` from the G group gradients."""
        count = self.count
        signal = (float(self.total @ self.total) - self.square_sum) / (count * (count - 1))
        return signal, self.square_sum / count - signal

    def mean(self) -> torch.Tensor:
        return (self.total / self.count).float()

    def vectors(self) -> torch.Tensor:
        """(G, P) the gradients, or (G, sketch) their sketches: what the cosine table reads."""
        return torch.stack(self._vectors)


def group_gradients(
    trainer: Trainer, num_groups: int, *, sketch: int = 0, seed: int = 0
) -> tuple[GroupGradients, dict[str, Any]]:
    """The loss gradient of each of ``num_groups`` fresh prompt groups at the current weights (as
    `GroupGradients`), and the rollouts' reward statistics. Rollout calls of
    ``data.prompts_per_step`` prompts, the k-th seeded as training step k (`RolloutScorer.run`)."""
    learner, n = trainer.learner, trainer.config.algorithm.group_size
    grads = GroupGradients(sum(p.numel() for p in learner.params), sketch=sketch, seed=seed)
    rewards: list[float] = []
    zero_spread = 0
    for call in itertools.count():
        if grads.count >= num_groups:
            break
        records = trainer.data.next_batch()
        with learner.sampling_policy():
            batch = trainer.rollout.run(records, group_offset=0, step=call)
        rewards += batch.scores.total.tolist()
        for g in range(len(records)):
            if grads.count >= num_groups:
                break
            rows = list(range(g * n, (g + 1) * n))
            zero_spread += int(bool((batch.advantages[rows] == 0).all()))
            grads.add(learner.gradient(batch, step=call, rows=rows))
        _progress(f"gradients: {grads.count}/{num_groups} groups")
    stats = {
        "images": grads.count * n,
        "reward_mean": sum(rewards) / len(rewards),
        "zero_spread_groups": zero_spread / grads.count,
    }
    return grads, stats


def pairwise_cosine(vectors: torch.Tensor) -> list[float]:
    """The cosines of every pair of rows of ``vectors`` (K, P)."""
    v = vectors.double()
    unit = v / v.norm(dim=1, keepdim=True).clamp_min(1e-300)
    sims = unit @ unit.T
    k = v.shape[0]
    return [float(sims[i, j]) for i in range(k) for j in range(i + 1, k)]


def cosine_table(
    vectors: torch.Tensor, group_size: int, sizes: Sequence[int], signal: float, noise: float
) -> list[dict[str, Any]]:
    """For each batch size (images), the mean pairwise cosine of disjoint batches' gradients
    (``vectors``: the group gradients or their sketches, `GroupGradients.vectors`), and the cosine
    ``S / (S + V / m)`` the signal and noise estimates expect of batches of m groups."""
    rows = []
    for images in sizes:
        m = images // group_size
        k = vectors.shape[0] // m
        row: dict[str, Any] = {"images": images, "groups": m, "batches": k}
        if k >= 2:
            batches = vectors[: k * m].reshape(k, m, -1).mean(dim=1)
            cos = pairwise_cosine(batches)
            row.update(cosine=sum(cos) / len(cos), cosine_min=min(cos), cosine_max=max(cos))
        else:
            row.update(cosine=math.nan, cosine_min=math.nan, cosine_max=math.nan)
        row["cosine_expected"] = signal / (signal + noise / m) if signal > 0 else 0.0
        rows.append(row)
    return rows


def _rewards(trainer: Trainer, groups: list[list], *, first_step: int) -> torch.Tensor:
    """The training reward of every image of ``groups`` (lists of records, one rollout call each)."""
    out = []
    with torch.no_grad(), trainer.learner.sampling_policy():
        for call, records in enumerate(groups):
            batch = trainer.rollout.run(records, group_offset=0, step=first_step + call)
            out.append(batch.scores.total.double().cpu())
    return torch.cat(out)


def _progress(message: str) -> None:
    print(f"  [{time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)


def _shift(params: list[torch.Tensor], direction: torch.Tensor, eps: float) -> None:
    with torch.no_grad():
        offset = 0
        for p in params:
            p.add_(direction[offset : offset + p.numel()].view_as(p).to(p.dtype), alpha=eps)
            offset += p.numel()


def uphill(
    trainer: Trainer, gradient: torch.Tensor, eps_values: Sequence[float], eval_groups: int
) -> dict[str, Any]:
    """Expected reward at the base and at ``+-eps`` along ``-gradient / |gradient|`` (same prompts and
    seeds everywhere), with standard errors; the weights are restored bitwise afterwards."""
    per_call = trainer.config.data.prompts_per_step
    calls = max(1, math.ceil(eval_groups / per_call))
    prompt_calls = [trainer.data.next_batch() for _ in range(calls)]
    params = trainer.learner.params
    saved = [p.detach().clone() for p in params]
    direction = -gradient / gradient.norm()
    base = _rewards(trainer, prompt_calls, first_step=EVAL_STEP_OFFSET)
    _progress(f"uphill: base reward {float(base.mean()):.4f} on {base.numel()} images")
    out: dict[str, Any] = {
        "images": base.numel(),
        "base": float(base.mean()),
        "base_se": float(base.std() / math.sqrt(base.numel())),
        "steps": [],
    }
    try:
        for eps in eps_values:
            side = {}
            for sign in (+1, -1):
                _shift(params, direction, sign * eps)
                side[sign] = _rewards(trainer, prompt_calls, first_step=EVAL_STEP_OFFSET)
                _progress(f"uphill: eps {sign * eps:+.3g}: reward {float(side[sign].mean()):.4f}")
                with torch.no_grad():
                    torch._foreach_copy_([p.detach() for p in params], saved)
            diff = side[1] - side[-1]
            se = float(diff.std() / math.sqrt(diff.numel()))
            margin = float(diff.mean())
            out["steps"].append(
                {
                    "eps": eps,
                    "plus": float(side[1].mean()),
                    "minus": float(side[-1].mean()),
                    "plus_minus_base": float((side[1] - base).mean()),
                    "minus_minus_base": float((side[-1] - base).mean()),
                    "margin": margin,
                    "margin_se": se,
                    "margin_in_se": margin / se
                    if se > 0
                    else math.copysign(math.inf, margin)
                    if margin
                    else 0.0,
                    "uphill": bool(margin > 2 * se),
                }
            )
    finally:
        with torch.no_grad():
            torch._foreach_copy_([p.detach() for p in params], saved)
    return out


def adam_step_length(trainer: Trainer, gradient: torch.Tensor) -> float:
    """The length of AdamW's first step at the recipe's lr: ``lr`` per parameter the gradient moves."""
    moved = int((gradient != 0).sum())
    return trainer.config.optim.lr * math.sqrt(max(moved, 1))


def measure(
    trainer: Trainer,
    *,
    groups: int,
    sizes: Sequence[int],
    eps: Sequence[float],
    eval_groups: int,
    cosine: bool = True,
    run_uphill: bool = True,
    sketch: int | None = None,
    max_store_gib: float = 2.0,
) -> dict[str, Any]:
    """Both instruments on ``trainer``'s recipe at its current weights (nothing is trained).
    ``sketch``: buckets of the CountSketch the cosine table reads (0: the gradients themselves;
    None: those while ``groups`` x P float32 fit in ``max_store_gib``, else `AUTO_SKETCH`)."""
    start = time.perf_counter()
    parameters = sum(p.numel() for p in trainer.learner.params)
    if sketch is None:  # the gradients themselves while they fit in max_store_gib, else a sketch
        sketch = 0 if groups * parameters * 4 <= max_store_gib * 2**30 else AUTO_SKETCH
    grads, rollout = group_gradients(trainer, groups, sketch=sketch, seed=trainer.config.seed)
    n = trainer.config.algorithm.group_size
    signal, noise = grads.signal_and_noise()
    mean_grad = grads.mean()
    result: dict[str, Any] = {
        "rollouts": rollout,
        "parameters": parameters,
        "parameters_moved": int(grads.moved.sum()),
        "cosine_from": f"a CountSketch of {sketch} buckets" if sketch else "the gradients",
        "signal": signal,
        "noise": noise,
        "groups_for_cosine_half": noise / signal if signal > 0 else math.inf,
        "images_for_cosine_half": n * noise / signal if signal > 0 else math.inf,
        "gradient_seconds": time.perf_counter() - start,
    }
    if cosine:
        result["cosine"] = cosine_table(grads.vectors(), n, [s for s in sizes if s // n >= 1], signal, noise)
    if run_uphill:
        unit = adam_step_length(trainer, mean_grad)
        result["adam_step_length"] = unit
        t0 = time.perf_counter()
        result["uphill"] = uphill(trainer, mean_grad, eps, eval_groups)
        for step in result["uphill"]["steps"]:
            step["eps_in_adam_steps"] = step["eps"] / unit
        result["uphill_seconds"] = time.perf_counter() - t0
    return result


# ----------------------------------------------------------------------------------------------
# The command


def build_config(args: argparse.Namespace, run_dir: str) -> TrainerConfig:
    overrides = list(args.set or [])
    base = None
    if args.recipe is None:
        from algorithms_scenes import ALGORITHMS

        base = scenes_task_config()
        if args.learner != "demo":
            overrides = [*ALGORITHMS[args.learner]["overrides"], *overrides]
    overrides += [
        "preflight=false",
        "logging.progress=false",
        f"logging.run_dir={run_dir}",
        "logging.name=gradient_check",
        f"seed={args.seed}",
    ]
    return load_config(args.recipe, overrides, base=base)


def open_trainer(config: TrainerConfig, resume: str | None) -> Trainer:
    """The recipe's trainer, at ``resume`` (a trainer checkpoint: its LoRA, optimizer and data
    position, loaded by the trainer's own resume, which refuses a config that differs from the run's)
    or at the base."""
    if resume and (problem := verify_checkpoint(Path(resume).expanduser(), hashes=False)) is not None:
        # said before the model loads (files and sizes only: the trainer's resume checks the hashes)
        raise CheckpointError(f"--resume {resume} is not an intact checkpoint: {problem}")
    trainer = Trainer(config)
    if resume:
        try:
            trainer.resume(resume)
        except BaseException:
            trainer.close()
            raise
    return trainer


def report(result: dict[str, Any], label: str) -> str:
    lines = [f"== {label}"]
    r = result["rollouts"]
    lines.append(
        f"gradient from {r['images']} images ({result['gradient_seconds']:.0f} s): rollout reward "
        f"{r['reward_mean']:.3f}, groups with no reward spread {r['zero_spread_groups']:.0%}; "
        f"{result['parameters_moved']} of {result['parameters']} parameters moved"
    )
    lines.append(
        f"signal |E g|^2 = {result['signal']:.3g}, noise E|g - E g|^2 per group = {result['noise']:.3g}: "
        f"a cosine of 1/2 needs ~{result['images_for_cosine_half']:.0f} images per batch; "
        f"cosines from {result['cosine_from']}"
    )
    if "cosine" in result:
        rows = [
            (
                str(c["images"]),
                str(c["batches"]),
                f"{c['cosine']:+.3f}",
                f"{c['cosine_min']:+.3f}..{c['cosine_max']:+.3f}",
                f"{c['cosine_expected']:+.3f}",
            )
            for c in result["cosine"]
        ]
        lines.append(table(rows, ("images/batch", "batches", "mean cosine", "range", "expected S/(S+V/m)")))
    if "uphill" in result:
        u = result["uphill"]
        lines.append(
            f"uphill on {u['images']} same-seed rollouts ({result['uphill_seconds']:.0f} s): base reward "
            f"{u['base']:.4f} (se {u['base_se']:.4f}); one AdamW step at the lr is {result['adam_step_length']:.3g} long"
        )
        rows = [
            (
                f"{s['eps']:g} ({s['eps_in_adam_steps']:.2g})",
                f"{s['plus']:.4f}",
                f"{s['minus']:.4f}",
                f"{s['margin']:+.4f} ({s['margin_se']:.4f})",
                f"{s['margin_in_se']:+.1f}",
                "yes" if s["uphill"] else "no",
            )
            for s in u["steps"]
        ]
        lines.append(
            table(
                rows,
                ("eps (AdamW steps)", "reward +eps", "reward -eps", "margin (se)", "in se", "uphill > 2 se"),
            )
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "recipe",
        nargs="?",
        help="a trainer recipe (YAML); default: the scenes task's config (scenes_task_config)",
    )
    parser.add_argument(
        "--learner",
        default="demo",
        choices=["demo", "flow_grpo", "grpo_guard", "diffusion_nft", "awm"],
        help="without a recipe: 'demo' is the scenes task's settings (the first demo's, scenes_quick.yaml; "
        "today's demo is examples/tiny_scenes/scenes_demo.yaml), or a learner's settings of the scenes comparison",
    )
    parser.add_argument("--set", action="append", metavar="KEY=VALUE", help="a config override (repeatable)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--resume",
        metavar="CHECKPOINT",
        help="measure at this trainer checkpoint (its trained LoRA and data position), as `trainer "
        "resume=...` would continue it; the recipe, --set and --seed must be the run's (the trainer's "
        "resume check names any difference); default: the base model",
    )
    parser.add_argument(
        "--groups", type=int, default=128, help="prompt groups for the gradients (>= 1024 images)"
    )
    parser.add_argument("--sizes", default="16,64,256", help="batch sizes (images) of the cosine table")
    parser.add_argument(
        "--eval-groups", type=int, default=64, help="prompt groups per side of the uphill check"
    )
    parser.add_argument("--eps", default="0.25,0.75", help="step lengths (L2 norm over the LoRA parameters)")
    parser.add_argument("--no-uphill", action="store_true", help="only the cosine table")
    parser.add_argument(
        "--sketch",
        type=int,
        default=None,
        help="read the cosine table from a CountSketch of this many buckets per gradient (0: the "
        f"gradients; default: those while --groups x parameters float32 fit in --max-store-gib, else {AUTO_SKETCH})",
    )
    parser.add_argument(
        "--max-store-gib", type=float, default=2.0, help="memory for the gradients themselves (default 2)"
    )
    parser.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    parser.add_argument("--json", help="write the figures here")
    parser.add_argument("--quick", action="store_true", help="a smoke run: few groups, one eps")
    args = parser.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.quick:
        args.groups, args.eval_groups, args.sizes, args.eps = 4, 2, "8,16", "0.5"
    sizes = [int(s) for s in args.sizes.split(",")]
    eps = [float(s) for s in args.eps.split(",")]
    with tempfile.TemporaryDirectory() as run_dir:
        config = build_config(args, run_dir)
        try:
            trainer = open_trainer(config, args.resume)
        except CheckpointError as error:  # not a checkpoint, or one of another run's config
            raise SystemExit(f"gradient_check: {error}") from None
        try:
            result = measure(
                trainer,
                groups=args.groups,
                sizes=sizes,
                eps=eps,
                eval_groups=args.eval_groups,
                run_uphill=not args.no_uphill,
                sketch=args.sketch,
                max_store_gib=args.max_store_gib,
            )
        finally:
            trainer.close()
    a = config.algorithm
    label = (
        f"{args.recipe or 'scenes demo'} / {args.learner if args.recipe is None else a.name} "
        f"({a.name}{'/' + a.loss if a.name == 'flow_grpo' else ''}, lr {config.optim.lr:g}, "
        f"group {a.group_size}, seed {args.seed}"
        f"{', at ' + args.resume if args.resume else ', at the base'})"
    )
    print(report(result, label))
    figures = {
        "label": label,
        "recipe": args.recipe,
        "learner": args.learner,
        "overrides": args.set or [],
        "seed": args.seed,
        "resume": args.resume,
        "environment": environment(),
        **result,
    }
    write_json(args.json, figures)
    return figures


if __name__ == "__main__":
    main()
