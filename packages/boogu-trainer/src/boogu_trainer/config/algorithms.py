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
from dataclasses import dataclass, field
from typing import Any, Literal

from boogu_trainer.config.fields import check, check_finite
from boogu_trainer.user_code import import_object


@dataclass(frozen=True)
class LearnerVariant:
    """A setting that changes what a learner trains on: a row of its own in the README's table."""

    setting: str
    """The key and value, as a recipe writes it (``algorithm.loss: grpo_guard``)."""
    trains_on: str
    rollouts: str
    pick_when: str


@dataclass(frozen=True)
class LearnerSpec:
    """What the config's checks and the README's table know of a learner."""

    name: str
    trains_on: str
    """What its loss trains on, in a line (the README's table)."""
    options_key: str | None = None
    """Its options' section under ``algorithm.`` (``nft``: ``algorithm.nft.*``), or None."""
    forward_process: bool = False
    """It trains on re-noised clean samples, so any sampler works, ODE rollouts (window 0) included;
    its options then carry the noise levels (``timesteps``, ``time_sampling``, ``guided``, ...)."""
    policy_ratio: bool = False
    """Its loss is a ratio against the rollout's transition log-probs: `POLICY_RATIO_KEYS` and
    ``algorithm.loss`` are its; it needs an SDE window."""
    rollouts: str = ""
    """What rollouts it takes (the README's table)."""
    pick_when: str = ""
    """When to pick it, with the measurement that says so (the README's table)."""
    variants: tuple[LearnerVariant, ...] = ()
    """Settings that change what it trains on, each a row after its own."""


POLICY_RATIO_KEYS: tuple[str, ...] = ("algorithm.clip_range", "algorithm.kl_kind")
"""The shared settings only a policy-ratio learner reads (flow_grpo's)."""

