"""Evaluation: deterministic (ODE) samples of held-out prompts with a fixed seed, scored by the rewards,
and the "gold" score that catches reward hacking.

It uses ``eval.num_steps`` steps, so its curve is comparable across training steps but not with the
training reward (rollouts use ``sampler.num_steps`` and SDE noise). The prompts are split over the
ranks by stride; every rank gets the same number of slots (the last ones padded with a repeat of
the first prompt, whose result is dropped), because the model's forwards are FSDP collectives that
every rank must join equally often.

Gold score: the weighted total of ``eval.rewards`` (held-out rewards the policy never trains on;
empty: the training rewards) averaged over the evaluation prompts, logged as ``eval/gold`` with
``eval/<label>/mean`` per gold reward (and ``eval/reward/mean``, the training rewards' total on the
same images). `GoldTracker` keeps the best gold score (for ``checkpoint.keep_best``) and detects
divergence: the training reward (the mean ``reward/mean`` of the steps since the previous
evaluation) rose while the gold score fell, over each of ``eval.stop_on_divergence`` consecutive
evaluations. Rank 0 writes ``eval/step_XXXXXX/``: each prompt's image (``prompt_000.png``, ...),
``scores.json`` (per prompt and reward) and ``grid.png``, the first evaluation's images ("before")
above this one's ("after"), same prompts and seeds.
"""

from __future__ import annotations

import json
import logging
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
from PIL import Image

from boogu_adapters.engines import LocalRolloutEngine
from boogu_adapters.types import RolloutRequest
from boogu_data import PromptRecord
from boogu_data.atomic import atomic_file, atomic_write_text
from boogu_schedule import WindowPlan
from boogu_trainer.checkpoint import seeded_global_rngs
from boogu_trainer.config import EvalConfig, SamplerConfig
from boogu_trainer.distributed import DistEnv
from boogu_trainer.metrics import sample_grid
from boogu_trainer.rewards import WeightedRewards, build_rewards

logger = logging.getLogger("boogu_trainer")

EVAL_DIR = "eval"


def deterministic_request(
    records: list[PromptRecord],
    *,
    num_steps: int,
    guidance_scale: float,
    height: int,
    width: int,
    seed: int,
    group_size: int = 1,
    group_offset: int = 0,
    image_guidance_scale: float = 1.0,
) -> RolloutRequest:
    """The evaluation path: ODE steps only (an empty SDE window, noise level 0), decoded images.

    Group ``g`` of the request draws its initial noise from stream ``(seed, group_offset + g)``, so
    ``boogu-sample`` and evaluation give the same image for the same prompt, seed and position.
    """
    return RolloutRequest(
        records=records,
        group_size=group_size,
        num_steps=num_steps,
        guidance_scale=guidance_scale,
        image_guidance_scale=image_guidance_scale,
        noise_level=0.0,
        window=WindowPlan(kind="fixed", size=0, start=0),
        height=height,
        width=width,
        seed=seed,
        group_offset=group_offset,
    )


@dataclass
class EvalResult:
    """One evaluation, the same on every rank (gathered)."""

    step: int
    metrics: dict[str, float]
    """``eval/gold``, ``eval/<label>/mean``, ``eval/reward/mean``, ``eval/prompts``."""
    gold: float
    prompts: list[dict[str, Any]]
    """Per evaluation prompt, in prompt order: index, prompt, ground truth, gold and training totals,
    each reward's score."""
    images: torch.Tensor | None
    """(P, 3, H, W) uint8 in prompt order (None if the engine decoded none)."""


