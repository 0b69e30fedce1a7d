#!/usr/bin/env bash
# One-shot GPU check for a lent GPU machine with no network (see the device tool's README), in one
# command of at most 600 s. Phases, each under its own `timeout`; a failing phase is recorded and the
# next one runs anyway:
#   install      the carried wheels (.whl/*.whl) into /tmp/site (GPU only; skipped without wheels);
#   env          torch / CUDA / diffusers / transformers / peft versions, every workspace package
#                importable from packages/*/src, and (on cuda) a CUDA device;
#   gpu_path     the transformer's GPU path at the released size and 1024x1024 (benchmarks/gpu_path.py):
#                sample-forwards/s, MFU, peak memory, the rollout forward with the LoRA adapters off and
#                with peft's forward instead of the fused one, the SDPA backend of every attention call,
#                bf16 vs fp32 LoRA products in a training step, eager vs regional compile;
#   e2e_t2i, e2e_edit   the end-to-end test on the GPU (bf16, 1 GPU);
#   gpu_scale    FlowGRPO steps of a random-weight transformer at the released size (or the largest
#                that fits; benchmarks/gpu_scale.py): images/s, MFU, the step-time split, peak memory;
#                here 1 prompt x 4 images, one warm-up and one timed step, to fit its timeout;
#   gpu_dryrun   benchmarks/gpu_dryrun.py (the fake-CUDA dry run), one case at the tiny preset, in
#                the CPU rehearsal only: it needs no GPU (CI runs it), so on cuda it is skipped;
#   vllm_e2e, vllm_engines   the vllm-omni engine, if the machine has the rollout environment (vllm
#                0.30, vllm-omni 0.30, torch 2.13: `uv sync --locked --project packages/boogu-vllm
#                --extra gpu`, or an interpreter with them in $BOOGU_VLLM_PYTHON): the e2e with
#                rollout.engine=vllm_omni, then rollout images/s of both engines on one request
#                (benchmarks/rollout_engines.py). The lent machine has no network and the carry limit
#                (64 MiB) is far below vllm's wheel (315 MB): there they are skipped, and say so.
#
# Time budget: the phases' timeouts sum to BUDGET_S = 540 s (install 30, env 20, gpu_path 120,
# e2e_t2i 60, e2e_edit 60, gpu_scale 130, gpu_dryrun 60, vllm_e2e 30, vllm_engines 30), which
# leaves the 600 s command 60 s for the kill grace (`timeout -k 5`) and the summary. A skipped phase
# takes none of it. gpu_path and gpu_scale, recomputed once they drew their 10.3B random weights on
# the GPU instead of the CPU (that draw took ~55 s of each phase) and started writing their JSON
# after every case (a timeout keeps the finished cases). Estimates for one H100/H200 (no GPU run
# yet; bf16, 1024^2, ~40% MFU, 73 TFLOPs per sample-forward):
#   gpu_path  ~105 of 120 s: start (imports, CUDA context) ~15, build + LoRA ~5 (was ~60 with the
#             CPU draw), rollout 4 calls of 4 sample-forwards ~3, lora (adapters off, peft's forward)
#             ~6, train bf16 + fp32 LoRA ~20, kernels ~3, compiled (3 block graphs, then 4 calls)
#             ~30-60: the compile runs last and is the least certain; cut by the timeout, only its
#             figures are lost (with the CPU draw, ~160 s: everything was lost);
#   gpu_scale ~90 of 130 s: start ~15, tiny checkpoint ~10, build ~5 (was ~60), trainer setup ~10,
#             a warm-up and a timed step of 4 images x 10 CFG steps + 2 window steps' update ~25
#             each (with the CPU draw ~145: it could not finish). Its margin is the larger one
#             because its figures come only from the last step.
# The first GPU run's summary.json (each phase's seconds) replaces these estimates.
# The vllm phases' 30 s only keep the sum: on a machine with the rollout
# environment, run them alone with more time, e.g.
#   BOOGU_GPU_CHECK_PHASES=env,vllm_e2e,vllm_engines BOOGU_GPU_CHECK_TIMEOUT_SCALE=8 bash benchmarks/gpu_check.sh
#
# Output, under $OUT (or ./gpu_check_out): summary.json, rewritten after every phase, so it is there
# even when a phase fails or the command is cut short:
#   {"device", "budget_s", "timeout_scale", "pythonpath": [...], "ok", "seconds",
#    "phases": [{"name", "ok", "seconds", "rc", "timed_out", "timeout_s", "log", "skipped", "reason"?}]}
# ("ok" is true for a skipped phase: it did not fail; "skipped" says it did not run), logs.tar.gz
# (one NAME.log per phase; the device tool brings back at most 8 files), and the figures
# gpu_path.json, gpu_scale.json, gpu_dryrun.json, rollout_engines.json. The exit status is 1 if any
# phase failed, 0 otherwise, and comes only after every phase has run.
#
# Environment:
#   BOOGU_GPU_CHECK_DEVICE   cuda (default) or cpu: every phase's python command takes its device
#                            from it. cpu is the rehearsal on a machine without a GPU: every phase
#                            at the tiny preset and toy sizes (tests/test_benchmarks.py runs it);
#   BOOGU_GPU_CHECK_PYTHON   the interpreter (default python3: the lent machine's own, with torch);
#   BOOGU_GPU_CHECK_PHASES   a comma-separated subset of the phases to run (the others are skipped);
#   BOOGU_GPU_CHECK_DRYRUN_ARGS     more arguments for gpu_dryrun.py (e.g. "--cases flow_grpo-t2i":
#                            a draft of it took about 40-70 s per case on 2 CPU cores at the tiny
#                            preset, 8 cases in all, more than the phase's timeout);
#   BOOGU_GPU_CHECK_TIMEOUT_SCALE   multiplies every timeout (default 1 on cuda, 5 on cpu, where a
#                            shared 2-core machine is far slower than the GPU machine the budget is for:
#                            under a load of 5 each CPU e2e run took 90-105 s).
# PYTHONPATH is every workspace package's src folder (packages/*/src), then /tmp/site once the wheels
# are installed, then the caller's PYTHONPATH: our own packages are used from source, not installed.
#
# The lent machine has its own python3 with torch, transformers, peft, safetensors, pyarrow... but no
# diffusers or rapidocr. Before the run, on this machine, from the repo root:
#   echo /.whl/ >> .git/info/exclude
#   python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
#       --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
#       -d .whl diffusers==0.42.1 rapidocr==3.10.0 pyclipper shapely omegaconf antlr4-python3-runtime colorlog
# and carry .whl with the run:
#   bash benchmarks/gpu_check.sh                                # on the GPU machine, timeout_s 600
#   BOOGU_GPU_CHECK_DEVICE=cpu bash benchmarks/gpu_check.sh     # the CPU rehearsal (about 3 minutes)
#
# Sourced (`source benchmarks/gpu_check.sh`), it only defines its functions and settings.

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
PHASES=(install env gpu_path e2e_t2i e2e_edit gpu_scale gpu_dryrun vllm_e2e vllm_engines)
declare -A PHASE_TIMEOUT_S=(
    [install]=30 [env]=20 [gpu_path]=120 [e2e_t2i]=60 [e2e_edit]=60 [gpu_scale]=130
    [gpu_dryrun]=60 [vllm_e2e]=30 [vllm_engines]=30
)
BUDGET_S=540
SITE=/tmp/site
KILL_GRACE_S=5
PHASE_RECORDS=()

