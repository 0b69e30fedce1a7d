"""A config as plain data, and what a resume may change: the diff against a checkpoint's config.

A checkpoint stores `config_to_dict` of its run's config; on resume the checkpointer compares it
with the new one (`config_changes`), refuses a difference outside `RESUME_FREE_KEYS` and the
recipe's ``resume_allow_changes``, and says when one of `RESUME_NOT_BITWISE_KEYS` changed
(`resume_not_bitwise_changes`).

The one rule: a key may change when it cannot change the numbers. Values are compared as the run
uses them, so spellings of the same thing are no change: paths are normalised (``~``, a trailing
slash, ``a/./b``; two spellings of one existing folder), ``model.device`` compares as its device
type ('auto' is what it resolves to here) and ``model.dtype`` as the dtype it runs in on that
device. A key the config does not use (`RESUME_CONDITIONAL_KEYS`: ``model.tiny_path`` when
``model.path`` is set, ``rollout.vllm.*`` with the local engine) may differ when neither config
uses it. Everything else is refused, naming the key, both values and ``resume_allow_changes``.
"""

from __future__ import annotations

import dataclasses
import os
import typing
from collections.abc import Callable, Iterable, Mapping
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
    # Where the text encoder's weights wait between encodes: the same encoder computes the same features.
    "model.text_encoder_offload",
    "rollout.micro_batch_size",
    "algorithm.train_micro_batch_size",
    # A warning threshold and a stop rule: they decide what is said and when the run stops, not a number.
    "rollout.logprob_diff_warn",
    "reward.max_nonfinite_steps",
    # Where the rollout worker runs and how long it may take; what it computes (backend, dtype,
    # engine_args, its environment: project, python) is not free.
    "rollout.vllm.url",
    "rollout.vllm.devices",
    "rollout.vllm.startup_timeout_s",
    "rollout.vllm.request_timeout_s",
    # Which weights an evaluation judges (the EMA or the trained ones): not a number of training.
    "ema.evaluate",
)
"""Keys (and sections) that may differ from a checkpoint's config on resume: they do not change the
past, nor the numbers of the steps to come (except `RESUME_NOT_BITWISE_KEYS`' rounding)."""

RESUME_NOT_BITWISE_KEYS: tuple[str, ...] = (
    "model.compile",
    "model.compile_bucket",
    "rollout.micro_batch_size",
    "algorithm.train_micro_batch_size",
)
"""Of `RESUME_FREE_KEYS`, those that change how the same numbers are computed (batch split, kernels):
the run goes on as its recipe says, but float rounding differs (~1e-8), so it is no longer bitwise
equal to an uninterrupted run. A resume that changes one says so."""

RESUME_PATH_KEYS: tuple[str, ...] = (
    "model.path",
    "model.tiny_path",
    "model.tiny_scenes_path",
    "model.tiny_scenes_edit_path",
    "rollout.vllm.project",
    "rollout.vllm.python",
    "data.train_files",
    "data.val_files",
)
"""Keys holding paths (or lists of paths): compared after normalising (`_same_path`)."""

