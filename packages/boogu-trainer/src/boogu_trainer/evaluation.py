"""Evaluation: deterministic (ODE) samples of held-out prompts with a fixed seed, scored by the rewards.

It uses ``eval.num_steps`` steps, so its curve is comparable across training steps but not with the
training reward (rollouts use ``sampler.num_steps`` and SDE noise). The prompts are split over the
ranks by stride; every rank gets the same number of slots (the last ones padded with a repeat of
the first prompt, whose result is dropped), because the model's forwards are FSDP collectives that
every rank must join equally often.
"""

from __future__ import annotations

import math

import torch

from boogu_adapters.rollout import LocalRolloutEngine
from boogu_adapters.types import RolloutRequest
from boogu_data import PromptRecord
from boogu_schedule import WindowPlan
from boogu_trainer.config import TrainerConfig
from boogu_trainer.distributed import DistEnv
from boogu_trainer.rewards import WeightedRewards


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
        noise_level=0.0,
        window=WindowPlan(kind="fixed", size=0, start=0),
        height=height,
        width=width,
        seed=seed,
        group_offset=group_offset,
    )


class Evaluator:
    def __init__(
        self,
        config: TrainerConfig,
        engine: LocalRolloutEngine,
        rewards: WeightedRewards,
        dist: DistEnv,
        records: list[PromptRecord],
    ):
        self.config = config
        self.engine = engine
        self.rewards = rewards
        self.dist = dist
        self.records = records[: config.eval.num_prompts]

    def due(self, step: int) -> bool:
        every = self.config.eval.every
        return bool(every and self.records and (step % every == 0 or step == self.config.total_steps))

    @torch.no_grad()
    def run(self) -> dict[str, float]:
        slots = self.dist.padded_share(len(self.records))
        records = [self.records[0 if i is None else i] for i in slots]
        s = self.config.sampler
        request = deterministic_request(
            records,
            num_steps=self.config.eval.num_steps,
            guidance_scale=s.guidance_scale,
            height=s.height,
            width=s.width,
            seed=self.config.seed,
        )
        with self.dist.collective("evaluation"):
            traj = self.engine.generate(request)
        scores = self.rewards(traj.images, records, micro_batch_size=self.config.rollout.micro_batch_size)
        valid = torch.tensor([i is not None for i in slots])
        keep = self.dist.all_gather_cat(valid, "gather evaluation slots")
        out = {}
        for name, v in {"reward": scores.total, **scores.per_reward}.items():
            v = self.dist.all_gather_cat(v.float(), f"gather evaluation {name!r}")[keep]
            v = v[torch.isfinite(v)]
            out[f"eval/{name}/mean"] = float(v.mean()) if v.numel() else math.nan
        out["eval/prompts"] = int(keep.sum())
        return out
