"""Weighted sums of named rewards, and building them from config-like specs.

`WeightedRewards` runs every reward on the batch and returns a `RewardOutput`: each reward's
scores (for logging and per-reward normalisation), their weighted sum, and which samples' sums
are finite. A NaN/inf score is never replaced: it makes that sample's total non-finite, the
``finite`` mask says so, and a warning names the reward and the samples. The loop drops those
samples' advantages, counts the failures and stops after repeated ones (docs/reliability.md).
"""

from __future__ import annotations

import dataclasses
import logging
import math
from collections.abc import Mapping, Sequence
from typing import Any

import torch

from boogu_data import PromptRecord
from boogu_trainer.rewards.base import RewardFn, check_batch, scores_tensor
from boogu_trainer.rewards.registry import build_reward, validate_reward_spec

__all__ = ["RewardOutput", "WeightedRewards", "build_rewards"]

logger = logging.getLogger(__name__)

_SPEC_KEYS = ("name", "weight", "label", "kwargs")


@dataclasses.dataclass(frozen=True, eq=False)
class RewardOutput:
    """The rewards of one batch of B images."""

    per_reward: dict[str, torch.Tensor]
    """Each reward's ``(B,)`` float32 scores by label, as the reward returned them (NaN/inf kept)."""
    total: torch.Tensor
    """``(B,)`` float32: the weighted sum over the rewards with a non-zero weight."""
    finite: torch.Tensor
    """``(B,)`` bool: False where ``total`` is NaN/inf; those samples must get no gradient."""

    @property
    def num_nonfinite(self) -> int:
        """How many samples have a non-finite total (the loop's failure counter adds this)."""
        return int((~self.finite).sum())

    def nonfinite_counts(self) -> dict[str, int]:
        """Non-finite scores per reward label, including weight-0 rewards (for the warning and logs)."""
        return {name: int((~torch.isfinite(scores)).sum()) for name, scores in self.per_reward.items()}

    def stacked(self) -> torch.Tensor:
        """``(B, R)`` float32: the per-reward scores as columns, in the order the rewards were given."""
        return torch.stack(list(self.per_reward.values()), dim=1)


class WeightedRewards:
    """``total = sum_r weight_r * reward_r(images, records)`` over named rewards.

    ``terms`` is ``[(label, weight, reward), ...]`` with distinct labels and finite weights
    (negative weights are penalties). A weight-0 reward is still computed and reported in
    ``per_reward`` (a metric) but does not enter ``total``, so its failures do not drop samples.
    Cost: the sum of the rewards' costs, run one after the other.
    """

    def __init__(self, terms: Sequence[tuple[str, float, RewardFn]]) -> None:
        if isinstance(terms, str | bytes) or not isinstance(terms, Sequence) or not terms:
            raise ValueError("WeightedRewards needs a non-empty list of (label, weight, reward) tuples")
        checked: list[tuple[str, float, RewardFn]] = []
        for i, term in enumerate(terms):
            if not isinstance(term, tuple) or len(term) != 3:
                raise ValueError(
                    f"WeightedRewards term {i} must be a (label, weight, reward) tuple, got {term!r}"
                )
            label, weight, reward = term
            if not isinstance(label, str) or not label:
                raise ValueError(f"WeightedRewards term {i}: label must be a non-empty string, got {label!r}")
            if any(label == other for other, _, _ in checked):
                raise ValueError(
                    f"WeightedRewards: label {label!r} is used twice; give one of them a distinct label"
                )
            if not callable(reward):
                raise ValueError(
                    f"WeightedRewards term {label!r}: reward must be callable, got {type(reward).__name__}"
                )
            checked.append((label, _check_weight(weight, f"reward {label!r}"), reward))
        self.terms = tuple(checked)

    @property
    def labels(self) -> tuple[str, ...]:
        return tuple(label for label, _, _ in self.terms)

    @property
    def weights(self) -> dict[str, float]:
        return {label: weight for label, weight, _ in self.terms}

    def __call__(
        self, images: torch.Tensor, records: Sequence[PromptRecord], *, micro_batch_size: int = 0
    ) -> RewardOutput:
        """Score ``images`` (B, 3, H, W) uint8; each reward sees at most ``micro_batch_size`` (0: all) at once."""
        batch_size = check_batch(images, records, "+".join(self.labels))
        per_reward: dict[str, torch.Tensor] = {}
        total = torch.zeros(batch_size, dtype=torch.float32)
        size = micro_batch_size or batch_size
        for label, weight, reward in self.terms:
            scores = torch.cat(
                [
                    scores_tensor(
                        reward(images[i : i + size], records[i : i + size]), min(size, batch_size - i), label
                    )
                    for i in range(0, batch_size, size)
                ]
            )
            bad = (~torch.isfinite(scores)).nonzero().flatten().tolist()
            if bad:
                logger.warning(
                    "reward %r returned non-finite scores for %d of %d samples (indices %s)%s",
                    label,
                    len(bad),
                    batch_size,
                    bad[:16],
                    "; weight 0, so no sample is dropped" if weight == 0 else "; they get no gradient",
                )
            per_reward[label] = scores
            if weight != 0:
                total = total + weight * scores
        return RewardOutput(per_reward=per_reward, total=total, finite=torch.isfinite(total))

    def __repr__(self) -> str:
        inner = ", ".join(f"{label!r}: {weight:g}" for label, weight, _ in self.terms)
        return f"WeightedRewards({{{inner}}})"


