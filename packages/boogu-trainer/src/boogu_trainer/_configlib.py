"""A small typed-config engine: nested frozen dataclasses from YAML plus ``a.b=c`` overrides.

Every field is typed and documented by the string literal under it (its "field docstring"); this
module reads those docstrings with ``ast`` for ``--help`` and the README's config reference. Unknown
keys, wrong types and bad values are errors that name the full dotted key.
"""

from __future__ import annotations

import ast
import dataclasses
import inspect
import itertools
import json
import re
import textwrap
import types
import typing
from collections.abc import Mapping
from enum import Enum
from pathlib import Path
from typing import Any

import yaml

_NUMBER = re.compile(r"[-+]?(\d+\.?\d*|\.\d+)([eE][-+]?\d+)?")


class ConfigError(ValueError):
    """A config value or key is invalid; the message names the dotted key."""


def field_docs(cls: type) -> dict[str, str]:
    """Field name -> the docstring written under it in the class body."""
    try:
        source = textwrap.dedent(inspect.getsource(cls))
    except (OSError, TypeError):
        return {}
    tree = ast.parse(source)
    body = tree.body[0].body  # type: ignore[attr-defined]
    docs: dict[str, str] = {}
    for node, nxt in itertools.pairwise(body):
        if (
            isinstance(node, ast.AnnAssign)
            and isinstance(node.target, ast.Name)
            and isinstance(nxt, ast.Expr)
            and isinstance(nxt.value, ast.Constant)
            and isinstance(nxt.value.value, str)
        ):
            docs[node.target.id] = " ".join(nxt.value.value.split())
    return docs


def _type_name(tp: Any) -> str:
    origin = typing.get_origin(tp)
    if origin in (typing.Union, types.UnionType):
        return " | ".join(_type_name(a) for a in typing.get_args(tp))
    if origin is typing.Literal:
        return " | ".join(repr(a) for a in typing.get_args(tp))
    if origin is not None:
        args = ", ".join("..." if a is Ellipsis else _type_name(a) for a in typing.get_args(tp))
        return f"{getattr(origin, '__name__', str(origin))}[{args}]"
    if tp is type(None):
        return "null"
    if isinstance(tp, type) and issubclass(tp, Enum):
        return " | ".join(repr(m.value) for m in tp)
    return getattr(tp, "__name__", str(tp))


def _coerce(value: Any, tp: Any, key: str) -> Any:
    """Check ``value`` against the annotation ``tp``; allow int -> float and list -> tuple only."""
    origin = typing.get_origin(tp)
    if tp is Any:
        return value
    if origin in (typing.Union, types.UnionType):
        errors = []
        for arg in typing.get_args(tp):
            try:
                return _coerce(value, arg, key)
            except ConfigError as e:
                errors.append(str(e))
        raise ConfigError(f"{key}: expected {_type_name(tp)}, got {value!r}")
    if tp is type(None):
        if value is None:
            return None
        raise ConfigError(f"{key}: expected null, got {value!r}")
    if origin is typing.Literal:
        if value in typing.get_args(tp):
            return value
        raise ConfigError(f"{key}: expected one of {list(typing.get_args(tp))}, got {value!r}")
    if dataclasses.is_dataclass(tp):
        if isinstance(value, tp):
            return value
        if not isinstance(value, Mapping):
            raise ConfigError(f"{key}: expected a mapping of {tp.__name__} fields, got {value!r}")
        return from_mapping(tp, value, prefix=key)
    if origin in (list, tuple):
        if not isinstance(value, list | tuple):
            raise ConfigError(f"{key}: expected a list, got {value!r}")
        args = typing.get_args(tp)
        if origin is tuple and args and args[-1] is not Ellipsis:
            if len(args) != len(value):
                raise ConfigError(f"{key}: expected {len(args)} items, got {len(value)}")
            return tuple(_coerce(v, a, f"{key}[{i}]") for i, (v, a) in enumerate(zip(value, args)))
        item = args[0] if args else Any
        out = [_coerce(v, item, f"{key}[{i}]") for i, v in enumerate(value)]
        return tuple(out) if origin is tuple else out
    if origin is dict:
        if not isinstance(value, Mapping):
            raise ConfigError(f"{key}: expected a mapping, got {value!r}")
        return dict(value)
    if isinstance(tp, type) and issubclass(tp, Enum):
        try:
            return tp(value)
        except ValueError:
            raise ConfigError(f"{key}: expected one of {[m.value for m in tp]}, got {value!r}") from None
    if tp is bool:
        if isinstance(value, bool):
            return value
        raise ConfigError(f"{key}: expected true or false, got {value!r}")
    if tp is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
        raise ConfigError(f"{key}: expected an integer, got {value!r}")
    if tp is float:
        if isinstance(value, int | float) and not isinstance(value, bool):
            return float(value)
        if isinstance(value, str) and _NUMBER.fullmatch(value.strip()):
            return float(value)  # YAML 1.1 reads '1e-3' (no dot) as a string
        raise ConfigError(f"{key}: expected a number, got {value!r}")
    if tp is str:
        if isinstance(value, str):
            return value
        raise ConfigError(f"{key}: expected a string, got {value!r}")
    if isinstance(tp, type) and isinstance(value, tp):
        return value
    raise ConfigError(f"{key}: expected {_type_name(tp)}, got {value!r}")