class Evaluator:
    """Deterministic samples of the validation prompts (``eval.*``, at the ``sampler.*`` size and CFG
    unless ``eval.guidance_scale`` sets the CFG),
    scored by the training rewards and the gold ones."""

    def __init__(
        self,
        eval_config: EvalConfig,
        sampler: SamplerConfig,
        engine: LocalRolloutEngine,
        rewards: WeightedRewards,
        dist: DistEnv,
        records: list[PromptRecord],
        *,
        seed: int,
        total_steps: int,
        micro_batch_size: int = 0,
        gold_rewards: WeightedRewards | None = None,
    ):
        self.eval_config = eval_config
        self.sampler = sampler
        self.seed = seed
        self.total_steps = total_steps
        self.micro_batch_size = micro_batch_size
        """``rollout.micro_batch_size``: rows per reward call (0: the whole batch)."""
        config = eval_config
        self.engine = engine
        self.rewards = rewards
        self.dist = dist
        self.records = records[: config.num_prompts]
        self.separate_gold = bool(config.rewards)
        """True when ``eval.rewards`` names held-out rewards (else the gold score is the training rewards')."""
        if gold_rewards is None:
            gold_rewards = build_rewards(config.rewards) if self.separate_gold else rewards
        self.gold_rewards = gold_rewards
        self._before: tuple[int, torch.Tensor] | None = None
        self._first_rows: list[dict[str, Any]] = []

    @property
    def guidance_scale(self) -> float:
        """The evaluation's CFG: ``eval.guidance_scale``, else the rollouts' ``sampler.guidance_scale``."""
        g = self.eval_config.guidance_scale
        return self.sampler.guidance_scale if g is None else g

    @property
    def image_guidance_scale(self) -> float:
        """The evaluation's image guidance (edit rows): ``eval.image_guidance_scale``, else the
        rollouts' ``sampler.image_guidance_scale``."""
        g = self.eval_config.image_guidance_scale
        return self.sampler.image_guidance_scale if g is None else g

    def due(self, step: int) -> bool:
        every = self.eval_config.every
        return bool(every and self.records and (step % every == 0 or step == self.total_steps))

    def run(self) -> dict[str, float]:
        """The evaluation's metrics (``eval/...``); see `evaluate` for everything."""
        return self.evaluate().metrics

    @torch.no_grad()
    def evaluate(self, step: int = 0) -> EvalResult:
        slots = self.dist.padded_share(len(self.records))
        records = [self.records[0 if i is None else i] for i in slots]
        s = self.sampler
        # Prompt i draws its noise from stream (seed, i) on any rank and any number of ranks: this
        # rank's slots are the contiguous block starting at slots[0] (fillers after the last prompt).
        request = deterministic_request(
            records,
            num_steps=self.eval_config.num_steps,
            guidance_scale=self.guidance_scale,
            image_guidance_scale=self.image_guidance_scale,
            height=s.height,
            width=s.width,
            seed=self.seed,
            group_offset=self.dist.rank * len(slots),
        )
        with self.dist.collective("evaluation"):
            traj = self.engine.generate(request)
        mb = self.micro_batch_size
        # The rewards draw from global RNG states of their own (a user's reward may draw from them):
        # the same numbers at every evaluation, and training's stream untouched (docs/reliability.md).
        with seeded_global_rngs(self.seed, self.dist.device):
            train = self.rewards(traj.images, records, micro_batch_size=mb)
            gold = (
                self.gold_rewards(traj.images, records, micro_batch_size=mb) if self.separate_gold else train
            )
        # Gathered like the training rewards (equal shapes on every rank: the slots are padded).
        slot = self.dist.all_gather_cat(
            torch.tensor([-1 if i is None else i for i in slots], device=self.dist.device),
            "gather evaluation slots",
        )
        columns = {"__gold__": gold.total, "__reward__": train.total, **train.per_reward, **gold.per_reward}
        values = {
            k: self.dist.all_gather_cat(v.float(), f"gather evaluation {k!r}").tolist()
            for k, v in columns.items()
        }
        images_all = None
        if traj.images is not None:
            images_all = self.dist.all_gather_cat(traj.images, "gather evaluation images").cpu()
        gathered = []
        for j, index in enumerate(slot.tolist()):
            if index < 0:
                continue  # a filler slot
            scores = {k: v[j] for k, v in values.items() if not k.startswith("__")}
            image = None if images_all is None else images_all[j]
            gathered.append((index, values["__gold__"][j], values["__reward__"][j], scores, image))
        gathered.sort(key=lambda row: row[0])

        def mean(values: list[float]) -> float:
            finite = [v for v in values if math.isfinite(v)]
            return sum(finite) / len(finite) if finite else math.nan

        out = {"eval/reward/mean": mean([row[2] for row in gathered])}
        labels = list(self.gold_rewards.labels if self.separate_gold else self.rewards.labels)
        for label in labels:
            out[f"eval/{label}/mean"] = mean([row[3][label] for row in gathered])
        out["eval/gold"] = mean([row[1] for row in gathered])
        out["eval/prompts"] = len(gathered)
        prompts = [
            {
                "index": index,
                "image": f"prompt_{index:03d}.png",
                "prompt": self.records[index].instruction,
                "ground_truth": self.records[index].ground_truth,
                "gold": g,
                "reward": r,
                "scores": scores,
            }
            for index, g, r, scores, _ in gathered
        ]
        images = None
        if gathered and all(row[4] is not None for row in gathered):
            images = torch.stack([row[4] for row in gathered])
        return EvalResult(step=step, metrics=out, gold=out["eval/gold"], prompts=prompts, images=images)

    def write(self, result: EvalResult, run_dir: Path) -> Path:
        """Rank 0: ``run_dir/eval/step_XXXXXX/`` with the images, ``scores.json`` and ``grid.png``."""
        folder = run_dir / EVAL_DIR / f"step_{result.step:06d}"
        if not self.dist.is_main:
            return folder
        folder.mkdir(parents=True, exist_ok=True)
        if result.images is not None:
            for row, image in zip(result.prompts, result.images):
                with atomic_file(folder / row["image"]) as tmp:
                    Image.fromarray(image.permute(1, 2, 0).numpy()).save(tmp, format="PNG")
            before = self._before_images(run_dir, result)
            if before is not None:
                first_step, first = before
                n = len(result.prompts)
                captions = [f"before (step {first_step}) | gold={r['gold']:.3f}" for r in self._first_rows]
                captions += [f"after (step {result.step}) | gold={r['gold']:.3f}" for r in result.prompts]
                sample_grid(
                    torch.cat([first, result.images]), captions, folder / "grid.png", columns=n, cell=128
                )
        summary = {
            "step": result.step,
            "gold": result.gold,
            "gold_rewards": list(self.gold_rewards.weights.items()) if self.separate_gold else None,
            "training_rewards": list(self.rewards.weights.items()),
            "metrics": result.metrics,
            "prompts": result.prompts,
        }
        atomic_write_text(folder / "scores.json", json.dumps(summary, indent=2) + "\n")
        return folder

    def _before_images(self, run_dir: Path, result: EvalResult) -> tuple[int, torch.Tensor] | None:
        """The first evaluation's images for the grid: kept from this process, or read back from the
        earliest ``eval/step_*`` folder on disk (after a resume); this one's if it is the first."""
        if self._before is None:
            self._before, self._first_rows = self._read_first(run_dir, result)
        step, images = self._before
        return (step, images) if images.shape == result.images.shape else None

    def _read_first(self, run_dir: Path, result: EvalResult):
        for folder in sorted((run_dir / EVAL_DIR).glob("step_*")):
            try:
                step = int(folder.name.removeprefix("step_"))
                saved = json.loads((folder / "scores.json").read_text())
                if step >= result.step or [r["index"] for r in saved["prompts"]] != [
                    r["index"] for r in result.prompts
                ]:
                    continue
                images = torch.stack(
                    [
                        torch.from_numpy(np.array(Image.open(folder / r["image"]).convert("RGB"))).permute(
                            2, 0, 1
                        )
                        for r in saved["prompts"]
                    ]
                )
                return (step, images), saved["prompts"]
            except (OSError, ValueError, KeyError):
                continue
        return (result.step, result.images.clone()), result.prompts


