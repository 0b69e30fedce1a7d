"""Reward registry: built-in rewards by name, a user's own reward by import path.

``build_reward(name, **kwargs)`` resolves ``name`` as follows:

* a registered name (``available_rewards()``): its factory is called with ``kwargs``;
* ``"package.module:attribute"`` (a dotted attribute path after the colon is allowed), a user's
  own reward, with this rule:

  - a **class** is instantiated with ``kwargs``; the instance is the reward and must be callable
    as ``instance(images, records)``;
  - any other **callable** is the reward itself; ``kwargs`` are passed on every call, as
    ``fn(images, records, **kwargs)``. A factory that returns a reward function can be used by
    making it a class (or a registered factory, see ``register_reward``).

  Its output may be a tensor, a NumPy array or a sequence of numbers, one per image; it is
  checked and converted to a ``(B,)`` float32 tensor.

``validate_reward_spec(name, kwargs)`` makes the same checks of the name and the option names
without building the reward, so a config can reject a typo when it loads, before any model does;
a registered reward's ``check`` (``register_reward(name, check=...)``) also checks the option
values it can check cheaply (a URL's syntax, not whether a server answers).
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable, Mapping, Sequence
from typing import Any, TypeVar

import torch

from boogu_data import PromptRecord
from boogu_trainer.rewards.base import RewardError, RewardFn, check_batch, scores_tensor
from boogu_trainer.user_code import import_object

__all__ = [
    "CallableReward",
    "available_rewards",
    "build_reward",
    "load_user_reward",
    "register_reward",
    "validate_reward_spec",
]

RewardFactory = Callable[..., RewardFn]
OptionsCheck = Callable[[Mapping[str, Any]], None]
F = TypeVar("F", bound=RewardFactory)

_REGISTRY: dict[str, RewardFactory] = {}
_CHECKS: dict[str, OptionsCheck] = {}


def register_reward(name: str, *, check: OptionsCheck | None = None) -> Callable[[F], F]:
    """Decorator: register a reward factory (a class or a function returning a `RewardFn`) under ``name``.

    The factory's keyword arguments are the reward's options (``build_reward(name, **kwargs)``).
    ``check(kwargs)``, when given, checks the values of the options given (the others take their
    defaults) without building anything: no model, no network, no environment. It raises
    ValueError saying which option is wrong and why; `validate_reward_spec` calls it, so a config
    reports a bad value when it loads. The factory should apply the same rules (call the same
    function) when it builds. Registering a second, different factory under a taken name raises
    ValueError.
    """
    if check is not None and not callable(check):
        raise TypeError(f"register_reward({name!r}): check must be callable, got {type(check).__name__}")
    if not isinstance(name, str) or not name or ":" in name or name != name.strip():
        raise ValueError(
            f"reward name must be a non-empty string without ':' or surrounding spaces, got {name!r}"
        )

    def decorator(factory: F) -> F:
        if not callable(factory):
            raise TypeError(
                f"register_reward({name!r}) needs a callable factory, got {type(factory).__name__}"
            )
        existing = _REGISTRY.get(name)
        if existing is not None and existing is not factory:
            raise ValueError(f"a reward named {name!r} is already registered ({_describe(existing)})")
        _REGISTRY[name] = factory
        if check is not None:
            _CHECKS[name] = check
        return factory

    return decorator


def available_rewards() -> tuple[str, ...]:
    """Registered reward names, sorted."""
    return tuple(sorted(_REGISTRY))


def validate_reward_spec(name: str, kwargs: Mapping[str, Any]) -> None:
    """Check that ``build_reward(name, **kwargs)`` can be called, without building the reward.

    Checks the name (registered, or ``module:attribute`` that imports to a class or function), the
    option names against the factory's signature (unknown ones, missing required ones) and, for a
    reward registered with a ``check``, the option values that it checks; the other values are
    checked when the reward is built. Nothing is constructed, so no model or engine loads; a
    ``module:attribute`` name imports its module. Raises ValueError naming the reward and listing
    what is allowed (the available names, or the options it takes), or the check's ValueError.
    """
    _checked_factory(name, kwargs)


def build_reward(name: str, **kwargs: Any) -> RewardFn:
    """Build the reward ``name`` (a registered name or ``module:attribute``) with its options.

    Raises ValueError for an unknown name (listing the available ones) or options the reward does
    not take (listing the ones it does), as `validate_reward_spec` does.
    """
    factory = _checked_factory(name, kwargs)
    if ":" in name:
        return _user_reward(name, factory, kwargs)
    return factory(**kwargs)


def load_user_reward(path: str, **kwargs: Any) -> RewardFn:
    """Import a user's reward from ``"package.module:attribute"`` (see the module docstring for the rule)."""
    target = _checked_user_target(path, kwargs)
    return _user_reward(path, target, kwargs)


