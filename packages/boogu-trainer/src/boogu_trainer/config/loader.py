"""Loading a config: defaults (or a base), a YAML recipe, then ``a.b=c`` overrides.

Recipes are YAML files of the sections; overrides on the command line go on top, and ``${...}``
interpolations (OmegaConf's) in either are resolved before anything is validated. The dataclasses
are OmegaConf structured configs: OmegaConf checks the types (and ``Literal`` choices) as each value
is set, :func:`load_config` names the full dotted key of anything wrong, and each ``__post_init__``
checks the values, so a loaded config has passed every check the trainer makes.

OmegaConf does the YAML, the dot-lists, the type checks and the interpolation; the walk below sets
one key at a time so that every error names its full dotted key (OmegaConf leaves the key out of
tuple-length errors and out of errors inside list items, and keeps the items of a
``tuple[Dataclass, ...]`` untyped, so reward.rewards items are typed here).
"""

from __future__ import annotations

import dataclasses
import difflib
import types
import typing
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import yaml
from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException

from boogu_trainer.config.checks import check_ignored_settings
from boogu_trainer.config.fields import field_hints, leaves, record_type, type_name
from boogu_trainer.config.sections import CHECK_REWARD_SPECS, ConfigError, TrainerConfig


def load_config(
    recipe: str | Path | None = None,
    overrides: list[str] | None = None,
    base: TrainerConfig | None = None,
    *,
    saved: bool = False,
    check_rewards: bool = True,
) -> TrainerConfig:
    """Defaults (or ``base``), then the YAML recipe, then ``a.b=c`` overrides; ``${...}`` resolved,
    then validated as a whole. Raises `ConfigError` naming the dotted key.

    ``saved``: the recipe is a run's own ``config.yaml`` (every key written, the algorithm's unused
    ones included), so none of its keys counts as the user's choice for `check_ignored_settings`;
    the overrides still do. ``check_rewards=False``: the reward specs are not resolved (no reward
    module is imported), for a caller that scores nothing (``boogu-sample``)."""
    node = _writable(OmegaConf.structured(TrainerConfig if base is None else base))
    given: set[str] = set()  # the dotted keys the recipe and the overrides set
    if recipe is not None:
        data = _read_recipe(recipe)
        if not saved:
            given |= set(leaves(data))
        _set_section(node, TrainerConfig, data, "")
    for text in overrides or []:
        data = _parse_override(text)
        given |= set(leaves(data))
        _set_section(node, TrainerConfig, data, "")
    _resolve(node, TrainerConfig, "")
    token = CHECK_REWARD_SPECS.set(check_rewards)
    try:
        config = OmegaConf.to_object(node)  # builds the frozen dataclasses: __post_init__ validates
    except ConfigError:
        raise
    except OmegaConfBaseException as e:
        raise ConfigError(f"{e.full_key or 'config'}: {_reason(e)}") from None
    except ValueError as e:
        raise ConfigError(str(e)) from e
    finally:
        CHECK_REWARD_SPECS.reset(token)
    check_ignored_settings(config, given)
    return config


def _read_recipe(path: str | Path) -> dict[str, Any]:
    try:
        loaded = OmegaConf.load(Path(path))  # OmegaConf's YAML: 1e-4 is a float, not YAML 1.1's string
    except yaml.YAMLError as e:
        raise ConfigError(f"{path}: not valid YAML ({e})") from None
    except OSError as e:
        raise ConfigError(f"{path}: cannot read the recipe ({e.strerror})") from None
    except UnicodeDecodeError as e:
        raise ConfigError(
            f"{path}: not UTF-8 text (byte {e.object[e.start]:#04x} at offset {e.start}); "
            "save the recipe as UTF-8"
        ) from None
    except OmegaConfBaseException as e:
        raise ConfigError(f"{path}: {_reason(e)}") from None
    if not isinstance(loaded, DictConfig):
        raise ConfigError(f"{path}: a recipe must be a mapping of sections")
    return OmegaConf.to_container(loaded, resolve=False)  # type: ignore[return-value]


def _parse_override(text: str) -> dict[str, Any]:
    """``a.b=c`` -> ``{"a": {"b": c}}``, c read as OmegaConf reads dot-lists (interpolations kept)."""
    key, sep, raw = text.partition("=")
    if not sep:
        raise ConfigError(f"override {text!r}: expected key=value (e.g. optim.lr=1e-4)")
    parts = key.split(".")
    if not all(parts):
        raise ConfigError(f"override {text!r}: bad key")
    value: Any = ""
    if raw:
        try:
            value = OmegaConf.to_container(OmegaConf.from_dotlist([f"value={raw}"]), resolve=False)["value"]
        except yaml.YAMLError as e:
            raise ConfigError(f"override {text!r}: cannot parse the value ({e})") from None
        except OmegaConfBaseException as e:
            raise ConfigError(f"override {text!r}: {_reason(e)}") from None
    for part in reversed(parts):
        value = {part: value}
    return value


