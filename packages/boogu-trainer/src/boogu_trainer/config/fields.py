"""Dataclass and annotation helpers shared by the sections, the loader, the resume diff and the reference.

Nothing here knows the trainer's sections: each function takes a dataclass (or its plain data) and
walks it, so that the three walks agree on what a field's type, default and plain value are.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import types
import typing
from collections.abc import Mapping
from typing import Any


class ConfigError(ValueError):
    """A config value or key is invalid; the message names the dotted key."""


def check(cond: bool, key: str, value: Any, allowed: str) -> None:
    if not cond:
        raise ConfigError(f"{key}={value!r}: expected {allowed}")


def check_finite(section: Any, prefix: str) -> None:
    """Every float of ``section`` (also inside tuple fields) is finite: OmegaConf reads .inf and nan."""
    for f in dataclasses.fields(section):
        value = getattr(section, f.name)
        allowed = "finite numbers" if isinstance(value, tuple) else "a finite number"
        for v in value if isinstance(value, tuple) else (value,):
            check(not isinstance(v, float) or math.isfinite(v), f"{prefix}{f.name}", value, allowed)


@functools.cache
def field_hints(cls: type) -> dict[str, Any]:
    """Field name -> resolved annotation, in field order."""
    hints = typing.get_type_hints(cls)
    return {f.name: hints[f.name] for f in dataclasses.fields(cls)}


def record_type(tp: Any) -> type | None:
    """``X`` for a ``tuple[X, ...]`` annotation whose items are dataclasses, else None."""
    args = typing.get_args(tp)
    if (
        typing.get_origin(tp) is tuple
        and len(args) == 2
        and args[1] is Ellipsis
        and dataclasses.is_dataclass(args[0])
    ):
        return args[0]  # type: ignore[return-value]
    return None


def field_default(f: dataclasses.Field[Any]) -> Any:
    """The value a field takes when it is not given (its default, or its factory's product)."""
    if f.default_factory is not dataclasses.MISSING:
        return f.default_factory()
    return f.default


def plain(obj: Any) -> Any:
    """Plain YAML-able data: nested dicts, lists (not tuples), numbers, strings, null."""
    if dataclasses.is_dataclass(obj):
        return {f.name: plain(getattr(obj, f.name)) for f in dataclasses.fields(obj)}
    if isinstance(obj, list | tuple):
        return [plain(v) for v in obj]
    if isinstance(obj, Mapping):
        return {k: plain(v) for k, v in obj.items()}
    return obj


def leaves(data: Mapping[str, Any], prefix: str = "") -> dict[str, Any]:
    """Dotted key -> value for every non-mapping value of nested ``data``."""
    out: dict[str, Any] = {}
    for k, v in data.items():
        if isinstance(v, Mapping):
            out.update(leaves(v, f"{prefix}{k}."))
        else:
            out[f"{prefix}{k}"] = v
    return out


def type_name(tp: Any) -> str:
    """An annotation as a user reads it: ``int | null``, ``'a' | 'b'``, ``tuple[str, ...]``."""
    origin = typing.get_origin(tp)
    if origin in (typing.Union, types.UnionType):
        return " | ".join(type_name(a) for a in typing.get_args(tp))
    if origin is typing.Literal:
        return " | ".join(repr(a) for a in typing.get_args(tp))
    if origin is not None:
        args = ", ".join("..." if a is Ellipsis else type_name(a) for a in typing.get_args(tp))
        return f"{getattr(origin, '__name__', str(origin))}[{args}]"
    if tp is type(None):
        return "null"
    return getattr(tp, "__name__", str(tp))
