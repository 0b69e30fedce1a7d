"""Shared pytest set-up: hypothesis profiles and offline environment for every test package."""

from __future__ import annotations

import os
import tempfile

from hypothesis import HealthCheck, settings

# Nothing in the test suite may reach a model hub.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
# Remote-code copies (diffusers/transformers dynamic modules) go to a per-session temp folder, not $HOME.
os.environ.setdefault("HF_MODULES_CACHE", tempfile.mkdtemp(prefix="boogu-hf-modules-"))

# Tensor code has no meaningful per-example deadline on a shared 2-core machine.
settings.register_profile("dev", max_examples=25, deadline=None)
settings.register_profile(
    "ci", max_examples=50, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.too_slow]
)
settings.register_profile("nightly", max_examples=1000, deadline=None)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci" if os.environ.get("CI") else "dev"))
