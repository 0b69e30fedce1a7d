"""Rollout and scoring: prompts in, a scored batch with group-normalised advantages out.

`RolloutScorer` is the one place that turns the sampler config into a `RolloutRequest` (the
config has already checked sizes and windows when it loaded), runs the engine on this rank's
prompt groups, scores the images, gathers the rewards of every rank and normalises them within
groups (`compute_advantages`). Every rank ends with the same global statistics and its own
slice of advantages.
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass
from typing import Any

import torch

from boogu_adapters.engines import LocalRolloutEngine
from boogu_adapters.types import RolloutRequest, Trajectory
from boogu_data import PromptRecord
from boogu_schedule import derive_seed
from boogu_trainer.advantages import Advantages, compute_advantages
from boogu_trainer.config import AlgorithmConfig, SamplerConfig
from boogu_trainer.distributed import DistEnv
from boogu_trainer.rewards import RewardOutput, WeightedRewards

logger = logging.getLogger("boogu_trainer")


@dataclass(frozen=True)
class ScoredBatch:
    """One step's rollouts on this rank, scored, with advantages from the whole global batch."""

    trajectory: Trajectory
    records: list[PromptRecord]
    """This rank's prompts (one per group)."""
    scores: RewardOutput
    """This rank's rewards, as scored."""
    advantages: torch.Tensor
    """(b,) float32 on the device: this rank's samples' advantages (0 where the reward was not finite)."""
    finite: torch.Tensor
    """(b,) bool: this rank's samples with finite rewards."""
    global_advantages: Advantages
    """The whole batch's advantages and rewards (same on every rank)."""
    metrics: dict[str, Any]
    """Reward statistics, advantage statistics, encoder counters of the step."""


@dataclass(frozen=True)
class SampledBatch:
    """One step's rollouts on this rank with their rewards, before any collective (`RolloutScorer.sample`)."""

    trajectory: Trajectory
    records: list[PromptRecord]
    scores: RewardOutput
    group_offset: int
    """The global index of this rank's first group."""
    step: int
    """The training step (0-based) whose seeds drew the rollout."""
    encoded: tuple[int, int, float]
    """Prompts and negatives the engine encoded for it, and the seconds that took."""


class RolloutScorer:
    """Rolls out prompt groups with the engine and scores them with the rewards."""

    def __init__(
        self,
        sampler: SamplerConfig,
        algorithm: AlgorithmConfig,
        engine: LocalRolloutEngine,
        rewards: WeightedRewards,
        dist: DistEnv,
        device: torch.device,
        *,
        seed: int,
        micro_batch_size: int = 0,
    ):
        self.sampler = sampler
        self.algorithm = algorithm
        """Group size and the advantage settings (``algorithm.*``)."""
        self.seed = seed
        self.micro_batch_size = micro_batch_size
        """``rollout.micro_batch_size``: rows per reward call (0: the whole batch)."""
        self.engine = engine
        self.rewards = rewards
        self.dist = dist
        self.device = device
        self.window = sampler.window_plan

    def request(self, records: list[PromptRecord], group_offset: int, step: int) -> RolloutRequest:
        s = self.sampler
        return RolloutRequest(
            records=records,
            group_size=self.algorithm.group_size,
            num_steps=s.num_steps,
            guidance_scale=s.guidance_scale,
            image_guidance_scale=s.image_guidance_scale,
            sampler=s.sampler,
            noise_level=s.noise_level,
            window=self.window,
            height=s.height,
            width=s.width,
            seed=derive_seed(self.seed, "rollout", step),
            group_offset=group_offset,
            iteration=step,
            decode=True,
        )

    def run(self, records: list[PromptRecord], group_offset: int, step: int) -> ScoredBatch:
        """Roll out ``records`` (this rank's groups, the first being global group ``group_offset``)."""
        return self.finish(self.sample(records, group_offset, step))

    def sample(self, records: list[PromptRecord], group_offset: int, step: int) -> SampledBatch:
        """The rank-local half of `run`: the engine's rollout and the rewards, no collective (so it may
        run on another thread while the update runs: ``rollout.pipeline=one_step``)."""
        stats = self.engine.stats
        before = (stats.prompts_encoded, stats.negatives_encoded, stats.seconds.get("encode", 0.0))
        traj = self.engine.generate(self.request(records, group_offset, step))
        n = self.algorithm.group_size
        scores = self.rewards(
            traj.images,
            [r for r in records for _ in range(n)],
            micro_batch_size=self.micro_batch_size,
        )
        encoded = (
            stats.prompts_encoded - before[0],
            stats.negatives_encoded - before[1],
            stats.seconds.get("encode", 0.0) - before[2],
        )
        return SampledBatch(traj, records, scores, group_offset, step, encoded)

    def finish(self, sampled: SampledBatch) -> ScoredBatch:
        """The collective half of `run`: every rank's rewards gathered, group advantages, the metrics."""
        traj, records, scores, group_offset, step = (
            sampled.trajectory,
            sampled.records,
            sampled.scores,
            sampled.group_offset,
            sampled.step,
        )
        n = self.algorithm.group_size
        per_reward = {
            k: self.dist.all_gather_cat(v.float(), f"gather reward {k!r}")
            for k, v in scores.per_reward.items()
        }
        group_id = self.dist.all_gather_cat(traj.group_id, "gather group ids")
        a = self.algorithm
        adv = compute_advantages(
            per_reward,
            self.rewards.weights,
            group_id,
            std_scope=a.std_scope,
            normalize_std=a.normalize_std,
            eps=a.adv_eps,
            clip=a.adv_clip,
            per_reward_normalization=a.per_reward_normalization,
            sign=a.advantage_sign,
        )
        lo, hi = group_offset * n, (group_offset + len(records)) * n
        counts = torch.tensor(
            [
                sampled.encoded[0],
                sampled.encoded[1],
                sum(r.ref_image is not None for r in records) * n,
                len(records),
            ],
            dtype=torch.float64,
            device=self.dist.device,
        )
        counts = self.dist.all_reduce_sum(counts, "sum encoder counters").tolist()  # one host read
        metrics = reward_metrics({"reward": adv.rewards, **per_reward}, group_id=group_id)
        metrics.update(adv.stats())
        metrics.update(
            {
                "prompt_encodings_per_prompt": counts[0] / counts[3],
                "negative_encodings": int(counts[1]),
                "edit_samples": int(counts[2]),
                "samples": int(counts[3]) * n,
                "time/encode": sampled.encoded[2],
            }
        )
        if not bool(adv.finite.all()):
            logger.warning(
                "step %d: %d samples with non-finite rewards get no gradient",
                step + 1,
                int((~adv.finite).sum()),
            )
        return ScoredBatch(
            trajectory=traj,
            records=records,
            scores=scores,
            advantages=adv.advantages[lo:hi].to(self.device),
            finite=adv.finite[lo:hi],
            global_advantages=adv,
            metrics=metrics,
        )


