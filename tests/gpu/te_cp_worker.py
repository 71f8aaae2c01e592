"""torchrun worker of the GPU CP check: CP=2 log-probs and one training step, saved by rank 0.

Usage: torchrun --nproc-per-node 2 te_cp_worker.py OUT HF_DIR. With CUDA visible the policy uses
the Transformer Engine spec (TE's context-parallel attention over NCCL); with
CUDA_VISIBLE_DEVICES="" the local spec with our all-gather CP attention over gloo.
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parents[1] / "integration" / "models"))
from policy_testlib import make_batch, make_loss_fn  # noqa: E402

from megatron_rl.compat import apply_compat  # noqa: E402
from megatron_rl.models import OptimConfig, ParallelConfig, PolicyConfig, init_distributed  # noqa: E402
from megatron_rl.models.policy import MegatronPolicy  # noqa: E402

LENGTHS = [40, 17, 64, 9, 33, 24]
PROMPTS = [8, 3, 20, 2, 1, 10]
TEMPERATURE = 0.8


def main() -> None:
    out, hf = Path(sys.argv[1]), sys.argv[2]
    apply_compat()  # no-op with CUDA
    if torch.cuda.is_available():
        torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
    par = ParallelConfig(context_parallel=2, timeout_s=300)
    cfg = PolicyConfig(parallel=par, micro_batch_tokens=128,
                       layer_spec="te" if torch.cuda.is_available() else "local",
                       optim=OptimConfig(lr=1e-3, clip_grad=0.0))
    policy = MegatronPolicy.from_hf(hf, cfg, init_distributed(par))
    batch = make_batch(LENGTHS, PROMPTS, seed=3)
    logps, ents = policy.compute_logprobs(batch, TEMPERATURE)
    metrics = policy.train_step(batch, make_loss_fn(batch), TEMPERATURE, with_entropy=True)
    if torch.distributed.get_rank() == 0:
        torch.save({"logps": logps, "ents": ents, "metrics": metrics}, out)
    torch.distributed.barrier()
    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
