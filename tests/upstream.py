"""Opt-in imports of upstream Boogu's own source, for the parity tests.

``BOOGU_UPSTREAM_SRC`` names one or more folders (joined with ``os.pathsep``) holding upstream's
``boogu/`` package and what it needs beyond this workspace (e.g. ``einops``)::

    git -C <upstream clone> archive HEAD boogu | tar -x -C /tmp/upsrc
    uv pip install --target /tmp/upextra einops
    BOOGU_UPSTREAM_SRC=/tmp/upsrc:/tmp/upextra uv run pytest tests/adapters/test_model_upstream_parity.py

Upstream is imported from there, never installed or vendored. Without the variable, the calling
test module is skipped.
"""

from __future__ import annotations

import importlib
import os
import sys
import warnings
from types import ModuleType

import pytest

ENV = "BOOGU_UPSTREAM_SRC"


def import_upstream(*modules: str, cpu_only: str | None = None) -> list[ModuleType]:
    """Put upstream's source on ``sys.path`` and import ``modules``; skip the calling module unless
    ``BOOGU_UPSTREAM_SRC`` is set. ``cpu_only``: a reason to skip when upstream's own ``device``
    environment variable selects CUDA (its CUDA kernels are not the path these tests pin)."""
    source = os.environ.get(ENV)
    if not source:
        pytest.skip(f"set {ENV} to upstream's source to run these tests", allow_module_level=True)
    if cpu_only and "cuda" in os.environ.get("device", "cpu"):  # noqa: SIM112 - upstream's lower-case name
        pytest.skip(f"upstream reads env 'device'; {cpu_only}", allow_module_level=True)
    for entry in reversed([p for p in source.split(os.pathsep) if p]):
        if entry not in sys.path:
            sys.path.insert(0, entry)
    loaded = []
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # upstream warns about missing triton / flash-attn
        for name in modules:
            try:
                loaded.append(importlib.import_module(name))
            except ImportError as error:
                pytest.skip(f"{ENV} is set but {name} does not import: {error}", allow_module_level=True)
    return loaded