def build_rewards(specs: Sequence[Mapping[str, Any] | Any]) -> WeightedRewards:
    """Build a `WeightedRewards` from config-like specs, one per reward::

        [{"name": "ocr", "weight": 1.0},
         {"name": "jpeg_compressibility", "weight": 0.002, "kwargs": {"quality": 95}},
         {"name": "my_pkg.rewards:aesthetic", "weight": 0.5, "label": "aesthetic"}]

    ``name`` (required) is a registered reward (`available_rewards`) or ``module:attribute`` (see
    `load_user_reward` for the class/function rule); ``weight`` defaults to 1; ``kwargs`` are the
    reward's options; ``label`` (missing or ``""``: ``name``) keys its scores and must be unique,
    so the same reward can appear twice with different options. A spec is a mapping with those
    keys (others raise ValueError), a dataclass instance with those fields, or any object with
    the attributes ``name``, ``weight``, ``label`` and ``kwargs`` (the trainer config's
    ``RewardSpec``, whose ``label`` defaults to ``""``).
    """
    if isinstance(specs, str | bytes | Mapping) or not isinstance(specs, Sequence) or not specs:
        raise ValueError(
            f"rewards must be a non-empty list of {{'name': ..., 'weight': ...}} mappings, got {specs!r}"
        )
    terms: list[tuple[str, float, RewardFn]] = []
    for i, spec in enumerate(specs):
        where = f"rewards[{i}]"
        spec = _spec_mapping(spec, where)
        unknown = sorted(str(key) for key in spec if key not in _SPEC_KEYS)
        if unknown:
            raise ValueError(f"{where}: unknown key(s) {unknown}; allowed: {', '.join(_SPEC_KEYS)}")
        name = spec.get("name")
        if not isinstance(name, str) or not name:
            raise ValueError(f"{where}: 'name' must be a reward name or 'module:function', got {name!r}")
        weight = _check_weight(spec.get("weight", 1.0), f"{where} ({name})")
        kwargs = spec.get("kwargs", {})
        if kwargs is None:
            kwargs = {}
        label = spec.get("label", "")
        if not isinstance(label, str):
            raise ValueError(f"{where} ({name}): 'label' must be a string (empty: the name), got {label!r}")
        label = label or name
        try:
            validate_reward_spec(name, kwargs)  # a non-mapping kwargs fails here, not in the ** below
            reward = build_reward(name, **kwargs)
        except ValueError as error:
            raise ValueError(f"{where}: {error}") from error
        terms.append((label, weight, reward))
    return WeightedRewards(terms)


def _spec_mapping(spec: object, where: str) -> Mapping[str, Any]:
    """A spec's keys and values: a mapping as it is, a dataclass's fields, or the four attributes."""
    if isinstance(spec, Mapping):
        return spec
    if dataclasses.is_dataclass(spec) and not isinstance(spec, type):
        # Shallow, unlike dataclasses.asdict: kwargs values are passed on as they are.
        return {f.name: getattr(spec, f.name) for f in dataclasses.fields(spec)}
    if all(hasattr(spec, key) for key in _SPEC_KEYS):
        return {key: getattr(spec, key) for key in _SPEC_KEYS}
    raise ValueError(
        f"{where} must be a mapping with keys {', '.join(_SPEC_KEYS)} (only 'name' required) or an "
        f"object with those attributes, got {spec!r}"
    )


def _check_weight(weight: object, where: str) -> float:
    if isinstance(weight, bool) or not isinstance(weight, int | float) or not math.isfinite(weight):
        raise ValueError(f"{where}: weight must be a finite number, got {weight!r}")
    return float(weight)
