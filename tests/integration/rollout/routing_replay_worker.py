"""torchrun worker of test_routing_replay.py: an EP2 trainer's replay and sync, in one launch.

Usage: torchrun --nproc-per-node 2 routing_replay_worker.py OUT_DIR MODEL_DIR SPEC

SPEC (``torch.save``): ``batches`` (``{name: {"sequences", "prompt_lens", "routes"}}``, batches whose
routes the rollout engines returned: the in-process engine's and the server's, responses spanning a
weight update among them), ``prompts`` and ``fleet`` (the RolloutConfig of the module's vLLM server).
Rank 0 also runs an in-process vLLM engine (its core in a process of its own beside the two trainer
ranks) and drives the server. Layouts, each built from MODEL_DIR:

- ``ep2``: expert parallel 2 (data parallel 2): every batch's old-log-prob pass replaying its engine
  routes, then one training step replaying them (a large learning rate: the weights move); then
  the sync of the updated weights, each EP rank sending its own experts (``export_owned``, gloo
  with two senders), into the server and (fanned in to rank 0) into the in-process engine; both
  engines generate (greedy; the server also samples with routes), rank 0 writes the updated
  weights as an HF checkpoint (OUT_DIR/updated: the test's float64 reference), and the two ranks
  run the server's sampled responses once replaying their routes (r3) and once routing freely;
- ``pp2``: pipeline parallel 2, full activation recomputation and none, one training step each on
  the batch that carries ``"forced"`` routes (they differ from the routers' own) (several micro-batches: the 1F1B
  schedule runs a micro-batch's forward before the previous one's backward, so a recomputation must
  pop its own targets).

Each rank taps its routers (``routes_ref.RouterTap``): what the MoE layers routed, per sequence.
Rank 0 writes OUT_DIR/<layout>.pt: log-probs, the taps of every rank, the gradients, the outputs.
"""

from __future__ import annotations

import os
import shutil
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
VERSION = 2  # the weights the EP2 trainer syncs (the server has version 1)


def _batch(d: dict) -> SequenceBatch:
    g = torch.Generator().manual_seed(0)
    adv = [torch.randn(len(s) - p, generator=g) for s, p in zip(d["sequences"], d["prompt_lens"])]
    return SequenceBatch(sequences=d["sequences"], prompt_lens=d["prompt_lens"], token_fields={"adv": adv})


def _loss(batch: SequenceBatch):
    denom = float(sum(batch.response_lens))

    def loss_fn(mb):
        return -(mb.fields["adv"] * mb.logp * mb.mask).sum() / denom, {}

    return loss_fn


def _policy(model: str, par: ParallelConfig, recompute: RecomputeConfig | None = None,
            lr: float = 1e-3) -> MegatronPolicy:
    cfg = PolicyConfig(parallel=par, micro_batch_tokens=TOKENS, layer_spec="local",
                       optim=OptimConfig(lr=lr, clip_grad=0.0), recompute=recompute or RecomputeConfig())
    return MegatronPolicy.from_hf(model, cfg, init_distributed(par))


def _gather(obj):
    out = [None] * dist.get_world_size()
    dist.all_gather_object(out, obj)
    return out


def _engines(model: str, spec: dict):
    """Rank 0: the in-process engine (its core spawned beside the trainer) and the server fleet."""
    from megatron_rl.rollout import connect_fleet
    from megatron_rl.rollout.config import RolloutConfig
    from megatron_rl.rollout.vllm_engine import VLLMEngine

    engine = VLLMEngine(model, RolloutConfig(kv_cache_bytes=16 << 20, max_num_seqs=8, max_prompt_len=200,
                                             max_response_len=48), max_model_len=256, name="inproc")
    fleet = connect_fleet(RolloutConfig.from_dict(spec["fleet"]), return_routes=True)
    return engine, fleet


