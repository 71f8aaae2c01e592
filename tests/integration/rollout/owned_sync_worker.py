"""torchrun worker of test_fleet.py's owned-export sync test (``--nproc-per-node 4``).

For each layout of ``spec["layouts"]`` (``parallel``: policy.parallel keys) every rank builds the Megatron
policy from that layout's checkpoint and syncs it, each pipeline stage's sender streaming its own
tensors (``sync.senders=owners``), into an in-process vLLM engine on rank 0 and into the module's
vLLM servers (gloo). Around each sync every rank counts the bytes it sends and receives through
torch.distributed (the export's TP gathers, the in-process fan-in) and the gloo broadcasts it roots,
and records the names its export yielded. After each sync rank 0 has the engines generate (greedy,
and sampled with log-probs) for the test to compare with transformers. Results: ``out/result.pt``.
"""

from __future__ import annotations

import contextlib
import json
import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")

COUNTS: dict[str, int] = {}
ON = {"value": False}


def _nbytes(t) -> int:
    return t.numel() * t.element_size()


def _add(key: str, n: int) -> None:
    if ON["value"]:
        COUNTS[key] = COUNTS.get(key, 0) + n


def instrument() -> None:
    """Count what this rank sends and receives through the calls the export and the syncs make."""
    import megatron_rl.sync.gloo_trainer as gloo_trainer

    real = {name: getattr(dist, name) for name in ("gather", "send", "isend", "recv", "irecv")}

    def gather(tensor, gather_list=None, dst=None, group=None, **kw):
        if gather_list is not None:  # the destination: every other rank's shard arrives here
            _add("recv", sum(_nbytes(t) for t in gather_list) - _nbytes(tensor))
        else:
            _add("sent", _nbytes(tensor))
        return real["gather"](tensor, gather_list, dst=dst, group=group, **kw)

    def sending(name):
        def call(tensor, *a, **kw):
            _add("sent", _nbytes(tensor))
            return real[name](tensor, *a, **kw)
        return call

    def receiving(name):
        def call(tensor, *a, **kw):
            _add("recv", _nbytes(tensor))
            return real[name](tensor, *a, **kw)
        return call

    dist.gather = gather
    dist.send, dist.isend = sending("send"), sending("isend")
    dist.recv, dist.irecv = receiving("recv"), receiving("irecv")
    real_bcast = gloo_trainer.broadcast

    def broadcast(group, tensor):  # the trainer side only roots its own group's broadcasts
        _add("sent", _nbytes(tensor))
        return real_bcast(group, tensor)

    gloo_trainer.broadcast = broadcast


@contextlib.contextmanager
def counting():
    COUNTS.clear()
    ON["value"] = True
    try:
        yield COUNTS
    finally:
        ON["value"] = False


def recorded(stream, names: list):
    for name, tensor in stream:
        names.append(name)
        yield name, tensor


def generate(engine, prompts) -> dict:
    from megatron_rl.rollout import SamplingSpec

    greedy = engine.generate(prompts, SamplingSpec(temperature=0.0, max_tokens=10))
    sampled = engine.generate(prompts, SamplingSpec(n=2, temperature=1.0, max_tokens=8, seed=3))
    return {"greedy": [g[0].token_ids for g in greedy],
            "sampled": [[(c.token_ids, c.logprobs) for c in g] for g in sampled],
            "versions": sorted({c.weight_version for g in greedy + sampled for c in g})}


def main() -> None:
    from megatron_rl.compat import apply_compat

    apply_compat()
    from megatron_rl.models.config import OptimConfig, ParallelConfig, PolicyConfig
    from megatron_rl.models.parallel import init_distributed
    from megatron_rl.models.policy import MegatronPolicy
    from megatron_rl.rollout import connect_fleet
    from megatron_rl.rollout.config import RolloutConfig
    from megatron_rl.sync import SyncConfig, build_weight_sync

    out = Path(sys.argv[1])
    spec = json.loads(Path(sys.argv[2]).read_text())
    instrument()
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    engine = fleet = None
    if rank == 0:
        from megatron_rl.rollout.vllm_engine import VLLMEngine

        engine = VLLMEngine(spec["engine_model"], RolloutConfig(kv_cache_bytes=16 << 20, max_num_seqs=8,
                                                                 max_prompt_len=32, max_response_len=32),
                            max_model_len=64, name="inproc")
        fleet = connect_fleet(RolloutConfig.from_dict(spec["fleet"]), registry_dir=spec["registry"],
                              names=spec["names"])
    results = []
    for layout in spec["layouts"]:
        par = ParallelConfig(**layout["parallel"], timeout_s=120)
        groups = init_distributed(par)
        policy = MegatronPolicy.from_hf(layout["model"], PolicyConfig(parallel=par, optim=OptimConfig(lr=1e-3)),
                                        groups)
        plan = policy.export_plan()
        row = {"name": layout["name"], "plan": [tuple(i[:1]) + (str(i.dtype), tuple(i.shape), i.sender) for i in plan]}
        for kind in ("inprocess", "gloo"):
            cfg = SyncConfig(transport=kind) if kind == "inprocess" else \
                SyncConfig(transport="gloo", bucket_bytes=64 * 1024, timeout_s=60.0)
            sync = build_weight_sync(cfg, (engine if kind == "inprocess" else fleet) if rank == 0 else None,
                                     rank=rank, metadata=plan)
            names: list[str] = []
            with counting() as counts:
                metrics = sync.sync(recorded(policy.export_owned(plan), names), layout["version"])
            sync.close()
            mine = {"names": names, "counts": dict(counts)}
            ranks = [None] * dist.get_world_size()
            dist.all_gather_object(ranks, mine)
            entry = {"ranks": ranks}
            if rank == 0:
                entry["metrics"] = {"senders": metrics.senders, "sender_bytes": metrics.sender_bytes,
                                    "bytes": metrics.bytes, "tensors": metrics.tensors, "engines": metrics.engines,
                                    "complete": metrics.complete, "failures": metrics.failures}
                if kind == "inprocess":
                    entry["outputs"] = {"inproc": generate(engine, spec["prompts"])}
                else:
                    entry["outputs"] = {e.name: generate(e, spec["prompts"]) for e in fleet.engines}
                    entry["rounds"] = {e.name: e.collective_rpc("mrl_last_weight_round") for e in fleet.engines}
            row[kind] = entry
        results.append(row)
    if rank == 0:
        fleet.close()
        engine.close()
        torch.save(results, out / "result.pt")
    dist.barrier()


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    main()
