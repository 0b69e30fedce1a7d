#!/usr/bin/env bash
# FlowGRPO LoRA on Boogu-Image-0.1 with an OCR reward, on NUM_GPUS GPUs of NNODES nodes.
#
#   bash examples/flowgrpo_trainer/boogu_image/run_boogu_image_ocr_lora.sh [key=value ...]
#   NUM_GPUS=8 bash .../run_boogu_image_ocr_lora.sh sampler.guidance_scale=1.0     # no CFG: half the rollout cost
#   NNODES=2 NODE_RANK=0 MASTER_ADDR=node0 bash .../run_boogu_image_ocr_lora.sh     # on each node, NODE_RANK 0..NNODES-1
#   ... resume=auto                                                                 # continue after a crash
#   RECIPE=examples/diffusion_nft_trainer/boogu_image/boogu_image_ocr_lora.yaml bash .../run_boogu_image_ocr_lora.sh
#                                                        # another algorithm's recipe (awm_trainer/, *_grpo_guard_*)
#
# Data: uv run python examples/flowgrpo_trainer/data_process/boogu_image_ocr.py \
#           --input_dir ~/data/ocr --output_dir ~/data/ocr/boogu_image
# Heights/widths must be multiples of 16 with an area of at most 2048^2 (checked before anything loads).
set -euo pipefail
HERE="$(cd "$(dirname "$0")" && pwd)"
NUM_GPUS="${NUM_GPUS:-4}"
NNODES="${NNODES:-1}"
NODE_RANK="${NODE_RANK:-0}"
if [ "$NNODES" -gt 1 ]; then
    # Every node must reach rank 0's node: a loopback default would leave each node waiting on itself.
    case "${MASTER_ADDR:-}" in
        "" | 127.* | localhost | ::1 | 0.0.0.0)
            echo "NNODES=$NNODES: set MASTER_ADDR to the address of the node with NODE_RANK=0 (got '${MASTER_ADDR:-}')," \
                "the same on every node; logging.run_dir must be on a filesystem every node shares (docs/reliability.md)" >&2
            exit 2 ;;
    esac
fi
MASTER_ADDR="${MASTER_ADDR:-127.0.0.1}"
MASTER_PORT="${MASTER_PORT:-29500}"
MODEL_PATH="${MODEL_PATH:-$HOME/models/Boogu/Boogu-Image-0.1-Base}"
RECIPE="${RECIPE:-$HERE/boogu_image_ocr_lora.yaml}"

# Fail fast on a bad recipe or override (prints the offending key), before any process starts.
uv run trainer "$RECIPE" "model.path=$MODEL_PATH" "$@" --print-config > /dev/null

exec uv run torchrun \
    --nnodes="$NNODES" --node_rank="$NODE_RANK" --nproc_per_node="$NUM_GPUS" \
    --master_addr="$MASTER_ADDR" --master_port="$MASTER_PORT" \
    -m boogu_trainer "$RECIPE" "model.path=$MODEL_PATH" "$@"
