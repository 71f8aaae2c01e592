#!/usr/bin/env bash
# H200 check of the weight sync: the colocated CUDA-IPC path, since NCCL refuses two
# processes on one GPU. Run from the repo root on the device machine, after
# benchmarks/gpu/fetch_sync_wheels.sh here:
#   run(command="bash benchmarks/gpu/weight_sync_h200.sh", carry=["build/sync_wheels"], timeout_s=480)
# The machine has torch but no vLLM (its wheel is far over the carry limit), so the engine process
# is the benchmark's bare engine: the real CudaIpcWeightSync + RemoteEngine + receive_ipc, with a
# worker that drains what vLLM's loader would get. With verify on, the engine process hashes every
# received tensor on the GPU and the trainer compares: a correctness check of the IPC path.
# Logs go to $OUT (or /tmp/sync_out). Budget: ~1 min start-up, ~2-4 min of trials.
set -uo pipefail
. "$(dirname "$0")/common.sh"
gpu_setup /tmp/sync_out build/sync_wheels weight_sync_h200.txt
python3 -c "import zmq; print('zmq', zmq.__version__)" 2>&1 | tee -a "$log"

run() {  # label, timeout, args...
  local label=$1 limit=$2; shift 2
  echo "== $label" | tee -a "$log"
  timeout "$limit" python3 benchmarks/weight_sync.py --backend ipc "$@" 2>&1 | tee -a "$log"
  echo "rc=${PIPESTATUS[0]}" | tee -a "$log"
}
# 1. a 7B-like bf16 model (Qwen2-7B shapes: 28 layers, hidden 3584, ffn 18944, vocab 152064;
#    ~15 GB, 339 tensors), 512 MiB buckets as in slime, sweep 64 MiB .. 2 GiB
run "7B-like bf16, cuda_ipc" 300 --layers 28 --hidden 3584 --inter 18944 --vocab 152064 \
  --dtype bfloat16 --bucket-mib 512 --sweep-mib 64 256 1024 2048 --repeats 3
# 2. the CPU run's model (few hundred MB, fp32), for comparison with benchmarks/RESULTS.md
run "CPU-benchmark model fp32, cuda_ipc" 120 --repeats 3
ls -la "$out"