def _checked_factory(name: str, kwargs: Mapping[str, Any]) -> Callable[..., Any]:
    """The registered factory or the user's class/function for ``name``, once ``kwargs`` fit it."""
    if not isinstance(name, str) or not name:
        raise ValueError(f"reward name must be a non-empty string, got {name!r}")
    if not isinstance(kwargs, Mapping) or not all(isinstance(key, str) for key in kwargs):
        raise ValueError(f"reward {name!r}: 'kwargs' must be a mapping of option names, got {kwargs!r}")
    if ":" in name:
        return _checked_user_target(name, kwargs)
    factory = _REGISTRY.get(name)
    if factory is None:
        raise ValueError(
            f"unknown reward {name!r}; available: {', '.join(available_rewards())}, "
            "or a user function as 'package.module:function'"
        )
    _check_kwargs(name, factory, kwargs)
    check = _CHECKS.get(name)
    if check is not None:
        check(kwargs)
    return factory


def _checked_user_target(path: str, kwargs: Mapping[str, Any]) -> Callable[..., Any]:
    """Import ``"package.module:attribute"`` and check that it is a class or function taking ``kwargs``."""
    module_name, sep, attribute = path.partition(":")
    if not sep or not module_name or not attribute or ":" in attribute:
        raise ValueError(f"a user reward must be given as 'package.module:function', got {path!r}")
    try:
        target = import_object(path)
    except ValueError as error:
        raise ValueError(f"reward {path!r}: {error}") from error.__cause__
    if inspect.isclass(target):
        _check_kwargs(path, target, kwargs)
    elif not callable(target):
        raise ValueError(f"reward {path!r} is a {type(target).__name__}, not a function or class")
    elif kwargs:
        _check_kwargs(path, target, kwargs, leading=2)
    return target


def _user_reward(path: str, target: Callable[..., Any], kwargs: Mapping[str, Any]) -> RewardFn:
    """Wrap a checked user class (instantiated with ``kwargs``) or function (``kwargs`` bound)."""
    if inspect.isclass(target):
        instance = target(**kwargs)
        if not callable(instance):
            raise ValueError(f"reward {path!r}: instances of {target.__qualname__} are not callable")
        return CallableReward(path, instance)
    if kwargs:
        target = functools.partial(target, **kwargs)
    return CallableReward(path, target)


class CallableReward:
    """Adapts a user's callable to `RewardFn`: gives it a name and checks and converts its output."""

    def __init__(self, name: str, fn: Callable[[torch.Tensor, Sequence[PromptRecord]], object]) -> None:
        self.name = name
        self.fn = fn
        self.pass_fail = getattr(fn, "pass_fail", False) is True  # the user's declaration (RewardFn)

    def __call__(self, images: torch.Tensor, records: Sequence[PromptRecord]) -> torch.Tensor:
        batch_size = check_batch(images, records, self.name)
        try:
            values = self.fn(images, records)
        except RewardError:
            raise
        except Exception as error:
            # Name the reward: a traceback from deep inside a user module does not say which
            # configured reward it was.
            raise RewardError(f"reward {self.name!r} raised {type(error).__name__}: {error}") from error
        return scores_tensor(values, batch_size, self.name)

    def __repr__(self) -> str:
        return f"CallableReward({self.name!r})"


def _check_kwargs(
    name: str, factory: Callable[..., object], kwargs: Mapping[str, Any], leading: int = 0
) -> None:
    """Raise ValueError if ``factory`` cannot take ``kwargs`` (after ``leading`` positional arguments)."""
    try:
        signature = inspect.signature(factory)
    except (TypeError, ValueError):
        return  # builtins without a signature: let the call itself report
    try:
        signature.bind(*([None] * leading), **kwargs)
    except TypeError as error:
        raise ValueError(
            f"reward {name!r}: bad options {sorted(kwargs)}: {error}; it takes {signature}"
        ) from None


def _describe(factory: Callable[..., object]) -> str:
    return f"{getattr(factory, '__module__', '?')}.{getattr(factory, '__qualname__', repr(factory))}"