@dataclass
class Verdict:
    """What one evaluation means for the run."""

    new_best: bool
    diverging: bool
    message: str = ""


@dataclass
class GoldTracker:
    """The best gold score so far and the train-up/gold-down streak; its state is in trainer_state.

    ``observe_step`` takes each step's ``reward/mean``; ``evaluation`` compares this evaluation's
    gold score and the mean training reward since the previous one with that previous one's.
    """

    k: int = 0
    best: dict[str, Any] | None = None
    """``{"step", "gold", "folder"}`` of the best finite gold score so far."""
    evals: list[dict[str, float]] = field(default_factory=list)
    """The last ``k + 1`` evaluations: ``{"step", "train", "gold"}``."""
    streak: int = 0
    train_sum: float = 0.0
    train_count: int = 0

    def observe_step(self, reward_mean: float) -> None:
        if math.isfinite(reward_mean):
            self.train_sum += reward_mean
            self.train_count += 1

    def evaluation(self, step: int, gold: float, folder: str) -> Verdict:
        train = self.train_sum / self.train_count if self.train_count else math.nan
        self.train_sum, self.train_count = 0.0, 0
        previous = self.evals[-1] if self.evals else None
        self.evals = [*self.evals, {"step": step, "train": train, "gold": gold}][-(self.k + 1) :]
        if previous is not None and train > previous["train"] and gold < previous["gold"]:
            self.streak += 1  # NaN compares False: a missing value breaks the streak
        else:
            self.streak = 0
        new_best = math.isfinite(gold) and (self.best is None or gold > self.best["gold"])
        if new_best:
            self.best = {"step": step, "gold": gold, "folder": folder}
        diverging = self.k > 0 and self.streak >= self.k
        message = ""
        if diverging:
            seen = self.evals[-(self.k + 1) :]
            steps = ", ".join(str(int(e["step"])) for e in seen)
            trains = " -> ".join(f"{e['train']:.4f}" for e in seen)
            golds = " -> ".join(f"{e['gold']:.4f}" for e in seen)
            message = (
                f"step {step}: the training reward rose ({trains}) while the gold evaluation score fell "
                f"({golds}) over {self.streak} consecutive evaluations (steps {steps}; "
                f"eval.stop_on_divergence={self.k}): the policy is likely exploiting the training rewards"
            )
        return Verdict(new_best=new_best, diverging=diverging, message=message)

    def state_dict(self) -> dict[str, Any]:
        return {
            "best": self.best,
            "evals": self.evals,
            "streak": self.streak,
            "train_sum": self.train_sum,
            "train_count": self.train_count,
        }

    def load_state_dict(self, state: dict[str, Any] | None) -> None:
        state = state or {}
        self.best = state.get("best")
        self.evals = list(state.get("evals", []))[-(self.k + 1) :]
        self.streak = int(state.get("streak", 0))
        self.train_sum = float(state.get("train_sum", 0.0))
        self.train_count = int(state.get("train_count", 0))
