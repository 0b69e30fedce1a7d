"""The vllm-omni worker splits a request into ``spec.micro_batch_size`` chunks (``bash tests/vllm/run.sh``).

The check is ``micro_batch_check.py``, run as a subprocess with the rollout environment's python
(boogu_vllm and vllm-omni are not installed in the workspace's environment); see its docstring.
"""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest

from boogu_adapters.vllm_engine import default_project_dir

pytestmark = pytest.mark.vllm

SCRIPT = Path(__file__).with_name("micro_batch_check.py")


def test_worker_micro_batches_equal_the_whole_request(tiny_checkpoint):
    python = default_project_dir() / ".venv" / "bin" / "python"
    if not python.exists():
        pytest.fail(f"the rollout environment is missing ({python}): run bash tests/vllm/run.sh")
    env = {k: v for k, v in os.environ.items() if k not in ("VIRTUAL_ENV", "PYTHONPATH")}
    proc = subprocess.run(
        [str(python), str(SCRIPT), str(tiny_checkpoint)],
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    output = proc.stdout + proc.stderr
    tail = "\n".join(output.splitlines()[-40:])
    assert proc.returncode == 0, f"{SCRIPT.name} exited {proc.returncode}:\n{tail}"
    last = proc.stdout.strip().splitlines()[-1] if proc.stdout.strip() else ""
    assert last.startswith("micro_batch_check: OK"), f"no summary line from {SCRIPT.name}:\n{tail}"
    print(last)


def test_the_engine_sends_its_micro_batch_size(tmp_path):
    """``rollout.micro_batch_size`` reaches the worker: the engine puts it in every request's spec."""
    from boogu_adapters.types import RolloutRequest
    from boogu_adapters.vllm_engine import VllmOmniRolloutEngine
    from boogu_data import PromptRecord
    from boogu_protocol import RolloutSpec
    from boogu_schedule import WindowPlan

    engine = VllmOmniRolloutEngine.__new__(VllmOmniRolloutEngine)  # no worker: spec() is pure
    engine.micro_batch_size = 3
    request = RolloutRequest(
        [PromptRecord(instruction="a red fox")],
        group_size=4,
        num_steps=2,
        guidance_scale=1.0,
        height=32,
        width=32,
        seed=0,
        window=WindowPlan(kind="random", size=1),
    )
    spec, _ = engine.spec(request)
    assert RolloutSpec.from_json(spec.to_json()).micro_batch_size == 3
    with pytest.raises(ValueError, match="micro_batch_size must be an int >= 0"):
        VllmOmniRolloutEngine(tmp_path, url="http://127.0.0.1:1", micro_batch_size=-1)
