"""Weight sync from a pipeline- or expert-parallel trainer: every stage (every expert-parallel rank)
streams its own layers (its own experts) (``sync.senders=owners``) vs one rank gathering the whole
model and sending it (``gather``), in one run.

The run starts two vLLM servers (127.0.0.2/3, the gloo weight-transfer backend) on a synthetic
Llama-like model, then a ``torchrun --nproc-per-node 2`` trainer at pipeline_parallel=2 (the real
Megatron policy, its real export) that syncs the servers ``--repeats`` times with each plan (a first,
untimed sync of each forms its transfer group). Printed per plan: the sync's time (median, on the
driver: the whole ``WeightSync.sync``, verification included), the bytes each trainer rank sent and
received through torch.distributed and the gloo broadcasts (counted around the sync), and each
rank's peak resident memory growth during the syncs. ``owners_vs_gather`` = owners / gather time.

Each sender should send only its own stage's bytes (about half each here; the stages' tensors differ
by the embedding and head), and no trainer rank should receive tensor bytes with ``owners``; with
``gather`` rank 0 receives stage 1's bytes and sends everything. On 2 shared cores the stages'
streams compete for the same CPUs, so the time ratio is an upper bound of what separate nodes see.
The last line is one JSON object.

``--moe``: a synthetic Qwen3-MoE (``--experts`` routed experts of width ``--inter`` / 4 per layer, top
2) and a trainer at expert_parallel=2 (``--ep``; ``--pp`` 1): each EP rank should send only its own
experts (1/EP of the expert bytes), plus the rest of the model where it holds it (the rank of the
first pipeline stage's replica 0: attention, norms, routers, embedding and head). Printed in addition:
each sender's expert and other bytes against that target.

    python benchmarks/owned_sync.py                        # ~3 min on 2 cores
    python benchmarks/owned_sync.py --layers 4 --repeats 2   # a quick look
    python benchmarks/owned_sync.py --moe                   # EP=2 on a Qwen3-MoE
"""

from __future__ import annotations

import argparse
import json
import os
import re
import resource
import signal
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))  # runnable without an install
HOSTS = ["127.0.0.2", "127.0.0.3"]
MiB = 1 << 20
EXPERT = re.compile(r"\.mlp\.experts\.\d+\.")  # a routed expert's HF tensor (not a shared expert's)


def loadavg() -> str:
    return open("/proc/loadavg").read().split(" ")[0]


# ------------------------------------------------------------------------------ the trainer ranks
COUNTS: dict[str, int] = {}


def _count(key: str, t) -> None:
    if COUNTS.get("on"):
        COUNTS[key] = COUNTS.get(key, 0) + t.numel() * t.element_size()


def _instrument() -> None:
    """Count the bytes this rank sends and receives in a sync (the export's gathers and sends, the
    in-process fan-in, the gloo broadcasts it roots)."""
    import torch.distributed as dist

    import megatron_rl.sync.gloo_trainer as gloo_trainer

    real = {n: getattr(dist, n) for n in ("gather", "send", "isend", "recv", "irecv")}

    def gather(tensor, gather_list=None, dst=None, group=None, **kw):
        if gather_list is not None:
            for t in gather_list[1:]:
                _count("recv", t)
        else:
            _count("sent", tensor)
        return real["gather"](tensor, gather_list, dst=dst, group=group, **kw)

    def wrap(name, key):
        def call(tensor, *a, **kw):
            _count(key, tensor)
            return real[name](tensor, *a, **kw)
        return call

    dist.gather = gather
    dist.send, dist.isend = wrap("send", "sent"), wrap("isend", "sent")
    dist.recv, dist.irecv = wrap("recv", "recv"), wrap("irecv", "recv")
    real_bcast = gloo_trainer.broadcast

    def broadcast(group, tensor):
        _count("sent", tensor)
        return real_bcast(group, tensor)

    gloo_trainer.broadcast = broadcast


def plan_split(plan) -> dict[int, dict[str, int]]:
    """Bytes each sender of ``plan`` sends: ``{rank: {"expert": routed experts', "rest": the others'}}``."""
    out: dict[int, dict[str, int]] = {}
    for item in plan:
        nbytes = item.dtype.itemsize
        for d in item.shape:
            nbytes *= d
        kind = "expert" if EXPERT.search(item.name) else "rest"
        row = out.setdefault(item.sender, {"expert": 0, "rest": 0})
        row[kind] += nbytes
    return out


