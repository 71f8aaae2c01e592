"""Routing replay for MoE end to end (issue 24): the engines' routes, and the trainer replaying them.

One tiny Qwen3-MoE (2 MoE layers, 8 experts, top-2; weights of std 0.2 so that routing matters), one
in-process engine (the streaming engine: partial rollouts), one vLLM server (booting while the
in-process checks run; the gloo sync's worker extension, which carries the routes' methods), one
one-rank Megatron policy in this process, one torchrun of two ranks (an EP2 trainer that syncs the
server and an in-process engine of its own, then a PP2 one). References: float64
transformers (its routers' top-k sets; its log-probs with the engine's experts forced).

Engines (``Completion.routes``: prompt + response - 1 rows, every MoE layer, top-k), in-process and
server: the routes equal transformers' top-k sets on the same tokens (near ties < 1e-4 in the
logits excepted: none seen), sampled n=2 and greedy with prompts batched, a prompt longer than one
KV block (128 tokens) served again from the prefix cache (and the later samples of its n=2 request,
which vLLM schedules on the first's blocks); after a weight update, the new weights' routes; across a
weight update with partial rollouts, the rows of positions the old weights computed are the old
weights' routes, the others the new weights'.

Trainer (r3 = replay the engine's routes): the experts every MoE layer actually routed each token to
(its router's ``routing_map``) are the engine's, 100%, and the log-probs equal transformers' with the
engine's experts forced, for both engines' batches spanning an update, at EP1 (here) and EP2
(torchrun, forward and training step; and the server's responses after the EP2 trainer's sync). A planted divergence (the engine's routers perturbed: a third
of the (token, layer) top-k sets differ): ``moe/router_agreement`` is exactly the share transformers
measures, the gap without replay is large, and the r3 log-probs equal the forced reference. r2 with
n_sgd=2: every router call of both passes routes as the old pass recorded, while the routers' own
choice moved after the first step. Recomputation: the recomputed forward pops its own micro-batch's
targets (PP2's 1F1B runs a forward before the previous backward): the gradients equal the run
without it. The KL reference, a second model in the process, routes freely mid-replay.

Multi-turn trajectories with a tool (``rollout/multi_turn.py``): on the in-process engine, with the
weights changed before every turn's request, each row of a trajectory is the top-k of the turn whose
forward computed it (the prompt's and turn k's tokens': turn k; turn k's last token's and the
observation's: turn k + 1), with a prefix served from the cache to the later turns too; r3 routes
every position as the engine did and gives the forced reference's log-probs; the routing metrics
count the model's tokens only. Through the fleet (the server): every row transformers' top-k.
"""

from __future__ import annotations

import dataclasses
import shutil
import time
from pathlib import Path

import numpy as np
import pytest
import torch

pytest.importorskip("vllm")

from routes_ref import (SPEC, RouterTap, assert_routes_match, assert_rows_match, checkpoint,  # noqa: E402
                        forced_logprobs, hf_topk, load_routers, loud, perturb_routers)

pytestmark = pytest.mark.slow
MAX_MODEL_LEN = 256
TOKENS = 128  # per micro-batch
QUESTIONS = ["12+345=", "99+1=", "407+58=" * 22]  # the last one is longer than a KV block


def _rollout(**kw):
    from megatron_rl.rollout import RolloutConfig

    base = dict(kv_cache_bytes=16 << 20, max_num_seqs=16, max_prompt_len=200, max_response_len=48, timeout_s=120.0)
    return RolloutConfig(**{**base, **kw})


@pytest.fixture(scope="module")
def env(tmp_path_factory):
    """The model, its checkpoint tensors, float64 transformers, and a server booting meanwhile."""
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from megatron_rl.demo import write_tiny_model
    from megatron_rl.rollout.launcher import ServerProcess, ServerSpec, free_port
    from megatron_rl.rollout.routes import server_route_args
    from megatron_rl.sync import SyncConfig
    from megatron_rl.sync.base import server_args

    root = tmp_path_factory.mktemp("routing_replay")
    model = str(write_tiny_model(root / "model", SPEC))
    loud(model, seed=5)
    weights = checkpoint(model)
    new = perturb_routers(weights, seed=20)  # the trainer's weights after an update: other routers
    model_new = root / "model_new"
    shutil.copytree(model, model_new)
    save_file(new, str(model_new / "model.safetensors"), metadata={"format": "pt"})
    args, senv = server_args(SyncConfig(transport="gloo"))
    args += server_route_args(args, "capture")
    spec = ServerSpec(name="moe-0", model=model, host="127.0.0.1", port=free_port("127.0.0.1"), rollout=_rollout(),
                      max_model_len=MAX_MODEL_LEN, extra_args=args, env={**senv, "OMP_NUM_THREADS": "1"},
                      log_path=str(root / "server.log"))
    server = ServerProcess(spec).start()  # boots while the in-process checks run
    try:
        tok = AutoTokenizer.from_pretrained(model)
        prompts = [tok.apply_chat_template([{"role": "user", "content": q}], add_generation_prompt=True,
                                           tokenize=True)["input_ids"] for q in QUESTIONS]
        hf = AutoModelForCausalLM.from_pretrained(model, dtype=torch.float64, experts_implementation="eager").eval()
        yield {"root": root, "model": model, "weights": weights, "new": new, "model_new": str(model_new), "hf": hf,
               "prompts": prompts, "server": server, "batches": {}}
    finally:
        server.stop()