def _set_section(node: DictConfig, cls: type, data: Mapping[Any, Any], prefix: str) -> None:
    """Set each key of ``data`` on the structured ``node`` of dataclass ``cls``."""
    hints = field_hints(cls)
    for name, value in data.items():
        key = f"{prefix}{name}"
        if name not in hints:
            close = difflib.get_close_matches(str(name), hints, n=3)
            hint = f" (did you mean {', '.join(close)}?)" if close else ""
            raise ConfigError(f"unknown config key {key!r}{hint}; allowed here: {', '.join(hints)}")
        tp = hints[name]
        if dataclasses.is_dataclass(tp):
            if not isinstance(value, Mapping):
                raise ConfigError(f"{key}={value!r}: expected a section (a mapping of {key}.* keys)")
            _set_section(node[name], tp, value, f"{key}.")
        else:
            _set_value(node, name, tp, value, key)


def _set_value(node: DictConfig, name: str, tp: Any, value: Any, key: str) -> None:
    shown = value
    if isinstance(value, bool) and typing.get_origin(tp) is typing.Literal:
        word = "on" if value else "off"  # YAML 1.1 reads a bare on/off as a boolean
        if word in typing.get_args(tp):
            value = word
    record = record_type(tp)
    if record is not None:
        if not isinstance(value, list | tuple):
            raise ConfigError(
                f"{key}={value!r}: expected a list of mappings of {', '.join(field_hints(record))}"
            )
        value = [_record(record, item, f"{key}[{i}]") for i, item in enumerate(value)]
    elif not _strict_scalar_ok(value, tp):
        raise ConfigError(f"{key}={value!r}: expected {type_name(tp)}")
    try:
        OmegaConf.update(node, name, value, merge=False)  # converts, checks against the annotation
    except OmegaConfBaseException:
        raise ConfigError(f"{key}={shown!r}: expected {type_name(tp)}") from None


def _record(cls: type, data: Any, key: str) -> DictConfig:
    """One typed item of a ``tuple[Dataclass, ...]`` field."""
    if not isinstance(data, Mapping):
        raise ConfigError(f"{key}={data!r}: expected a mapping of {', '.join(field_hints(cls))}")
    item = _writable(OmegaConf.structured(cls))
    _set_section(item, cls, data, f"{key}.")
    return item


def _strict_scalar_ok(value: Any, tp: Any) -> bool:
    """False for a non-bool in a bool field or a non-string in a str field: OmegaConf would turn
    2 into True and 1e3 into '1000.0', silently."""
    if value is None or _is_interpolation(value):
        return True
    args = typing.get_args(tp) if typing.get_origin(tp) in (typing.Union, types.UnionType) else (tp,)
    kinds = [a for a in args if a is not type(None)]
    if kinds == [bool]:
        return isinstance(value, bool)
    if kinds == [str]:
        return isinstance(value, str)
    return True


def _is_interpolation(value: Any) -> bool:
    return isinstance(value, str) and "${" in value


def _resolve(node: DictConfig, cls: type, prefix: str) -> None:
    """Resolve every ``${...}`` (checked against its field's type), errors naming the key."""
    for name, tp in field_hints(cls).items():
        key = f"{prefix}{name}"
        record = record_type(tp)
        if dataclasses.is_dataclass(tp):
            _resolve(node[name], tp, f"{key}.")
        elif record is not None:
            for i, item in enumerate(node[name]):
                _resolve(item, record, f"{key}[{i}].")
        else:
            try:
                value = node[name]
                if OmegaConf.is_config(value):
                    OmegaConf.to_container(value, resolve=True)
            except OmegaConfBaseException as e:
                raw = OmegaConf.to_container(node, resolve=False)[name]  # type: ignore[index]
                raise ConfigError(f"{key}={raw!r}: {_reason(e)}") from None


def _reason(e: OmegaConfBaseException) -> str:
    """OmegaConf's message without its 'full_key: ...' trailer."""
    return str(e).splitlines()[0] if str(e) else type(e).__name__


def _writable(node: Any) -> Any:
    """Clear the read-only flags OmegaConf sets for frozen dataclasses (the objects stay frozen)."""
    OmegaConf.set_readonly(node, None)
    for child in node.values() if isinstance(node, DictConfig) else node:
        if OmegaConf.is_config(child):
            _writable(child)
    return node
