#!/usr/bin/env bash
# One-shot GPU check for a lent GPU machine with no network (see the device tool's README); it fits
# in 10 minutes of device time (each part has its own timeout):
#   1. the transformer's GPU path at the released size and 1024x1024 (benchmarks/gpu_path.py):
#      sample-forwards/s, MFU, peak memory, the SDPA backend of every attention call, bf16 vs fp32
#      LoRA products in a training step, eager vs regional compile;
#   2. the end-to-end test on the GPU (T2I and edit, bf16, 1 GPU);
#   3. a few FlowGRPO steps of a random-weight transformer at the released size (or the largest
#      that fits), printing images/s, MFU, the step-time split and peak memory;
#   4. the vllm-omni engine, if the machine has the rollout environment (vllm 0.30, vllm-omni 0.30,
#      torch 2.13: `uv sync --locked --project packages/boogu-vllm --extra gpu`, or an interpreter
#      with them in $BOOGU_VLLM_PYTHON): the e2e with rollout.engine=vllm_omni, then rollout images/s
#      of both engines on the same request (benchmarks/rollout_engines.py). The lent machine has no
#      network and the carry limit (64 MiB) is far below vllm's wheel (315 MB): there it is skipped,
#      and says so.
#
# That machine has its own python3 with torch, transformers, peft, safetensors, pyarrow... but no
# diffusers or rapidocr. Before the run, on this machine, from the repo root:
#   echo /.whl/ >> .git/info/exclude
#   python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
#       --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
#       -d .whl diffusers==0.42.1 rapidocr==3.10.0 pyclipper shapely omegaconf antlr4-python3-runtime colorlog
# and carry .whl with the run. Our own packages are used from packages/*/src (no install needed).
#
#   bash benchmarks/gpu_check.sh            # writes figures to $OUT (or ./gpu_check_out)
set -euo pipefail
cd "$(dirname "$0")/.."
OUT="${OUT:-$PWD/gpu_check_out}"
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1

if compgen -G ".whl/*.whl" > /dev/null; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
    export PYTHONPATH="/tmp/site${PYTHONPATH:+:$PYTHONPATH}"
fi
export PYTHONPATH="$PWD/packages/boogu-schedule/src:$PWD/packages/boogu-data/src:$PWD/packages/boogu-adapters/src:$PWD/packages/boogu-trainer/src:$PWD${PYTHONPATH:+:$PYTHONPATH}"
python3 - <<'PY'
import torch, diffusers, transformers, peft
print("torch", torch.__version__, "cuda", torch.cuda.is_available(), torch.cuda.get_device_name(0) if torch.cuda.is_available() else "-")
print("diffusers", diffusers.__version__, "transformers", transformers.__version__, "peft", peft.__version__)
assert torch.cuda.is_available(), "no CUDA device"
PY

echo "== transformer GPU path: released size, 1024x1024"
timeout 300 python3 benchmarks/gpu_path.py --json "$OUT/gpu_path.json" 2>&1 | tee "$OUT/gpu_path.log" | grep -v "^[ {}\"]" || true

echo "== e2e on the GPU (T2I, then edit)"
for mode in t2i edit; do
    CUDA_VISIBLE_DEVICES=0 NUM_GPUS=1 MODE=$mode PYTHON=python3 WORK_DIR="$(mktemp -d)" \
        timeout 90 bash tests/special_e2e/run_flowgrpo_boogu_image.sh 2>&1 | tee "$OUT/e2e_$mode.log" | tail -3
done

echo "== released-size random transformer: a few FlowGRPO steps"
timeout 200 python3 benchmarks/gpu_scale.py --json "$OUT/gpu_scale.json" 2>&1 | tee "$OUT/gpu_scale.log"

echo "== the vllm-omni engine (rollout.engine=vllm_omni)"
VLLM_PY="${BOOGU_VLLM_PYTHON:-$PWD/packages/boogu-vllm/.venv/bin/python}"
if [ -x "$VLLM_PY" ] && "$VLLM_PY" -c "import vllm_omni, boogu_vllm.omni_backend" >/dev/null 2>&1; then
    CUDA_VISIBLE_DEVICES=0 NUM_GPUS=1 MODE=t2i PYTHON=python3 WORK_DIR="$(mktemp -d)" \
        EXTRA_OVERRIDES="rollout.engine=vllm_omni rollout.vllm.python=$VLLM_PY rollout.vllm.backend=omni" \
        timeout 240 bash tests/special_e2e/run_flowgrpo_boogu_image.sh 2>&1 | tee "$OUT/e2e_vllm.log" | tail -3
    timeout 240 python3 benchmarks/rollout_engines.py --backend omni --device cuda --size 512 --steps 10 \
        --worker-python "$VLLM_PY" --json "$OUT/rollout_engines.json" 2>&1 | tee "$OUT/rollout_engines.log"
else
    echo "skipped: no rollout environment with vllm-omni on this machine ($VLLM_PY); see the header"
fi
