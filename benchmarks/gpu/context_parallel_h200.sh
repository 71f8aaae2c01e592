#!/usr/bin/env bash
# H200 check of long sequences on the policy (issue 15). Run from the repo root on the device
# machine, after benchmarks/gpu/fetch_megatron_wheels.sh here:
#   run(command="bash benchmarks/gpu/context_parallel_h200.sh", carry=["build/megatron_wheels"],
#       timeout_s=420)
# 1. tests/gpu/test_te_policy_gpu.py: TE-spec policy vs transformers and vs the local spec, one
#    train step, export bytes, TE CP vs ours (2 GPUs). Skips without Transformer Engine (the
#    machine's image has none, see fetch_megatron_wheels.sh) or with one GPU (the CP case).
# 2. our SDPA core attention on CUDA (torch's flash kernel) vs Megatron's DotProductAttention, bf16:
#    the benchmark's attention part (peak memory from torch.cuda.max_memory_allocated, time, and
#    the largest difference of outputs and gradients) at S=4096 and 16384.
# Logs go to $OUT (or /tmp/cp_out). Budget: ~1 min start-up, ~2 min of checks.
set -uo pipefail
. "$(dirname "$0")/common.sh"
gpu_setup /tmp/cp_out build/megatron_wheels context_parallel_h200.txt
python3 -c "import megatron.core; print('megatron-core', megatron.core.__version__)" 2>&1 | tee -a "$log"
python3 -c "import transformer_engine as te; print('transformer-engine', te.__version__)" 2>&1 \
  | tee -a "$log"

echo "== tests/gpu/test_te_policy_gpu.py" | tee -a "$log"
timeout 240 python3 -m pytest -q -p no:cacheprovider -rs tests/gpu/test_te_policy_gpu.py 2>&1 \
  | tee -a "$log"
echo "== core attention on CUDA, bf16: ours vs DotProductAttention" | tee -a "$log"
for s in 4096 16384; do
  timeout 120 python3 benchmarks/context_parallel.py --attention-only --device cuda --dtype bf16 \
    --attn-seq "$s" 2>&1 | tee -a "$log"
done
rm -rf "$gpu_site"