def reward_metrics(
    rewards: dict[str, torch.Tensor], group_id: torch.Tensor | None = None
) -> dict[str, float]:
    """Per-reward statistics of one step's (B,) rewards, so a user sees one reward eating another.

    * ``<name>/mean``, ``<name>/std`` over the finite entries of each reward (NaN if none);
    * ``<name>/zero_std_share`` (with ``group_id``): the share of groups (with a finite score) whose
      finite scores for that reward are all equal, i.e. that reward gives those groups no signal;
    * ``reward_corr/<a>~<b>``: the Pearson correlation of each pair of rewards other than the total
      ``"reward"`` over the samples where both are finite (NaN with fewer than 2 such samples or a
      constant reward). With a single reward there is no pair, so nothing is added.
    """
    out: dict[str, float] = {}
    for name, v in rewards.items():
        finite = v[torch.isfinite(v)]
        out[f"{name}/mean"] = float(finite.mean()) if finite.numel() else math.nan
        out[f"{name}/std"] = float(finite.std(unbiased=False)) if finite.numel() else math.nan
        if group_id is not None:
            out[f"{name}/zero_std_share"] = zero_std_share(v, group_id)
    names = [n for n in rewards if n != "reward"]
    for i, a in enumerate(names):
        for b in names[i + 1 :]:
            out[f"reward_corr/{a}~{b}"] = pearson(rewards[a], rewards[b])
    return out


def zero_std_share(values: torch.Tensor, group_id: torch.Tensor) -> float:
    """Share of the groups with a finite score whose finite scores are all equal (NaN: no such group)."""
    values, group_id = values.double().cpu(), group_id.long().cpu()
    ok = torch.isfinite(values)
    if not bool(ok.any()):
        return math.nan
    v, g = values[ok], group_id[ok]
    groups = int(group_id.max()) + 1
    big = torch.full((groups,), -math.inf, dtype=torch.float64).scatter_reduce(0, g, v, "amax")
    small = torch.full((groups,), math.inf, dtype=torch.float64).scatter_reduce(0, g, v, "amin")
    present = torch.zeros(groups, dtype=torch.bool).index_fill_(0, g, True)
    return float((big[present] == small[present]).double().mean())


def pearson(a: torch.Tensor, b: torch.Tensor) -> float:
    """Pearson correlation of two (B,) rewards over the samples where both are finite (NaN if undefined)."""
    a, b = a.double().cpu(), b.double().cpu()
    ok = torch.isfinite(a) & torch.isfinite(b)
    if int(ok.sum()) < 2:
        return math.nan
    x, y = a[ok] - a[ok].mean(), b[ok] - b[ok].mean()
    denom = float((x.square().sum() * y.square().sum()).sqrt())
    return float((x * y).sum()) / denom if denom > 0 else math.nan
