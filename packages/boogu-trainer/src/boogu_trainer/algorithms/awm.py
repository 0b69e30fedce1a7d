"""AWM (``algorithm.name=awm``; Xue et al. 2025): the advantage-weighted flow-matching loss.

On re-noised clean samples (`algorithms.renoise`), ``log p = -mean((v - (x0 - eps))^2)`` and
``ratio = exp(log p - log p_old)``; the loss is ``mean(-A ratio)``, or PPO-clipped with
``algorithm.awm.clip_range`` (`losses.awm_loss`). Without the clip the ratio is held at 1 at every
optimizer step, so no old log-probs are computed; with it they are the trust region's.
"""

from __future__ import annotations

import torch

from boogu_trainer.algorithms.renoise import ForwardProcessAlgorithm
from boogu_trainer.losses import PolicyLoss, awm_log_prob, awm_loss


class AWM(ForwardProcessAlgorithm):
    """AWM's loss per noise level; its old log-probs only with ``awm.clip_range``."""

    name = "awm"

    def own_old_values(self, first: bool) -> bool:
        # Plain AWM (no clip): the ratio is 1 at every optimizer step, so no old values at all.
        return self.config.awm.clip_range is None or first

    def old_value(self, velocity: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        return awm_log_prob(velocity, target)

    def level_loss(self, velocity, old, x0, x_sigma, sigma, target, advantages) -> PolicyLoss:
        log_prob = awm_log_prob(velocity, target)
        return awm_loss(
            log_prob, log_prob.detach() if old is None else old, advantages, self.config.awm.clip_range
        )


__all__ = ["AWM"]
