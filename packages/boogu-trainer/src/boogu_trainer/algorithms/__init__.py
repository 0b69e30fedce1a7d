"""The algorithms the `Learner` runs, one module each, picked by ``algorithm.name``.

* ``flow_grpo`` (`flow_grpo.FlowGRPO`): PPO-clip or GRPO-Guard on the rollout's SDE transitions.
* ``diffusion_nft`` (`diffusion_nft.DiffusionNFT`) and ``awm`` (`awm.AWM`): losses on re-noised
  clean samples (`renoise`); DiffusionNFT keeps its old policy.

`base.Algorithm` is the interface; the loss math is in `boogu_trainer.losses`. A learner of your own
is ``algorithm.name=package.module:Class`` (`algorithm_class`; docs/algorithms.md).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from boogu_trainer.algorithms.awm import AWM
from boogu_trainer.algorithms.base import Algorithm, Policy, Term, UpdateResult
from boogu_trainer.algorithms.diffusion_nft import DiffusionNFT
from boogu_trainer.algorithms.flow_grpo import FlowGRPO
from boogu_trainer.config.algorithms import import_learner

if TYPE_CHECKING:
    from boogu_trainer.config import AlgorithmConfig

ALGORITHMS: dict[str, type[Algorithm]] = {cls.name: cls for cls in (FlowGRPO, DiffusionNFT, AWM)}
"""The built-in learners by ``algorithm.name`` (the names and traits are ``config.algorithms.BUILTIN``'s;
a test holds them equal)."""


def algorithm_class(name: str) -> type[Algorithm]:
    """The class ``algorithm.name`` picks: a built-in one, or a learner of your own
    (``package.module:Class``, imported and checked by `config.algorithms.import_learner`)."""
    if name in ALGORITHMS:
        return ALGORITHMS[name]
    try:
        return import_learner(name)
    except ValueError as error:
        raise ValueError(f"algorithm.name={name!r}: {error}") from None


def build_algorithm(config: AlgorithmConfig, seed: int, policy: Policy) -> Algorithm:
    """The algorithm ``config.name`` names, training ``policy`` (``seed``: the run's, for its noise)."""
    return algorithm_class(config.name)(config, seed, policy)


__all__ = [
    "ALGORITHMS",
    "AWM",
    "Algorithm",
    "DiffusionNFT",
    "FlowGRPO",
    "Policy",
    "Term",
    "UpdateResult",
    "algorithm_class",
    "build_algorithm",
]
