"""One-sender weight sync, checkout A vs checkout B, in one run: has a change made the common sync
(one trainer rank sending to vLLM servers over gloo) slower?

For each round, A then B, then B then A in the next round (a checkout that always ran second would
start beside the first one's servers still shutting down): two vLLM servers started from that
checkout's code (the
gloo backend runs inside them) on a synthetic Qwen2-like model with many small tensors, a first
untimed sync that forms the transfer group, then ``--syncs`` timed syncs through that checkout's
``build_weight_sync`` (verification on: checksums and the version check; no probe). Printed: each
checkout's median sync time over all its rounds, and B / A. The last line is one JSON object.

    python benchmarks/sync_ab.py --a /path/to/base-checkout --b .      # ~4 min on 2 cores

The checkouts need not be git worktrees (``git archive <commit> | tar -x -C DIR`` makes one).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

HOSTS = ["127.0.0.2", "127.0.0.3"]
MiB = 1 << 20


def one_round(args) -> None:
    """Under one checkout (its directory first on sys.path): servers, syncs, times to ``args.out``."""
    import time

    import torch

    from megatron_rl.demo import TinySpec, write_tiny_model
    from megatron_rl.rollout import connect_fleet
    from megatron_rl.rollout.config import RolloutConfig
    from megatron_rl.rollout.launcher import EngineLauncher, node_specs
    from megatron_rl.rollout.registry import EngineRegistry
    from megatron_rl.sync import SyncConfig, build_weight_sync
    from megatron_rl.sync.base import server_args

    work = Path(args.work_dir)
    model = work / f"qwen2_l{args.layers}"
    if not (model / "tiny_spec.json").exists():
        write_tiny_model(model, TinySpec(arch="qwen2", hidden_size=192, intermediate_size=384, num_layers=args.layers,
                                         num_heads=6, num_kv_heads=2, seed=0))
    from safetensors.torch import load_file

    named = list(load_file(str(model / "model.safetensors")).items())
    meta = [(n, t.dtype, tuple(t.shape)) for n, t in named]
    extra, env = server_args(SyncConfig(transport="gloo"))
    rollout = RolloutConfig(engine="vllm_server", placement="dedicated", num_engines=len(HOSTS),
                            kv_cache_bytes=16 * MiB, max_num_seqs=4, max_prompt_len=8, max_response_len=8,
                            start_timeout_s=600, control_timeout_s=120)
    specs = []
    for i, host in enumerate(HOSTS):
        specs += node_specs(node=f"ab{i}", host=host, count=1, model=str(model), rollout=rollout, max_model_len=16,
                            extra_args=extra, env={**env, "OMP_NUM_THREADS": "1"}, log_dir=str(work / "logs"))
    registry = EngineRegistry(work / f"engines_{os.getpid()}")
    launcher = EngineLauncher(specs, registry=registry, start_timeout_s=600).start()
    try:
        fleet = connect_fleet(rollout, registry_dir=str(registry.dir))
        sync = build_weight_sync(SyncConfig(transport="gloo", bucket_bytes=args.bucket_mib * MiB, timeout_s=300.0),
                                 fleet, metadata=meta)
        sync.sync(iter(named), 1)  # forms the group
        times, phases = [], {}
        for v in range(args.syncs):
            t0 = time.perf_counter()
            m = sync.sync(iter(named), v + 2)
            times.append(time.perf_counter() - t0)
            assert m.complete and not m.failures, m
            for k, x in (m.phases or {}).items():
                phases.setdefault(k, []).append(x)
        sync.close()
        fleet.close()
    finally:
        launcher.stop()
    total = sum(t.numel() * t.element_size() for _, t in named)
    Path(args.out).write_text(json.dumps({"times": times, "phases": phases, "mib": total / MiB, "tensors": len(named),
                                          "load": open("/proc/loadavg").read().split()[0]}))
    del torch


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--a", required=True, help="the checkout to compare against (e.g. the base commit)")
    ap.add_argument("--b", default=str(Path(__file__).resolve().parents[1]), help="the changed checkout")
    ap.add_argument("--rounds", type=int, default=2, help="rounds per checkout (alternating)")
    ap.add_argument("--syncs", type=int, default=6, help="timed syncs per round")
    ap.add_argument("--layers", type=int, default=48)
    ap.add_argument("--bucket-mib", type=int, default=16)
    ap.add_argument("--work-dir", default="/tmp/mrl_sync_ab")
    ap.add_argument("--pause-s", type=float, default=10.0, help="pause between rounds")
    ap.add_argument("--round", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--out", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.round:
        return one_round(args)
    Path(args.work_dir).mkdir(parents=True, exist_ok=True)
    results = {"a": [], "b": []}
    phases: dict = {"a": {}, "b": {}}
    meta = {}
    for r in range(args.rounds):
        for key in (("a", "b") if r % 2 == 0 else ("b", "a")):
            checkout = str(Path(getattr(args, key)).resolve())
            out = Path(args.work_dir) / f"{key}{r}.json"
            proc = subprocess.run([sys.executable, __file__, "--round", "--a", args.a, "--out", str(out),
                                   "--syncs", str(args.syncs), "--layers", str(args.layers),
                                   "--bucket-mib", str(args.bucket_mib), "--work-dir", args.work_dir],
                                  env={**os.environ, "PYTHONPATH": checkout, "OMP_NUM_THREADS": "1"},
                                  cwd=checkout, capture_output=True, text=True, timeout=1200)
            if proc.returncode:
                print(proc.stdout[-2000:], proc.stderr[-5000:])
                raise SystemExit(f"round {key}{r} failed")
            res = json.loads(out.read_text())
            results[key] += res["times"]
            for k, xs in res["phases"].items():
                phases[key].setdefault(k, []).extend(xs)
            meta = res
            print(f"round {r} {key}: median {statistics.median(res['times']):.3f} s (load {res['load']})", flush=True)
            time.sleep(args.pause_s)  # the servers' processes are gone before the next round starts
    a, b = statistics.median(results["a"]), statistics.median(results["b"])
    print(f"\none-sender sync of {meta['mib']:.0f} MiB in {meta['tensors']} tensors to 2 servers: "
          f"A {a:.3f} s, B {b:.3f} s (medians of {len(results['a'])} syncs each); B / A = {b / a:.3f}")
    for key in ("a", "b"):
        print(f"{key} phases (medians, s): " + ", ".join(f"{k} {statistics.median(v):.3f}"
                                                       for k, v in sorted(phases[key].items())))
    print(json.dumps({"a_s": round(a, 4), "b_s": round(b, 4), "b_over_a": round(b / a, 3),
                      "mib": round(meta["mib"], 1), "tensors": meta["tensors"], "syncs_each": len(results["a"])}))


if __name__ == "__main__":
    main()
