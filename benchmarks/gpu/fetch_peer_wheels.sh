#!/usr/bin/env bash
# Download, here (where PyPI is reachable), the pure-Python wheels the H200 check needs, into the
# git-ignored build/peer_wheels/ that the device tool carries (carry: ["build/peer_wheels"]).
# The GPU machine has torch + Triton but no package index, so nothing is installed there: the
# wheels are unpacked into a temporary folder on PYTHONPATH (see logprob_entropy_h200.sh).
#   liger-kernel   peer: fused linear cross-entropy (Triton)
#   verl           peer: linear_cross_entropy (Triton; only verl/utils/kernel is imported)
#   pytest pluggy iniconfig packaging   to run tests/gpu there
set -euo pipefail
cd "$(dirname "$0")/../.."
dest=build/peer_wheels
rm -rf "$dest" && mkdir -p "$dest"
python -m pip download --no-deps --only-binary=:all: --python-version 3.11 -d "$dest" \
  liger-kernel verl pytest pluggy iniconfig packaging
ls -la "$dest"
du -sh "$dest"
