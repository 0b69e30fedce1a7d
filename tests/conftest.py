"""Shared pytest set-up: hypothesis profiles and offline environment for every test package."""

from __future__ import annotations

import atexit
import os
import shutil
import tempfile
import time
from pathlib import Path

import pytest
from hypothesis import HealthCheck, settings

# Idle OpenMP threads must not spin on a shared 2-core machine (set before torch is imported).
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
# Under pytest-xdist (`-n auto` in pyproject.toml) the workers share the cores: each gets its share of
# threads rather than one per core (four threads on two cores make every worker slower).
if "PYTEST_XDIST_WORKER_COUNT" in os.environ:
    _threads = max(1, (os.cpu_count() or 1) // int(os.environ["PYTEST_XDIST_WORKER_COUNT"]))
    os.environ.setdefault("OMP_NUM_THREADS", str(_threads))
# Nothing in the test suite may reach a model hub.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
# Remote-code copies (diffusers/transformers dynamic modules) go to a per-session temp folder, not
# $HOME, removed when the session ends (subprocesses inherit the variable and share the folder).
# Each pytest-xdist worker makes its own, so that two workers never write the same copy at once.
_own_cache = os.environ.get("BOOGU_TESTS_OWN_MODULES_CACHE") == "1"
if "HF_MODULES_CACHE" not in os.environ or (_own_cache and "PYTEST_XDIST_WORKER" in os.environ):
    _modules_cache = tempfile.mkdtemp(prefix="boogu-hf-modules-")
    os.environ["HF_MODULES_CACHE"] = _modules_cache
    os.environ["BOOGU_TESTS_OWN_MODULES_CACHE"] = "1"
    atexit.register(shutil.rmtree, _modules_cache, ignore_errors=True)

# Tensor code has no meaningful per-example deadline on a shared 2-core machine.
settings.register_profile("dev", max_examples=25, deadline=None)
settings.register_profile(
    "ci", max_examples=50, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.too_slow]
)
settings.register_profile("nightly", max_examples=1000, deadline=None)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci" if os.environ.get("CI") else "dev"))


@pytest.fixture(scope="session")
def tiny_build(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, float]:
    """A freshly built tiny checkpoint and its build time in seconds (imports excluded)."""
    from boogu_tiny.checkpoints import ensure_tiny_checkpoint  # imported before the clock starts

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
