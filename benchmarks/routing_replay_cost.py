"""What carrying MoE routes costs (routing replay, ``algo.routing_replay=r3``), in one run.

On the MoE demo's own model and step (``--config``, default ``configs/demo_moe_cpu.yaml``: its
``model.tiny``, its training prompts templated and tokenized as the run does them, ``rollout_batch_size``
x ``group_size`` samples, each stage's ``max_response_len``; ``--prompts``/``--group``/``--max-tokens``
override), two in-process vLLM engines on the same weights, one returning routes (the capture hook, the
CPU's way) and one not, generate the same seeded batches, interleaved ``--repeats`` times (medians), for
every stage of the config. The trainer's side is
timed on the same batch: the routes into the batch (``phases.make_batch``'s position field) and laid
out as Megatron's router rows for every micro-batch (``models.routing_replay.micro_batch_routes``),
and, with ``--policy``, the policy's old-log-prob pass and one training step with and without the
engine's routes replayed (a one-rank Megatron-Core MoE policy).

With ``--policy`` it also measures what replay is for: ``moe/router_agreement`` (the trainer's own
routers vs the engine's routes) and the train-inference log-prob gap without and with the engine's
routes replayed (r3); ``--engine-dtype bfloat16`` serves in bf16 as on GPUs (the trainer: float32).

Prints per stage bytes per position and per response token (the ``Completion.routes`` array; over a
server, base64 in JSON: x 4/3), the generation time with / without routes, the trainer-side seconds,
and their share of the step (generation + the trainer's passes), then the share over the whole run
(stages weighted by their ``max_steps``). The last line is one JSON object.

    python benchmarks/routing_replay_cost.py [--repeats 5] [--policy] [--config configs/demo_moe_cpu.yaml]

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


def _demo(args, work: Path):
    """The config's run (its tiny model written under ``work``), its engines' rollout config and the
    training prompts' token ids, as the run templates and tokenizes them."""
    import dataclasses

    from transformers import AutoTokenizer

    from megatron_rl.data.dataset import load_prompts
    from megatron_rl.demo.inputs import prepare_inputs, tiny_model_dir
    from megatron_rl.trainer.schema import load_run_config

    cfg = load_run_config(args.config, [f"trainer.run_dir={work}"])
    if cfg.model.tiny is None or not cfg.model.tiny.is_moe:
        raise SystemExit(f"{args.config}: model.tiny must be a Mixture-of-Experts model (qwen3_moe, qwen2_moe)")
    prepare_inputs(work, tiny=cfg.model.tiny, synthetic=cfg.synthetic, seed=cfg.trainer.seed)
    model = str(tiny_model_dir(work))
    tok = AutoTokenizer.from_pretrained(model)
    records, _ = load_prompts(cfg.data.train_path, tok, cfg.data, cfg.rollout.max_prompt_len)
    n = args.prompts or cfg.rollout.rollout_batch_size
    prompts = [r.prompt_ids for r in records[:n]]
    stages = ([("max_tokens", args.max_tokens, 1)] if args.max_tokens
              else [(s.name, s.max_response_len, s.max_steps) for s in cfg.stages])
    longest = max(t for _, t, _ in stages)
    group = args.group or cfg.rollout.group_size
    rollout = dataclasses.replace(cfg.rollout, engine="vllm", max_response_len=longest, max_num_seqs=n * group,
                                  dtype=args.engine_dtype)
    return cfg, model, prompts, group, stages, rollout, cfg.rollout.max_prompt_len + longest


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--config", default=str(REPO / "configs" / "demo_moe_cpu.yaml"),
                    help="the run whose model and step are measured (default: the MoE demo)")
    ap.add_argument("--prompts", type=int, default=0, help="prompts per step (0: rollout.rollout_batch_size)")
    ap.add_argument("--group", type=int, default=0, help="samples per prompt (0: rollout.group_size)")
    ap.add_argument("--max-tokens", type=int, default=0, help="one response length instead of the stages'")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--policy", action="store_true", help="also time the policy's passes (Megatron-Core) and "
                    "measure moe/router_agreement and the log-prob gap with and without replay")
    ap.add_argument("--engine-dtype", default="float32", help="the engines' dtype (bfloat16: as on GPUs; the "
                    "trainer stays float32)")
    args = ap.parse_args()

    from megatron_rl.rollout.vllm_engine import VLLMEngine

    print(f"load average before: {_load()}", flush=True)
    work = Path(tempfile.mkdtemp(prefix="replay_bench_"))
    cfg, model, prompts, group, stages, rollout, max_len = _demo(args, work)
    tiny = cfg.model.tiny
    plain = VLLMEngine(model, rollout, seed=0, name="plain", max_model_len=max_len)
    routed = VLLMEngine(model, rollout, seed=0, name="routes", return_routes=True, max_model_len=max_len)
    policy = _policy(model, cfg) if args.policy else None
    print(f"{args.config}: {tiny.arch}, {tiny.num_layers} MoE layers x {tiny.num_experts} experts, top-"
          f"{tiny.num_experts_per_tok}, hidden {tiny.hidden_size}, expert width {tiny.moe_intermediate_size}; "
          f"{len(prompts)} prompts x {group}; engines {args.engine_dtype}, trainer {cfg.policy.params_dtype}")
    per_stage = {}
    for name, max_tokens, steps in stages:
        per_stage[name] = _stage(plain, routed, policy, prompts, group, max_tokens, cfg, args)
        per_stage[name]["max_steps"] = steps
        _print_stage(name, max_tokens, per_stage[name], args)
    weight = sum(r["max_steps"] for r in per_stage.values())
    share = sum(r["share_of_step"] * r["max_steps"] for r in per_stage.values()) / weight
    worst = max(r["share_of_step"] for r in per_stage.values())
    print(f"\ncarrying routes over the run (stages weighted by max_steps): {share * 100:.2f} % of the step; "
          f"worst stage {worst * 100:.2f} % (target <= 3 %)"
          f"{'' if args.policy else ' (step = generation only: --policy adds the passes)'}")
    print(f"load average after: {_load()}", flush=True)
    print(json.dumps({"config": args.config, "share_of_step": share, "worst_stage_share": worst,
                      "engine_dtype": args.engine_dtype, "stages": per_stage, "load": _load()}))
    return 0


