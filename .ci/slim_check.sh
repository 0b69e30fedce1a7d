#!/usr/bin/env bash
# Other projects install boogu-schedule (torch only) and boogu-data (pyarrow + pillow only) alone.
# Build each wheel without workspace sources, install it into a fresh venv outside the repo, import
# it, run a smoke, and fail if a heavy or sibling module was imported.
set -euo pipefail
cd "$(dirname "$0")/.."
work="$(mktemp -d)"
trap 'rm -rf "$work"' EXIT

torch_version="$(uv run --frozen python -c 'import torch; print(torch.__version__.split("+")[0])')"

uv build --quiet --package boogu-schedule --no-sources --wheel --out-dir "$work/dist"
uv build --quiet --package boogu-data --no-sources --wheel --out-dir "$work/dist"
uv build --quiet --package boogu-protocol --no-sources --wheel --out-dir "$work/dist"

# boogu-schedule: torch comes from the same registry build the lock uses (uv's cache already has it).
uv venv --quiet --python 3.11 "$work/schedule-venv"
uv pip install --quiet --python "$work/schedule-venv/bin/python" "$work"/dist/boogu_schedule-*.whl "torch==$torch_version"
"$work/schedule-venv/bin/python" - <<'PY'
import sys
import torch
import boogu_schedule as bs

sig = bs.boogu_sigmas(bs.BooguScheduleConfig.released(), 10)
assert abs(sig[1].item() - 0.966) < 1e-4 and sig[-1].item() == 0.0, sig
x = torch.zeros(2, 16, 4, 4)
step = bs.sde_step("flow_sde", x, torch.ones_like(x), sig[2], sig[3], 0.7, generator=torch.Generator().manual_seed(0))
assert step.log_prob.shape == (2,) and step.log_prob.dtype == torch.float32
heavy = ("diffusers", "transformers", "peft", "pyarrow", "vllm", "vllm_omni", "boogu_data", "boogu_adapters", "boogu_trainer")
bad = sorted(m for m in sys.modules if m.split(".")[0] in heavy)
assert not bad, f"boogu_schedule imported {bad}"
print("slim boogu-schedule OK:", bs.__version__, "torch", torch.__version__)
PY

# boogu-data: no torch at all.
uv venv --quiet --python 3.11 "$work/data-venv"
uv pip install --quiet --python "$work/data-venv/bin/python" "$work"/dist/boogu_data-*.whl
"$work/data-venv/bin/python" - <<'PY'
import sys
import boogu_data

heavy = ("torch", "diffusers", "transformers", "peft", "vllm", "boogu_schedule", "boogu_adapters", "boogu_trainer")
bad = sorted(m for m in sys.modules if m.split(".")[0] in heavy)
assert not bad, f"boogu_data imported {bad}"
print("slim boogu-data OK:", boogu_data.__version__)
PY

# boogu-protocol (the rollout worker's wire format, installed in vllm-omni's environment too):
# torch + safetensors only, beside boogu-schedule in that venv.
uv pip install --quiet --python "$work/schedule-venv/bin/python" "$work"/dist/boogu_protocol-*.whl
"$work/schedule-venv/bin/python" - <<'PY'
import sys
import torch
import boogu_protocol as bp

meta, tensors = bp.unpack(bp.pack({"spec": {"a": 1}}, {"x": torch.arange(3)}))
assert meta == {"spec": {"a": 1}} and torch.equal(tensors["x"], torch.arange(3))
heavy = ("diffusers", "transformers", "peft", "pyarrow", "vllm", "vllm_omni", "boogu_data", "boogu_adapters", "boogu_trainer")
bad = sorted(m for m in sys.modules if m.split(".")[0] in heavy)
assert not bad, f"boogu_protocol imported {bad}"
print("slim boogu-protocol OK:", bp.__version__)
PY