def _sync(policy: MegatronPolicy, engine, fleet) -> dict:
    """The updated weights into both engines, each EP rank sending its own experts."""
    from megatron_rl.sync import SyncConfig, build_weight_sync

    rank = dist.get_rank()
    plan = policy.export_plan()
    out = {"plan": [(i.name, i.sender) for i in plan]}
    for kind, target in (("inprocess", engine), ("gloo", fleet)):
        cfg = SyncConfig(transport=kind) if kind == "inprocess" else \
            SyncConfig(transport="gloo", bucket_bytes=64 * 1024, timeout_s=60.0)
        sync = build_weight_sync(cfg, target if rank == 0 else None, rank=rank, metadata=plan)
        try:
            m = sync.sync(policy.export_owned(plan), VERSION)
        finally:
            sync.close()
        if rank == 0:
            out[kind] = {"senders": m.senders, "sender_bytes": m.sender_bytes, "tensors": m.tensors,
                         "bytes": m.bytes, "engines": m.engines, "complete": m.complete}
            if kind == "gloo":  # what the server's worker received: every bucket of both senders, checksummed
                out[kind]["rounds"] = [r for e in target.engines for r in e.collective_rpc("mrl_last_weight_round")]
    return out


def _after_sync(policy: MegatronPolicy, engine, fleet, spec: dict, model: str, out: Path) -> dict:
    """Both engines' outputs on the synced weights, the updated HF checkpoint, and the EP2 trainer's
    routes on the server's sampled responses (replaying them, and free)."""
    from safetensors.torch import save_file

    from megatron_rl.rollout import SamplingSpec
    from megatron_rl.trainer.routing_replay import engine_routes

    updated = {n: t for n, t in policy.export_hf_weights() if t is not None}  # collective
    result: dict = {}
    sampled = None
    if dist.get_rank() == 0:
        shutil.copytree(model, out / "updated")
        save_file({n: t.contiguous() for n, t in updated.items()}, str(out / "updated" / "model.safetensors"),
                  metadata={"format": "pt"})
        greedy = SamplingSpec(temperature=0.0, max_tokens=10)
        result["greedy"] = {"inproc": [g[0].token_ids for g in engine.generate(spec["prompts"], greedy)],
                            "server": [g[0].token_ids for g in fleet.generate(spec["prompts"], greedy)]}
        groups = fleet.generate(spec["prompts"], SamplingSpec(n=2, temperature=1.0, max_tokens=12, seed=8))
        result["sampled"] = [(p, c.token_ids, c.logprobs, c.routes) for p, g in zip(spec["prompts"], groups)
                             for c in g]
        result["versions"] = sorted({c.weight_version for g in groups for c in g})
        seqs = [list(p) + t for p, t, _, _ in result["sampled"]]
        sampled = {"sequences": seqs, "prompt_lens": [len(p) for p, *_ in result["sampled"]],
                   "routes": [engine_routes(r, len(s), "server") for (*_, r), s in zip(result["sampled"], seqs)]}
    box = [sampled]
    dist.broadcast_object_list(box, src=0)
    sampled = box[0]
    batch = _batch(sampled)
    with RouterTap(policy, batch) as tap:
        logp, _ = policy.compute_logprobs(batch, 1.0, with_entropy=False, routes=Routes(replay=sampled["routes"]))
    free = Routes(record=True)  # the trainer's own routers (recorded on every rank)
    policy.compute_logprobs(batch, 1.0, with_entropy=False, routes=free)
    result.update(replay_logp=logp, replay_tap=_gather(tap.merged()), free=free.recorded)
    return result


def main(out: Path, model: str, spec_file: str) -> None:
    apply_compat()
    spec = torch.load(spec_file, weights_only=False)
    batches = spec["batches"]
    dist.init_process_group("gloo")  # before the engine: its core then runs in a process of its own
    engine = fleet = None
    if dist.get_rank() == 0:
        engine, fleet = _engines(model, spec)
    dist.barrier()  # (the world's default timeout: rank 1 waits here while the engine starts, not in a group's)
    result: dict = {}
    policy = _policy(model, ParallelConfig(expert_parallel=2, timeout_s=120), lr=0.02)
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
    result["sync"] = _sync(policy, engine, fleet)
    result["after_sync"] = _after_sync(policy, engine, fleet, spec, model, out)
    if dist.get_rank() == 0:
        fleet.close()
        engine.close()
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
        print(f"case routing replay: {len(batches)} batches at ep2, synced to both engines; pp2 with and "
              "without recomputation", flush=True)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    main(Path(sys.argv[1]), sys.argv[2], sys.argv[3])
