"""``boogu_vllm.omni_backend`` with vllm-omni's engine faked, against the direct backend (``bash tests/vllm/run.sh``).

The check is ``omni_backend_check.py``, run as a subprocess with the rollout environment's python
(boogu_vllm and vllm-omni are not installed in the workspace's environment); see its docstring.
"""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest

from boogu_adapters.model import LORA_TARGET_MODULES
from boogu_adapters.vllm_engine import default_project_dir

pytestmark = pytest.mark.vllm

SCRIPT = Path(__file__).with_name("omni_backend_check.py")


def test_omni_backend_matches_the_direct_backend(tiny_checkpoint):
    python = default_project_dir() / ".venv" / "bin" / "python"
    if not python.exists():
        pytest.fail(f"the rollout environment is missing ({python}): run bash tests/vllm/run.sh")
    env = {k: v for k, v in os.environ.items() if k not in ("VIRTUAL_ENV", "PYTHONPATH")}
    proc = subprocess.run(
        # The trainer's LoRA targets travel on the command line (the rollout env has no boogu_adapters).
        [str(python), str(SCRIPT), str(tiny_checkpoint), ",".join(LORA_TARGET_MODULES)],
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    output = proc.stdout + proc.stderr
    tail = "\n".join(output.splitlines()[-40:])
    assert proc.returncode == 0, f"{SCRIPT.name} exited {proc.returncode}:\n{tail}"
    last = proc.stdout.strip().splitlines()[-1] if proc.stdout.strip() else ""
    assert last.startswith("omni_backend_check: OK"), f"no summary line from {SCRIPT.name}:\n{tail}"
    print(last)
