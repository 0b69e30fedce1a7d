"""Runs tests/special_e2e/run_flowgrpo_boogu_image.sh: T2I and edit, on 1 and on 2 gloo ranks."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).with_name("run_flowgrpo_boogu_image.sh")
REPO = SCRIPT.parents[2]


@pytest.mark.slow
@pytest.mark.parametrize("nproc", [1, 2])
@pytest.mark.parametrize("mode", ["t2i", "edit"])
def test_e2e(mode, nproc, tmp_path):
    env = {
        **os.environ,
        "MODE": mode,
        "NPROC": str(nproc),
        "NUM_GPUS": "0",
        "WORK_DIR": str(tmp_path),
        "PYTHON": sys.executable,
        "OMP_NUM_THREADS": "1",
    }
    result = subprocess.run(
        ["bash", str(SCRIPT)], cwd=REPO, env=env, capture_output=True, text=True, timeout=600
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-5000:]
    assert f"e2e OK ({mode})" in result.stdout
    assert (tmp_path / "runs" / "e2e" / "checkpoints" / "step_000002" / "adapter_model.safetensors").is_file()
