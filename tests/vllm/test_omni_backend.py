"""``boogu_vllm.omni_backend`` with vllm-omni's engine faked, against the direct backend (``bash tests/vllm/run.sh``).

The check is ``omni_backend_check.py``, run as a subprocess with the rollout environment's python
(boogu_vllm and vllm-omni are not installed in the workspace's environment); see its docstring.
"""

from __future__ import annotations

import ast
import os
import subprocess
from pathlib import Path

import pytest

from boogu_adapters.model import LORA_TARGET_MODULES
from boogu_adapters.vllm_engine import default_project_dir

pytestmark = pytest.mark.vllm

SCRIPT = Path(__file__).with_name("omni_backend_check.py")


def _script_constant(name: str):
    """A literal module-level constant of the check script (it cannot be imported here)."""
    for node in ast.parse(SCRIPT.read_text()).body:
        if isinstance(node, ast.Assign) and any(
            isinstance(t, ast.Name) and t.id == name for t in node.targets
        ):
            return ast.literal_eval(node.value)
    raise AssertionError(f"{SCRIPT.name} defines no {name}")


def test_omni_backend_matches_the_direct_backend(tiny_checkpoint):
    python = default_project_dir() / ".venv" / "bin" / "python"
    if not python.exists():
        pytest.fail(f"the rollout environment is missing ({python}): run bash tests/vllm/run.sh")
    # The script's copy of the trainer's LoRA targets (the rollout env has no boogu_adapters).
    assert tuple(_script_constant("TARGET_MODULES")) == LORA_TARGET_MODULES
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
    assert last.startswith(_script_constant("SUMMARY")), f"no summary line from {SCRIPT.name}:\n{tail}"
    print(last)
