"""What every algorithm implements for the `Learner`, and what the two share.

The `Learner` runs the one loop of an update: for each of ``inner_epochs`` passes and each
mini-batch, zero the gradients, then for each micro-batch of the mini-batch's rows run the
algorithm's `Algorithm.losses` and backward each term with the micro-batch's share of the mean over
the mini-batch's rows and the terms (window steps or noise levels); then one optimizer step. An
algorithm says what an update needs before its first optimizer step (`Algorithm.begin`,
`Algorithm.prepare`), the loss terms of one micro-batch, and what follows a finished update
(`Algorithm.after_update`). It never steps the optimizer and never reads the loop's indices itself.
"""

from __future__ import annotations

import contextlib
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar

import torch

from boogu_schedule.hot import per_iteration
from boogu_trainer.losses import PolicyLoss

if TYPE_CHECKING:
    from boogu_adapters.recompute import TransitionRecompute
    from boogu_trainer.config import AlgorithmConfig
    from boogu_trainer.scoring import ScoredBatch

PhaseCounter = Callable[[str], contextlib.AbstractContextManager[None]]


def nullphase(_: str) -> contextlib.AbstractContextManager[None]:
    return contextlib.nullcontext()


@dataclass(frozen=True)
class UpdateResult:
    metrics: dict[str, Any]
    """Averaged loss terms, ratio/clip statistics, grad norm, on-policy log-prob differences."""
    finite: bool
    """Every loss and gradient was finite (no optimizer step was skipped for non-finite values)."""
    weights_finite: bool = True
    """The LoRA stayed finite; False means the last update was undone (see `Learner`)."""


@dataclass
class Policy:
    """What an algorithm trains: the module with its LoRA, the window-step recomputation, the device.

    The `Learner` owns it and hands the same object to its algorithm; ``count_as`` is set later (by the
    trainer, to its forward counter)."""

    transformer: torch.nn.Module
    recompute: TransitionRecompute
    device: torch.device
    params: list[torch.Tensor]
    """The trainable LoRA parameters, in ``named_parameters`` order (sharded under FSDP)."""
    param_names: list[str]
    count_as: PhaseCounter = nullphase
    """Names the phase of an algorithm's extra forwards ('reference', 'old') for the FE accounting."""


@dataclass(frozen=True)
class Term:
    """One loss term of a micro-batch (a window step or a noise level), the mean over its rows."""

    loss: torch.Tensor
    """0-d: the objective plus ``kl_coef`` times the KL, if any; the `Learner` backwards it."""
    policy: PolicyLoss
    """The objective alone and its metrics (`losses.PolicyLoss`)."""
    kl: torch.Tensor | None = None
    """0-d KL to the reference (base) model, when ``algorithm.kl_coef > 0``."""


def micro_batches(rows: torch.Tensor | list[int], size: int) -> list[list[int]]:
    """``rows`` (host indices) in consecutive chunks of ``size`` (0: one chunk)."""
    rows = rows.tolist() if isinstance(rows, torch.Tensor) else list(rows)
    size = size or len(rows)
    return [rows[i : i + size] for i in range(0, len(rows), size)]


class Algorithm(ABC):
    """One algorithm's part of the update (`boogu_trainer.algorithms` builds it from ``algorithm.name``)."""

    name: ClassVar[str]
    forward_process: ClassVar[bool] = False
    """It trains on re-noised clean samples (any sampler, ODE rollouts included); its options carry the
    noise levels (`renoise.ForwardProcessAlgorithm`)."""
    options_class: ClassVar[type | None] = None
    """A learner of your own: the dataclass its ``algorithm.options`` build (``config.options_of()``);
    the built-in ones' options are sections of ``AlgorithmConfig`` (``nft``, ``awm``)."""
    zero_advantage_has_no_gradient: ClassVar[bool] = True
    """A row with ``A = 0`` adds nothing to the gradient without a KL, so one process may skip it."""
    reads_rollout_logprobs: ClassVar[bool] = False
    """The loss compares with the rollout's log-probs (a ratio against them), so the first optimizer
    step must recompute them within the clip (`boogu_trainer.onpolicy`). Such an algorithm gives
    ``objective(stats, traj, k, rows, advantages, dt) -> PolicyLoss``, its loss on one recomputed
    window step, whose ``clipfrac`` the preflight reads."""

    @classmethod
    def planned_memory(cls, lora_bytes: float, rows: int, levels: int, latent_bytes: int) -> dict[str, float]:
        """Device memory the algorithm holds beyond the update's (``trainer --plan``), by what it is:
        ``lora_bytes`` one LoRA copy on this rank, ``rows`` this rank's samples per step, ``levels``
        trained per sample, ``latent_bytes`` one latent. None here."""
        return {}

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        # Each learner's loss terms run once per micro-batch and term: watched for host reads
        # (`boogu_schedule.hot`), whoever writes them.
        own = cls.__dict__.get("losses")
        if own is not None and not getattr(own, "__isabstractmethod__", False):
            per_iteration(own)

    def __init__(self, config: AlgorithmConfig, seed: int, policy: Policy):
        self.config = config
        self.seed = seed
        self.policy = policy

    def begin(self, batch: ScoredBatch, step: int) -> None:
        """Start an update on ``batch`` (``step``: the training step, 0-based); called first, also
        for an update that then stops because no advantage is finite."""
        return None

    def prepare(self, schedule: list[list[int]]) -> None:
        """Before the first optimizer step: ``schedule`` holds each mini-batch's local rows."""
        return None

    @abstractmethod
    def num_terms(self, batch: ScoredBatch) -> int:
        """Loss terms per micro-batch (window steps, noise levels): each is backwarded on its own."""

    @abstractmethod
    def losses(
        self, batch: ScoredBatch, advantages: torch.Tensor, chunk: list[int], *, first: bool
    ) -> Iterator[Term]:
        """The `num_terms` loss terms of the micro-batch ``chunk`` (host row indices), one at a time
        (each is backwarded before the next is computed). ``advantages``: (B,) float32, 0 where the
        reward is not finite; ``first``: the update's first optimizer step (epoch 0, mini-batch 0),
        whose weights are still those that rolled out."""

    def metrics(self) -> dict[str, torch.Tensor | float]:
        """The update's own metrics, beyond the loss terms' (device values are read with the rest)."""
        return {}

    def after_update(self, counters: dict[str, int]) -> None:
        """After an update that kept the weights finite (``counters``: the learner's, to read and set)."""
        return None

    @contextlib.contextmanager
    def sampling_policy(self) -> Iterator[None]:
        """The module holds the rollout policy's weights inside the block (the current ones here)."""
        yield

    def rollout_weights(self, current: Callable[[], dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
        """What an engine with its own copy of the weights rolls out with, by LoRA file key (a
        collective under FSDP): the current LoRA here (``current`` gathers it)."""
        return current()

    def step_metrics(self) -> dict[str, float]:
        """The algorithm's state after a step's update, for the step's record (none here)."""
        return {}

    def state_dict(self) -> dict[str, Any]:
        """The algorithm's saved state, merged into `Learner.state_dict` (none here)."""
        return {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Put this algorithm's part of a `Learner.state_dict` back; called before the LoRA is loaded."""
        return None


__all__ = [
    "Algorithm",
    "PhaseCounter",
    "Policy",
    "Term",
    "UpdateResult",
    "micro_batches",
    "nullphase",
]