@pytest.fixture(scope="module")
def groups(env):
    """A one-rank gloo world with Megatron's groups (before the in-process engine, as a run starts)."""
    from megatron_rl.compat import apply_compat
    from megatron_rl.models import ParallelConfig, destroy_distributed, init_distributed

    apply_compat()
    g = init_distributed(ParallelConfig())
    yield g
    destroy_distributed()


@pytest.fixture(scope="module")
def engine(env, groups):
    from megatron_rl.rollout import make_engine
    from megatron_rl.rollout.config import AsyncConfig

    cfg = _rollout(kv_cache_bytes=32 << 20, max_num_seqs=64, async_=AsyncConfig(max_staleness=2, partial_rollout=True))
    eng = make_engine(env["model"], cfg, seed=0, max_model_len=MAX_MODEL_LEN, return_routes=True)
    yield eng
    eng.close()


@pytest.fixture(scope="module")
def policy(env, groups):
    from megatron_rl.models import OptimConfig
    from megatron_rl.models.policy import MegatronPolicy

    return MegatronPolicy.from_hf(env["model_new"], _policy_cfg(OptimConfig(lr=1e-3, clip_grad=0.0)), groups)


def _policy_cfg(optim=None):
    """The trainer's policy config: micro-batches of 128 tokens (several per batch, packed: the
    default; two or three short sequences in one row, each followed by the next at the routers)."""
    from megatron_rl.models import OptimConfig, PolicyConfig

    return PolicyConfig(micro_batch_tokens=TOKENS, layer_spec="local", optim=optim or OptimConfig())


# --------------------------------------------------------------------------------------- helpers
def _check_groups(groups_out, prompts, hf, where) -> None:
    """Every completion's routes are transformers' top-k sets (near ties left out: at most 1 %)."""
    compared = total = 0
    for i, (p, group) in enumerate(zip(prompts, groups_out)):
        for j, c in enumerate(group):
            assert c.routes is not None and c.routes.dtype == np.uint8
            assert c.routes.shape == (len(p) + len(c.token_ids) - 1, SPEC.num_layers, SPEC.num_experts_per_tok)
            compared += assert_routes_match(c.routes, hf, (list(p) + c.token_ids)[:-1], f"{where} prompt {i} sample {j}")
            total += c.routes.shape[0] * SPEC.num_layers
    assert compared >= 0.99 * total, (where, compared, total)


def _check_versions(completions, states, hf, new, where) -> int:
    """Responses sampled with min_tokens = max_tokens across an update: each token's log-prob is its
    version's (the KV recomputed with the new weights), the rows before the first token the new
    weights sampled are the old weights' routes, the rest the new weights'; returns how many
    responses span the update."""
    partial = 0
    for i, (p, c) in enumerate(completions):
        seq = (list(p) + c.token_ids)[:-1]
        versions = c.token_versions()
        split = versions.index(new) if new in versions else len(versions)
        cut = len(p) - 1 + split  # rows before it are of positions the old weights computed
        partial += 0 < split < len(versions)
        for v, lo, hi in ((min(states), 0, cut), (new, cut, len(seq))):
            load_routers(hf, states[v])
            want, clear = hf_topk(hf, seq)
            with torch.no_grad():
                logits = hf(torch.tensor([list(p) + c.token_ids])).logits[0].double()
            logits = logits[len(p) - 1:-1]
            logits[:, hf.config.eos_token_id] = float("-inf")  # min_tokens = the whole response: no EOS
            ref = torch.log_softmax(logits, -1).gather(1, torch.tensor(c.token_ids)[:, None])[:, 0]
            sel = torch.tensor(versions) == v
            gap = (torch.tensor(c.logprobs, dtype=torch.float64)[sel] - ref[sel]).abs().max().item() if sel.any() else 0.0
            assert gap < 2e-4, f"{where} {i}: the tokens of version {v} are {gap:.2e} from its log-probs"
            assert_rows_match(c.routes[lo:hi], want[lo:hi], clear[lo:hi], f"{where} {i} version {v} rows [{lo}, {hi})")
    return partial


def _replay_batch(completions) -> dict:
    """What the trainer gets from these completions (``phases.make_batch``'s routes field)."""
    from megatron_rl.trainer.routing_replay import engine_routes

    seqs = [list(p) + c.token_ids for p, c in completions]
    return {"sequences": seqs, "prompt_lens": [len(p) for p, _ in completions],
            "routes": [engine_routes(c.routes, len(s), "test") for (_, c), s in zip(completions, seqs)],
            "rollout_logp": [torch.tensor(c.logprobs) for _, c in completions]}


