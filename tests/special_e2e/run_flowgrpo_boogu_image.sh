#!/usr/bin/env bash
# End-to-end FlowGRPO smoke run of Boogu-Image on the tiny random checkpoint:
# builds the checkpoint, writes a small dataset with boogu-data, runs 2 training steps (parquet
# loading, rollout, reward, LoRA training with a KL term, checkpointing, weight sync) and checks
# the outputs.
#
#   bash tests/special_e2e/run_flowgrpo_boogu_image.sh                 # T2I on CPU, 1 process
#   MODE=edit bash tests/special_e2e/run_flowgrpo_boogu_image.sh       # edit (reference-image refiner path)
#   NPROC=2 bash tests/special_e2e/run_flowgrpo_boogu_image.sh         # 2 gloo ranks on CPU (FSDP2)
#   CUDA_VISIBLE_DEVICES=0 NUM_GPUS=1 bash tests/special_e2e/run_flowgrpo_boogu_image.sh   # on a GPU
#
# Environment: MODE (t2i|edit), NUM_GPUS (0 = CPU), NPROC (CPU ranks, default 1), SOURCE_MODEL (a
# local Boogu snapshot whose processor/ and scheduler/ are copied into the tiny checkpoint),
# WORK_DIR (default: a new temporary folder), PYTHON (the interpreter to use; default: `python` of
# the active virtual environment, or without one `uv run --frozen --project <repo> python`, which
# creates and syncs the project's .venv from uv.lock on first use), EXTRA_OVERRIDES (more config
# overrides, whitespace-separated, e.g. "rollout.engine=vllm_omni" for rollouts in vllm-omni).
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
if [ -n "${PYTHON:-}" ]; then
    PY=("$PYTHON")
elif [ -n "${VIRTUAL_ENV:-}" ]; then
    PY=(python)
else
    PY=(uv run --frozen --project "$ROOT" python)
fi

MODE="${MODE:-t2i}"
NUM_GPUS="${NUM_GPUS:-0}"
NPROC="${NPROC:-1}"
WORK_DIR="${WORK_DIR:-$(mktemp -d -t boogu-e2e-XXXXXX)}"
case "$MODE" in t2i|edit) ;; *) echo "MODE must be t2i or edit, got '$MODE'" >&2; exit 2 ;; esac

TINY="$WORK_DIR/tiny-random/Boogu-Image"
DATA_IN="$WORK_DIR/data/raw"
DATA_OUT="$WORK_DIR/data/boogu_image"
RUNS="$WORK_DIR/runs"
mkdir -p "$DATA_IN"

echo "== [1/4] tiny checkpoint -> $TINY"
"${PY[@]}" -m boogu_tiny.checkpoints --output-dir "$TINY" ${SOURCE_MODEL:+--source-model "$SOURCE_MODEL"}

echo "== [2/4] $MODE dataset -> $DATA_OUT"
if [ "$MODE" = t2i ]; then
    cat > "$DATA_IN/train.txt" <<'PROMPTS'
A wooden sign on a beach that says "SURF".
A coffee mug printed with the word "MONDAY".
A neon sign in a dark alley reading "OPEN".
A birthday cake with "HAPPY 30" written in icing.
PROMPTS
    cp "$DATA_IN/train.txt" "$DATA_IN/test.txt"
    "${PY[@]}" -m boogu_data.cli convert-ocr --input-dir "$DATA_IN" --output-dir "$DATA_OUT"
else
    "${PY[@]}" - "$DATA_IN" <<'MAKE_EDIT'
import json, sys
from pathlib import Path
from PIL import Image, ImageDraw
root = Path(sys.argv[1]); (root / "images").mkdir(parents=True, exist_ok=True)
rows = []
for i, (old, new) in enumerate([("OPEN", "SALE"), ("CAT", "DOG"), ("RED", "BLUE"), ("TEA", "CAKE")]):
    img = Image.new("RGB", (48, 40), "white")
    ImageDraw.Draw(img).text((4, 14), old, fill="black")
    img.save(root / "images" / f"{i}.png")
    rows.append({"image": f"{i}.png", "instruction": f'Replace the text "{old}" with "{new}".', "target_text": new})
for split in ("train", "test"):
    (root / f"{split}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
MAKE_EDIT
    "${PY[@]}" -m boogu_data.cli convert-edit-ocr --input-dir "$DATA_IN" --output-dir "$DATA_OUT" --image-size 32
fi
"${PY[@]}" -m boogu_data.cli inspect "$DATA_OUT/train.parquet" > "$WORK_DIR/inspect.txt"

echo "== [3/4] 2 FlowGRPO steps (MODE=$MODE NUM_GPUS=$NUM_GPUS NPROC=$NPROC)"
if [ "$NUM_GPUS" -gt 0 ]; then DEVICE=cuda; RANKS="$NUM_GPUS"; DTYPE=bfloat16; else DEVICE=cpu; RANKS="$NPROC"; DTYPE=float32; fi
# 4 prompt groups a step, an equal share per rank; 2 mini-batches where each rank's share splits in two
# (the trainer refuses a layout whose mini-batches differ from one rank's: config.check_world_layout).
case "$RANKS" in
    1 | 2) MINI_BATCHES=2 ;;
    4) MINI_BATCHES=1 ;;
    *) echo "run_flowgrpo_boogu_image.sh: $RANKS ranks cannot share 4 prompt groups equally (use 1, 2 or 4)" >&2; exit 2 ;;
