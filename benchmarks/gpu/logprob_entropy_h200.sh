#!/usr/bin/env bash
# H200 check of the fused log-prob + entropy op. Run from the repo root on the device
# machine, after benchmarks/gpu/fetch_peer_wheels.sh here, with carry ["build/peer_wheels"]:
#   run(command="bash benchmarks/gpu/logprob_entropy_h200.sh", carry=["build/peer_wheels"],
#       timeout_s=540)
# Offline: needs only the machine's torch + Triton. Writes its logs under $OUT (or /tmp/lpe_out).
# Budget: ~1 min of compiles + tests, ~2-3 min of benchmarks; every step has its own timeout.
set -uo pipefail
. "$(dirname "$0")/common.sh"
gpu_setup /tmp/lpe_out build/peer_wheels logprob_entropy_h200.txt
python -c "import triton; print('triton', triton.__version__)" 2>&1 | tee -a "$log"

echo "== correctness: tests/gpu (compiled Triton kernels and torch back-end vs float64)" | tee -a "$log"
timeout 240 python -m pytest -q -p no:cacheprovider tests/gpu/test_logprob_entropy_gpu.py 2>&1 \
  | tee -a "$log"

echo "== benchmark: Triton back-end, bf16, with peers" | tee -a "$log"
timeout 240 python benchmarks/logprob_entropy.py --device cuda --backend triton --dtype bf16 \
  --peers --repeats 5 2>&1 | tee -a "$log"

echo "== benchmark: torch chunked back-end on the GPU, bf16, big size" | tee -a "$log"
timeout 120 python benchmarks/logprob_entropy.py --device cuda --backend torch --dtype bf16 \
  --sizes big --repeats 3 2>&1 | tee -a "$log"
rm -rf "$gpu_site"
