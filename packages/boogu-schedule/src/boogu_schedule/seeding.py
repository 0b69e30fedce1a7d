"""Seed derivation: every random stream of a run comes from one user seed and a path of keys.

``derive_seed(seed, k1, k2, ...)`` folds the keys into the seed one at a time with splitmix64's
finaliser, so nearby seeds and keys give unrelated 63-bit seeds. Integer keys are used as they are;
string keys (domain tags such as ``"data"``) are hashed with SHA-256 first, so two uses with different
tags never share a stream. Both rollout engines and the trainer derive their generators here, which
is what lets a second engine reproduce the first one's noise exactly.
"""

from __future__ import annotations

import contextlib
import hashlib
from collections.abc import Callable, Iterator

import torch

__all__ = ["GeneratorFactory", "derive_seed", "generator_factory", "make_generator"]

_MASK64 = 0xFFFFFFFFFFFFFFFF


def _key_int(key: int | str) -> int:
    if isinstance(key, bool) or not isinstance(key, int | str):
        raise TypeError(f"derive_seed: keys must be int or str, got {type(key).__name__}")
    if isinstance(key, str):
        return int.from_bytes(hashlib.sha256(key.encode("utf-8")).digest()[:8], "little")
    return key


def _mix(seed: int, key: int) -> int:
    z = (seed * 0x9E3779B97F4A7C15 + (key + 1) * 0xBF58476D1CE4E5B9) & _MASK64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK64
    return (z ^ (z >> 31)) & 0x7FFFFFFFFFFFFFFF


def derive_seed(seed: int, *keys: int | str) -> int:
    """A seed in ``[0, 2**63)`` for the stream ``keys`` of ``seed`` (``seed`` itself without keys)."""
    if isinstance(seed, bool) or not isinstance(seed, int):
        raise TypeError(f"derive_seed: seed must be an int, got {type(seed).__name__}")
    out = seed & 0x7FFFFFFFFFFFFFFF
    for key in keys:
        out = _mix(out, _key_int(key))
    return out


GeneratorFactory = Callable[[torch.device], torch.Generator]
"""Makes an unseeded generator for a device (the seam a fake-CUDA dry run replaces)."""


def _torch_generator(device: torch.device) -> torch.Generator:
    return torch.Generator(device=device)


_factory: GeneratorFactory = _torch_generator


def make_generator(seed: int, device: torch.device | str = "cpu") -> torch.Generator:
    """A ``torch.Generator`` on ``device`` seeded with ``seed``: the one place the packages make one.

    A CUDA generator cannot be made without a driver, so a dry run on fake CUDA tensors swaps the
    factory (:func:`generator_factory`) for one that records the device each generator was asked
    for, and checks every random op against it. Random ops given a generator must also be given
    ``device=generator.device``: without it ``torch.randint`` makes a CPU tensor, which a CUDA
    generator refuses.
    """
    return _factory(torch.device(device)).manual_seed(seed)


@contextlib.contextmanager
def generator_factory(factory: GeneratorFactory) -> Iterator[None]:
    """Inside the block :func:`make_generator` makes its generators with ``factory``."""
    global _factory
    previous, _factory = _factory, factory
    try:
        yield
    finally:
        _factory = previous