def _sequence_batch(d: dict, **fields):
    from megatron_rl.models.batch import SequenceBatch
    from megatron_rl.trainer.routing_replay import ENGINE

    n = len(d["sequences"])
    g = torch.Generator().manual_seed(1)
    return SequenceBatch(
        sequences=[list(s) for s in d["sequences"]], prompt_lens=list(d["prompt_lens"]),
        token_fields={"rollout_logp": [x.clone() for x in d["rollout_logp"]],
                      "weight_version": [torch.zeros(len(s) - p, dtype=torch.long) for s, p in
                                         zip(d["sequences"], d["prompt_lens"])]},
        seq_fields={"advantages": torch.randn(n, generator=g), "rewards": torch.zeros(n),
                    "group_ids": torch.arange(n) // 2, "truncated": torch.zeros(n, dtype=torch.bool)},
        position_fields={ENGINE: [r.clone() for r in d["routes"]], **fields})


def _equal_to_engine(tapped: list[np.ndarray], routes: list[torch.Tensor], lengths: list[int]) -> None:
    """Every (position, layer) the engine computed was routed to the engine's experts, 100%."""
    for i, (t, r, n) in enumerate(zip(tapped, routes, lengths)):
        got, want = t[:n - 1], r.numpy()[:n - 1].astype(np.int64)
        assert (got >= 0).all(), f"sequence {i}: positions not routed"
        same = (np.sort(got, -1) == np.sort(want, -1)).all(-1)
        assert same.all(), f"sequence {i}: {int((~same).sum())} of {same.size} (position, layer) differ"


# ---------------------------------------------------------------------------------------- engines
def test_routing_replay_engine_routes_equal_transformers_router(env, engine):
    from megatron_rl.rollout import SamplingSpec
    from megatron_rl.rollout.vllm_engine import VLLMEngine

    hf, prompts, weights = env["hf"], env["prompts"], env["weights"]
    sampled = SamplingSpec(n=2, temperature=1.0, max_tokens=12, seed=5)
    cached = lambda: engine.llm.collective_rpc(lambda w: w._mrl_route_capture.cached_rows)[0]  # noqa: E731
    _check_groups(VLLMEngine.generate(engine, prompts, sampled), prompts, hf, "LLM.generate")
    first = cached()
    assert first >= 128  # the long prompt's second sample started on the first's block
    _check_groups(engine.generate(prompts, SamplingSpec(n=1, temperature=0.0, max_tokens=12)), prompts, hf,
                  "stream greedy")
    _check_groups(engine.generate(prompts, sampled), prompts, hf, "stream sampled")
    assert cached() >= first + 2 * 128  # the long prompt again, from the prefix cache
    new = perturb_routers(weights, seed=3)  # new weights: routes follow them, no stale cached prefix
    load_routers(hf, new)
    engine.update_weights(new.items(), version=1)
    _check_groups(engine.generate(prompts, sampled), prompts, hf, "after the update")
    load_routers(hf, weights)
    engine.update_weights(weights.items(), version=2)


def test_routing_replay_engine_partial_rollout_rows_keep_the_sampling_version(env, engine):
    from megatron_rl.rollout import SamplingSpec

    hf, weights = env["hf"], env["weights"]
    prompts = [p for p in env["prompts"][:2] for _ in range(3)]
    tries = []
    for attempt in range(3):  # whether the update catches responses in flight is timing
        old, new = 10 + 2 * attempt, 11 + 2 * attempt
        states = {old: weights, new: env["new"]}
        engine.update_weights(weights.items(), version=old)
        got: dict = {}
        busy = engine.busy_seconds()
        engine.submit(prompts, SamplingSpec(n=2, temperature=1.0, max_tokens=40, min_tokens=40, seed=9),
                      list(range(len(prompts))), got.update)
        deadline = time.monotonic() + 60
        while engine.busy_seconds() == busy:  # at least one engine step: every request has its first token
            assert time.monotonic() < deadline
            time.sleep(0.001)
        engine.update_weights(states[new].items(), version=new)  # requests in flight continue
        while len(got) < len(prompts):
            assert time.monotonic() < deadline
            time.sleep(0.01)
        completions = [(prompts[i], c) for i in range(len(prompts)) for c in got[i]]
        tries.append(_check_versions(completions, states, hf, new, f"try {attempt} prompt"))
        if tries[-1]:
            env["batches"]["in-process"] = _replay_batch(completions)
            break
    load_routers(hf, weights)
    engine.update_weights(weights.items(), version=20)
    assert tries[-1] > 0, f"no response spanned the weight update in {len(tries)} tries: {tries}"


def _generated(server) -> float:
    """The server's generated-token counter (Prometheus ``/metrics``)."""
    for line in server._call("GET", "/metrics").text.splitlines():
        if line.startswith("vllm:generation_tokens_total") and not line.startswith("vllm:generation_tokens_total_"):
            return float(line.rsplit(" ", 1)[1])
    return 0.0


def test_routing_replay_server_routes_equal_transformers_router_and_span_an_update(env):
    from megatron_rl.rollout import SamplingSpec, connect_fleet
    from megatron_rl.rollout.fleet_stream import FleetStream
    from megatron_rl.sync import SyncConfig, build_weight_sync

    hf, weights, prompts = env["hf"], env["weights"], env["prompts"]
    env["server"].wait_ready(300.0)
    url = env["server"].spec.url()
    fleet = connect_fleet(_rollout(engine="vllm_server", placement="external", server_urls=[url], hedge_after=0.0,
                                   control_timeout_s=20.0), return_routes=True)
    sync = build_weight_sync(SyncConfig(transport="gloo", bucket_bytes=64 * 1024, timeout_s=30.0), fleet,
                             metadata=[(n, t.dtype, tuple(t.shape)) for n, t in weights.items()])
    try:
        for spec in (SamplingSpec(n=2, temperature=1.0, max_tokens=12, seed=5),
                     SamplingSpec(n=1, temperature=0.0, max_tokens=12),
                     SamplingSpec(n=2, temperature=1.0, max_tokens=12, seed=6)):  # the long prompt cached
            _check_groups(fleet.generate(prompts, spec), prompts, hf, f"server {spec.n} {spec.temperature}")
        _check_fleet_trajectories(fleet, env)
        # partial rollouts: frozen (/pause?mode=keep), new routers through the gloo sync, recomputed, resumed
        new = env["new"]
        stream = FleetStream(fleet)
        short = [p for p in prompts[:2] for _ in range(3)]
        spec = SamplingSpec(n=2, temperature=1.0, max_tokens=40, min_tokens=40, seed=9)
        (server,) = fleet.engines
        for attempt in range(4):  # whether the pause catches responses in flight is timing
            got: dict = {}
            base = _generated(server)
            stream.submit(short, spec, list(range(len(short))), got.update)
            deadline = time.monotonic() + 60
            while _generated(server) == base:  # the server has begun
                assert time.monotonic() < deadline
                time.sleep(0.005)
            stream.before_weight_update()
            if len(got) < len(short):
                break
            stream.after_weight_update()  # every response finished before the pause: try again
        assert len(got) < len(short), f"every response finished before the pause, {attempt + 1} times"
        assert sync.sync(iter(new.items()), version=1).complete
        stream.after_weight_update()
        while len(got) < len(short):
            assert time.monotonic() < deadline, f"{len(got)} of {len(short)} groups came back"
            time.sleep(0.01)
        completions = [(short[i], c) for i in range(len(short)) for c in got[i]]
        env["batches"]["server"] = _replay_batch(completions)
        load_routers(hf, new)
        _check_groups(fleet.generate(prompts, SamplingSpec(n=2, temperature=1.0, max_tokens=12, seed=7)), prompts, hf,
                      "server after the sync")
        assert _check_versions(completions, {0: weights, 1: new}, hf, 1, "server prompt") > 0, \
            "no response spanned the weight update"
    finally:
        load_routers(hf, weights)
        sync.close()
        fleet.close()


def _check_fleet_trajectories(fleet, env) -> None:
    """Multi-turn trajectories with a tool through the fleet (the server): routes for the whole
    interleaved sequence, transformers' top-k sets at every row (one weight version)."""
    from multi_turn_ref import records, stop_ids
    from transformers import AutoTokenizer

    from megatron_rl.envs import EnvConfig, Environments
    from megatron_rl.rollout import SamplingSpec
    from megatron_rl.rollout.multi_turn import generate

    tok = AutoTokenizer.from_pretrained(env["model"])
    envs = Environments(EnvConfig(), tok, max_turns=3)
    recs = records(tok, 2, offset=5)
    try:
        out = generate(fleet, envs, recs, SamplingSpec(n=2, temperature=1.0, max_tokens=60, seed=8,
                                                       stop_token_ids=stop_ids(tok)))
    finally:
        envs.close()
    for r, group in zip(recs, out):
        for c in group:
            assert c.routes is not None and c.routes.shape[0] == len(r.prompt_ids) + len(c.token_ids) - 1
            assert_routes_match(c.routes, env["hf"], (r.prompt_ids + c.token_ids)[:-1], f"server trajectory {r.uid}")
    assert any(c.extra["episode"]["turns"] >= 2 for g in out for c in g), "no trajectory took two turns"


def test_routing_replay_server_returning_routes_another_way_is_refused(env):
    from megatron_rl.rollout.routes import RoutesError
    from megatron_rl.rollout.server import VLLMServer

    url = env["server"].spec.url()
    server = VLLMServer(url, _rollout(engine="vllm_server", placement="external", server_urls=[url],
                                      routes_source="native"), return_routes=True)
    try:
        with pytest.raises(RoutesError, match="returns routes by 'capture', but rollout.routes_source='native'"):
            server.connect()
    finally:
        server.close()


# ---------------------------------------------------------------------------------------- trainer
def test_routing_replay_r3_trainer_routes_are_the_engines_at_ep1(env, policy):
    """Both engines' batches spanning an update: every MoE layer routed every token the engine computed
    to the engine's experts, and the log-probs are transformers' with those experts forced (float64,
    the trainer's weights: the newest version's)."""
    from megatron_rl.models.routing_replay import Routes

    hf = env["hf"]
    assert set(env["batches"]) == {"in-process", "server"}, "the engine tests above make the batches"
    load_routers(hf, env["new"])
    expected = env["expected"] = {}
    try:
        for name, d in env["batches"].items():
            batch = _sequence_batch(d)
            with RouterTap(policy, batch) as tap:
                logp, _ = policy.compute_logprobs(batch, 1.0, with_entropy=False, routes=Routes(replay=d["routes"]))
            _equal_to_engine(tap.merged(), d["routes"], [len(s) for s in d["sequences"]])
            assert any(len(call) > 1 for call in tap.calls), "no micro-batch held two sequences"
            expected[name] = [forced_logprobs(hf, s, p, r.numpy()) for s, p, r in
                              zip(d["sequences"], d["prompt_lens"], d["routes"])]
            err = max((lp.double() - ref).abs().max().item() for lp, ref in zip(logp, expected[name]))
            assert err < 2e-5, f"{name}: EP1 r3 log-probs {err:.2e} from transformers' with the engine's experts"
        env["forced"] = [torch.from_numpy((hf_topk(hf, s)[0] + 3) % SPEC.num_experts).to(torch.int16)
                         for s in env["batches"]["in-process"]["sequences"]]  # PP2: every expert moved by 3
    finally:
        load_routers(hf, env["weights"])


def test_routing_replay_moe_ep2_trainer_replays_then_syncs_both_engines_and_replays_the_servers_routes(env):
    """One torchrun of two ranks. EP2 (data parallel 2): the same batches (the old pass and a training
    step) route as the engines did and give the forced reference's log-probs. The updated weights
    then sync, each EP rank sending its own experts, into the module's server (gloo, two senders)
    and an in-process engine beside the trainer: both engines' greedy outputs equal float64
    transformers' on the exported updated checkpoint, and the server's sampled responses (their
    log-probs and routes transformers') replayed by the EP2 trainer route through the engine's
    experts, 100% of tokens and layers, with the forced reference's log-probs. PP2 with full
    recomputation replays (every router runs again in backward) and its gradients equal the run
    without it."""
    from transformers import AutoModelForCausalLM

    from hf_ref import hf_greedy, hf_logprobs
    from megatron_rl.trainer.routing_replay import engine_routes
    from tests.integration.models.policy_testlib import torchrun

    assert "expected" in env and "forced" in env, "the EP1 test above makes the references"
    forced, expected = env["forced"], env["expected"]
    root = env["root"] / "torchrun"
    root.mkdir()
    batches = {name: {"sequences": d["sequences"], "prompt_lens": d["prompt_lens"], "routes": d["routes"]}
               for name, d in env["batches"].items()}
    batches["in-process"]["forced"] = forced
    fleet = dict(engine="vllm_server", placement="external", server_urls=[env["server"].spec.url()], hedge_after=0.0,
                 control_timeout_s=20.0, kv_cache_bytes=16 << 20, max_num_seqs=16, max_prompt_len=200,
                 max_response_len=48, timeout_s=120.0)
    torch.save({"batches": batches, "prompts": env["prompts"], "fleet": fleet}, root / "spec.pt")
    torchrun(Path(__file__).parent / "routing_replay_worker.py", root, env["model_new"], root / "spec.pt", nproc=2)

    ep2 = torch.load(root / "ep2.pt", weights_only=False)
    for name, d in env["batches"].items():
        lengths = [len(s) for s in d["sequences"]]
        for key in ("tap", "train_tap"):  # each rank routed its own sequences: all of them, as the engine
            merged = _merge_ranks(ep2[name][key])
            _equal_to_engine(merged, d["routes"], lengths)
        err = max((lp.double() - ref).abs().max().item() for lp, ref in zip(ep2[name]["logp"], expected[name]))
        assert err < 2e-5, f"{name}: EP2 r3 log-probs {err:.2e} from transformers' with the engine's experts"

    # the sync: each EP rank sent its own experts (rank 1: experts 4-7) and about half of the
    # replicated tensors, into both engines
    sync, after = ep2["sync"], ep2["after_sync"]
    state = checkpoint(str(root / "updated"))  # the exported updated weights, by HF name
    half = SPEC.num_experts // 2

    def expert(n: str) -> int | None:
        return int(n.split(".mlp.experts.")[1].split(".")[0]) if ".mlp.experts." in n else None

    assert sorted(n for n, _ in sync["plan"]) == sorted(state)
    plan = dict(sync["plan"])
    for name, sender in plan.items():  # experts from their EP rank; the replicated tensors spread over both
        assert sender == expert(name) // half if expert(name) is not None else sender in (0, 1), (name, sender)
    per_rank = [sum(t.numel() * 4 for n, t in state.items() if plan[n] == r) for r in (0, 1)]
    largest = max(t.numel() * 4 for n, t in state.items() if expert(n) is None)
    assert max(per_rank) <= sum(per_rank) / 2 + largest, f"each EP rank should send about half: {per_rank}"
    rank1 = per_rank[1]
    for kind in ("inprocess", "gloo"):
        m = sync[kind]
        assert m["complete"] and m["engines"] == 1 and m["senders"] == 2 and m["tensors"] == len(state), m
        assert m["bytes"] == sum(t.numel() * 4 for t in state.values()) and m["sender_bytes"][1] == rank1, m
    (round_,) = sync["gloo"]["rounds"]  # the server's worker received both senders' buckets, checksummed
    assert round_["senders"] == 2 and round_["bytes"] == sync["gloo"]["bytes"], round_
    moved = max((state[n] - t).abs().max().item() for n, t in env["new"].items()
                if expert(n) is not None and expert(n) >= half)
    assert moved > 1e-2, f"the update moved rank 1's experts by {moved:.2e} only: the check could not tell"
    hf = AutoModelForCausalLM.from_pretrained(str(root / "updated"), dtype=torch.float64,
                                              experts_implementation="eager").eval()
    want = [hf_greedy(hf, prompt, 10) for prompt in env["prompts"]]
    differ = [name for name, got in after["greedy"].items() if got != want]
    assert not differ, f"{differ}: greedy outputs differ from transformers' after the EP2 sync"
    assert after["versions"] == [2]
    sampled = after["sampled"]
    for i, (p, t, lp, r) in enumerate(sampled):
        gap = (torch.tensor(lp, dtype=torch.float64) - hf_logprobs(hf, p, t)).abs().max().item()
        assert gap < 2e-4, f"server sample {i}: log-probs {gap:.2e} from transformers' after the EP2 sync"
        assert_routes_match(r, hf, (list(p) + t)[:-1], f"server sample {i} after the EP2 sync")
    seqs = [list(p) + t for p, t, _, _ in sampled]
    routes = [engine_routes(r, len(s), "server") for (*_, r), s in zip(sampled, seqs)]  # as the trainer got them
    lengths = [len(s) for s in seqs]
    _equal_to_engine(_merge_ranks(after["replay_tap"]), routes, lengths)  # r3: 100%, every token and layer
    for i, (s, f, r) in enumerate(zip(seqs, after["free"], routes)):  # its own routers agree (near ties aside)
        assert_rows_match(f.numpy()[:len(s) - 1], np.sort(r.numpy()[:len(s) - 1].astype(np.int64), -1),
                          hf_topk(hf, s[:-1])[1], f"EP2 trainer's free routes, server sample {i}")
    err = max((lp.double() - forced_logprobs(hf, s, len(p), r.numpy())).abs().max().item()
              for lp, s, (p, *_), r in zip(after["replay_logp"], seqs, sampled, routes))
    assert err < 2e-5, f"EP2 r3 log-probs of the server's samples {err:.2e} from the forced reference"

    pp2 = torch.load(root / "pp2.pt", weights_only=False)
    lengths = [len(s) for s in env["batches"]["in-process"]["sequences"]]
    for kind in ("none", "full"):
        _equal_to_engine(_merge_ranks(pp2[kind]["tap"]), forced, lengths)
    assert pp2["full"]["calls"] == 2 * pp2["none"]["calls"]  # every router ran again in backward
    for n, g in pp2["none"]["grads"].items():
        scale = g.abs().max().clamp(min=1e-12)
        assert ((pp2["full"]["grads"][n] - g).abs().max() / scale) < 1e-6, n


def _merge_ranks(per_rank: list[list[np.ndarray]]) -> list[np.ndarray]:
    """The ranks' taps (each routed some sequences, or some layers) as one."""
    out = [x.copy() for x in per_rank[0]]
    for other in per_rank[1:]:
        for o, x in zip(out, other):
            seen = x[..., 0] >= 0
            both = seen & (o[..., 0] >= 0)
            assert (np.sort(o[both], -1) == np.sort(x[both], -1)).all(), "two ranks routed a token differently"
            o[seen] = x[seen]
    return out


def test_routing_replay_planted_divergence_agreement_gap_and_forced_reference(env, engine, policy):
    """The engine's routers perturbed: a known share of (token, layer) top-k sets differ from the
    trainer's. Without replay moe/router_agreement is exactly transformers' share and the gap is large;
    with r3 the trainer's log-probs are transformers' with the engine's experts forced."""
    from megatron_rl.algo import AlgoConfig
    from megatron_rl.rollout import SamplingSpec
    from megatron_rl.trainer import grpo

    hf, new = env["hf"], env["new"]
    planted = perturb_routers(new, seed=30, scale=0.05)
    engine.update_weights(planted.items(), version=30)
    prompts = env["prompts"][:2]
    groups_out = engine.generate(prompts, SamplingSpec(n=4, temperature=1.0, max_tokens=24, seed=4))
    engine.update_weights(new.items(), version=31)
    completions = [(p, c) for p, g in zip(prompts, groups_out) for c in g]
    d = _replay_batch(completions)
    load_routers(hf, new)  # the trainer's weights
    try:
        same = total = 0
        for s, p, r in zip(d["sequences"], d["prompt_lens"], d["routes"]):
            want, clear = hf_topk(hf, s)
            rows = slice(p - 1, len(s) - 1)
            assert clear[rows].all()
            eq = (np.sort(r.numpy()[rows].astype(np.int64), -1) == want[rows]).all(-1)
            same, total = same + int(eq.sum()), total + eq.size
        share = same / total
        assert 0.2 < share < 0.95, f"the planted divergence left {share:.2f} of the routes alike"

        off = grpo.add_logprobs(policy, None, _sequence_batch(d), AlgoConfig(router_agreement=True, n_sgd=2), 1.0, 0)
        assert off["moe/router_agreement"] == pytest.approx(share, abs=1e-12)
        r3 = grpo.add_logprobs(policy, None, batch := _sequence_batch(d),
                               AlgoConfig(routing_replay="r3", router_agreement=True, n_sgd=2), 1.0, 0)
        assert r3["moe/router_agreement"] == pytest.approx(share, abs=1e-12)  # measured by one more free pass
        assert r3["moe/train_infer_logp_gap_free"] == pytest.approx(off["moe/train_infer_logp_gap_free"], rel=1e-5)
        for lp, s, p, r in zip(batch.token_fields["old_logp"], d["sequences"], d["prompt_lens"], d["routes"]):
            ref = forced_logprobs(hf, s, p, r.numpy())
            assert (lp.double() - ref).abs().max() < 2e-5
        free_gap, replay_gap = off["moe/train_infer_logp_gap_free"], r3["moe/train_infer_logp_gap_replay"]
        # (with replay the engine's perturbed routers still weigh the same experts differently)
        assert free_gap > 0.05, free_gap
        print(f"planted divergence: agreement {share:.3f}; gap without replay {free_gap:.3g}, with r3 {replay_gap:.3g}")
    finally:
        load_routers(hf, env["weights"])


def _turn_ranges(c, prompt_len: int) -> list[tuple[int, int]]:
    """The rows each model turn's request gives a trajectory (the module doc of rollout/multi_turn.py,
    written out): turn k from where turn k - 1's stopped (its last token's row) to its own last token."""
    out, lo = [], 0
    for m in c.extra["episode"]["messages"]:
        if m["role"] == "assistant":
            hi = prompt_len + m["start"] + m["tokens"] - 1
            out.append((lo, hi))
            lo = hi
    return out


def test_routing_replay_multi_turn_tool_trajectories_carry_each_turns_rows_and_r3_replays_them(env, engine, policy):
    """Multi-turn trajectories with a tool (two tool observations, three model turns) on the in-process
    engine. Every turn's request runs on other weights than the one before (routers moved), so each
    row tells which forward computed it: the trajectory has one row per position, the prompt's and
    turn k's tokens' rows are turn k's weights' transformers top-k sets, turn k's last token's and
    the observation's rows the next turn's. Without updates (the long prompt: its first KV block
    served from the prefix cache to the later turns) every row is the weights' top-k. The trainer
    (r3) routes every position of every trajectory to the engine's experts, 100%, and its log-probs
    equal transformers' with those experts forced (float64); the routing metrics count the model's
    tokens only (an observation's rollout log-prob is 0.0)."""
    from multi_turn_ref import ENV, check_trajectory, records, stop_ids

    from megatron_rl.algo import AlgoConfig
    from megatron_rl.data.dataset import PromptRecord
    from megatron_rl.envs import EnvConfig, Environments
    from megatron_rl.models.batch import LOSS_MASK
    from megatron_rl.models.routing_replay import Routes
    from megatron_rl.rollout import SamplingSpec
    from megatron_rl.rollout.multi_turn import generate
    from megatron_rl.trainer import grpo

    hf, tok = env["hf"], engine.tokenizer
    states = [env["weights"], env["new"]]
    envs = Environments(EnvConfig(), tok, max_turns=3)
    real, turns_sent = engine.submit, []

    def alternating(prompt_ids, sampling, tags, on_done):  # one trajectory at a time: one request per turn
        engine.update_weights(states[len(turns_sent) % 2].items(), version=40 + len(turns_sent))
        turns_sent.append(len(prompt_ids[0]))
        return real(prompt_ids, sampling, tags, on_done)

    cached = lambda: engine.llm.collective_rpc(lambda w: w._mrl_route_capture.cached_rows)[0]  # noqa: E731
    spec = SamplingSpec(n=1, temperature=1.0, max_tokens=120, seed=3, stop_token_ids=stop_ids(tok))
    long = PromptRecord(prompt_ids=env["prompts"][2], prompt_text=QUESTIONS[2], ground_truth="0",
                        style="exact_boxed", data_source="t", uid="long", row=9, env=ENV)
    try:
        alternated = []
        engine.submit = alternating
        for r in records(tok, 4):
            turns_sent.clear()
            alternated += [(r, c, len(turns_sent)) for c in generate(engine, envs, [r], spec)[0]]
        del engine.submit
        engine.update_weights(states[0].items(), version=50)
        before = cached()
        (same,) = generate(engine, envs, [long], dataclasses.replace(spec, n=2, max_tokens=90))
        from_cache = cached() - before
    finally:
        engine.__dict__.pop("submit", None)
        envs.close()
    assert sum(c.extra["episode"]["turns"] >= 2 for _, c, _ in alternated) >= 2, "too few multi-turn trajectories"
    assert all(c.extra["episode"]["tool_calls"] >= 1 for _, c, _ in alternated + [(long, c, 0) for c in same]
               if c.extra["episode"]["turns"] >= 2)
    telling = 0  # rows where the other version's routers choose otherwise: the check can tell the turns apart
    for r, c, sent in alternated:
        P, seq = len(r.prompt_ids), r.prompt_ids + c.token_ids
        check_trajectory(c, r.prompt_ids, envs.renderer)
        assert c.routes is not None and c.routes.shape == (len(seq) - 1, SPEC.num_layers, SPEC.num_experts_per_tok)
        ranges = _turn_ranges(c, P)
        assert len(ranges) == sent and ranges[-1][1] == len(seq) - 1
        tops = []
        for state in states:
            load_routers(hf, state)
            tops.append(hf_topk(hf, seq[:-1]))
        for k, (lo, hi) in enumerate(ranges):
            (want, clear), (other, _) = tops[k % 2], tops[1 - k % 2]
            assert_rows_match(c.routes[lo:hi], want[lo:hi], clear[lo:hi], f"{r.uid} turn {k} rows [{lo}, {hi})")
            telling += int(((want[lo:hi] != other[lo:hi]).any(-1) & clear[lo:hi]).sum())
    assert telling > 20, telling
    load_routers(hf, states[0])
    for c in same:
        check_trajectory(c, long.prompt_ids, envs.renderer, hf)
        assert_routes_match(c.routes, hf, (long.prompt_ids + c.token_ids)[:-1], "prefix-cached trajectory")
    later = sum(c.extra["episode"]["turns"] - 1 for c in same)  # turns whose history's first block is cached
    assert later >= 1 and from_cache >= 128 * later, (later, from_cache)

    # the trainer (the trainer's weights: the new routers)
    trajectories = [(r.prompt_ids, c) for r, c, _ in alternated] + [(long.prompt_ids, c) for c in same]
    d = _replay_batch(trajectories)
    masks = [torch.tensor(c.model_tokens()) for _, c in trajectories]
    load_routers(hf, env["new"])
    try:
        batch = _sequence_batch(d)
        batch.token_fields[LOSS_MASK] = [m.clone() for m in masks]
        with RouterTap(policy, batch) as tap:
            logp, _ = policy.compute_logprobs(batch, 1.0, with_entropy=False, routes=Routes(replay=d["routes"]))
        _equal_to_engine(tap.merged(), d["routes"], [len(s) for s in d["sequences"]])
        refs = [forced_logprobs(hf, s, p, r.numpy()) for s, p, r in zip(d["sequences"], d["prompt_lens"], d["routes"])]
        err = max((lp.double() - ref).abs().max().item() for lp, ref in zip(logp, refs))
        assert err < 2e-5, f"multi-turn r3 log-probs {err:.2e} from transformers' with the engine's experts"
        r3 = grpo.add_logprobs(policy, None, batch, AlgoConfig(routing_replay="r3", router_agreement=True, n_sgd=2),
                               1.0, 0)
        gaps = [(ref - rl.double())[m].abs().mean().item() for ref, rl, m in zip(refs, d["rollout_logp"], masks)]
        assert r3["moe/train_infer_logp_gap_replay"] == pytest.approx(sum(gaps) / len(gaps), abs=1e-4)
        same_sets = total = unclear = 0  # the agreement: the trainer's own routers on the model's tokens
        for s, p, r, m in zip(d["sequences"], d["prompt_lens"], d["routes"], masks):
            want, clear = hf_topk(hf, s)
            rows = torch.arange(p - 1, len(s) - 1)[m].numpy()
            eq = (np.sort(r.numpy()[rows].astype(np.int64), -1) == want[rows]).all(-1)
            same_sets, total, unclear = same_sets + int(eq.sum()), total + eq.size, unclear + int((~clear[rows]).sum())
        assert r3["moe/router_agreement"] == pytest.approx(same_sets / total, abs=unclear / total + 1e-12)
    finally:
        load_routers(hf, env["weights"])
        engine.update_weights(env["weights"].items(), version=60)


def test_routing_replay_reference_policy_routes_freely_while_the_policy_replays(env, groups, policy):
    """The KL reference is a second model in the process (megatron-core's RouterReplay instances are
    one class-level list): mid-way through a replaying pass of the policy, the reference's forward
    routes with its own routers."""
    from megatron_rl.models.forward import bare
    from megatron_rl.models.micro_batches import plan_micro_batches
    from megatron_rl.models.reference import ReferencePolicy
    from megatron_rl.models.routing_replay import Routes

    reference = ReferencePolicy.from_hf(env["model_new"], _policy_cfg(), groups)
    d = env["batches"]["in-process"]
    batch = _sequence_batch(d)
    free, _ = reference.compute_logprobs(batch, 1.0)
    forced = [(r.long() + 3) % SPEC.num_experts for r in d["routes"]]
    replay = policy.routing_replay(Routes(replay=forced))
    try:
        replay.before_forward(bare(policy.model[0]), plan_micro_batches(batch, groups, TOKENS)[0])
        during, _ = reference.compute_logprobs(batch, 1.0)
    finally:
        replay.finish()
    assert all(torch.equal(a, b) for a, b in zip(free, during))


def test_routing_replay_r2_with_two_sgd_passes_replays_the_old_pass_routes(env, policy):
    """r2, n_sgd=2, a large learning rate: every router call of both passes (each mini-batch) routes
    as the old-log-prob pass recorded, though after the first step the routers' own choice moved."""
    from megatron_rl.algo import AlgoConfig
    from megatron_rl.models.routing_replay import Routes
    from megatron_rl.trainer import grpo
    from megatron_rl.trainer.routing_replay import OLD

    a = AlgoConfig(routing_replay="r2", n_sgd=2, mini_batches=2)
    batch = _sequence_batch(env["batches"]["in-process"])
    policy.set_lr(0.05)
    grpo.add_logprobs(policy, None, batch, a, 1.0, 0)
    old = batch.position_fields[OLD]
    with RouterTap(policy, batch) as tap:
        grpo.update_policy(policy, batch, a, 1.0, alpha=0.0, max_response_len=48, seed=3)
    index = {id(s): i for i, s in enumerate(batch.sequences)}
    routed = [0] * len(batch.sequences)  # router calls (one per layer and micro-batch) per sequence
    for call in tap.calls:
        for key in call:
            routed[index[key]] += 1
    assert min(routed) == 2 * SPEC.num_layers, routed  # both passes, every layer
    for call in tap.calls:
        for key, rows in call.items():
            seen = rows[..., 0] >= 0
            want = old[index[key]].numpy().astype(np.int64)
            assert (np.sort(rows[seen], -1) == np.sort(want[seen], -1)).all()
    after = Routes(record=True)
    policy.compute_logprobs(batch, 1.0, with_entropy=False, routes=after)
    moved = sum(int((np.sort(x.numpy(), -1) != np.sort(o.numpy(), -1)).any(-1).sum())
                for x, o in zip(after.recorded, old))
    assert moved > 0, "the update did not move any route: the test could not tell replay from free routing"
