"""A config as plain data, and what a resume may change: the diff against a checkpoint's config.

A checkpoint stores `config_to_dict` of its run's config; on resume the checkpointer compares it
with the new one (`config_changes`), refuses a difference outside `RESUME_FREE_KEYS` and the
recipe's ``resume_allow_changes``, and says when one of `RESUME_NOT_BITWISE_KEYS` changed
(`resume_not_bitwise_changes`).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Mapping
from typing import Any

from boogu_protocol import resolve_device_type
from boogu_trainer.config.fields import field_default, field_hints, leaves, plain, record_type
from boogu_trainer.config.sections import TrainerConfig, resolved_model_dtype

RESUME_FREE_KEYS: tuple[str, ...] = (
    "total_steps",
    "resume",
    "resume_allow_changes",
    "logging",
    "checkpoint",
    "eval",
    "distributed.timeout_s",
    "perf",
    "preflight",
    "model.compile",
    "model.compile_bucket",
    "rollout.micro_batch_size",
    "algorithm.train_micro_batch_size",
)
"""Keys (and sections) that may differ from a checkpoint's config on resume: they do not change the past."""

RESUME_NOT_BITWISE_KEYS: tuple[str, ...] = (
    "model.compile",
    "model.compile_bucket",
    "rollout.micro_batch_size",
    "algorithm.train_micro_batch_size",
)
"""Of `RESUME_FREE_KEYS`, those that change how the same numbers are computed (batch split, kernels):
the run goes on as its recipe says, but float rounding differs (~1e-8), so it is no longer bitwise
equal to an uninterrupted run. A resume that changes one says so."""


def config_to_dict(config: TrainerConfig) -> dict[str, Any]:
    """Plain YAML-able data: nested dicts, lists (not tuples), numbers, strings, null."""
    return plain(config)


def config_to_yaml(config: TrainerConfig) -> str:
    """The text of a run's ``config.yaml`` (and ``trainer --print-config``): every key, in the
    sections' order. Read it back with ``load_config(path, saved=True)``."""
    import yaml

    return yaml.safe_dump(config_to_dict(config), sort_keys=False)


def config_changes(
    old: Mapping[str, Any], new: Mapping[str, Any], allowed: Iterable[str] = ()
) -> list[tuple[str, Any, Any]]:
    """``(dotted key, old value, new value)`` for every leaf of ``new`` that differs from ``old``,
    except keys under `RESUME_FREE_KEYS` or ``allowed`` (``optim`` covers ``optim.lr``).

    Both are `config_to_dict` outputs (``old`` read back from a checkpoint's config.yaml). A key
    that ``old`` lacks because this version added it compares as its default (so it is unchanged
    when ``new`` keeps the default); a key only ``old`` has (removed since) is not reported, since
    this version cannot honour it either way. Lists, ``reward.rewards`` included, compare whole.
    """
    skip = (*RESUME_FREE_KEYS, *allowed)
    before = leaves(_with_defaults(old, TrainerConfig))
    after = leaves(_with_defaults(new, TrainerConfig))
    return [
        (key, before.get(key), value)
        for key, value in after.items()
        if not any(key == p or key.startswith(f"{p}.") for p in skip)
        and _resolved(key, before.get(key)) != _resolved(key, value)
    ]


def resume_not_bitwise_changes(old: Mapping[str, Any], new: Mapping[str, Any]) -> list[tuple[str, Any, Any]]:
    """``(dotted key, old value, new value)`` for each key of `RESUME_NOT_BITWISE_KEYS` that differs."""
    before = leaves(_with_defaults(old, TrainerConfig))
    after = leaves(_with_defaults(new, TrainerConfig))
    return [
        (key, before.get(key), value)
        for key, value in after.items()
        if any(key == p or key.startswith(f"{p}.") for p in RESUME_NOT_BITWISE_KEYS)
        and before.get(key) != value
    ]


def _resolved(key: str, value: Any) -> Any:
    # 'auto' and the dtype it stands for on this machine are the same run (a v0.2 checkpoint says
    # float32 where this version's default says auto).
    if key == "model.dtype" and isinstance(value, str):
        return resolved_model_dtype(value, resolve_device_type("auto"))
    return value


def _with_defaults(data: Mapping[str, Any], cls: type) -> dict[str, Any]:
    """``data`` with the fields of ``cls`` it lacks (also inside reward.rewards items) at their defaults."""
    out = dict(data)
    for f in dataclasses.fields(cls):
        tp = field_hints(cls)[f.name]
        value = out.get(f.name)
        record = record_type(tp)
        if f.name not in out:
            out[f.name] = plain(field_default(f))
        elif dataclasses.is_dataclass(tp) and isinstance(value, Mapping):
            out[f.name] = _with_defaults(value, tp)  # type: ignore[arg-type]
        elif record is not None and isinstance(value, list):
            out[f.name] = [_with_defaults(v, record) if isinstance(v, Mapping) else v for v in value]
    return out
