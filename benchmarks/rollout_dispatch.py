"""Rollout fleet: straggler-aware dispatch vs fixed shares; a sync through vLLM's weight-transfer
protocol vs one raw broadcast of the same bytes; the cost of verifying it.

One run starts three real vLLM servers (127.0.0.2/3/4, the gloo weight-transfer backend), reused by
every phase, on a synthetic Qwen2-like model with many small tensors (default: 200 layers, 2403
tensors, 245 MiB fp32: the shape the 11.75x per-tensor-checksum figure was measured on), and prints,
measured in this run:

1. Generation with one of the three engines slowed by a per-step delay (a vLLM logits processor
   loaded into that server only, ``benchmarks/fleet_hooks.py``, sleeps in every engine step and so
   leaves its CPU to the other two; the delay is ``--slowdown`` - 1 times the step time measured
   unslowed, or ``--step-delay-ms``): ``fixed shares`` = each engine samples a
   contiguous third of the prompts (what rollout/pool.py did), vs :class:`EngineFleet` (one request
   per prompt to the engine with the least outstanding work) without and with tail hedging
   (``rollout.hedge_after``: a slow engine's requests are also sent to engines with room, the first
   answer wins). All must return the same samples (same seeds). ``straggler_speedup`` = fixed shares
   / the fleet with hedging.
2. Weight sync: ``ServerWeightSync`` (vLLM's protocol: HTTP routes, our gloo engine packing
   ``--bucket-mib`` buckets, the servers loading through vLLM's layerwise reload) without
   verification, vs the floor: one broadcast of a single buffer holding all the bytes from the
   sender to three bare receiver processes (no HTTP, no packing, no loading). ``sync_vs_floor`` =
   sync / floor. Beside it: where the sync's time goes (sender phases and, per engine, time blocked
   on the broadcast vs in vLLM's ``load_weights``), and a second floor: the raw broadcast plus the
   engines' own load of the same tensors (vLLM's reload of the model files, timed inside the worker,
   all three engines at once, without any transfer).
3. Verification: the same sync with one checksum per packed bucket (XXH3-64 of the bucket's bytes;
   the sender hashes while the bucket is in flight, every worker on a side thread while it loads;
   one all-gather at the end), alternated with the unverified sync in blocks of four (ABBA, then
   BAAB, ``--rounds`` blocks): ``verify_overhead`` = the median over blocks of (verified -
   unverified) / unverified, printed with its spread over the blocks, against
   the naive way (hashing each of the 2403 tensors separately, as the old per-tensor checksums did;
   sender side only) over the floor. Then the functional check ``sync.verify`` adds in a run: the
   three servers score the probe sequence (``probe_vs_sync`` = its time / the unverified sync).

The floor is measured first, then phases 2 and 3 (alternated), then 1 (same servers throughout).
Times are medians of ``--repeats`` rounds, on a shared 2-core machine: the load average is printed
beside them. The last line is one JSON object with the headline figures.

    python benchmarks/rollout_dispatch.py                  # ~5-6 min on 2 cores (3 servers)
    python benchmarks/rollout_dispatch.py --layers 24      # a quick look (~2 min)
"""

from __future__ import annotations

import argparse
import dataclasses
import asyncio
import json
import os
import signal
import statistics
import sys
import time
from concurrent.futures import ThreadPoolExecutor
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
from megatron_rl.sync.buckets import host_digest  # noqa: E402
from megatron_rl.sync.group import broadcast, host_store, make_group  # noqa: E402

HOSTS = ["127.0.0.2", "127.0.0.3", "127.0.0.4"]  # the last one is slowed
MiB = 1 << 20


async def fixed_shares(engines, prompts, spec):
    """Each engine samples a contiguous third, with each prompt's own seed: the old pool's split."""
    k = len(engines)
    bounds = [round(i * len(prompts) / k) for i in range(k + 1)]

    async def share(engine, lo, hi):
        return await asyncio.gather(*(engine.submit(prompts[i], spec.for_prompt(i)) for i in range(lo, hi)))

    async def timed(engine, lo, hi):
        t = time.perf_counter()
        out = await share(engine, lo, hi)
        return out, time.perf_counter() - t

    parts = await asyncio.gather(*(timed(e, lo, hi) for e, lo, hi in zip(engines, bounds, bounds[1:])))
    for e in engines:
        await e.aclose()
    return [g for part, _ in parts for g in part], [s for _, s in parts]


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


