#!/usr/bin/env bash
# Download, here (where PyPI is reachable), what the H200 long-sequence check needs and the GPU
# machine lacks, into the git-ignored build/megatron_wheels/ (carry: ["build/megatron_wheels"]).
#   megatron-core 0.16.1   the policy (the machine's Python is 3.12: the cp312 wheel)
# Transformer Engine is NOT fetched: its PyTorch extension has no wheel for the machine's torch
# (pip builds it from source with nvcc, far longer than a device lease), so the TE checks in
# tests/gpu/test_te_policy_gpu.py skip there unless an image with TE is lent.
set -euo pipefail
cd "$(dirname "$0")/../.."
dest=build/megatron_wheels
rm -rf "$dest" && mkdir -p "$dest"
python -m pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_24_x86_64 -d "$dest" megatron-core==0.16.1
ls -la "$dest"
