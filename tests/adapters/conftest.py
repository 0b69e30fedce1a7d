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
from pathlib import Path

import pytest

_MODULES_CACHE = tempfile.mkdtemp(prefix="boogu-tests-hf-modules-")
os.environ["HF_MODULES_CACHE"] = _MODULES_CACHE
atexit.register(shutil.rmtree, _MODULES_CACHE, ignore_errors=True)


@pytest.fixture(scope="session")
def modules_cache() -> Path:
    """Where remote-code modules are copied to during this session."""
    return Path(_MODULES_CACHE)
