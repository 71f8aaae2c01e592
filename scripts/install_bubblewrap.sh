#!/usr/bin/env bash
# Install bubblewrap (`bwrap`), the sandbox of code rewards, if it is missing. Idempotent.
#
#   scripts/install_bubblewrap.sh      # Debian/Ubuntu: apt-get install bubblewrap (as root, or sudo -n)
#
# Exit codes: 0 bwrap is installed, 3 it cannot be installed here (no root/sudo, no mirror, another
# package manager: the message says what to run by hand).
set -euo pipefail

log() { echo "[install_bubblewrap] $*" >&2; }

if PATH="/usr/local/bin:/usr/bin:/bin:$PATH" command -v bwrap >/dev/null 2>&1; then
  exit 0
fi
if ! command -v apt-get >/dev/null 2>&1; then
  log "ERROR: no apt-get here; install the bubblewrap package with your package manager (e.g. dnf install bubblewrap)"
  exit 3
fi
sudo=()
if [ "$(id -u)" != 0 ]; then
  if command -v sudo >/dev/null 2>&1 && sudo -n true 2>/dev/null; then
    sudo=(sudo -n)
  else
    log "ERROR: installing bubblewrap needs root: run 'sudo apt-get install bubblewrap'"
    exit 3
  fi
fi
export DEBIAN_FRONTEND=noninteractive
apt=("${sudo[@]}" apt-get -o DPkg::Lock::Timeout=300 -y -qq)
log "installing bubblewrap (apt)"
if ! "${apt[@]}" install --no-install-recommends bubblewrap >/dev/null 2>&1; then
  "${apt[@]}" update >/dev/null 2>&1 || { log "ERROR: apt-get update failed (is a Debian mirror reachable?)"; exit 3; }
  "${apt[@]}" install --no-install-recommends bubblewrap >/dev/null \
    || { log "ERROR: apt-get install bubblewrap failed"; exit 3; }
fi
command -v bwrap >/dev/null 2>&1 || { log "ERROR: bubblewrap installed but bwrap is not on PATH"; exit 3; }
