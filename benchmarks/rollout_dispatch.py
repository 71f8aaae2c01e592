"""Rollout fleet: straggler-aware dispatch vs fixed shares; a sync through vLLM's weight-transfer
protocol vs one raw broadcast of the same bytes; the cost of verifying it.

One run starts three real vLLM servers (127.0.0.2/3/4, the gloo weight-transfer backend) on a
synthetic Qwen2-like model with many small tensors (default: 200 layers, 2403 tensors, ~256 MiB
fp32: the shape the 11.75x per-tensor-checksum figure was measured on) and prints, measured in this
run:

1. Generation with one of the three engines CPU-throttled (its process group is SIGSTOPped for
   ``--throttle`` of every 100 ms): ``shares`` = each engine samples a fixed contiguous third of the
   prompts (what rollout/pool.py did), ``fleet`` = :class:`EngineFleet` (one request per prompt to
   the engine with the least outstanding work). Both must return the same samples (same seeds).
   ``straggler_speedup`` = shares / fleet.
2. Weight sync: ``ServerWeightSync`` (vLLM's protocol: HTTP routes, our gloo engine packing 16 MiB
   buckets, the servers loading through vLLM's layerwise reload) without verification, vs the floor:
   one broadcast of a single buffer holding all the bytes from the sender to three bare receiver
   processes (no HTTP, no packing, no loading). ``sync_vs_floor`` = sync / floor.
3. Verification: the same sync with one checksum per packed bucket (sender and every worker hash,
   one all-gather at the end): ``verify_overhead`` = (verified - unverified) / unverified, against
   the naive way (hashing each of the 2403 tensors separately, as the old per-tensor checksums did;
   sender side only) over the floor. Then the functional check ``sync.verify`` adds in a run: the
   three servers score the probe sequence (``probe_vs_sync`` = its time / the unverified sync).

Times are medians of ``--repeats`` rounds, on a shared machine: the load average is printed beside
them. The last line is one JSON object with the headline figures.

    python benchmarks/rollout_dispatch.py                 # ~6-8 min on 2 cores (3 servers)
    python benchmarks/rollout_dispatch.py --layers 24 --repeats 2
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import statistics
import sys
import threading
import time
from pathlib import Path

import torch
import torch.multiprocessing as mp

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # runnable without an install
from megatron_rl.demo import TinySpec, write_tiny_model  # noqa: E402
from megatron_rl.rollout import SamplingSpec  # noqa: E402
from megatron_rl.rollout.config import RolloutConfig  # noqa: E402
from megatron_rl.rollout.fleet import EngineFleet  # noqa: E402
from megatron_rl.rollout.launcher import EngineLauncher, node_specs  # noqa: E402
from megatron_rl.rollout.server import VLLMServer  # noqa: E402
from megatron_rl.sync import SyncConfig, build_weight_sync  # noqa: E402
from megatron_rl.sync.base import server_args  # noqa: E402
from megatron_rl.sync.buckets import hash_tensor  # noqa: E402
from megatron_rl.sync.group import broadcast, host_store, make_group  # noqa: E402

HOSTS = ["127.0.0.2", "127.0.0.3", "127.0.0.4"]
MiB = 1 << 20


def loadavg() -> str:
    return open("/proc/loadavg").read().split(" ")[0]


class Throttle:
    """Keep a server's process group stopped for ``fraction`` of every ``period_s``."""

    def __init__(self, server, fraction: float, period_s: float = 0.1):
        self.server, self.fraction, self.period = server, fraction, period_s
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self):
        while not self._stop.is_set():
            self.server.signal(signal.SIGSTOP)
            time.sleep(self.period * self.fraction)
            self.server.signal(signal.SIGCONT)
            time.sleep(self.period * (1 - self.fraction))

    def __enter__(self):
        self._thread.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        self._thread.join()
        self.server.signal(signal.SIGCONT)


async def fixed_shares(engines, prompts, spec):
    """Each engine samples a contiguous third, with each prompt's own seed: the old pool's split."""
    k = len(engines)
    bounds = [round(i * len(prompts) / k) for i in range(k + 1)]

    async def share(engine, lo, hi):
        return await asyncio.gather(*(engine.submit(prompts[i], spec.for_prompt(i)) for i in range(lo, hi)))

    parts = await asyncio.gather(*(share(e, lo, hi) for e, lo, hi in zip(engines, bounds, bounds[1:])))
    out = [g for part in parts for g in part]
    for e in engines:
        await e.aclose()
    return out