def set_verify(sync, on: bool) -> None:
    """Checksum the next rounds or not (the sender's flag rides on each round's update info)."""
    sync.config.verify = on
    sync.transfer.engine.info.verify = on


def loadavg() -> str:
    return open("/proc/loadavg").read().split(" ")[0]


def med(xs) -> float:
    return statistics.median(xs) if xs else float("nan")


def _terminate(signum, frame):  # a timeout's SIGTERM: leave through the launcher, which kills the servers
    raise SystemExit(128 + signum)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--layers", type=int, default=200)
    ap.add_argument("--hidden", type=int, default=192)
    ap.add_argument("--inter", type=int, default=384)
    ap.add_argument("--prompts", type=int, default=24)
    ap.add_argument("--n", type=int, default=4)
    ap.add_argument("--max-tokens", type=int, default=8)
    ap.add_argument("--max-num-seqs", type=int, default=32)
    ap.add_argument("--slowdown", type=float, default=4.0,
                    help="slow the third engine's steps to this many times the others' measured step time "
                         "(4: the issue's 75%% CPU throttle)")
    ap.add_argument("--step-delay-ms", type=float, default=None,
                    help="a fixed per-step delay of the slow engine instead of --slowdown")
    ap.add_argument("--hedge-after", type=float, default=1.5, help="rollout.hedge_after of the hedged fleet")
    ap.add_argument("--bucket-mib", type=int, default=16)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--sync-only", action="store_true",
                    help="phases 2 and 3 only (the sync and its verification), not the straggler phase")
    ap.add_argument("--rounds", type=int, default=4,
                    help="blocks of four syncs (ABBA / BAAB alternately) comparing verified and unverified")
    ap.add_argument("--work-dir", default="/tmp/mrl_rollout_dispatch")
    args = ap.parse_args()
    signal.signal(signal.SIGTERM, _terminate)
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
    max_len = 8 + args.max_tokens
    # room for max_num_seqs full sequences (16-token blocks), so no request waits for KV blocks
    kv_bytes = (args.layers * 2 * 2 * (args.hidden // (args.hidden // 32)) * 4 * args.max_num_seqs
                * -(-max_len // 16) * 16)
    cfg = RolloutConfig(engine="vllm_server", placement="external", server_urls=["http://x"],
                        kv_cache_bytes=int(kv_bytes * 1.5) + 16 * MiB,
                        max_num_seqs=args.max_num_seqs, max_prompt_len=8, max_response_len=args.max_tokens,
                        timeout_s=600, start_timeout_s=600, control_timeout_s=60, hedge_after=0.0)
    extra, env = server_args(SyncConfig(transport="gloo"))
    ext = extra.index("--worker-extension-cls")
    extra[ext + 1] = "benchmarks.fleet_hooks.BenchWorkerExtension"  # the product's + the own-load timer
    work.mkdir(parents=True, exist_ok=True)
    delay_file = work / "step_delay_s"
    delay_file.write_text("0")
    specs = []
    for i, host in enumerate(HOSTS):
        slow = i == len(HOSTS) - 1
        specs += node_specs(node=f"b{i}", host=host, count=1, model=str(model), rollout=cfg,
                            max_model_len=max_len,
                            extra_args=extra + (["--logits-processors", "benchmarks.fleet_hooks:StepDelay"]
                                                if slow else []),
                            env={**env, "OMP_NUM_THREADS": "1",
                                 **({"MRL_BENCH_STEP_DELAY_FILE": str(delay_file)} if slow else {})},
                            log_dir=str(work / "logs"))
    print(f"# model: {len(named)} tensors, {total / MiB:.0f} MiB fp32; 3 servers; load average {loadavg()} "
          f"(2-core box shared with other sessions)", flush=True)
    # the floor first, before any server runs
    floor = floor_times(total, len(HOSTS), args.repeats)
    t0 = time.perf_counter()
    for _, t in named:  # the naive verification: one checksum per tensor (sender side)
        host_digest(t)
    per_tensor = time.perf_counter() - t0
    t_start = t0 = time.perf_counter()
    with EngineLauncher(specs, start_timeout_s=600) as launcher:
        launcher.start()
        print(f"# servers ready in {time.perf_counter() - t0:.0f}s; load {loadavg()}", flush=True)
        engines = [VLLMServer(s.spec.url(), cfg, name=s.spec.name).connect() for s in launcher.servers]
        slow = engines[-1]

        # the sync phases first (all three engines alike), then generation with one slowed
        plain = EngineFleet(engines, cfg)  # least outstanding work, no hedging (the policy before)
        hedged = EngineFleet(engines, dataclasses.replace(cfg, hedge_after=args.hedge_after))
        fleet = plain

        # ---- 2 + 3. sync and its verification, alternated (ABBA, BAAB, ...) so that neither variant
        # always runs first or second (warm caches, the load of the moment): one sync forms the group
        # (untimed), then --rounds blocks of four; whether a round is checksummed travels with it
        version, sync_s, hash_s = 0, {False: [], True: []}, []
        phases: dict[str, list[float]] = {}
        worker: dict[str, dict[str, list[float]]] = {e.name: {} for e in engines}
        sync = build_weight_sync(SyncConfig(transport="gloo", bucket_bytes=args.bucket_mib * MiB,
                                            timeout_s=300, verify=True), fleet, metadata=meta)
        version += 1
        assert sync.sync(iter(named), version).complete
        blocks: list[float] = []  # per block: (verified - unverified) / unverified, each the block's mean
        for b in range(args.rounds):
            order = (False, True, True, False) if b % 2 == 0 else (True, False, False, True)
            block = {False: [], True: []}
            for verify in order:
                set_verify(sync, verify)
                version += 1
                m = sync.sync(iter(named), version)
                assert m.complete and m.engines == 3, m
                block[verify].append(m.seconds)
                sync_s[verify].append(m.seconds)
                if verify:
                    hash_s.append(m.verify_seconds)
                    continue
                for k, v in m.phases.items():
                    phases.setdefault(k, []).append(v)
                for e in engines:
                    (rnd,) = e.collective_rpc("mrl_last_weight_round")
                    for k in ("seconds", "wait_seconds", "load_seconds", "start_seconds", "finish_seconds"):
                        worker[e.name].setdefault(k, []).append(rnd.get(k, float("nan")))
            off_b, on_b = statistics.mean(block[False]), statistics.mean(block[True])
            blocks.append((on_b - off_b) / off_b)
        sync.close()
        # the engines' own load of the same tensors (from the model files, no transfer), all at once
        own = []
        with ThreadPoolExecutor(len(engines)) as pool:
            for _ in range(args.repeats):
                rounds = list(pool.map(lambda e: e.collective_rpc("mrl_bench_own_load", [str(model)],
                                                                  timeout=300)[0], engines))
                own.append(rounds)
        own_s = med([max(r["seconds"] for r in rounds) for rounds in own])
        own_load = med([max(r["load_seconds"] for r in rounds) for rounds in own])
        own_finish = med([max(r["finish_seconds"] for r in rounds) for rounds in own])
        # the functional check a trainer adds with sync.verify: every server scores the probe
        # sequence after loading (timed alone here: all servers at once, as the sync settles them)
        from megatron_rl.sync.probe import probe_length, probe_tokens

        probe_toks = probe_tokens(vocab, probe_length(max_len))
        probe_s = []
        with ThreadPoolExecutor(len(engines)) as pool:
            list(pool.map(lambda e: e.score(probe_toks), engines))  # warm-up: each server's first scoring
            for _ in range(args.repeats):
                t = time.perf_counter()
                list(pool.map(lambda e: e.score(probe_toks), engines))
                probe_s.append(time.perf_counter() - t)

        off, on, fl = med(sync_s[False]), med(sync_s[True]), med(floor)
        floor2 = fl + own_s
        print(f"\n## weight sync of {total / MiB:.0f} MiB in {len(named)} tensors to 3 servers, "
              f"{args.bucket_mib} MiB buckets; load {loadavg()}")
        print("| variant | s (median) | x floor |\n| --- | --- | --- |")
        print(f"| floor: one raw broadcast of all bytes to 3 bare receivers | {fl:.2f} | 1.00 |")
        print(f"| floor 2: raw broadcast + the engines' own load of the same tensors (all 3 at once) | "
              f"{floor2:.2f} | {floor2 / fl:.2f} |")
        print(f"| vLLM protocol (gloo engine, HTTP routes, vLLM reload), no verify | {off:.2f} | {off / fl:.2f} |")
        print(f"| the same + one checksum per bucket | {on:.2f} | {on / fl:.2f} |")
        print(f"sync_vs_floor = {off / fl:.2f}x; vs floor 2 = {off / floor2:.2f}x")
        print("\nwhere the unverified sync's time goes (medians; sender phases, then per engine inside its worker):")
        print("| phase | s |\n| --- | --- |")
        for k, v in phases.items():
            print(f"| sender: {k} | {med(v):.3f} |")
        routes = sum(med(phases[k]) for k in ("start", "load_tail", "finish", "commit") if k in phases)
        print(f"| sender: route round trips (start with the check, load tail, finish, commit) | {routes:.3f} |")
        for name, w in worker.items():
            print(f"| {name}: start (reload set-up) {med(w['start_seconds']):.3f}, receive {med(w['seconds']):.3f} "
                  f"(blocked on the broadcast {med(w['wait_seconds']):.3f}, vLLM load_weights "
                  f"{med(w['load_seconds']):.3f}), finish (reload finalise) {med(w['finish_seconds']):.3f} | |")
        print(f"| engines' own load, no transfer (slowest of 3): set-up + load_weights {own_load:.3f} + "
              f"finalise {own_finish:.3f} | {own_s:.3f} |")
        overhead = med(blocks)
        print(f"\nverify_overhead = {overhead:.3f} (median of {len(blocks)} alternated blocks, ABBA/BAAB; "
              f"spread {min(blocks):+.3f} .. {max(blocks):+.3f}; blocks: "
              f"{', '.join(f'{x:+.3f}' for x in blocks)}; sender hashing {med(hash_s):.3f}s, overlapped "
              f"with the transfer); naive per-tensor checksums on the sender alone: {per_tensor:.3f}s = "
              f"{per_tensor / fl:.2f}x the floor")
        probe = med(probe_s)
        print(f"probe (3 servers score {len(probe_toks)} tokens, concurrently): {probe:.3f}s = "
              f"{probe / off:.3f}x the unverified sync; load {loadavg()}")

        if args.sync_only:
            plain.close()
            hedged.close()
        else:
            s_med, p_med, h_med = straggler(args, engines, plain, hedged, delay_file, slow)
    print(f"# servers stopped; {time.perf_counter() - t_start:.0f}s with servers", flush=True)
    head = {"sync_vs_floor": round(off / fl, 3), "verify_overhead": round(overhead, 3),
            "verify_overhead_spread": [round(min(blocks), 3), round(max(blocks), 3)],
            "probe_vs_sync": round(probe / off, 3), "sync_vs_floor_with_engine_load": round(off / floor2, 3),
            "sync_route_s": round(routes, 3)}
    if not args.sync_only:
        head = {"straggler_speedup": round(s_med / h_med, 3), **head,
                "straggler_speedup_no_hedging": round(s_med / p_med, 3)}
    print(json.dumps(head))


def straggler(args, engines, plain, hedged, delay_file, slow) -> tuple[float, float, float]:
    """Phase 1: generation with one engine slowed: fixed shares vs the fleet without / with hedging."""
    # ---- 1. straggler (the same servers, one slowed)
    prompts = [[5 + (7 * i) % 50, 9 + i % 13, 3, 11 + (3 * i) % 17] for i in range(args.prompts)]
    spec = SamplingSpec(n=args.n, temperature=1.0, max_tokens=args.max_tokens, seed=7)
    # warm-up, and the hedged fleet learns each engine's request time on this batch (as in a
    # run, where the last steps' requests are the measure)
    plain.generate(prompts[:3], spec)
    # the slow engine's per-step delay: (slowdown - 1) x the step time all three take unslowed
    # (its third's time over the engine steps it took, counted by the logits processor)
    steps_file = Path(str(delay_file) + ".steps")
    steps0 = int(steps_file.read_text()) if steps_file.exists() else 0
    _, even = asyncio.run(fixed_shares(engines, prompts, spec))
    steps = int(steps_file.read_text()) - steps0
    step_s = even[-1] / max(1, steps)
    delay_s = args.step_delay_ms / 1000 if args.step_delay_ms is not None else (args.slowdown - 1) * step_s
    delay_file.write_text(f"{delay_s:.4f}")
    print(f"# unslowed, each engine's third took {', '.join(f'{x:.2f}' for x in even)}s (the last one "
          f"{steps} engine steps, {step_s * 1000:.0f} ms each); the slow engine now sleeps "
          f"{delay_s * 1000:.0f} ms per step",
          flush=True)
    hedged.generate(prompts, spec)
    times: dict[str, list[float]] = {"shares": [], "plain": [], "hedged": []}
    share_times, slow_share, hedge_metrics = [], {}, {}
    for _ in range(args.repeats):
        t = time.perf_counter()
        a, per_share = asyncio.run(fixed_shares(engines, prompts, spec))
        times["shares"].append(time.perf_counter() - t)
        share_times.append(per_share)
        outs = {}
        for key, fleet in (("plain", plain), ("hedged", hedged)):
            fleet.pop_metrics()
            t = time.perf_counter()
            outs[key] = fleet.generate(prompts, spec)
            times[key].append(time.perf_counter() - t)
            slow_share[key] = sum(len(g) for g in outs[key] if g[0].engine == slow.name) / (len(prompts) * args.n)
            hedge_metrics[key] = fleet.pop_metrics()
        tokens = [[c.token_ids for c in g] for g in a]
        assert all(tokens == [[c.token_ids for c in g] for g in o] for o in outs.values()), \
            "fixed shares and the fleet sampled differently"
    s_med, p_med, h_med = med(times["shares"]), med(times["plain"]), med(times["hedged"])
    fast_share = med([max(p[:-1]) for p in share_times])
    slow_share_t = med([p[-1] for p in share_times])
    hm = hedge_metrics["hedged"]
    print(f"\n## generation, engine {slow.name} slowed by {delay_s * 1000:.0f} ms per engine step "
          f"({args.prompts} prompts x n={args.n} x {args.max_tokens} tokens, max_num_seqs "
          f"{args.max_num_seqs}); load {loadavg()}")
    print(f"under fixed shares the slow engine took {slow_share_t:.2f}s for its third, the fast ones "
          f"{fast_share:.2f}s: {slow_share_t / fast_share:.1f}x slower on the same work")
    print("| dispatch | s (median) | runs | slow engine's share |\n| --- | --- | --- | --- |")
    print(f"| fixed shares (contiguous 1/3 each) | {s_med:.2f} | {', '.join(f'{x:.2f}' for x in times['shares'])} "
          f"| 33% |")
    print(f"| fleet, least outstanding work, no hedging | {p_med:.2f} | "
          f"{', '.join(f'{x:.2f}' for x in times['plain'])} | {slow_share['plain']:.0%} |")
    print(f"| fleet + tail hedging (hedge_after {args.hedge_after:g}) | {h_med:.2f} | "
          f"{', '.join(f'{x:.2f}' for x in times['hedged'])} | {slow_share['hedged']:.0%} |")
    print(f"straggler_speedup = {s_med / h_med:.2f}x (without hedging {s_med / p_med:.2f}x); last round: "
          f"{hm['rollout/hedged_requests']:.0f} requests hedged, {hm['rollout/hedge_wins']:.0f} answered "
          f"first by the copy", flush=True)
    delay_file.write_text("0")
    hedged.close()
    plain.close()
    return s_med, p_med, h_med


if __name__ == "__main__":
    main()