# Every workspace package's src folder, ':'-joined, in the glob's (sorted) order.
workspace_pythonpath() {
    local src joined=""
    for src in "$ROOT"/packages/*/src; do
        [ -d "$src" ] && joined="${joined:+$joined:}$src"
    done
    printf '%s' "$joined"
}

json_str() {
    local s="${1//\\/\\\\}"
    s="${s//\"/\\\"}"
    s="${s//$'\n'/ }"
    printf '"%s"' "$s"
}

# The JSON list of a ':'-separated path.
json_path_list() {
    local IFS=: item out="" parts
    read -r -a parts <<< "$1"
    for item in "${parts[@]}"; do
        [ -n "$item" ] && out="${out:+$out, }$(json_str "$item")"
    done
    printf '[%s]' "$out"
}

# TIMEOUT_S * TIMEOUT_SCALE, rounded up to whole seconds (at least 1).
scaled_timeout() {
    awk -v t="$1" -v s="$TIMEOUT_SCALE" 'BEGIN { v = t * s; n = int(v); if (n < v) n++; if (n < 1) n = 1; print n }'
}

write_summary() {
    local all_ok=true record phases="" total
    for record in "${PHASE_RECORDS[@]}"; do
        phases="${phases:+$phases,
    }$record"
        [[ "$record" == *'"ok": false'* ]] && all_ok=false
    done
    total=$(awk -v a="$RUN_START" -v b="$(date +%s.%N)" 'BEGIN { printf "%.1f", b - a }')
    cat > "$OUT/summary.json.tmp" <<JSON
{
  "device": $(json_str "$DEVICE"),
  "budget_s": $BUDGET_S,
  "timeout_scale": $TIMEOUT_SCALE,
  "pythonpath": $(json_path_list "$PYTHONPATH"),
  "ok": $all_ok,
  "seconds": $total,
  "phases": [
    $phases
  ]
}
JSON
    mv "$OUT/summary.json.tmp" "$OUT/summary.json"
    tar -czf "$OUT/logs.tar.gz" -C "$LOG_DIR" .
}

# run_phase NAME FUNCTION [ARGS...]: FUNCTION ARGS under `timeout`, output to LOG_DIR/NAME.log.
run_phase() {
    local name="$1" limit start rc seconds ok timed_out=false
    shift
    limit=$(scaled_timeout "${PHASE_TIMEOUT_S[$name]}")
    echo "== $name (timeout $limit s)"
    start=$(date +%s.%N)
    # timeout puts the phase in its own process group and signals all of it (python children too).
    timeout -k "$KILL_GRACE_S" "$limit" bash -c '"$@"' "$name" "$@" > "$LOG_DIR/$name.log" 2>&1
    rc=$?
    seconds=$(awk -v a="$start" -v b="$(date +%s.%N)" 'BEGIN { printf "%.1f", b - a }')
    # 124: timeout's TERM, 137: its KILL after the grace (a process killed for memory is 137 too).
    if { [ "$rc" -eq 124 ] || [ "$rc" -eq 137 ]; } && awk -v s="$seconds" -v l="$limit" 'BEGIN { exit !(s >= l) }'; then
        timed_out=true
    fi
    if [ "$rc" -eq 0 ]; then ok=true; else ok=false; fi
    PHASE_RECORDS+=("{\"name\": $(json_str "$name"), \"ok\": $ok, \"seconds\": $seconds, \"rc\": $rc, \"timed_out\": $timed_out, \"timeout_s\": $limit, \"log\": \"$name.log\", \"skipped\": false}")
    if [ "$ok" = true ]; then
        tail -n 3 "$LOG_DIR/$name.log"
        echo "-- $name: ok in $seconds s"
    else
        tail -n 25 "$LOG_DIR/$name.log"
        echo "-- $name: FAILED (rc $rc$([ "$timed_out" = true ] && echo ", timed out after $limit s")) in $seconds s"
    fi
    write_summary
    [ "$ok" = true ]
}

skip_phase() {
    local name="$1" reason="$2"
    echo "== $name: skipped ($reason)"
    PHASE_RECORDS+=("{\"name\": $(json_str "$name"), \"ok\": true, \"seconds\": 0.0, \"rc\": null, \"timed_out\": false, \"timeout_s\": 0, \"log\": null, \"skipped\": true, \"reason\": $(json_str "$reason")}")
    write_summary
}

selected() {
    [ -z "${BOOGU_GPU_CHECK_PHASES:-}" ] && return 0
    [[ ",$BOOGU_GPU_CHECK_PHASES," == *",$1,"* ]]
}

# maybe_run NAME FUNCTION [ARGS...]: run_phase, or skip_phase if NAME is not selected.
maybe_run() {
    if selected "$1"; then
        run_phase "$@"
    else
        skip_phase "$1" "not in BOOGU_GPU_CHECK_PHASES"
    fi
}

# The phases' commands. Each runs in a child bash (exported below), in ROOT.

phase_install() {
    "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$SITE" "$ROOT"/.whl/*.whl
}

phase_env() {
    "$PY" - "$DEVICE" "$ROOT" <<'PY'
import importlib, os, sys
device, root = sys.argv[1], sys.argv[2]
import torch, diffusers, transformers, peft
cuda = torch.cuda.is_available()
print("torch", torch.__version__, "cuda", cuda, torch.cuda.get_device_name(0) if cuda else "-")
print("diffusers", diffusers.__version__, "transformers", transformers.__version__, "peft", peft.__version__)
# Every workspace package must come from its packages/<dist>/src, as PYTHONPATH says.
for src in sorted(p for p in os.environ["PYTHONPATH"].split(os.pathsep) if p.startswith(os.path.join(root, "packages"))):
    for name in sorted(os.listdir(src)):
        if os.path.isfile(os.path.join(src, name, "__init__.py")):
            module = importlib.import_module(name)
            assert os.path.dirname(os.path.dirname(module.__file__)) == src, (name, module.__file__, src)
            print(name, "from", src)
assert device == "cpu" or cuda, f"BOOGU_GPU_CHECK_DEVICE={device} but torch sees no CUDA device"
PY
}

phase_gpu_path() {
    if [ "$DEVICE" = cuda ]; then
        "$PY" benchmarks/gpu_path.py --device cuda --preset released --json "$OUT/gpu_path.json"
    else
        "$PY" benchmarks/gpu_path.py --device cpu --preset tiny --size 64 --text-tokens 16 --batch 1 --rank 4 \
            --repeats 1 --cases rollout,lora,train,kernels --json "$OUT/gpu_path.json"
    fi
}

# phase_e2e MODE [EXTRA_OVERRIDES]
phase_e2e() {
    local gpus=0
    if [ "$DEVICE" = cuda ]; then
        gpus=1
        export CUDA_VISIBLE_DEVICES="${CUDA_VISIBLE_DEVICES:-0}"
    fi
    NUM_GPUS="$gpus" MODE="$1" PYTHON="$PY" WORK_DIR="$(mktemp -d)" EXTRA_OVERRIDES="${2:-}" \
        bash tests/special_e2e/run_flowgrpo_boogu_image.sh
}

phase_gpu_scale() {
    if [ "$DEVICE" = cuda ]; then
        "$PY" benchmarks/gpu_scale.py --device cuda --preset released --prompts 1 --group 4 --steps 1 \
            --json "$OUT/gpu_scale.json"
    else
        "$PY" benchmarks/gpu_scale.py --device cpu --preset tiny --size 64 --prompts 1 --group 2 --steps 1 \
            --sampler-steps 4 --micro-batch 2 --train-micro-batch 2 --json "$OUT/gpu_scale.json"
    fi
}

phase_gpu_dryrun() {
    local extra
    # shellcheck disable=SC2206  # split on whitespace on purpose
    extra=(${BOOGU_GPU_CHECK_DRYRUN_ARGS:-})
    # One case at the tiny preset: the script and its checks work with this PYTHONPATH. The dry run
    # needs no GPU; CI runs it at the mid preset and benchmarks/README.md has its released figures.
    "$PY" benchmarks/gpu_dryrun.py --preset tiny --world-size 1 --json "$OUT/gpu_dryrun.json" \
        --sampler-steps 6 --cases flow_grpo-edit "${extra[@]}"
}

phase_vllm_engines() {
    "$PY" benchmarks/rollout_engines.py --backend omni --device "$DEVICE" --size 512 --steps 10 \
        --worker-python "$VLLM_PY" --json "$OUT/rollout_engines.json"
}

main() {
    DEVICE="${BOOGU_GPU_CHECK_DEVICE:-cuda}"
    case "$DEVICE" in
        cuda | cpu) ;;
        *) echo "BOOGU_GPU_CHECK_DEVICE must be cuda or cpu, got '$DEVICE'" >&2; return 2 ;;
    esac
    local default_scale=1 name
    [ "$DEVICE" = cpu ] && default_scale=5
    TIMEOUT_SCALE="${BOOGU_GPU_CHECK_TIMEOUT_SCALE:-$default_scale}"
    if ! awk -v s="$TIMEOUT_SCALE" 'BEGIN { exit !(s ~ /^[0-9]*\.?[0-9]+$/ && s > 0) }'; then
        echo "BOOGU_GPU_CHECK_TIMEOUT_SCALE must be a positive number, got '$TIMEOUT_SCALE'" >&2
        return 2
    fi
    TIMEOUT_SCALE=$(awk -v s="$TIMEOUT_SCALE" 'BEGIN { print s + 0 }') # a JSON number (".5" is not)
    local total=0
    for name in "${PHASES[@]}"; do total=$((total + PHASE_TIMEOUT_S[$name])); done
    if [ "$total" -gt "$BUDGET_S" ]; then
        echo "the phases' timeouts sum to $total s, over the budget of $BUDGET_S s (see the header)" >&2
        return 2
    fi
    local selection="${BOOGU_GPU_CHECK_PHASES:-}"
    for name in ${selection//,/ }; do
        if [ -z "${PHASE_TIMEOUT_S[$name]:-}" ]; then
            echo "BOOGU_GPU_CHECK_PHASES: unknown phase '$name' (phases: ${PHASES[*]})" >&2
            return 2
        fi
    done
    PY="${BOOGU_GPU_CHECK_PYTHON:-python3}"
    VLLM_PY="${BOOGU_VLLM_PYTHON:-$ROOT/packages/boogu-vllm/.venv/bin/python}"
    OUT="${OUT:-$PWD/gpu_check_out}"
    mkdir -p "$OUT" && OUT="$(cd "$OUT" && pwd)"
    WORK="$(mktemp -d -t boogu-gpu-check-XXXXXX)"
    # shellcheck disable=SC2064  # WORK is fixed now
    trap "rm -rf '$WORK'" EXIT
    LOG_DIR="$WORK/logs"
    mkdir -p "$LOG_DIR" "$WORK/tmp"
    RUN_START=$(date +%s.%N)
    cd "$ROOT" || return 2
    # The phases' temporary folders (tiny checkpoints, run dirs) go under WORK and leave with it.
    export TMPDIR="$WORK/tmp" PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1
    export OMP_WAIT_POLICY="${OMP_WAIT_POLICY:-PASSIVE}" # idle OpenMP threads must not spin (CPU rehearsal)
    export ROOT DEVICE PY VLLM_PY OUT SITE
    export -f phase_install phase_env phase_gpu_path phase_e2e phase_gpu_scale phase_gpu_dryrun phase_vllm_engines
    local caller_path="${PYTHONPATH:-}"
    export PYTHONPATH
    PYTHONPATH="$(workspace_pythonpath)${caller_path:+:$caller_path}"
    echo "device $DEVICE, budget $BUDGET_S s x timeout scale $TIMEOUT_SCALE, figures and logs in $OUT"

    local wheels=("$ROOT"/.whl/*.whl)
    if ! selected install; then
        skip_phase install "not in BOOGU_GPU_CHECK_PHASES"
    elif [ "$DEVICE" = cpu ]; then
        skip_phase install "the CPU rehearsal uses its interpreter's own packages"
    elif [ ! -e "${wheels[0]}" ]; then
        skip_phase install "no .whl/*.whl to install"
    elif run_phase install phase_install; then
        PYTHONPATH="$(workspace_pythonpath):$SITE${caller_path:+:$caller_path}"
    fi

    maybe_run env phase_env
    maybe_run gpu_path phase_gpu_path
    maybe_run e2e_t2i phase_e2e t2i
    maybe_run e2e_edit phase_e2e edit
    maybe_run gpu_scale phase_gpu_scale

    if ! selected gpu_dryrun; then
        skip_phase gpu_dryrun "not in BOOGU_GPU_CHECK_PHASES"
    elif [ ! -f benchmarks/gpu_dryrun.py ]; then
        skip_phase gpu_dryrun "benchmarks/gpu_dryrun.py does not exist"
    elif [ "$DEVICE" = cuda ]; then
        skip_phase gpu_dryrun "the fake-CUDA dry run needs no GPU (CI runs it): no device time spent on it"
    else
        run_phase gpu_dryrun phase_gpu_dryrun
    fi

    local no_vllm=""
    if [ "$DEVICE" = cpu ]; then
        no_vllm="the vllm-omni engine runs on a GPU here; tests/vllm covers it on CPU"
    elif ! { [ -x "$VLLM_PY" ] && "$VLLM_PY" -c "import vllm_omni, boogu_vllm.omni_backend" > /dev/null 2>&1; }; then
        no_vllm="no rollout environment with vllm-omni on this machine ($VLLM_PY); see the header"
    fi
    for name in vllm_e2e vllm_engines; do
        if ! selected "$name"; then
            skip_phase "$name" "not in BOOGU_GPU_CHECK_PHASES"
        elif [ -n "$no_vllm" ]; then
            skip_phase "$name" "$no_vllm"
        elif [ "$name" = vllm_e2e ]; then
            run_phase vllm_e2e phase_e2e t2i \
                "rollout.engine=vllm_omni rollout.vllm.python=$VLLM_PY rollout.vllm.backend=omni"
        else
            run_phase vllm_engines phase_vllm_engines
        fi
    done

    echo "== summary ($OUT/summary.json)"
    local record failed=0
    for record in "${PHASE_RECORDS[@]}"; do
        [[ "$record" == *'"ok": false'* ]] && failed=$((failed + 1))
        printf '%s\n' "$record"
    done
    if [ "$failed" -gt 0 ]; then
        echo "$failed phase(s) failed"
        return 1
    fi
    echo "every phase passed or was skipped"
}

if [ "${BASH_SOURCE[0]}" = "$0" ]; then
    set -uo pipefail # no -e: a failing phase must not end the run
    main
    exit $?
fi
