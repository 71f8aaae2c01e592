"""What carrying MoE routes costs (routing replay, ``algo.routing_replay=r3``), in one run.

On the MoE demo's model shape (a tiny Qwen3-MoE; ``--hidden``/``--layers``/``--experts``/``--top-k``)
and a demo-sized step (``--prompts`` x ``--group`` samples, ``--max-tokens``), two in-process vLLM
engines on the same weights, one returning routes (the capture hook, the CPU's way) and one not,
generate the same seeded batches, interleaved ``--repeats`` times (medians). The trainer's side is
timed on the same batch: the routes into the batch (``phases.make_batch``'s position field) and laid
out as Megatron's router rows for every micro-batch (``models.routing_replay.micro_batch_routes``),
and, with ``--policy``, the policy's old-log-prob pass and one training step with and without the
engine's routes replayed (a one-rank Megatron-Core MoE policy).

With ``--policy`` it also measures what replay is for: ``moe/router_agreement`` (the trainer's own
routers vs the engine's routes) and the train-inference log-prob gap without and with the engine's
routes replayed (r3); ``--engine-dtype bfloat16`` serves in bf16 as on GPUs (the trainer: float32).

Prints bytes per position and per response token (the ``Completion.routes`` array; over a server,
base64 in JSON: x 4/3), the generation time with / without routes, the trainer-side seconds, and their
share of the step (generation + the trainer's passes). The last line is one JSON object.

    python benchmarks/routing_replay_cost.py [--repeats 5] [--policy]

The box is shared: the load average is printed before and after; read the ratios within one run.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")


def _load() -> str:
    return " ".join(f"{x:.1f}" for x in os.getloadavg())


def _prompts(n: int, seed: int) -> list[list[int]]:
    import random

    rng = random.Random(seed)
    return [[1] + [rng.randint(3, 200) for _ in range(rng.randint(8, 20))] for _ in range(n)]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--hidden", type=int, default=128)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--experts", type=int, default=8)
    ap.add_argument("--top-k", type=int, default=2)
    ap.add_argument("--prompts", type=int, default=64)
    ap.add_argument("--group", type=int, default=8)
    ap.add_argument("--max-tokens", type=int, default=12)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--micro-batch-tokens", type=int, default=8192)
    ap.add_argument("--policy", action="store_true", help="also time the policy's passes (Megatron-Core) and "
                    "measure moe/router_agreement and the log-prob gap with and without replay")
    ap.add_argument("--engine-dtype", default="float32", help="the engines' dtype (bfloat16: as on GPUs; the "
                    "trainer stays float32)")
    args = ap.parse_args()

    import torch

    from megatron_rl.demo import TinySpec, write_tiny_model
    from megatron_rl.models.batch import SequenceBatch, pack_micro_batches
    from megatron_rl.models.routing_replay import micro_batch_routes
    from megatron_rl.rollout import RolloutConfig, SamplingSpec
    from megatron_rl.rollout.vllm_engine import VLLMEngine
    from megatron_rl.trainer import routing_replay

    print(f"load average before: {_load()}", flush=True)
    work = Path(tempfile.mkdtemp(prefix="replay_bench_"))
    spec = TinySpec(arch="qwen3_moe", hidden_size=args.hidden, intermediate_size=3 * args.hidden,
                    num_layers=args.layers, num_heads=max(1, args.hidden // 32), num_kv_heads=max(1, args.hidden // 32),
                    num_experts=args.experts, num_experts_per_tok=args.top_k, moe_intermediate_size=args.hidden // 2,
                    seed=1)
    model = str(write_tiny_model(work / "model", spec))
    cfg = RolloutConfig(max_prompt_len=32, max_response_len=args.max_tokens, kv_cache_bytes=64 << 20,
                        max_num_seqs=args.prompts * args.group, dtype=args.engine_dtype)
    plain = VLLMEngine(model, cfg, seed=0, name="plain")
    routed = VLLMEngine(model, cfg, seed=0, name="routes", return_routes=True)
    prompts = _prompts(args.prompts, 0)
    sampling = SamplingSpec(n=args.group, temperature=1.0, max_tokens=args.max_tokens, seed=7)
    for eng in (plain, routed):  # warm-up
        eng.generate(prompts[:4], sampling)
    times = {"plain": [], "routes": []}
    groups = None
    for _ in range(args.repeats):
        for name, eng in (("plain", plain), ("routes", routed)):
            t0 = time.perf_counter()
            out = eng.generate(prompts, sampling)
            times[name].append(time.perf_counter() - t0)
            if name == "routes":
                groups = out
    gen_plain, gen_routes = (statistics.median(times[k]) for k in ("plain", "routes"))

    comps = [c for g in groups for c in g]
    seqs = [list(p) + c.token_ids for p, g in zip(prompts, groups) for c in g]
    positions = sum(c.routes.shape[0] for c in comps)
    response_tokens = sum(len(c.token_ids) for c in comps)
    route_bytes = sum(c.routes.nbytes for c in comps)

    # the trainer's side: the routes into the batch, then every micro-batch's router rows
    t0 = time.perf_counter()
    fields = [routing_replay.engine_routes(c.routes, len(s), "bench") for c, s in zip(comps, seqs)]
    batch = SequenceBatch(sequences=seqs, prompt_lens=[len(p) for p, g in zip(prompts, groups) for _ in g],
                          token_fields={"rollout_logp": [torch.tensor(c.logprobs) for c in comps]},
                          position_fields={routing_replay.ENGINE: fields})
    t_batch = time.perf_counter() - t0
    lengths = [len(s) for s in seqs]
    t0 = time.perf_counter()
    for idx in pack_micro_batches(lengths, list(range(len(seqs))), args.micro_batch_tokens):
        seq_len = max(lengths[i] for i in idx)
        micro_batch_routes(fields, idx, len(idx), torch.arange(seq_len), args.experts)
    t_layout = time.perf_counter() - t0

    trainer = {}
    if args.policy:
        trainer = _policy_passes(model, batch, args)
    passes = sum(v for k, v in trainer.items() if k.endswith("_plain_s"))
    replay_extra = sum(trainer.get(f"{k}_replay_s", 0.0) - trainer.get(f"{k}_plain_s", 0.0) for k in ("logprob", "update"))
    carry = (gen_routes - gen_plain) + t_batch + t_layout * (2 if args.policy else 1)
    step = gen_plain + passes
    print(f"engines: {args.engine_dtype}; trainer: float32")
    print(f"model: {args.layers} MoE layers x {args.experts} experts, top-{args.top_k}; step: {len(comps)} "
          f"sequences, {response_tokens} response tokens, {positions} positions with routes")
    print(f"routes: {route_bytes / positions:.1f} B per position, {route_bytes / response_tokens:.1f} B per "
          f"response token ({route_bytes / 1e6:.3f} MB per step; over HTTP x 4/3 base64)")
    print(f"generation: {gen_plain:.3f} s plain, {gen_routes:.3f} s with routes "
          f"({(gen_routes / gen_plain - 1) * 100:+.1f} %), medians of {args.repeats}")
    print(f"trainer side: routes into the batch {t_batch * 1e3:.1f} ms, router rows of every micro-batch "
          f"{t_layout * 1e3:.1f} ms per pass")
    for k, v in trainer.items():
        if k.endswith("_s"):
            print(f"  {k}: {v:.3f} s")
    share = carry / step if step else float("nan")
    print(f"carrying routes: {carry:.3f} s of a {step:.3f} s step = {share * 100:.2f} % "
          f"(target <= 3 %){'' if args.policy else ' (step = generation only: --policy adds the passes)'}")
    if args.policy:
        print(f"replay itself (forced routes vs the routers' own, both passes): {replay_extra:+.3f} s")
        print(f"moe/router_agreement {trainer['router_agreement']:.4f}; train-inference log-prob gap (mean |trainer "
              f"- engine| per token) without replay {trainer['logp_gap_free']:.3g}, with r3 "
              f"{trainer['logp_gap_replay']:.3g}")
    print(f"load average after: {_load()}", flush=True)
    result = {"bytes_per_position": route_bytes / positions, "bytes_per_response_token": route_bytes / response_tokens,
              "gen_plain_s": gen_plain, "gen_routes_s": gen_routes, "batch_s": t_batch, "layout_s": t_layout,
              "step_s": step, "carry_s": carry, "share_of_step": share, **trainer}
    print(json.dumps(result))
    return 0


def _policy_passes(model: str, batch, args) -> dict:
    """Seconds of the old-log-prob pass and one training step, plain and replaying the engine's
    routes (median of ``args.repeats``), on a one-rank Megatron-Core policy."""
    import torch

    from megatron_rl.compat import apply_compat
    from megatron_rl.models import ParallelConfig, PolicyConfig, init_distributed
    from megatron_rl.models.policy import MegatronPolicy
    from megatron_rl.models.routing_replay import Routes
    from megatron_rl.trainer import routing_replay

    apply_compat()
    groups = init_distributed(ParallelConfig())
    policy = MegatronPolicy.from_hf(model, PolicyConfig(micro_batch_tokens=args.micro_batch_tokens), groups)
    routes = batch.position_fields[routing_replay.ENGINE]

    def loss_fn(mb):
        loss = -(mb.logp * mb.mask).sum() * 0.0
        return loss, {}

    out = {}
    for name, replay in (("plain", None), ("replay", routes)):
        lp, up = [], []
        for _ in range(args.repeats):
            t0 = time.perf_counter()
            policy.compute_logprobs(batch, 1.0, with_entropy=False,
                                    routes=None if replay is None else Routes(replay=replay))
            lp.append(time.perf_counter() - t0)
            t0 = time.perf_counter()
            policy.train_step(batch, loss_fn, 1.0, with_entropy=True,
                              routes=None if replay is None else Routes(replay=replay))
            up.append(time.perf_counter() - t0)
        out[f"logprob_{name}_s"] = statistics.median(lp)
        out[f"update_{name}_s"] = statistics.median(up)
    # what replay is for (untimed passes): the routers' own choice against the engine's, the gaps
    free = Routes(record=True)
    logp, _ = policy.compute_logprobs(batch, 1.0, with_entropy=False, routes=free)
    out["router_agreement"] = routing_replay.router_agreement(free.recorded, routes, batch.prompt_lens,
                                                              [len(s) for s in batch.sequences])
    out["logp_gap_free"] = routing_replay.logp_gap(logp, batch.token_fields["rollout_logp"])
    logp, _ = policy.compute_logprobs(batch, 1.0, with_entropy=False, routes=Routes(replay=routes))
    out["logp_gap_replay"] = routing_replay.logp_gap(logp, batch.token_fields["rollout_logp"])
    del torch
    return out


if __name__ == "__main__":
    sys.exit(main())