esac
ARGS=(
    "model.path=$TINY" "model.device=$DEVICE" "model.dtype=$DTYPE"
    "data.train_files=[$DATA_OUT/train.parquet]" "data.val_files=[$DATA_OUT/test.parquet]"
    "data.prompts_per_step=4" "algorithm.group_size=2" "algorithm.mini_batches=$MINI_BATCHES" "algorithm.kl_coef=0.04"
    "sampler.num_steps=4" "sampler.height=32" "sampler.width=32" "sampler.guidance_scale=4.0"
    "sampler.noise_level=0.7" "sampler.window_size=2" "sampler.window_range=[0,3]"
    "lora.rank=4" "lora.alpha=8" "optim.lr=1e-3"
    # OCR exercises the real reward path; a random tiny model draws no text, so the cheap demo term
    # gives the groups a reward spread (and the LoRA a gradient).
    "reward.rewards=[{name: ocr, weight: 1.0}, {name: demo_brightness, weight: 1.0}]"
    "total_steps=2" "checkpoint.save_every=1" "eval.every=2" "eval.num_steps=4" "eval.num_prompts=3"
    "logging.run_dir=$RUNS" "logging.name=e2e" "logging.sample_every=1" "logging.progress=false"
)
# shellcheck disable=SC2206  # split on whitespace on purpose
[ -n "${EXTRA_OVERRIDES:-}" ] && ARGS+=(${EXTRA_OVERRIDES})
if [ "$RANKS" -gt 1 ]; then
    PORT=$("${PY[@]}" -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')
    "${PY[@]}" -m torch.distributed.run --nproc_per_node="$RANKS" --master_port="$PORT" \
        -m boogu_trainer "$ROOT/examples/flowgrpo_trainer/boogu_image/boogu_image_ocr_lora.yaml" "${ARGS[@]}"
else
    "${PY[@]}" -m boogu_trainer "$ROOT/examples/flowgrpo_trainer/boogu_image/boogu_image_ocr_lora.yaml" "${ARGS[@]}"
fi

echo "== [4/4] checks"
"${PY[@]}" - "$RUNS/e2e" "$MODE" <<'CHECK'
import json, math, sys
from pathlib import Path
import yaml
from safetensors.torch import load_file
run, mode = Path(sys.argv[1]), sys.argv[2]
# The local engine's log-probs equal training's recomputation to the last bit when both forwards see
# as many rows; here the rollout calls carry 8 latents and the training micro-batches 4, and a CPU's
# matrix kernels may block by row count (6e-8 seen on an AVX-512/AMX Xeon). bf16 on a GPU and another
# engine (vllm-omni's transformer port) agree to rounding. The tolerance per device and dtype is the
# trainer's own table (boogu_trainer.onpolicy); a wrong sign, time or schedule is >= 1e-2.
import torch
from boogu_trainer.config import resolved_model_dtype
from boogu_trainer.onpolicy import logprob_tolerance
cfg = yaml.safe_load((run / "config.yaml").read_text())
device = torch.device(cfg["model"]["device"]).type
tol = logprob_tolerance(
    device, resolved_model_dtype(cfg["model"]["dtype"], device), own_copy=cfg["rollout"]["engine"] != "local"
)
steps = [json.loads(l) for l in (run / "metrics.jsonl").read_text().splitlines()]
train = [s for s in steps if "reward/mean" in s]
assert [s["step"] for s in train] == [1, 2], [s["step"] for s in train]
for s in train:
    assert math.isfinite(s["reward/mean"]) and 0.0 <= s["reward/mean"] <= 1.0, s["reward/mean"]
    assert s["logprob_diff/step0"] <= tol and s["logprob_diff/step1"] <= tol, ("rollout and training log-probs differ", tol)
    assert s["clipfrac_first"] == 0.0, ("the first optimizer step clipped on-policy ratios", s["clipfrac_first"])
    assert math.isfinite(s["loss"]) and math.isfinite(s["kl_ref"]) and s["optimizer_steps"] >= 1
    assert s["edit_samples"] == (s["samples"] if mode == "edit" else 0), (s["edit_samples"], mode)
assert train[-1]["weights_version"] == 2, "the rollout engine did not receive both weight syncs"
evals = [s for s in steps if "eval/reward/mean" in s]
assert evals and evals[-1]["eval/prompts"] == 3, "no evaluation record over the 3 held-out prompts"
ckpt = run / "checkpoints" / "step_000002"
lora = load_file(ckpt / "adapter_model.safetensors")
assert lora and all(k.startswith("base_model.model.") for k in lora)
assert any("lora_B" in k and v.abs().sum() > 0 for k, v in lora.items()), "LoRA did not train"
assert (run / "reward_curve.png").is_file() and sorted(p.name for p in (run / "samples").iterdir())
print(f"e2e OK ({mode}): reward {train[0]['reward/mean']:.3f} -> {train[-1]['reward/mean']:.3f}, checkpoint {ckpt}")
CHECK
