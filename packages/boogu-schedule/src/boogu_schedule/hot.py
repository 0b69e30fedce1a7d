"""Functions that run once per iteration of a hot loop, marked where they are defined.

`per_iteration` marks a function whose body runs once per denoising step, micro-batch, loss term or
optimizer step. It returns the function itself (no wrapper: nothing changes when it runs) and records
its code object, so that a checker walking the stack can tell that a frame is inside such a loop: the
fake-CUDA dry run (``boogu_dryrun``) reports every host read under a marked frame, since on a
GPU each one stalls the queue once per iteration. A mark travels with the function: renaming or
moving it keeps it watched (a list of names would silently drop it).
"""

from __future__ import annotations

from collections.abc import Callable
from types import CodeType
from typing import Any, TypeVar

F = TypeVar("F", bound=Callable[..., Any])

_MARKED: dict[CodeType, str] = {}


def per_iteration(fn: F) -> F:
    """Mark ``fn`` (a plain function or method, undecorated: mark it innermost) as run once per
    iteration of a hot loop; returns ``fn``."""
    code = getattr(fn, "__code__", None)
    if not isinstance(code, CodeType):
        raise TypeError(f"per_iteration marks a plain function (innermost decorator), got {fn!r}")
    _MARKED[code] = f"{fn.__module__}:{fn.__qualname__}"
    return fn


def is_per_iteration(code: CodeType) -> bool:
    """Whether ``code`` (a frame's ``f_code``) is a marked function's."""
    return code in _MARKED


def per_iteration_functions() -> list[str]:
    """``module:qualname`` of every marked function imported so far, sorted."""
    return sorted(_MARKED.values())


__all__ = ["is_per_iteration", "per_iteration", "per_iteration_functions"]