def _stage(plain, routed, policy, prompts, group, max_tokens, cfg, args) -> dict:
    """One stage's step: generation with / without routes, the trainer's handling of the routes
    and, with a policy, its passes with and without replay."""
    import torch

    from megatron_rl.models.batch import SequenceBatch
    from megatron_rl.models.packing import pack_micro_batches, packed_layout, padded_layout
    from megatron_rl.models.routing_replay import micro_batch_routes, router_tokens
    from megatron_rl.rollout import SamplingSpec
    from megatron_rl.trainer import routing_replay

    sampling = SamplingSpec(n=group, temperature=cfg.rollout.temperature, max_tokens=max_tokens, seed=7)
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
    packed = cfg.policy.packed_sequences
    for idx in pack_micro_batches(lengths, list(range(len(seqs))), cfg.policy.micro_batch_tokens, packed=packed):
        mine = [lengths[i] for i in idx]
        layout = packed_layout(mine, 1) if packed else padded_layout(mine, 1)
        micro_batch_routes(fields, idx, *router_tokens(layout), cfg.model.tiny.num_experts)
    t_layout = time.perf_counter() - t0

    trainer = _policy_passes(policy, batch, args) if policy is not None else {}
    passes = sum(v for k, v in trainer.items() if k.endswith("_plain_s"))
    carry = (gen_routes - gen_plain) + t_batch + t_layout * (2 if policy is not None else 1)
    step = gen_plain + passes
    return {"sequences": len(comps), "response_tokens": response_tokens, "positions": positions,
            "bytes_per_position": route_bytes / positions, "bytes_per_response_token": route_bytes / response_tokens,
            "route_bytes": route_bytes, "gen_plain_s": gen_plain, "gen_routes_s": gen_routes, "batch_s": t_batch,
            "layout_s": t_layout, "step_s": step, "carry_s": carry,
            "share_of_step": carry / step if step else float("nan"), **trainer}


def _print_stage(name: str, max_tokens: int, r: dict, args) -> None:
    print(f"\n## {name}: {r['sequences']} sequences x <= {max_tokens} tokens, {r['response_tokens']} response "
          f"tokens, {r['positions']} positions with routes")
    print(f"routes: {r['bytes_per_position']:.1f} B per position, {r['bytes_per_response_token']:.1f} B per "
          f"response token ({r['route_bytes'] / 1e6:.3f} MB per step; over HTTP x 4/3 base64)")
    print(f"generation: {r['gen_plain_s']:.3f} s plain, {r['gen_routes_s']:.3f} s with routes "
          f"({(r['gen_routes_s'] / r['gen_plain_s'] - 1) * 100:+.1f} %), medians of {args.repeats}")
    print(f"trainer side: routes into the batch {r['batch_s'] * 1e3:.1f} ms, router rows of every micro-batch "
          f"{r['layout_s'] * 1e3:.1f} ms per pass")
    for k, v in r.items():
        if k.startswith(("logprob_", "update_")):
            print(f"  {k}: {v:.3f} s")
    print(f"carrying routes: {r['carry_s']:.3f} s of a {r['step_s']:.3f} s step = {r['share_of_step'] * 100:.2f} %")
    if "router_agreement" in r:
        replay_extra = sum(r[f"{k}_replay_s"] - r[f"{k}_plain_s"] for k in ("logprob", "update"))
        print(f"replay itself (forced routes vs the routers' own, both passes): {replay_extra:+.3f} s")
        print(f"moe/router_agreement {r['router_agreement']:.4f}; train-inference log-prob gap (mean |trainer "
              f"- engine| per token) without replay {r['logp_gap_free']:.3g}, with r3 {r['logp_gap_replay']:.3g}")


def _policy(model: str, cfg):
    """A one-rank Megatron-Core policy of the config's model (its micro-batch size and dtype)."""
    import dataclasses

    from megatron_rl.compat import apply_compat
    from megatron_rl.models import ParallelConfig, init_distributed
    from megatron_rl.models.policy import MegatronPolicy

    apply_compat()
    groups = init_distributed(ParallelConfig())
    # lr 0: the timed updates (the same arithmetic) leave the weights as the engines hold them, so the
    # router agreement and the log-prob gaps compare the two on equal weights
    optim = dataclasses.replace(cfg.policy.optim, lr=0.0, min_lr=0.0)
    return MegatronPolicy.from_hf(model, dataclasses.replace(cfg.policy, parallel=ParallelConfig(), optim=optim),
                                  groups)


def _policy_passes(policy, batch, args) -> dict:
    """Seconds of the old-log-prob pass and one training step, plain and replaying the engine's
    routes (median of ``args.repeats``)."""
    from megatron_rl.models.routing_replay import Routes
    from megatron_rl.trainer import routing_replay

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
    return out


if __name__ == "__main__":
    sys.exit(main())
