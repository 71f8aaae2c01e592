#!/usr/bin/env bash
# Run the test suite with the project's virtualenv (scripts/bootstrap.sh must have run; `make test` does).
set -euo pipefail
here="$(cd "$(dirname "$0")/.." && pwd)"
venv="${MEGATRON_RL_VENV:-$HOME/.cache/megatron-rl/venv}"
cd "$here"
export PYTHONPATH="$here${PYTHONPATH:+:$PYTHONPATH}"
export OMP_NUM_THREADS="${OMP_NUM_THREADS:-2}"
export VLLM_ENABLE_V1_MULTIPROCESSING=0
export WANDB_MODE=offline WANDB_SILENT=true
export PYTHONWARNINGS="ignore::UserWarning,ignore::DeprecationWarning,ignore::FutureWarning"
# Default to the whole suite unless test paths are given (e.g. `make test PYTEST_ARGS=tests/unit`).
args=("$@"); has_path=0
for a in "$@"; do case "$a" in -*) ;; *) [ -e "${a%%::*}" ] && has_path=1 ;; esac; done
[ "$has_path" -eq 1 ] || args+=(tests)
exec "$venv/bin/python" -m pytest -q -p no:cacheprovider --timeout=900 "${args[@]}"