def worker(args) -> None:
    """One trainer rank (under torchrun): build the PP x EP policy, sync with each plan, report."""
    from megatron_rl.compat import apply_compat

    apply_compat()
    import torch.distributed as dist

    from megatron_rl.models.config import OptimConfig, ParallelConfig, PolicyConfig
    from megatron_rl.models.parallel import init_distributed
    from megatron_rl.models.policy import MegatronPolicy
    from megatron_rl.rollout import connect_fleet
    from megatron_rl.rollout.config import RolloutConfig
    from megatron_rl.sync import SyncConfig, build_weight_sync

    _instrument()
    par = ParallelConfig(pipeline_parallel=args.pp, expert_parallel=args.ep, timeout_s=600)
    groups = init_distributed(par)
    policy = MegatronPolicy.from_hf(args.model, PolicyConfig(parallel=par, optim=OptimConfig(lr=1e-3)), groups)
    rank = groups.rank
    fleet = None
    if rank == 0:
        fleet = connect_fleet(RolloutConfig(engine="vllm_server", placement="dedicated", num_engines=len(HOSTS),
                                            kv_cache_bytes=16 * MiB, max_num_seqs=4, max_prompt_len=8,
                                            max_response_len=8, start_timeout_s=600, control_timeout_s=120),
                              registry_dir=args.registry)
    out = {}
    version = 0
    for kind in ("gather", "owners"):
        cfg = SyncConfig(transport="gloo", bucket_bytes=args.bucket_mib * MiB, timeout_s=300.0, senders=kind,
                         verify=True)
        plan = policy.export_plan(to_rank=cfg.gather_rank())
        sync = build_weight_sync(cfg, fleet, rank=rank, metadata=plan)
        out.setdefault(kind, {})["plan"] = {str(k): v for k, v in plan_split(plan).items()}
        version += 1
        sync.sync(policy.export_owned(plan), version)  # forms the group (untimed)
        entry = out[kind]
        entry.update(seconds=[], ranks=None, rss_growth_mib=None)
        rss0 = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        for _ in range(args.repeats):
            version += 1
            COUNTS.clear()
            COUNTS["on"] = 1
            dist.barrier()
            t0 = time.perf_counter()
            m = sync.sync(policy.export_owned(plan), version)
            took = time.perf_counter() - t0
            COUNTS.pop("on")
            ranks = [None] * groups.world_size
            dist.all_gather_object(ranks, {"sent": COUNTS.get("sent", 0), "recv": COUNTS.get("recv", 0)})
            if rank == 0:
                assert m.complete and not m.failures, m
                entry["seconds"].append(took)
                entry["ranks"] = ranks
                entry["sender_bytes"] = {int(k): v for k, v in m.sender_bytes.items()}
                entry["bytes"] = m.bytes
        growth = (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - rss0) / 1024
        grown = [None] * groups.world_size
        dist.all_gather_object(grown, growth)
        entry["rss_growth_mib"] = grown
        sync.close()
    if rank == 0:
        fleet.close()
        Path(args.out).write_text(json.dumps(out))
    dist.barrier()


