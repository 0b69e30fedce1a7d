"""Importing what a config names as ``package.module:attribute`` (a user's reward, a learner of your
own): one loader, one set of messages."""

from __future__ import annotations

import importlib
from typing import Any


def import_object(path: str) -> Any:
    """The object ``'package.module:attribute'`` names (``attribute`` may be dotted). ValueError saying
    which module cannot be imported or which attribute is missing; the caller checks the format."""
    module_name, _, attribute = path.partition(":")
    try:
        target: Any = importlib.import_module(module_name)
    except ImportError as error:
        raise ValueError(f"cannot import module {module_name!r}: {error}") from error
    for part in attribute.split("."):
        try:
            target = getattr(target, part)
        except AttributeError:
            raise ValueError(f"{module_name!r} has no attribute {attribute!r}") from None
    return target


__all__ = ["import_object"]
