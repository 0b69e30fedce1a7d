"""Rules that need more than the config itself, so `TrainerConfig` cannot check them when it is built.

- `check_world_layout`: the batch layout on ``world_size`` ranks (the world size is known at launch).
- `check_ignored_settings`: a setting the recipe or the overrides give that the chosen algorithm, or
  the chosen evaluation set, would ignore (only the loader knows which keys the user gave; a base's
  inherited value passes).

Each section's own rules are in its ``__post_init__``, and the rules between sections in
`TrainerConfig.__post_init__` (:mod:`boogu_trainer.config.sections`).
"""

from __future__ import annotations

from collections.abc import Iterable

from boogu_trainer.config.algorithms import POLICY_RATIO_KEYS
from boogu_trainer.config.sections import ConfigError, TrainerConfig


def check_world_layout(config: TrainerConfig, world_size: int) -> None:
    """Refuse a batch layout on ``world_size`` ranks whose update differs from the same recipe on one rank.

    Each rank rolls out a contiguous share of ``data.prompts_per_step`` groups, and the learner puts
    a group in mini-batch ``global index % mini_batches``, weighting each of a rank's rows by one over
    that rank's rows in the mini-batch; FSDP then averages the gradients over the ranks. That mean
    is the one-rank mini-batch mean only when every rank holds the same number of each mini-batch's
    groups, i.e. when ``mini_batches`` divides the groups per rank (a rank with fewer groups than
    mini-batches also makes fewer optimizer steps, and ranks with unequal shares run different
    numbers of micro-batches, whose FSDP collectives then do not pair up). Raises `ConfigError`.
    """
    if world_size <= 1:
        return
    groups = config.data.prompts_per_step
    if groups % world_size:
        raise ConfigError(
            f"data.prompts_per_step={groups} over {world_size} ranks: expected a multiple of {world_size} "
            "(each rank rolls out an equal share of the prompt groups)"
        )
    per_rank = groups // world_size
    mini_batches = config.algorithm.mini_batches
    if per_rank % mini_batches:
        allowed = ", ".join(str(d) for d in range(1, per_rank + 1) if per_rank % d == 0)
        raise ConfigError(
            f"algorithm.mini_batches={mini_batches} with data.prompts_per_step={groups} over {world_size} "
            f"ranks ({per_rank} groups per rank): expected algorithm.mini_batches to divide the groups per "
            f"rank (one of {allowed}), or data.prompts_per_step a multiple of {world_size * mini_batches} "
            f"({world_size} ranks x {mini_batches} mini-batches); otherwise the ranks hold unequal shares "
            "of a mini-batch and the update differs from the same recipe on one rank"
        )


def check_ignored_settings(config: TrainerConfig, given: Iterable[str]) -> None:
    """Refuse a setting the recipe or the overrides give (``given``: dotted keys) that the chosen
    algorithm (flow_grpo's loss keys) or evaluation set (``data.demo_eval_split``) would ignore
    without a word. A value inherited from the defaults or a ``base`` config
    (the demo's clip_range) is not the user's choice and passes."""
    data = config.data
    if "data.demo_eval_split" in given and (data.demo_set == "ocr" or data.val_files):
        why = (
            f"data.val_files={list(data.val_files)!r} is the evaluation set"
            if data.val_files
            else f"data.demo_set={data.demo_set!r} has no built-in evaluation captions"
        )
        raise ConfigError(
            f"data.demo_eval_split={data.demo_eval_split!r}: it picks the built-in scene captions (or edit "
            f"pairs) an evaluation scores when data.demo_set is 'scenes' or 'scene_edits' and data.val_files "
            f"is empty, but {why}; "
            "remove data.demo_eval_split from the recipe and overrides"
        )
    algorithm = config.algorithm
    name, spec = algorithm.name, algorithm.spec
    if spec.policy_ratio:
        return
    options = algorithm.options_of()
    for key in POLICY_RATIO_KEYS:
        if key in given:
            field = key.rpartition(".")[2]
            value = getattr(algorithm, field)
            own = (
                f" ({name}'s own {field} is algorithm.{spec.options_key}.{field})"
                if options is not None and hasattr(options, field)
                else ""
            )
            kl = (
                " (its KL term is the velocity MSE weighted by algorithm.kl_coef)"
                if spec.forward_process
                else ""
            )
            raise ConfigError(
                f"{key}={value!r} with algorithm.name={name!r}: it belongs to flow_grpo's policy-ratio loss, "
                f"which {name} does not use{kl}; remove {key} from the recipe and overrides{own}"
            )
