"""The trainer's configuration: one typed, validated dataclass per component, nested.

Recipes are YAML files of these sections, with ``a.b=c`` overrides on top. The package's modules,
lowest first (each imports only those above it, never this ``__init__``):

- `fields`: dataclass and annotation helpers shared by the loader, the resume diff and the reference.
- `algorithms`: the one list of the built-in learners (`BUILTIN`, `LearnerSpec`: options key, forward
  process, policy ratio), and a learner of your own (``package.module:Class``, `learner_spec`).
- `sections`: `ConfigError`, the sections (`DataConfig` ... `PerfConfig`, `RewardSpec`) and
  `TrainerConfig`, each validating its own fields in ``__post_init__`` (`TrainerConfig` also how
  its sections fit together); `scenes_demo_config` (the `trainer` demo), `demo_config` (the
  tests' fast runs); `resolved_model_dtype`.
- `checks`: the rules that need more than the config: `check_world_layout` (the world size),
  `check_ignored_settings` (which keys the user gave).
- `loader`: `load_config` (OmegaConf: defaults or a base, a YAML recipe, overrides, ``${...}``).
- `resume`: `config_to_dict`, `config_to_yaml` and the resume diff (`config_changes`, `RESUME_FREE_KEYS`,
  `RESUME_NOT_BITWISE_KEYS`, `resume_not_bitwise_changes`).
- `reference`: the generated key reference (`describe`, `config_reference_markdown`), the README's.
"""

from __future__ import annotations

from boogu_trainer.config.algorithms import (
    ALGORITHMS,
    FORWARD_OPTIONS_KEYS,
    POLICY_RATIO_KEYS,
    AwmConfig,
    LearnerChoice,
    LearnerSpec,
    NftConfig,
    learner_spec,
    learners_table_markdown,
)
from boogu_trainer.config.checks import check_ignored_settings, check_world_layout
from boogu_trainer.config.loader import load_config
from boogu_trainer.config.recipes import (
    BUILTIN_RECIPES,
    demo_config,
    scenes_demo_config,
    scenes_edit_demo_config,
    scenes_task_config,
)
from boogu_trainer.config.reference import config_reference_markdown, describe, field_docs
from boogu_trainer.config.resume import (
    RESUME_FREE_KEYS,
    RESUME_NOT_BITWISE_KEYS,
    config_changes,
    config_to_dict,
    config_to_yaml,
    resume_not_bitwise_changes,
)
from boogu_trainer.config.sections import (
    AlgorithmConfig,
    CheckpointConfig,
    ConfigError,
    DataConfig,
    DistributedConfig,
    EmaConfig,
    EvalConfig,
    LoggingConfig,
    LoraConfig,
    ModelConfig,
    OptimConfig,
    PerfConfig,
    RewardConfig,
    RewardSpec,
    RolloutConfig,
    SamplerConfig,
    TrainerConfig,
    VllmConfig,
    resolved_model_dtype,
)

__all__ = [
    "ALGORITHMS",
    "BUILTIN_RECIPES",
    "FORWARD_OPTIONS_KEYS",
    "POLICY_RATIO_KEYS",
    "RESUME_FREE_KEYS",
    "RESUME_NOT_BITWISE_KEYS",
    "AlgorithmConfig",
    "AwmConfig",
    "CheckpointConfig",
    "ConfigError",
    "DataConfig",
    "DistributedConfig",
    "EmaConfig",
    "EvalConfig",
    "LearnerChoice",
    "LearnerSpec",
    "LoggingConfig",
    "LoraConfig",
    "ModelConfig",
    "NftConfig",
    "OptimConfig",
    "PerfConfig",
    "RewardConfig",
    "RewardSpec",
    "RolloutConfig",
    "SamplerConfig",
    "TrainerConfig",
    "VllmConfig",
    "check_ignored_settings",
    "check_world_layout",
    "config_changes",
    "config_reference_markdown",
    "config_to_dict",
    "config_to_yaml",
    "demo_config",
    "describe",
    "field_docs",
    "learner_spec",
    "learners_table_markdown",
    "load_config",
    "resolved_model_dtype",
    "resume_not_bitwise_changes",
    "scenes_demo_config",
    "scenes_edit_demo_config",
    "scenes_task_config",
]
