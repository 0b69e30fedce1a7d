"""Shared fixtures for the boogu_adapters tests: one tiny checkpoint per session, loaded once.

diffusers and transformers copy remote-code files into ``HF_MODULES_CACHE`` (``~/.cache/huggingface``
by default) and read that variable when they are imported, so it is pointed at a temporary folder
here, before any test module imports them.
"""

from __future__ import annotations

import atexit
import os
import shutil
import tempfile
import time
from pathlib import Path

import pytest

_MODULES_CACHE = tempfile.mkdtemp(prefix="boogu-tests-hf-modules-")
os.environ["HF_MODULES_CACHE"] = _MODULES_CACHE
atexit.register(shutil.rmtree, _MODULES_CACHE, ignore_errors=True)


@pytest.fixture(scope="session")
def modules_cache() -> Path:
    """Where remote-code modules are copied to during this session."""
    return Path(_MODULES_CACHE)


@pytest.fixture(scope="session")
def tiny_build(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, float]:
    """A freshly built tiny checkpoint and its build time in seconds (imports excluded)."""
    from boogu_adapters.tiny import ensure_tiny_checkpoint  # imported before the clock starts

    start = time.perf_counter()
    path = ensure_tiny_checkpoint(tmp_path_factory.mktemp("tiny") / "Boogu-Image")
    return path, time.perf_counter() - start


@pytest.fixture(scope="session")
def tiny_checkpoint(tiny_build: tuple[Path, float]) -> Path:
    """The session's tiny checkpoint folder. Tests must not modify it; copy it first."""
    return tiny_build[0]


@pytest.fixture(scope="session")
def tiny_parts(tiny_checkpoint: Path):
    """The tiny checkpoint loaded with the native transformer, float32 on the CPU."""
    from boogu_adapters.loading import load_boogu

    return load_boogu(tiny_checkpoint, transformer="native")


@pytest.fixture
def checkpoint_copy(tiny_checkpoint: Path, tmp_path: Path) -> Path:
    """A private copy of the tiny checkpoint that a test may break."""
    return Path(shutil.copytree(tiny_checkpoint, tmp_path / "Boogu-Image"))
