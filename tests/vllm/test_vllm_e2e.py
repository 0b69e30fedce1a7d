"""The e2e script with ``rollout.engine=vllm_omni`` (``bash tests/vllm/run.sh``).

A module of its own, apart from test_vllm_engine.py: run.sh hands whole modules to its pytest-xdist
workers (``--dist loadfile``), and this whole-process test runs beside that module's shared worker.
"""

from __future__ import annotations

import json
import os
import re
import socket
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.vllm


def test_the_e2e_script_with_the_vllm_omni_engine(tmp_path):
    """The user's path: `trainer <recipe> rollout.engine=vllm_omni` launches its own worker from the
    rollout environment (edit rows, CFG, KL, evaluation, checkpoints), and stops it at the end."""
    script = Path(__file__).parents[1] / "special_e2e" / "run_flowgrpo_boogu_image.sh"
    env = {
        **os.environ,
        "MODE": "edit",
        "NUM_GPUS": "0",
        "WORK_DIR": str(tmp_path),
        "PYTHON": sys.executable,
        "OMP_NUM_THREADS": "1",
        "EXTRA_OVERRIDES": "rollout.engine=vllm_omni rollout.vllm.backend=direct",
    }
    result = subprocess.run(["bash", str(script)], env=env, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-5000:]
    assert "e2e OK (edit)" in result.stdout
    log = (tmp_path / "runs" / "e2e" / "logs" / "rollout_worker_rank0.log").read_text()
    served = re.search(r"boogu_vllm worker \(direct backend\) serving .* at http://127.0.0.1:(\d+)", log)
    assert served, log[-2000:]
    with pytest.raises(ConnectionRefusedError):  # the worker stopped with the run
        socket.create_connection(("127.0.0.1", int(served.group(1))), timeout=5).close()
    metrics = [
        json.loads(line) for line in (tmp_path / "runs" / "e2e" / "metrics.jsonl").read_text().splitlines()
    ]
    assert [m["weights_version"] for m in metrics] == [1, 2]
    assert all(m["nfe/rollout_per_image"] == 8.0 for m in metrics)  # 4 steps x 2 (CFG), from the worker
