"""The learners ``algorithm.name`` picks: the one list of the built-in ones, and a learner of your own.

`BUILTIN` is the list: each `LearnerSpec` says what the config's checks need to know of a learner
(its options section, whether it trains on re-noised clean samples, whether it reads flow_grpo's
policy-ratio keys). ``AlgorithmConfig.name``'s check, ``FORWARD_OPTIONS_KEYS``, the ignored-key check
(`checks.check_ignored_settings`) and the README's table (a test) are derived from it; the classes
are ``boogu_trainer.algorithms.ALGORITHMS`` (a test holds the two equal).

A learner of your own is ``algorithm.name=package.module:Class``: a subclass of
``boogu_trainer.algorithms.Algorithm`` (imported when the config is checked), whose class attributes
say the same (`Algorithm.forward_process`, `Algorithm.reads_rollout_logprobs`), and whose options, if
it has any, are ``algorithm.options`` (a mapping), checked by its ``options_class`` (a dataclass) and
handed to it as ``config.options_of()``. This module imports no torch: the learner's module is
imported only for such a name.
"""

from __future__ import annotations

import dataclasses
import difflib
import functools
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from boogu_trainer.user_code import import_object


@dataclass(frozen=True)
class LearnerSpec:
    """What the config's checks know of a learner."""

    name: str
    trains_on: str
    """What its loss trains on, in a line (docs)."""
    options_key: str | None = None
    """Its options' section under ``algorithm.`` (``nft``: ``algorithm.nft.*``), or None."""
    forward_process: bool = False
    """It trains on re-noised clean samples, so any sampler works, ODE rollouts (window 0) included;
    its options then carry the noise levels (``timesteps``, ``time_sampling``, ``guided``, ...)."""
    policy_ratio: bool = False
    """Its loss is a ratio against the rollout's transition log-probs: `POLICY_RATIO_KEYS` and
    ``algorithm.loss`` are its; it needs an SDE window."""


POLICY_RATIO_KEYS: tuple[str, ...] = ("algorithm.clip_range", "algorithm.kl_kind")
"""The shared settings only a policy-ratio learner reads (flow_grpo's)."""

BUILTIN: tuple[LearnerSpec, ...] = (
    LearnerSpec(
        "flow_grpo",
        "PPO-clip (or GRPO-Guard, algorithm.loss) on the SDE window's transition log-probs",
        policy_ratio=True,
    ),
    LearnerSpec(
        "diffusion_nft",
        "contrastive flow matching on re-noised final latents, around a lagging old policy",
        options_key="nft",
        forward_process=True,
    ),
    LearnerSpec(
        "awm",
        "the flow-matching loss on re-noised final latents, weighted by the advantage",
        options_key="awm",
        forward_process=True,
    ),
)
"""The built-in learners, in the order the docs list them."""

SPECS: dict[str, LearnerSpec] = {spec.name: spec for spec in BUILTIN}
ALGORITHMS: tuple[str, ...] = tuple(SPECS)
FORWARD_OPTIONS_KEYS: dict[str, str] = {
    s.name: s.options_key for s in BUILTIN if s.forward_process and s.options_key
}
"""The built-in learners that train on re-noised clean samples, each with its options' key."""

USER_OPTIONS_KEY = "options"
"""A learner of your own reads its options from ``algorithm.options``."""


def is_user_learner(name: str) -> bool:
    """``name`` is ``package.module:Class`` rather than a built-in learner's name."""
    return ":" in name


@functools.cache
def import_learner(name: str) -> type:
    """The class ``package.module:Class`` names, checked to be an ``Algorithm``; ValueError otherwise."""
    module_name, _, attribute = name.partition(":")
    if not module_name or not attribute or ":" in attribute:
        raise ValueError(f"expected 'package.module:Class' for a learner of your own, got {name!r}")
    target = import_object(name)
    # By name, not by import: the algorithms import the config (no cycle, and no torch here).
    bases = {f"{c.__module__}.{c.__qualname__}" for c in getattr(target, "__mro__", ())}
    if not (isinstance(target, type) and "boogu_trainer.algorithms.base.Algorithm" in bases):
        raise ValueError(f"{name!r} is not a subclass of boogu_trainer.algorithms.Algorithm")
    options = getattr(target, "options_class", None)
    if options is not None and not dataclasses.is_dataclass(options):
        raise ValueError(f"{name}.options_class must be a dataclass, got {options!r}")
    return target


@functools.cache
def learner_spec(name: str) -> LearnerSpec:
    """The spec of ``name``: a built-in one, or read off the class a ``package.module:Class`` names.
    ValueError naming the choices when it is neither."""
    if name in SPECS:
        return SPECS[name]
    if not is_user_learner(name):
        close = difflib.get_close_matches(name, ALGORITHMS, n=1)
        hint = f" (did you mean {close[0]!r}?)" if close else ""
        raise ValueError(
            f"expected one of {', '.join(ALGORITHMS)}{hint}, or a learner of your own as 'package.module:Class'"
        )
    cls = import_learner(name)
    return LearnerSpec(
        name,
        (cls.__doc__ or name).strip().splitlines()[0],
        options_key=USER_OPTIONS_KEY if getattr(cls, "options_class", None) is not None else None,
        forward_process=bool(getattr(cls, "forward_process", False)),
        policy_ratio=bool(getattr(cls, "reads_rollout_logprobs", False)),
    )


def user_options(name: str, options: Mapping[str, Any], key: str) -> Any:
    """``options`` (``algorithm.options``) as the ``options_class`` of the learner ``name`` builds
    them; ValueError naming ``key.<option>`` for one it does not have. None for a class without one."""
    cls = import_learner(name)
    options_class = getattr(cls, "options_class", None)
    if options_class is None:
        if options:
            raise ValueError(f"{key}={dict(options)!r}: {name} takes no options (it has no options_class)")
        return None
    fields = [f.name for f in dataclasses.fields(options_class)]
    for option in options:
        if option not in fields:
            close = difflib.get_close_matches(str(option), fields, n=1)
            hint = f" (did you mean {close[0]!r}?)" if close else ""
            raise ValueError(
                f"{key}.{option}: {name} has no such option{hint}; its options: {', '.join(fields)}"
            )
    return options_class(**options)


__all__ = [
    "ALGORITHMS",
    "BUILTIN",
    "FORWARD_OPTIONS_KEYS",
    "POLICY_RATIO_KEYS",
    "SPECS",
    "USER_OPTIONS_KEY",
    "LearnerSpec",
    "import_learner",
    "is_user_learner",
    "learner_spec",
    "user_options",
]