def floor_receiver(rank: int, world: int, port: int, nbytes: int, rounds: int):
    os.environ["OMP_NUM_THREADS"] = "1"
    group = make_group("127.0.0.1", port, rank, world, 300.0)
    for _ in range(rounds):
        buf = torch.empty(nbytes, dtype=torch.uint8)
        broadcast(group, buf).wait()
        group.barrier().wait()


def floor_times(nbytes: int, receivers: int, rounds: int) -> list[float]:
    """One broadcast of ``nbytes`` from rank 0 to bare receiver processes (ends with a barrier)."""
    world = receivers + 1
    store = host_store("127.0.0.1", world, 300.0)
    ctx = mp.get_context("spawn")
    procs = [ctx.Process(target=floor_receiver, args=(r, world, store.port, nbytes, rounds)) for r in range(1, world)]
    for p in procs:
        p.start()
    group = make_group("127.0.0.1", store.port, 0, world, 300.0, store=store)
    data = torch.randint(0, 255, (nbytes,), dtype=torch.uint8)
    times = []
    for _ in range(rounds):
        t0 = time.perf_counter()
        broadcast(group, data).wait()
        group.barrier().wait()
        times.append(time.perf_counter() - t0)
    for p in procs:
        p.join(timeout=60)
    return times


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--layers", type=int, default=200)
    ap.add_argument("--hidden", type=int, default=192)
    ap.add_argument("--inter", type=int, default=384)
    ap.add_argument("--prompts", type=int, default=48)
    ap.add_argument("--n", type=int, default=4)
    ap.add_argument("--max-tokens", type=int, default=48)
    ap.add_argument("--throttle", type=float, default=0.75, help="fraction of time the slow engine is stopped")
    ap.add_argument("--bucket-mib", type=int, default=16)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--work-dir", default="/tmp/mrl_rollout_dispatch")
    args = ap.parse_args()
    work = Path(args.work_dir)
    model = work / f"qwen2_l{args.layers}_h{args.hidden}"
    if not (model / "tiny_spec.json").exists():
        write_tiny_model(model, TinySpec(arch="qwen2", hidden_size=args.hidden, intermediate_size=args.inter,
                                         num_layers=args.layers, num_heads=args.hidden // 32, num_kv_heads=2,
                                         seed=0))
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32)
    vocab = hf.config.vocab_size
    named = [(n, p.detach().clone()) for n, p in hf.named_parameters()]
    del hf
    meta = [(n, t.dtype, tuple(t.shape)) for n, t in named]
    total = sum(t.numel() * t.element_size() for _, t in named)
    cfg = RolloutConfig(engine="vllm_server", placement="external", server_urls=["http://x"], kv_cache_bytes=64 * MiB,
                        max_num_seqs=32, max_prompt_len=32, max_response_len=args.max_tokens, timeout_s=600,
                        start_timeout_s=900, control_timeout_s=60)
    extra, env = server_args(SyncConfig(transport="gloo"))
    specs = []
    for i, host in enumerate(HOSTS):
        specs += node_specs(node=f"b{i}", host=host, count=1, model=str(model), rollout=cfg,
                            max_model_len=32 + args.max_tokens, extra_args=extra,
                            env={**env, "OMP_NUM_THREADS": "1"}, log_dir=str(work / "logs"))
    print(f"# model: {len(named)} tensors, {total / MiB:.0f} MiB fp32; 3 servers; load average {loadavg()} "
          f"(2-core box shared with other sessions)", flush=True)
    t0 = time.perf_counter()
    with EngineLauncher(specs, start_timeout_s=900) as launcher:
        launcher.start()
        print(f"# servers ready in {time.perf_counter() - t0:.0f}s", flush=True)
        engines = [VLLMServer(s.spec.url(), cfg, name=s.spec.name).connect() for s in launcher.servers]

        # ---- 1. straggler
        prompts = [[5 + (7 * i) % 50, 9 + i % 13, 3, 11 + (3 * i) % 17] for i in range(args.prompts)]
        spec = SamplingSpec(n=args.n, temperature=1.0, max_tokens=args.max_tokens, seed=7)
        fleet = EngineFleet(engines, cfg)
        fleet.generate(prompts[:6], spec)  # warm-up
        t_shares, t_fleet = [], []
        for _ in range(args.repeats):
            with Throttle(launcher.servers[2], args.throttle):
                t = time.perf_counter()
                a = asyncio.run(fixed_shares(engines, prompts, spec))
                t_shares.append(time.perf_counter() - t)
                t = time.perf_counter()
                b = fleet.generate(prompts, spec)
                t_fleet.append(time.perf_counter() - t)
            assert [[c.token_ids for c in g] for g in a] == [[c.token_ids for c in g] for g in b], \
                "fixed shares and the fleet sampled differently"
        share_of_slow = sum(len(g) for g in b if g[0].engine == engines[2].name) / (len(prompts) * args.n)
        s_med, f_med = statistics.median(t_shares), statistics.median(t_fleet)
        print(f"\n## generation, engine {engines[2].name} stopped {args.throttle:.0%} of the time "
              f"({args.prompts} prompts x {args.n} x {args.max_tokens} tokens); load {loadavg()}")
        print("| dispatch | s (median) | runs |\n| --- | --- | --- |")
        print(f"| fixed shares (1/3 each) | {s_med:.2f} | {', '.join(f'{x:.2f}' for x in t_shares)} |")
        print(f"| fleet (least outstanding work) | {f_med:.2f} | {', '.join(f'{x:.2f}' for x in t_fleet)} |")
        print(f"straggler_speedup = {s_med / f_med:.2f}x; the slow engine sampled {share_of_slow:.0%} "
              f"of the sequences under the fleet", flush=True)

        # ---- 2 + 3. sync (the group is formed by a first, untimed sync; then timed rounds)
        version, times, hash_s = 0, {False: [], True: []}, []
        for verify in (False, True):
            sync = build_weight_sync(SyncConfig(transport="gloo", bucket_bytes=args.bucket_mib * MiB,
                                                timeout_s=300, verify=verify), fleet, metadata=meta)
            for r in range(args.repeats + 1):
                version += 1
                m = sync.sync(iter(named), version)
                assert m.complete and m.engines == 3, m
                if r:
                    times[verify].append(m.seconds)
                    hash_s += [m.verify_seconds] if verify else []
            sync.close()
        # the functional check a trainer adds with sync.verify: every server scores the probe
        # sequence after loading (timed alone here: all servers at once, as the sync settles them)
        from concurrent.futures import ThreadPoolExecutor

        from megatron_rl.sync.probe import probe_length, probe_tokens

        tokens = probe_tokens(vocab, probe_length(32 + args.max_tokens))
        probe_s = []
        with ThreadPoolExecutor(len(engines)) as pool:
            for _ in range(args.repeats):
                t = time.perf_counter()
                list(pool.map(lambda e: e.score(tokens), engines))
                probe_s.append(time.perf_counter() - t)
        fleet.close()
    floor = floor_times(total, len(HOSTS), args.repeats)
    t0 = time.perf_counter()
    for _, t in named:  # the naive verification: one checksum per tensor (sender side)
        hash_tensor(t)
    per_tensor = time.perf_counter() - t0
    off, on, fl = statistics.median(times[False]), statistics.median(times[True]), statistics.median(floor)
    print(f"\n## weight sync of {total / MiB:.0f} MiB in {len(named)} tensors to 3 servers, "
          f"{args.bucket_mib} MiB buckets; load {loadavg()}")
    print("| variant | s (median) | x floor |\n| --- | --- | --- |")
    print(f"| floor: one raw broadcast of all bytes to 3 bare receivers | {fl:.2f} | 1.00 |")
    print(f"| vLLM protocol (gloo engine, HTTP routes, vLLM reload), no verify | {off:.2f} | {off / fl:.2f} |")
    print(f"| the same + one checksum per bucket | {on:.2f} | {on / fl:.2f} |")
    print(f"verify_overhead = {(on - off) / off:.3f} (sender hashing {statistics.median(hash_s):.3f}s, overlapped "
          f"with the transfer); naive per-tensor checksums on the sender alone: {per_tensor:.3f}s = "
          f"{per_tensor / fl:.2f}x the floor")
    probe = statistics.median(probe_s)
    print(f"probe (3 servers score {len(tokens)} tokens, concurrently): {probe:.3f}s = "
          f"{probe / off:.3f}x the unverified sync")
    print(json.dumps({"straggler_speedup": round(s_med / f_med, 3), "sync_vs_floor": round(off / fl, 3),
                      "verify_overhead": round((on - off) / off, 3), "probe_vs_sync": round(probe / off, 3)}))


if __name__ == "__main__":
    main()