# ------------------------------------------------------------------------------ the driver script
def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--hidden", type=int, default=512)
    ap.add_argument("--inter", type=int, default=1536)
    ap.add_argument("--moe", action="store_true", help="a Qwen3-MoE at expert_parallel=2 (pipeline_parallel=1)")
    ap.add_argument("--experts", type=int, default=8, help="--moe: routed experts per layer (top 2)")
    ap.add_argument("--pp", type=int, default=None, help="pipeline-parallel size (default: 2; --moe: 1)")
    ap.add_argument("--ep", type=int, default=None, help="expert-parallel size (default: 1; --moe: 2)")
    ap.add_argument("--bucket-mib", type=int, default=16)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--work-dir", default="/tmp/mrl_owned_sync")
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--model", help=argparse.SUPPRESS)
    ap.add_argument("--registry", help=argparse.SUPPRESS)
    ap.add_argument("--out", help=argparse.SUPPRESS)
    args = ap.parse_args()
    args.pp = args.pp or (1 if args.moe else 2)
    args.ep = args.ep or (2 if args.moe else 1)
    if args.ep > 1 and not args.moe:
        ap.error("--ep needs --moe (a dense model has no experts)")
    if args.worker:
        return worker(args)
    from megatron_rl.demo import TinySpec, write_tiny_model
    from megatron_rl.rollout.config import RolloutConfig
    from megatron_rl.rollout.launcher import EngineLauncher, node_specs
    from megatron_rl.rollout.registry import EngineRegistry
    from megatron_rl.sync import SyncConfig
    from megatron_rl.sync.base import server_args

    signal.signal(signal.SIGTERM, lambda s, f: (_ for _ in ()).throw(SystemExit(128 + s)))
    work = Path(args.work_dir)
    heads = args.hidden // 64
    if args.moe:
        model = work / f"qwen3moe_l{args.layers}_h{args.hidden}_i{args.inter}_e{args.experts}"
        spec = TinySpec(arch="qwen3_moe", hidden_size=args.hidden, intermediate_size=args.inter,
                        num_layers=args.layers, num_heads=heads, num_kv_heads=heads, num_experts=args.experts,
                        num_experts_per_tok=2, moe_intermediate_size=args.inter // 4, seed=0)
    else:
        model = work / f"llama_l{args.layers}_h{args.hidden}"
        spec = TinySpec(arch="llama", hidden_size=args.hidden, intermediate_size=args.inter,
                        num_layers=args.layers, num_heads=heads, num_kv_heads=heads, seed=0)
    if not (model / "tiny_spec.json").exists():
        write_tiny_model(model, spec)
    world = args.pp * args.ep
    extra, env = server_args(SyncConfig(transport="gloo"))
    rollout = RolloutConfig(engine="vllm_server", placement="dedicated", kv_cache_bytes=16 * MiB, max_num_seqs=4,
                            max_prompt_len=8, max_response_len=8)
    specs = []
    for i, host in enumerate(HOSTS):
        specs += node_specs(node=f"o{i}", host=host, count=1, model=str(model), rollout=rollout, max_model_len=16,
                            extra_args=extra, env={**env, "OMP_NUM_THREADS": "1"}, log_dir=str(work / "logs"))
    registry = EngineRegistry(work / "engines")
    launcher = EngineLauncher(specs, registry=registry, start_timeout_s=600).start()
    try:
        print(f"# {model.name}: 2 servers, trainer PP={args.pp} EP={args.ep} (torchrun {world} ranks), "
              f"load average {loadavg()} "
              f"(2-core box shared with other sessions)", flush=True)
        result = work / "result.json"
        proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone",
                               "--nproc-per-node", str(world), __file__, "--worker", "--model", str(model), "--registry", str(registry.dir),
                               "--pp", str(args.pp), "--ep", str(args.ep), *(["--moe"] if args.moe else []),
                               "--out", str(result), "--repeats", str(args.repeats),
                               "--bucket-mib", str(args.bucket_mib)],
                              env={**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO)},
                              capture_output=True, text=True, timeout=1800)
        if proc.returncode:
            print(proc.stdout[-3000:], proc.stderr[-6000:])
            raise SystemExit(proc.returncode)
        out = json.loads(result.read_text())
    finally:
        launcher.stop()
    total = out["owners"]["bytes"]
    print(f"\n## one sync of {total / MiB:.1f} MiB to 2 servers (median of {args.repeats}; load {loadavg()})")
    print("| plan | seconds | per rank: sent MiB / received MiB | senders' bytes | peak RSS growth per rank MiB |")
    print("|---|---|---|---|---|")
    med = {}
    for kind in ("gather", "owners"):
        e = out[kind]
        med[kind] = statistics.median(e["seconds"])
        ranks = ", ".join(f"r{i}: {r['sent'] / MiB:.1f} / {r['recv'] / MiB:.1f}" for i, r in enumerate(e["ranks"]))
        senders = ", ".join(f"r{k}: {v / MiB:.1f}" for k, v in sorted(e["sender_bytes"].items()))
        print(f"| {kind} | {med[kind]:.3f} | {ranks} | {senders} | {e['rss_growth_mib']} |")
    owners = out["owners"]
    most = max(owners["sender_bytes"].values())
    print(f"\nowners_vs_gather = {med['owners'] / med['gather']:.3f}; the most one owner sends: "
          f"{most / total:.3f} of the model; gather: rank 0 receives "
          f"{out['gather']['ranks'][0]['recv'] / MiB:.1f} MiB and sends {out['gather']['ranks'][0]['sent'] / MiB:.1f} MiB")
    split = owners["plan"]
    experts = sum(r["expert"] for r in split.values())
    rest = sum(r["rest"] for r in split.values())
    extra = {}
    if experts:
        shares = {k: r["expert"] / experts for k, r in split.items()}
        print(f"\nexperts {experts / MiB:.1f} MiB, the rest {rest / MiB:.1f} MiB; each owner sends (target: <= 1/EP = "
              f"{1 / args.ep:.3f} of the expert bytes, plus the rest it holds):")
        for k, r in sorted(split.items()):
            print(f"  rank {k}: experts {r['expert'] / MiB:.1f} MiB ({shares[k]:.3f} of them), the rest "
                  f"{r['rest'] / MiB:.1f} MiB ({r['rest'] / rest:.3f} of it)")
        extra = {"expert_mib": round(experts / MiB, 1), "rest_mib": round(rest / MiB, 1),
                 "owners_expert_share": {k: round(v, 3) for k, v in shares.items()},
                 "owners_rest_mib": {k: round(r["rest"] / MiB, 1) for k, r in split.items()},
                 "experts_within_target": max(shares.values()) <= 1 / args.ep + 1e-9}
    print(json.dumps({"pp": args.pp, "ep": args.ep, "owners_vs_gather": round(med["owners"] / med["gather"], 3),
                      "owners_s": round(med["owners"], 3), "gather_s": round(med["gather"], 3),
                      "model_mib": round(total / MiB, 1),
                      "owners_max_sender_share": round(most / total, 3),
                      "owners_sender_mib": {k: round(v / MiB, 1) for k, v in owners["sender_bytes"].items()},
                      "owners_trainer_recv_mib": [round(r["recv"] / MiB, 1) for r in owners["ranks"]],
                      "gather_trainer_recv_mib": [round(r["recv"] / MiB, 1) for r in out["gather"]["ranks"]],
                      **extra, "load": loadavg()}))


if __name__ == "__main__":
    main()