BUILTIN: tuple[LearnerSpec, ...] = (
    LearnerSpec(
        "flow_grpo",
        "PPO-clip on the SDE window's transition log-probs",
        policy_ratio=True,
        rollouts="SDE window, CFG as configured",
        pick_when="you want the reference integration's recipe and its known behaviour "
        "(`examples/flowgrpo_trainer/`)",
        variants=(
            LearnerVariant(
                "algorithm.loss: grpo_guard",
                "the same on a RatioNorm'd ratio, each step weighted by 1/\\|dt\\|",
                "same",
                "FlowGRPO over-optimises (the proxy reward rises while `eval/gold` falls); clip near "
                "2e-6 on the real model",
            ),
        ),
    ),
    LearnerSpec(
        "diffusion_nft",
        "contrastive flow matching on re-noised final latents, around a lagging old policy",
        options_key="nft",
        forward_process=True,
        rollouts="any; ODE and CFG-free by default in its recipe",
        pick_when="the cheapest path to a moderate reward: on the demo task, with `nft.group_noise: true`, "
        "0.57x FlowGRPO's compute to the target (0.45x to a lower one) and the lowest spread over seeds",
        variants=(
            LearnerVariant(
                "nft.guided: true",
                "the same on the CFG-guided velocity (both CFG rows trained)",
                "needs CFG (`sampler.guidance_scale > 1`)",
                "the CFG-free learners' reward levels off below what you need: on the demo task it was "
                "the only learner to pass FlowGRPO's ceiling",
            ),
        ),
    ),
    LearnerSpec(
        "awm",
        "the pretraining flow-matching loss on re-noised final latents, weighted by the advantage",
        options_key="awm",
        forward_process=True,
        rollouts="any; ODE and CFG-free in its recipe",
        pick_when="you want the simplest forward-process loss (no old policy at all without "
        "`awm.clip_range`); on the demo task a little dearer than DiffusionNFT",
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


def learners_table_markdown() -> str:
    """The README's "Choosing an algorithm" table, from `BUILTIN`: a row per learner and one per
    variant (``trainer --learners`` prints it; ``tools/update_readme_config.py`` writes it)."""
    lines = ["| | what it trains on | rollouts | pick it when |", "|---|---|---|---|"]
    for spec in BUILTIN:
        lines.append(f"| `{spec.name}` | {spec.trains_on} | {spec.rollouts} | {spec.pick_when} |")
        for v in spec.variants:
            lines.append(f"| `{spec.name}` + `{v.setting}` | {v.trains_on} | {v.rollouts} | {v.pick_when} |")
    return "\n".join(lines)


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


PolicyRatioLoss = Literal["ppo_clip", "grpo_guard"]
"""``algorithm.loss``: the objective of a policy-ratio learner (flow_grpo's PPO-clip or GRPO-Guard)."""


@dataclass(frozen=True)
class NftConfig:
    beta: float = 1.0
    """Implicit-policy strength: v+ = v_old + beta (v - v_old), v- = v_old - beta (v - v_old) (the paper's 1.0; 0.1 for OCR and several rewards)."""
    timesteps: int | None = None
    """Noise levels trained per sample and step; null: all rollout-schedule levels but one (the reference's 9 of 10)."""
    time_sampling: Literal["schedule", "uniform"] = "schedule"
    """'schedule': distinct levels of the rollout's schedule, permuted per sample (the reference); 'uniform': stratified in sigma_range."""
    sigma_range: tuple[float, float] = (0.0, 1.0)
    """uniform time sampling: the noise levels sigma (1 = noise, 0 = data) to draw from."""
    adaptive_weight: bool = True
    """Divide each sample's x0-space error by its detached mean absolute error (the reference's adaptive weighting)."""
    group_noise: bool = False
    """Re-noise every sample of a group at the same levels with the same noise (common random numbers: the advantage-weighted part of the loss sums to zero over a group, so its noise-only part cancels); false: each sample draws its own (the reference)."""
    guided: bool = False
    """Train the CFG-guided velocity at the rollout's guidance scale (the positive and negative rows, as flow_grpo trains), twice the training forwards; needs sampler.guidance_scale > 1. false: the conditional velocity (the reference, CFG-free)."""
    old_decay_start: int = 0
    """Optimizer steps with old = current policy before the old policy starts lagging (75 in the reference's OCR recipe)."""
    old_decay_rate: float = 0.001
    """After old_decay_start, the old policy's decay grows by this per optimizer step: old <- d old + (1 - d) current."""
    old_decay_max: float = 0.5
    """Cap on that decay (0.5 in the reference's default, 0.999 for OCR; 0 keeps old = current)."""

    def __post_init__(self) -> None:
        check_finite(self, "algorithm.nft.")
        check(self.beta > 0, "algorithm.nft.beta", self.beta, "> 0")
        if self.timesteps is not None:
            check(self.timesteps >= 1, "algorithm.nft.timesteps", self.timesteps, ">= 1 or null")
        _check_sigma_range(self.sigma_range, "algorithm.nft.sigma_range")
        check(self.old_decay_start >= 0, "algorithm.nft.old_decay_start", self.old_decay_start, ">= 0")
        check(self.old_decay_rate >= 0, "algorithm.nft.old_decay_rate", self.old_decay_rate, ">= 0")
        check(0 <= self.old_decay_max < 1, "algorithm.nft.old_decay_max", self.old_decay_max, "in [0, 1)")

    def old_decay(self, optimizer_steps: int) -> float:
        """The decay d of the soft update after ``optimizer_steps`` optimizer steps."""
        if optimizer_steps < self.old_decay_start:
            return 0.0
        return min((optimizer_steps - self.old_decay_start) * self.old_decay_rate, self.old_decay_max)


@dataclass(frozen=True)
class AwmConfig:
    timesteps: int = 4
    """Noise levels trained per sample and step."""
    time_sampling: Literal["schedule", "uniform"] = "uniform"
    """'uniform': stratified in sigma_range; 'schedule': distinct levels of the rollout's schedule."""
    sigma_range: tuple[float, float] = (0.0, 1.0)
    """uniform time sampling: the noise levels sigma (1 = noise, 0 = data) to draw from."""
    clip_range: float | None = None
    """PPO clip on exp(log p - log p_old), log p = -mean((v - target)^2); null: no clip, the ratio is 1 and no old-policy forward is made (plain advantage-weighted matching)."""
    group_noise: bool = False
    """Re-noise every sample of a group at the same levels with the same noise (common random numbers: the advantages sum to zero over a group, so the noise-only part of the weighted flow-matching gradient cancels); false: each sample draws its own."""
    guided: bool = False
    """Train the CFG-guided velocity at the rollout's guidance scale (the positive and negative rows, as flow_grpo trains), twice the training forwards; needs sampler.guidance_scale > 1. false: the conditional velocity (the pretraining loss's)."""

    def __post_init__(self) -> None:
        check_finite(self, "algorithm.awm.")
        check(self.timesteps >= 1, "algorithm.awm.timesteps", self.timesteps, ">= 1")
        _check_sigma_range(self.sigma_range, "algorithm.awm.sigma_range")
        if self.clip_range is not None:
            check(self.clip_range > 0, "algorithm.awm.clip_range", self.clip_range, "> 0 or null")


def _check_sigma_range(value: tuple[float, float], key: str) -> None:
    lo, hi = value
    check(0.0 <= lo < hi <= 1.0, key, list(value), "[lo, hi] with 0 <= lo < hi <= 1")


@dataclass(frozen=True)
class LearnerChoice:
    """The learner ``algorithm.*`` picks and its options: the first fields of
    ``boogu_trainer.config.AlgorithmConfig`` (which adds what every learner shares). The one place
    the built-in learners' option sections are declared; a learner of your own reads
    ``algorithm.options`` through its ``options_class``."""

    name: str = BUILTIN[0].name
    """The learner: flow_grpo (policy gradient on SDE transitions), diffusion_nft or awm (losses on re-noised clean samples; ODE rollouts allowed); or one of your own as 'package.module:Class' (docs/algorithms.md, "A learner of your own")."""
    loss: PolicyRatioLoss = "ppo_clip"
    """flow_grpo's objective: PPO-clip, or GRPO-Guard (RatioNorm and per-step 1/|dt| reweighting; use clip_range ~2e-6)."""
    nft: NftConfig = field(default_factory=NftConfig)
    """diffusion_nft's options."""
    awm: AwmConfig = field(default_factory=AwmConfig)
    """awm's options."""
    options: dict[str, Any] = field(default_factory=dict)
    """The options of a learner of your own (name 'package.module:Class'), checked by its options_class; empty for the built-in ones."""

    @property
    def spec(self) -> LearnerSpec:
        """What the checks know of the learner (`config.algorithms`)."""
        return learner_spec(self.name)

    @property
    def forward_key(self) -> str | None:
        """The options key of a learner that trains on re-noised clean samples ('nft', 'awm', or
        'options' for one of your own); None for flow_grpo."""
        spec = self.spec
        return spec.options_key if spec.forward_process else None

    @property
    def forward_options(self) -> Any:
        """The options of a learner that trains on re-noised clean samples (``algorithm.<forward_key>``);
        None for flow_grpo."""
        return None if self.forward_key is None else self.options_of()

    def options_of(self) -> Any:
        """The learner's own options: ``algorithm.nft`` / ``algorithm.awm``, or for a learner of your own
        ``algorithm.options`` built by its options_class; None for a learner without options."""
        if is_user_learner(self.name):
            return user_options(self.name, self.options, "algorithm.options")
        key = self.spec.options_key
        return None if key is None else getattr(self, key)


__all__ = [
    "ALGORITHMS",
    "BUILTIN",
    "FORWARD_OPTIONS_KEYS",
    "POLICY_RATIO_KEYS",
    "SPECS",
    "USER_OPTIONS_KEY",
    "AwmConfig",
    "LearnerChoice",
    "LearnerSpec",
    "LearnerVariant",
    "NftConfig",
    "PolicyRatioLoss",
    "import_learner",
    "is_user_learner",
    "learner_spec",
    "learners_table_markdown",
    "user_options",
]
