"""FlowGRPO (``algorithm.name=flow_grpo``): the policy gradient on the rollout's SDE transitions.

Every window step ``k`` of a micro-batch is recomputed through the same step function as the
rollout (`TransitionRecompute.step_stats`) and contributes ``PPO-clip(exp(log p - log p_old), A)`` or
GRPO-Guard's loss (``algorithm.loss``), plus ``kl_coef`` times the KL to the reference (base) model
(``algorithm.kl_kind``), to a mean over the mini-batch's samples and the window's steps. The
`Learner` runs the mini-batches, the backward of each term and the optimizer steps.

Nothing inside the loops over micro-batches and window steps is read back from the device; the
on-policy checks (the first optimizer step's recomputed log-prob against the rollout's, and the share
of its ratios the clip acted on) stay on the device until the update's metrics are read.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import TYPE_CHECKING

import torch

from boogu_trainer.algorithms.base import Algorithm, Term
from boogu_trainer.losses import grpo_guard_loss, kl_to_reference, policy_loss

if TYPE_CHECKING:
    from boogu_adapters.recompute import StepStats
    from boogu_adapters.types import Trajectory
    from boogu_trainer.losses import PolicyLoss
    from boogu_trainer.scoring import ScoredBatch


class FlowGRPO(Algorithm):
    """PPO-clip (``algorithm.loss=ppo_clip``) or GRPO-Guard (``grpo_guard``) per window step."""

    name = "flow_grpo"
    reads_rollout_logprobs = True

    def begin(self, batch: ScoredBatch, step: int) -> None:
        self.logprob_diff: list[torch.Tensor | None] = [None] * batch.trajectory.window_size
        """Per window step: max |log p - log p_rollout| over the first optimizer step's rows (0-d)."""
        self.clipped_first: torch.Tensor | None = None
        """The first optimizer step's clipped ratios, summed over its rows and window steps (0-d)."""
        self.rows_first = 0
        """That step's rows times window steps."""

    def num_terms(self, batch: ScoredBatch) -> int:
        return batch.trajectory.window_size

    def losses(
        self, batch: ScoredBatch, advantages: torch.Tensor, chunk: list[int], *, first: bool
    ) -> Iterator[Term]:
        a, policy = self.config, self.policy
        recompute = policy.recompute
        traj = batch.trajectory
        chunk_advantages = recompute.rows(advantages, chunk)
        for k in range(traj.window_size):
            stats = recompute.step_stats(policy.transformer, traj, k, index=chunk)
            step = recompute.rows(traj.step_index, chunk)[:, k]
            dt = traj.sigmas[step + 1] - traj.sigmas[step]
            pl = self.objective(stats, traj, k, chunk, chunk_advantages, dt)
            if first:
                # Before any update the recomputed log-prob must equal the rollout's, and the clip must
                # act on nothing (the on-policy checks, `boogu_trainer.onpolicy`).
                old = recompute.rows(traj.log_prob, chunk)[:, k]
                diff = (stats.log_prob.detach() - old).abs().max()
                previous = self.logprob_diff[k]
                self.logprob_diff[k] = diff if previous is None else torch.maximum(previous, diff)
                clipped = pl.metrics["clipfrac"] * len(chunk)
                self.clipped_first = clipped if self.clipped_first is None else self.clipped_first + clipped
                self.rows_first += len(chunk)
            loss, kl = pl.loss, None
            if a.kl_coef > 0:
                with torch.no_grad(), policy.count_as("reference"):
                    ref = recompute.step_stats(policy.transformer, traj, k, index=chunk, use_adapters=False)
                kl = kl_to_reference(stats.mean, ref.mean, stats.std, dt, a.kl_kind, traj.sampler).mean()
                loss = loss + a.kl_coef * kl
            yield Term(loss, pl, kl)

    def objective(
        self,
        stats: StepStats,
        traj: Trajectory,
        k: int,
        chunk: list[int],
        advantages: torch.Tensor,
        dt: torch.Tensor,
    ) -> PolicyLoss:
        """The clipped objective of window step ``k`` on the rows ``chunk`` (``algorithm.loss``), from the
        recomputed ``stats`` against the rollout's; ``advantages``, ``dt``: (b,). The preflight scores
        its probe with it too."""
        a, recompute = self.config, self.policy.recompute
        old = recompute.rows(traj.log_prob, chunk)[:, k]
        if a.loss == "grpo_guard":
            old_mean = recompute.rows(traj.mean, chunk)[:, k]
            return grpo_guard_loss(
                stats.log_prob,
                old,
                stats.mean,
                old_mean,
                stats.std,
                dt,
                advantages,
                a.clip_range,
                sampler=traj.sampler,
            )
        return policy_loss(stats.log_prob, old, advantages, a.clip_range)

    def metrics(self) -> dict[str, torch.Tensor | float]:
        """The first optimizer step's on-policy checks (the `Learner` reports their max over ranks)."""
        out: dict[str, torch.Tensor | float] = {
            f"logprob_diff/step{k}": 0.0 if d is None else d for k, d in enumerate(self.logprob_diff)
        }
        if self.clipped_first is not None:
            out["clipfrac_first"] = self.clipped_first / self.rows_first
        return out


__all__ = ["FlowGRPO"]