RESUME_CONDITIONAL_KEYS: dict[str, Callable[[Mapping[str, Any]], bool]] = {
    "model.tiny": lambda c: not c.get("model.path"),
    "model.tiny_path": lambda c: not c.get("model.path") and c.get("model.tiny") == "random",
    "model.tiny_scenes_path": lambda c: not c.get("model.path") and c.get("model.tiny") == "scenes",
    "model.tiny_scenes_edit_path": lambda c: not c.get("model.path") and c.get("model.tiny") == "scenes_edit",
    "rollout.vllm": lambda c: c.get("rollout.engine") == "vllm_omni",
}
"""Keys (and sections) a config uses only in some settings: key -> whether a config (its dotted
leaves) uses it (`models.base_model_path`, `Trainer._remote_engine`). A difference in such a key
counts only when the checkpoint's config or the new one uses it."""


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
    this version cannot honour it either way, except inside a free-form mapping
    (``rollout.vllm.engine_args``), where it is the user's and reported as ``"(not set)"``. Lists,
    ``reward.rewards`` included, compare whole.
    """
    skip = (*RESUME_FREE_KEYS, *allowed)
    return [change for change in _differences(old, new) if not _under(change[0], skip)]


def resume_not_bitwise_changes(old: Mapping[str, Any], new: Mapping[str, Any]) -> list[tuple[str, Any, Any]]:
    """``(dotted key, old value, new value)`` for each key of `RESUME_NOT_BITWISE_KEYS` that differs."""
    return [change for change in _differences(old, new) if _under(change[0], RESUME_NOT_BITWISE_KEYS)]


def _under(key: str, prefixes: Iterable[str]) -> bool:
    return any(key == p or key.startswith(f"{p}.") for p in prefixes)


def _differences(old: Mapping[str, Any], new: Mapping[str, Any]) -> list[tuple[str, Any, Any]]:
    """Every leaf whose value, as the run uses it (`_resolved`), differs; keys neither config uses skipped."""
    before = leaves(_with_defaults(old, TrainerConfig))
    after = leaves(_with_defaults(new, TrainerConfig))
    out = []

    def unused(key: str) -> bool:
        used = [uses for prefix, uses in RESUME_CONDITIONAL_KEYS.items() if _under(key, (prefix,))]
        return bool(used) and not any(uses(before) or uses(after) for uses in used)

    for key, value in after.items():
        if unused(key):
            continue
        a, b = _resolved(key, before.get(key), before), _resolved(key, value, after)
        if a != b:
            if before.get(key) == value:  # one spelling, two meanings: show what each run computes with
                out.append((key, f"{value} (as {a})", f"{value} (as {b})"))
            else:
                out.append((key, before.get(key), value))
    # A key of a free-form mapping (``rollout.vllm.engine_args``) that only the old run set: the user
    # removed it, so the run no longer gets it (a key this version removed from the schema is not here).
    for key in sorted(before.keys() - after.keys()):
        if _in_free_form_mapping(key) and not unused(key):
            out.append((key, before[key], "(not set)"))
    return out


def _in_free_form_mapping(key: str, cls: type = TrainerConfig) -> bool:
    """Whether dotted ``key`` lies inside a ``dict``-typed field of the config's schema."""
    head, _, rest = key.partition(".")
    fields = {f.name for f in dataclasses.fields(cls)}
    if head not in fields or not rest:
        return False
    tp = field_hints(cls)[head]
    if dataclasses.is_dataclass(tp):
        return _in_free_form_mapping(rest, tp)  # type: ignore[arg-type]
    return typing.get_origin(tp) is dict or tp is dict


def _resolved(key: str, value: Any, config: Mapping[str, Any]) -> Any:
    """``value`` of ``key`` as the run uses it, given the rest of its ``config`` (dotted leaves)."""
    if key == "model.device" and isinstance(value, str):
        return resolve_device_type(value)  # 'auto' is cpu on a machine without CUDA; cuda:1 is cuda
    # 'auto' and the dtype it stands for on the config's device are the same run (a v0.2 checkpoint
    # says float32 where this version's default says auto).
    if key == "model.dtype" and isinstance(value, str):
        device = config.get("model.device")
        return resolved_model_dtype(value, resolve_device_type(device if isinstance(device, str) else "auto"))
    if key in RESUME_PATH_KEYS:
        return _PathValue(value)
    return value


class _PathValue:
    """A path setting (a string, "" for none, or a list of them) that equals another spelling of it."""

    def __init__(self, value: Any) -> None:
        self.value = value

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, _PathValue):
            return NotImplemented
        a, b = self.value, other.value
        if isinstance(a, list) and isinstance(b, list):
            return len(a) == len(b) and all(_same_path(x, y) for x, y in zip(a, b, strict=True))
        return _same_path(a, b)

    __hash__ = None  # type: ignore[assignment]


def _same_path(a: Any, b: Any) -> bool:
    """Two path settings that name the same file or folder: equal after ``~`` expansion and
    normalisation (a trailing slash, ``./``, ``a/../b``), or two spellings of one existing file."""
    if not isinstance(a, str) or not isinstance(b, str) or not a or not b:
        return a == b  # "" (no path: the tiny model) is not a spelling of any folder
    x, y = (os.path.normpath(os.path.expanduser(p)) for p in (a, b))
    if x == y:
        return True
    try:
        return os.path.samefile(x, y)
    except OSError:  # either is missing: only the spelling can tell
        return False


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
