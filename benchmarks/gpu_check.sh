#!/usr/bin/env bash
# One-shot GPU check for a lent GPU machine with no network (see the device tool's README); it fits
# in 10 minutes of device time (each part has its own timeout):
#   1. the transformer's GPU path at the released size and 1024x1024 (benchmarks/gpu_path.py):
#      sample-forwards/s, MFU, peak memory, the SDPA backend of every attention call, bf16 vs fp32
#      LoRA products in a training step, eager vs regional compile;
#   2. the end-to-end test on the GPU (T2I and edit, bf16, 1 GPU);
#   3. a few FlowGRPO steps of a random-weight transformer at the released size (or the largest
#      that fits), printing images/s, MFU, the step-time split and peak memory.
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
