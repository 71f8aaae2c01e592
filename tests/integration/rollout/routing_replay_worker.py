"""torchrun worker of test_routing_replay.py: routing replay on two ranks, in one launch.

Usage: torchrun --nproc-per-node 2 routing_replay_worker.py OUT_DIR MODEL_DIR BATCHES

BATCHES (``torch.save``): ``{name: {"sequences", "prompt_lens", "routes"}}``, batches whose routes
the rollout engines returned (the in-process engine's and the server's, responses spanning a weight
update among them). Layouts, each built from MODEL_DIR:

- ``ep2``: expert parallel 2 (data parallel 2): every batch's old-log-prob pass replaying its engine
  routes, then one training step replaying them;
- ``pp2``: pipeline parallel 2, full activation recomputation and none, one training step each on
  the batch that carries ``"forced"`` routes (they differ from the routers' own) (several micro-batches: the 1F1B
  schedule runs a micro-batch's forward before the previous one's backward, so a recomputation must
  pop its own targets).

Each rank taps its routers (``routes_ref.RouterTap``): what the MoE layers routed, per sequence.
Rank 0 writes OUT_DIR/<layout>.pt: log-probs, the taps of every rank, the gradients.
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).parent))
from routes_ref import RouterTap  # noqa: E402

from megatron_rl.compat import apply_compat  # noqa: E402
from megatron_rl.models import OptimConfig, ParallelConfig, PolicyConfig, init_distributed  # noqa: E402
from megatron_rl.models.batch import SequenceBatch  # noqa: E402
from megatron_rl.models.config import RecomputeConfig  # noqa: E402
from megatron_rl.models.policy import MegatronPolicy  # noqa: E402
from megatron_rl.models.routing_replay import Routes  # noqa: E402

TOKENS = 128  # per micro-batch: several micro-batches per batch, short sequences two or three to one


def _batch(d: dict) -> SequenceBatch:
    g = torch.Generator().manual_seed(0)
    adv = [torch.randn(len(s) - p, generator=g) for s, p in zip(d["sequences"], d["prompt_lens"])]
    return SequenceBatch(sequences=d["sequences"], prompt_lens=d["prompt_lens"], token_fields={"adv": adv})


def _loss(batch: SequenceBatch):
    denom = float(sum(batch.response_lens))

    def loss_fn(mb):
        return -(mb.fields["adv"] * mb.logp * mb.mask).sum() / denom, {}

    return loss_fn


def _policy(model: str, par: ParallelConfig, recompute: RecomputeConfig | None = None) -> MegatronPolicy:
    cfg = PolicyConfig(parallel=par, micro_batch_tokens=TOKENS, layer_spec="local",
                       optim=OptimConfig(lr=1e-3, clip_grad=0.0), recompute=recompute or RecomputeConfig())
    return MegatronPolicy.from_hf(model, cfg, init_distributed(par))


def _gather(obj):
    out = [None] * dist.get_world_size()
    dist.all_gather_object(out, obj)
    return out


def main(out: Path, model: str, batches_file: str) -> None:
    apply_compat()
    batches = torch.load(batches_file, weights_only=False)
    result: dict = {}
    policy = _policy(model, ParallelConfig(expert_parallel=2, timeout_s=120))
    for name, d in batches.items():  # every batch's old pass before any step moves the weights
        batch = _batch(d)
        with RouterTap(policy, batch) as tap:
            logp, _ = policy.compute_logprobs(batch, 1.0, with_entropy=False, routes=Routes(replay=d["routes"]))
        result[name] = {"logp": logp, "tap": _gather(tap.merged())}
    for name, d in batches.items():
        batch = _batch(d)
        with RouterTap(policy, batch) as train_tap:
            policy.train_step(batch, _loss(batch), 1.0, with_entropy=False, routes=Routes(replay=d["routes"]))
        result[name]["train_tap"] = _gather(train_tap.merged())
    if dist.get_rank() == 0:
        torch.save(result, out / "ep2.pt")
    del policy

    d = next(d for d in batches.values() if "forced" in d)
    batch = _batch(d)
    pp: dict = {}
    for kind, recompute in (("none", RecomputeConfig()), ("full", RecomputeConfig(granularity="full"))):
        policy = _policy(model, ParallelConfig(pipeline_parallel=2, timeout_s=120), recompute)
        with RouterTap(policy, batch) as tap:
            policy.train_step(batch, _loss(batch), 1.0, with_entropy=False, routes=Routes(replay=d["forced"]))
        grads = {n: t.clone() for n, t in policy.export_hf_grads() if t is not None}
        pp[kind] = {"grads": grads, "tap": _gather(tap.merged()), "calls": len(tap.calls)}
        del policy
    if dist.get_rank() == 0:
        torch.save(pp, out / "pp2.pt")
        print(f"case routing replay: {len(batches)} batches at ep2; pp2 with and without recomputation",
              flush=True)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main(Path(sys.argv[1]), sys.argv[2], sys.argv[3])