def from_mapping(cls: type, mapping: Mapping[str, Any], prefix: str = "") -> Any:
    """Build dataclass ``cls`` from a nested mapping; unknown keys are errors naming the key."""
    hints = typing.get_type_hints(cls)
    names = {f.name for f in dataclasses.fields(cls) if f.init}
    kwargs = {}
    for key, value in mapping.items():
        dotted = f"{prefix}.{key}" if prefix else str(key)
        if key not in names:
            close = [n for n in names if n.startswith(str(key)[:3])]
            hint = f" (did you mean {', '.join(sorted(close))}?)" if close else ""
            raise ConfigError(
                f"unknown config key {dotted!r}{hint}; allowed here: {', '.join(sorted(names))}"
            )
        kwargs[key] = _coerce(value, hints[key], dotted)
    try:
        return cls(**kwargs)
    except ConfigError:
        raise
    except ValueError as e:
        raise ConfigError(f"{prefix + ': ' if prefix else ''}{e}") from e


def to_mapping(obj: Any) -> Any:
    """Plain YAML-able data (enums as values, tuples as lists)."""
    if dataclasses.is_dataclass(obj):
        return {f.name: to_mapping(getattr(obj, f.name)) for f in dataclasses.fields(obj)}
    if isinstance(obj, Enum):
        return obj.value
    if isinstance(obj, list | tuple):
        return [to_mapping(v) for v in obj]
    if isinstance(obj, Mapping):
        return {k: to_mapping(v) for k, v in obj.items()}
    return obj


def parse_override(text: str) -> tuple[list[str], Any]:
    """``a.b=c`` -> (["a", "b"], yaml value of c)."""
    if "=" not in text:
        raise ConfigError(f"override {text!r}: expected key=value (e.g. optim.lr=1e-4)")
    key, raw = text.split("=", 1)
    if not key or any(not part for part in key.split(".")):
        raise ConfigError(f"override {text!r}: bad key")
    try:
        value = yaml.safe_load(raw) if raw != "" else ""
    except yaml.YAMLError as e:
        raise ConfigError(f"override {text!r}: cannot parse the value ({e})") from e
    return key.split("."), value


def apply_overrides(data: dict[str, Any], overrides: list[str]) -> dict[str, Any]:
    for text in overrides:
        path, value = parse_override(text)
        node = data
        for part in path[:-1]:
            child = node.get(part)
            if child is None:
                child = node[part] = {}
            if not isinstance(child, dict):
                raise ConfigError(f"override {text!r}: {part!r} is not a section")
            node = child
        node[path[-1]] = value
    return data


def load(
    cls: type, path: str | Path | None = None, overrides: list[str] | None = None, base: Any = None
) -> Any:
    """``base`` (or defaults), then the YAML file, then overrides; validated as a whole."""
    data: dict[str, Any] = to_mapping(base) if base is not None else {}
    if path is not None:
        try:
            loaded = yaml.safe_load(Path(path).read_text(encoding="utf-8")) or {}
        except yaml.YAMLError as e:
            raise ConfigError(f"{path}: not valid YAML ({e})") from e
        except OSError as e:
            raise ConfigError(f"{path}: cannot read the recipe ({e.strerror})") from e
        if not isinstance(loaded, dict):
            raise ConfigError(f"{path}: a recipe must be a mapping of sections")
        _merge(data, loaded)
    apply_overrides(data, overrides or [])
    return from_mapping(cls, data)


def _merge(into: dict[str, Any], other: Mapping[str, Any]) -> None:
    for k, v in other.items():
        if isinstance(v, Mapping) and isinstance(into.get(k), dict):
            _merge(into[k], v)
        else:
            into[k] = v


def describe(cls: type, prefix: str = "") -> list[tuple[str, str, str, str]]:
    """Rows ``(dotted key, type, default, doc)`` for every leaf field, depth first."""
    rows = []
    hints = typing.get_type_hints(cls)
    docs = field_docs(cls)
    defaults = cls()
    for f in dataclasses.fields(cls):
        key = f"{prefix}{f.name}"
        tp = hints[f.name]
        if dataclasses.is_dataclass(tp):
            rows.append((key, "section", "", docs.get(f.name, "")))
            rows.extend(describe(tp, key + "."))
            continue
        default = to_mapping(getattr(defaults, f.name))
        rows.append((key, _type_name(tp), json.dumps(default), docs.get(f.name, "")))
    return rows
