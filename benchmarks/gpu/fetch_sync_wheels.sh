#!/usr/bin/env bash
# Download, here (where PyPI is reachable), what the H200 weight-sync check needs and the GPU
# machine lacks, into the git-ignored build/sync_wheels/ (carry: ["build/sync_wheels"]).
#   pyzmq   the colocated (cuda_ipc) transport's control sockets; the machine's Python is 3.12
set -euo pipefail
cd "$(dirname "$0")/../.."
dest=build/sync_wheels
rm -rf "$dest" && mkdir -p "$dest"
python -m pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
  -d "$dest" pyzmq==27.3.0
ls -la "$dest"
