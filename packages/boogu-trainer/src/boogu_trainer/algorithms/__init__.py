"""The algorithms the `Learner` runs, one module each, picked by ``algorithm.name``.

* ``flow_grpo`` (`flow_grpo.FlowGRPO`): PPO-clip or GRPO-Guard on the rollout's SDE transitions.
* ``diffusion_nft`` (`diffusion_nft.DiffusionNFT`) and ``awm`` (`awm.AWM`): losses on re-noised
  clean samples (`renoise`); DiffusionNFT keeps its old policy.

`base.Algorithm` is the interface; the loss math is in `boogu_trainer.losses`.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from boogu_trainer.algorithms.awm import AWM
from boogu_trainer.algorithms.base import Algorithm, Policy, Term, UpdateResult
from boogu_trainer.algorithms.diffusion_nft import DiffusionNFT
from boogu_trainer.algorithms.flow_grpo import FlowGRPO

if TYPE_CHECKING:
    from boogu_trainer.config import AlgorithmConfig

ALGORITHMS: dict[str, type[Algorithm]] = {cls.name: cls for cls in (FlowGRPO, DiffusionNFT, AWM)}
"""``algorithm.name`` -> its class."""


def build_algorithm(config: AlgorithmConfig, seed: int, policy: Policy) -> Algorithm:
    """The algorithm ``config.name`` names, training ``policy`` (``seed``: the run's, for its noise)."""
    if config.name not in ALGORITHMS:
        raise ValueError(f"algorithm.name={config.name!r}: expected one of {sorted(ALGORITHMS)}")
    return ALGORITHMS[config.name](config, seed, policy)


__all__ = [
    "ALGORITHMS",
    "AWM",
    "Algorithm",
    "DiffusionNFT",
    "FlowGRPO",
    "Policy",
    "Term",
    "UpdateResult",
    "build_algorithm",
]
