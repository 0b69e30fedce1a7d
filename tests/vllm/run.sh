#!/usr/bin/env bash
# The vllm-omni engine's tests: set up the rollout environment from packages/boogu-vllm (its own
# pyproject.toml and uv.lock; uv's cache makes a second run cheap), then run tests/vllm with the
# workspace's pytest. The tests launch the rollout worker from that environment (a worker that
# fails to import or load shows its log's tail in the test failure). pytest-xdist spreads the modules
# over the cores, a whole module per worker (`--dist loadfile`): test_vllm_engine.py's tests share one
# rollout worker (a module fixture, started once) and run in file order (the last one kills it).
set -euo pipefail
cd "$(dirname "$0")/../.."
export PATH="$HOME/.local/bin:$PATH"
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1
# Compiled bytecode is cached for this run (see .ci/run): with PYTHONDONTWRITEBYTECODE set and no
# .pyc in the environments, every process would recompile torch, vllm and diffusers from source.
if [ -z "${PYTHONPYCACHEPREFIX:-}" ]; then
    PYTHONPYCACHEPREFIX="$(mktemp -d -t boogu-pycache-XXXXXX)"
    export PYTHONPYCACHEPREFIX
    trap 'rm -rf "$PYTHONPYCACHEPREFIX"' EXIT
fi
unset PYTHONDONTWRITEBYTECODE

echo "== rollout environment (packages/boogu-vllm, uv sync --locked)"
start=$(date +%s)
uv sync --locked --project packages/boogu-vllm
echo "rollout environment ready in $(( $(date +%s) - start )) s"

echo "== tests/vllm"
set +e
uv run pytest tests/vllm -m vllm -n auto --dist loadfile "$@"
status=$?
set -e
if [ "$status" -eq 5 ]; then
    echo "tests/vllm collected no tests: that is a failure" >&2
    exit 1
fi
exit "$status"
