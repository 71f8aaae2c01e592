"""Fleet dispatch logic with stand-in engines (pure logic; the real servers are in
tests/integration/rollout/test_fleet.py): least-outstanding dispatch within each engine's room, the
result independent of which engine served a prompt, requeue on failure, membership states."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import random
import threading
import time

import pytest

from megatron_rl.rollout.base import UNKNOWN_VERSION, Completion, EngineDied, EngineError, RolloutEngine, SamplingSpec
from megatron_rl.rollout.config import AsyncConfig, RolloutConfig
from megatron_rl.rollout.fleet import EngineFleet, EngineState


class Seeded(RolloutEngine):
    """Samples a deterministic function of (prompt, seed + j): what a seeded vLLM server does."""

    def __init__(self, name: str, delay: float = 0.0, die_after: int | None = None):
        self.name, self.delay, self.die_after = name, delay, die_after
        self.calls = 0
        self.inflight = self.peak = 0
        self.alive = True
        self.weight_version = 0

    async def submit(self, prompt_ids, sampling):
        self.calls += 1
        self.inflight += sampling.n
        self.peak = max(self.peak, self.inflight)
        try:
            if self.die_after is not None and self.calls > self.die_after:
                self.alive = False
            if not self.alive:
                await asyncio.sleep(self.delay / 2)
                raise EngineDied(f"engine {self.name}: connection refused")
            await asyncio.sleep(self.delay)
            out = []
            for j in range(sampling.n):
                rng = random.Random(hash((tuple(prompt_ids), sampling.seed + j)))
                ids = [rng.randrange(100) for _ in range(sampling.max_tokens)]
                out.append(Completion(token_ids=ids, logprobs=[0.0] * len(ids), text="", finish_reason="length",
                                      truncated=True, weight_version=self.weight_version, engine=self.name))
            return out
        finally:
            self.inflight -= sampling.n

    def generate(self, prompt_ids, sampling):
        raise NotImplementedError

    def health(self, timeout=None):
        return self.alive

    def reset_prefix_cache(self):
        pass


def _cfg(room: int, hedge_after: float = 0.0) -> RolloutConfig:
    """Tail hedging off unless a test is about it (it changes which engine answers)."""
    return RolloutConfig(engine="vllm_server", num_engines=3, max_num_seqs=room, timeout_s=5.0,
                         hedge_after=hedge_after)


PROMPTS = [[i, i + 1, i + 2] for i in range(24)]
SPEC = SamplingSpec(n=2, max_tokens=4, seed=11)


def _reference():
    """What one engine alone samples for every prompt."""
    one = Seeded("ref")
    return [[c.token_ids for c in asyncio.run(one.submit(p, SPEC.for_prompt(i)))] for i, p in enumerate(PROMPTS)]


def test_fleet_dispatch_gives_a_slow_engine_fewer_prompts_and_the_same_samples():
    engines = [Seeded("fast0", 0.01), Seeded("fast1", 0.01), Seeded("slow", 0.08)]
    fleet = EngineFleet(engines, _cfg(room=4))
    try:
        got = fleet.generate(PROMPTS, SPEC)
        m = fleet.pop_metrics()
    finally:
        fleet.close()
    assert [[c.token_ids for c in g] for g in got] == _reference()
    # room 4 = two n=2 requests per engine at a time; the slow engine gets far fewer than a third
    assert all(e.peak <= 4 for e in engines)
    assert engines[2].calls < len(PROMPTS) / 3 < engines[0].calls
    assert m["rollout/requeued_requests"] == 0 and m["rollout/engines_up"] == 3
    assert {c.engine for g in got for c in g} == {"fast0", "fast1", "slow"}


class Stalled(Seeded):
    """A straggler at the limit: it never answers; it counts the requests it was given and those
    the fleet took back (cancelled)."""

    def __init__(self, name):
        super().__init__(name)
        self.cancelled = 0

    async def submit(self, prompt_ids, sampling):
        self.calls += 1
        try:
            await asyncio.Event().wait()
        except asyncio.CancelledError:
            self.cancelled += 1
            raise


def _all(fleet, prompts, spec, timeout=30.0):
    """Every prompt through submit_threadsafe, each answer awaited with a timeout."""
    futures = [fleet.submit_threadsafe(p, spec.for_prompt(i)) for i, p in enumerate(prompts)]
    return [f.result(timeout=timeout) for f in futures]


def test_fleet_hedges_a_stalled_engines_requests_onto_engines_with_room_and_samples_the_same():
    engines = [Seeded("fast0", 0.01), Seeded("fast1", 0.01), Stalled("stall")]
    fleet = EngineFleet(engines, _cfg(room=4, hedge_after=1.5))
    try:
        got = _all(fleet, PROMPTS, SPEC)
        m = fleet.pop_metrics()
        deadline = time.monotonic() + 10.0  # the cancelled copies' tasks finish unwinding (slow when loaded)
        while engines[2].cancelled < engines[2].calls and time.monotonic() < deadline:
            time.sleep(0.01)
    finally:
        fleet.close()
    assert [[c.token_ids for c in g] for g in got] == _reference()  # same seeds, same samples
    stall = engines[2]
    assert stall.calls >= 2  # its first room (two n=2 requests), then more once those were taken back
    assert {c.engine for g in got for c in g} == {"fast0", "fast1"}
    # every request the straggler held was copied to a fast engine, answered there, and cancelled
    assert m["rollout/hedged_requests"] == m["rollout/hedge_wins"] == stall.calls == stall.cancelled
    assert m["rollout/requeued_requests"] == 0 and m["rollout/engines_up"] == 3


class Stopped(Stalled):
    """A stopped server (SIGSTOP): it takes requests with ids and never answers them, nor an abort."""

    def __init__(self, name):
        super().__init__(name)
        self.ids, self.aborts = [], []

    async def submit(self, prompt_ids, sampling, request_id=None):
        self.ids.append(request_id)
        return await super().submit(prompt_ids, sampling)

    async def abort(self, request_ids):
        self.aborts += request_ids
        await asyncio.Event().wait()


def test_fleet_hedging_still_marks_down_an_engine_whose_requests_were_all_hedged_away():
    """With tail hedging, a stopped engine's requests all finish elsewhere; their losing copies are
    aborted on it and still awaited, so it is marked down within rollout.timeout_s (its hedged
    requests are not counted as re-sent), not left up to take the next requests."""
    engines = [Seeded("fast0", 0.01), Seeded("fast1", 0.01), Stopped("stop")]
    # timeout_s leaves the 24 prompts time to finish on the fast engines first on a loaded machine
    # (the scenario: hedging, not the timeout, answered them); then the timeout marks it down
    cfg = RolloutConfig(engine="vllm_server", num_engines=3, max_num_seqs=4, timeout_s=2.0, hedge_after=1.5)
    fleet = EngineFleet(engines, cfg)
    try:
        t0 = time.monotonic()
        got = _all(fleet, PROMPTS, SPEC)
        m = fleet.pop_metrics()
        assert fleet.state("stop") is EngineState.UP  # (all answered before its timeout)
        while fleet.state("stop") is not EngineState.DOWN:
            assert time.monotonic() - t0 < 8.0, "the stopped engine was not marked down"
            time.sleep(0.01)
        reason = fleet.members.slot("stop").reason
    finally:
        fleet.close()
    assert [[c.token_ids for c in g] for g in got] == _reference()
    stop = engines[2]
    assert stop.calls >= 2 and m["rollout/hedge_wins"] == stop.calls and m["rollout/requeued_requests"] == 0
    assert sorted(stop.aborts) == sorted(stop.ids) and None not in stop.ids  # each losing copy, by its id
    assert "rollout.timeout_s=2" in reason, reason


def test_fleet_hedging_spares_engines_of_another_weight_version_and_is_off_at_zero():
    """A straggler's request may only be copied to an engine holding the same weights (or the
    samples could differ); hedge_after=0 turns hedging off. Either way its requests stay put."""
    for hedge_after, stale in ((1.5, True), (0.0, False)):
        engines = [Seeded("fast0", 0.01), Stalled("stall")]
        engines[0].weight_version = 3 if stale else 0
        fleet = EngineFleet(engines, _cfg(room=4, hedge_after=hedge_after))
        try:
            # least outstanding work: p0 fast0, p1 stall, p2 fast0, p3 stall, p4 and p5 wait for fast0
            futures = [fleet.submit_threadsafe(p, SPEC.for_prompt(i)) for i, p in enumerate(PROMPTS[:6])]
            for k in (0, 2, 4, 5):
                futures[k].result(timeout=10)
            time.sleep(0.3)  # 30 times fast0's request time: a hedge would have happened by now
            m = fleet.pop_metrics()
            assert not futures[1].done() and not futures[3].done()
        finally:
            fleet.close()
        assert m["rollout/hedged_requests"] == 0 and engines[1].calls == 2, (hedge_after, stale, m)


def test_fleet_requeues_a_dead_engines_requests_with_the_same_seeds():
    engines = [Seeded("e0", 0.01), Seeded("e1", 0.01, die_after=2), Seeded("e2", 0.01)]
    fleet = EngineFleet(engines, _cfg(room=2))
    try:
        got = fleet.generate(PROMPTS, SPEC)
        m = fleet.pop_metrics()
        assert fleet.state("e1") is EngineState.DOWN and engines[1].weight_version == UNKNOWN_VERSION
        assert [e.name for e in fleet.live()] == ["e0", "e2"]
        assert [[c.token_ids for c in g] for g in got] == _reference()
        assert m["rollout/requeued_requests"] >= 1 and m["rollout/engines_down"] == 1
        # a DOWN engine that answers again rejoins (it takes part in the next sync), then is admitted
        engines[1].alive, engines[1].die_after = True, None
        assert fleet.probe() == [engines[1]] and fleet.state("e1") is EngineState.JOINING
        assert [e.name for e in fleet.sync_targets()] == ["e0", "e1", "e2"]
        fleet.admit("e1")
        assert fleet.generate(PROMPTS[:6], SPEC) and engines[1].calls > 3
    finally:
        fleet.close()


def test_fleet_with_every_engine_down_raises_naming_them():
    engines = [Seeded("a", 0.0, die_after=0), Seeded("b", 0.0, die_after=0)]
    fleet = EngineFleet(engines, _cfg(room=2))
    try:
        with pytest.raises(EngineError, match=r"no engine is up: a down \(.*connection refused\); b down"):
            fleet.generate(PROMPTS[:4], SPEC)
    finally:
        fleet.close()


def test_fleet_submit_threadsafe_dispatches_continuously_from_other_threads():
    engines = [Seeded("e0", 0.02), Seeded("e1", 0.02)]
    fleet = EngineFleet(engines, _cfg(room=2))
    results = {}
    try:
        def worker(k):
            results[k] = fleet.submit_threadsafe(PROMPTS[k], SPEC.for_prompt(k)).result(timeout=10)
        threads = [threading.Thread(target=worker, args=(k,)) for k in range(8)]
        t0 = time.monotonic()
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert time.monotonic() - t0 < 2
    finally:
        fleet.close()
    ref = _reference()
    assert all([c.token_ids for c in results[k]] == ref[k] for k in range(8))
    assert max(e.peak for e in engines) <= 2


class Named(Seeded):
    """A server's request names: ``submit(..., request_id)``, ``abort(ids)``, pause / resume."""

    def __init__(self, name, delay):
        super().__init__(name, delay)
        self.sent, self.aborted, self.control = [], [], []

    async def submit(self, prompt_ids, sampling, request_id=None):
        self.sent.append(request_id)
        return await super().submit(prompt_ids, sampling)

    async def abort(self, request_ids):
        self.aborted += request_ids

    def pause(self, mode="keep"):
        self.control.append(("pause", mode))

    def resume(self):
        self.control.append(("resume",))


def test_async_fleet_stream_delivers_groups_aborts_leftovers_and_freezes_across_updates():
    from megatron_rl.algo.config import AlgoConfig
    from megatron_rl.data.dataset import PromptRecord
    from megatron_rl.data.loader import PromptLoader
    from megatron_rl.rewards import RewardManager
    from megatron_rl.rewards.config import RewardConfig
    from megatron_rl.rollout.config import AsyncConfig
    from megatron_rl.rollout.fleet_stream import FleetStream
    from megatron_rl.trainer.async_rollout import RolloutScheduler

    engines = [Named("e0", 0.3), Named("e1", 0.3)]
    fleet = EngineFleet(engines, _cfg(room=8))
    stream = FleetStream(fleet)
    got = {}
    try:
        stream.submit(PROMPTS[:6], SPEC, list(range(6)), got.update)
        deadline = time.monotonic() + 5
        while sum(len(e.sent) for e in engines) < 6:  # all sent (named), none finished yet
            assert time.monotonic() < deadline
            time.sleep(0.005)
        assert stream.in_flight() == 6
        stream.abort([0, 1, 2, 3])
        aborted = sorted(r for e in engines for r in e.aborted)
        sent = {r: e for e in engines for r in e.sent}
        assert len(aborted) == 4 and len(set(sent)) == 6  # the engines serving them were told
        assert all(r in sent[r].aborted for r in aborted)
        while len(got) < 2:
            assert time.monotonic() < deadline
            time.sleep(0.01)
        time.sleep(0.4)  # an aborted request that still came back is not delivered
        assert sorted(got) == [4, 5] and stream.in_flight() == 0 and not fleet.dispatcher.requests
        ref = _reference()
        assert [[c.token_ids for c in got[k]] for k in (4, 5)] == [ref[4], ref[5]]  # prompt k: seed + k
        assert 0.2 < stream.busy_seconds() < 5
        # the scheduler with partial rollouts: paused (keep) before the weight update, resumed after
        records = [PromptRecord(prompt_ids=p, prompt_text="", ground_truth="1", style="exact_boxed",
                                data_source="t", uid=str(i)) for i, p in enumerate(PROMPTS)]
        rcfg = RolloutConfig(engine="vllm_server", rollout_batch_size=2, group_size=2, timeout_s=5.0,
                             async_=AsyncConfig(max_staleness=1, partial_rollout=True))
        sched = RolloutScheduler(fleet, PromptLoader(records, 2, seed=1), RewardManager(RewardConfig()), rcfg,
                                 AlgoConfig(filter_zero_variance_groups=False), run_seed=3, max_response_len=4)
        assert isinstance(sched.stream, FleetStream)
        for e in engines:
            e.control.clear()
        ro, _ = sched.next_rollout(0, 0, 0, lambda name: contextlib.nullcontext())
        assert len(ro.records) == 2 and sum(len(e.sent) for e in engines) == 6 + 4  # and the wave ahead
        sched.before_sync()
        assert all(e.control == [("pause", "keep")] for e in engines)
        sched.after_sync()
        assert all(e.control == [("pause", "keep"), ("resume",)] for e in engines)
        sched.close()
        assert sched.stream.in_flight() == 0 and not fleet.dispatcher.requests
    finally:
        fleet.close()


class Frozen(Seeded):
    """A server paused in mode keep: its requests make no progress until it resumes."""

    def __init__(self, name):
        super().__init__(name)
        self.running = threading.Event()
        self.running.set()

    async def submit(self, prompt_ids, sampling):
        while not self.running.is_set():
            await asyncio.sleep(0.005)
        return await super().submit(prompt_ids, sampling)

    def pause(self, mode="keep"):
        self.running.clear()

    def resume(self):
        self.running.set()


def _frozen_on_both(fleet) -> list:
    """The fleet paused (keep), four prompts sent: two frozen requests on each of its two engines."""
    fleet.pause("keep")
    futures = [fleet.submit_threadsafe(p, SPEC.for_prompt(k)) for k, p in enumerate(PROMPTS[:4])]
    deadline = time.monotonic() + 5
    while sum(s.outstanding for s in fleet.members.slots) < 8:
        assert time.monotonic() < deadline
        time.sleep(0.005)
    return futures


def test_fleet_holds_what_a_resumed_engine_returns_until_its_sync_verified_it():
    """Partial rollouts: each engine resumes before its probe (a paused server scores nothing), so
    what it returns between its resume and the sync's verdict is held; admitted, it is delivered; if
    it fails the sync instead, its requests are re-sent to an engine that passed, with the same seeds."""
    engines = [Frozen("e0"), Frozen("e1")]
    fleet = EngineFleet(engines, _cfg(room=4))
    try:
        futures = _frozen_on_both(fleet)
        fleet.resume_paused(engines[1])  # e1's new weights loaded; its probe still to come
        time.sleep(0.3)
        assert engines[1].calls == 2 and not any(f.done() for f in futures), "delivered before the verdict"
        fleet.admit(engines[1])  # its probe passed
        time.sleep(0.3)
        done = [k for k, f in enumerate(futures) if f.done()]
        assert len(done) == 2 and all(c.engine == "e1" for k in done for c in futures[k].result())
        fleet.resume_paused(engines[0])
        time.sleep(0.3)
        assert engines[0].calls == 2 and sum(f.done() for f in futures) == 2
        fleet.mark_unknown(engines[0], "probe mismatch")  # its probe failed: the held results go
        got = [f.result(timeout=5) for f in futures]
        m = fleet.pop_metrics()
    finally:
        fleet.close()
    assert [[c.token_ids for c in g] for g in got] == _reference()[:4]
    assert {c.engine for g in got for c in g} == {"e1"} and m["rollout/requeued_requests"] == 2


def test_fleet_resends_what_a_resumed_engine_returns_when_it_is_never_verified_within_the_timeout():
    """An engine resumed before its probe whose sync never settles (no admit, no failure) within
    rollout.timeout_s: what it returned is not delivered; it is taken out (unknown weights) and its
    requests are re-sent, with their seeds, to the engine that was verified."""
    engines = [Frozen("e0"), Frozen("e1")]
    cfg = RolloutConfig(engine="vllm_server", num_engines=2, max_num_seqs=4, timeout_s=0.5, hedge_after=0.0)
    fleet = EngineFleet(engines, cfg)
    try:
        futures = _frozen_on_both(fleet)
        fleet.resume_paused(engines[0])  # loaded; its verdict never comes
        fleet.resume_paused(engines[1])
        fleet.admit(engines[1])
        got = [f.result(timeout=5) for f in futures]
        m = fleet.pop_metrics()
        assert engines[0].calls == 2, "e0 did not return its held results before the timeout"
        assert fleet.state("e0") is EngineState.JOINING and engines[0].weight_version == UNKNOWN_VERSION
        assert "not verified within rollout.timeout_s=0.5" in fleet.members.slot("e0").reason
    finally:
        fleet.close()
    assert [[c.token_ids for c in g] for g in got] == _reference()[:4]
    assert {c.engine for g in got for c in g} == {"e1"} and m["rollout/requeued_requests"] == 2


class Lost(Frozen):
    """A server that can be lost (every request to it then fails, as to a killed process) and come
    back later as a new process: base weights, not paused."""

    def __init__(self, name):
        super().__init__(name)
        self.lost_at: float | None = None
        self.back_after = 0.0

    def lose(self, back_after: float) -> None:
        self.alive, self.lost_at, self.back_after = False, time.monotonic(), back_after

    def health(self, timeout=None):
        if not self.alive and self.lost_at is not None and time.monotonic() - self.lost_at >= self.back_after:
            self.alive, self.weight_version = True, 0  # restarted
            self.running.set()
        return self.alive


def test_fleet_with_every_engine_lost_waits_for_restarts_revives_them_and_samples_the_same():
    """Every engine lost mid-batch: the requests wait (rollout.start_timeout_s) for the engines to come
    back, the reviver (the weight sync: here, a stand-in that loads version 7) loads and admits each
    one that answers, from a thread other than the fleet's loop, and every request is re-sent with its
    seed: the same samples as an unfaulted run, the re-sent requests and the revival counted."""
    engines = [Lost("e0"), Lost("e1")]
    cfg = RolloutConfig(engine="vllm_server", num_engines=2, max_num_seqs=4, timeout_s=5.0, start_timeout_s=5.0,
                        hedge_after=0.0)
    fleet = EngineFleet(engines, cfg)
    revived, threads, lag = [], [], []

    def reviver():
        threads.append(threading.current_thread() is fleet._thread)
        time.sleep(0.2)
        # a revival under way is progress: the trainer's watchdog (rollout.timeout_s) waits for it
        lag.append(time.monotonic() - fleet.last_progress())
        fleet.hold()  # (as the sync's round does)
        for engine in fleet.sync_targets():
            engine.weight_version = 7
            fleet.resume_paused(engine)
            fleet.admit(engine)
            revived.append(engine.name)

    fleet.set_reviver(reviver)
    real = engines[0].submit
    state = {"calls": 0}

    async def losing(prompt_ids, sampling):
        state["calls"] += 1
        if state["calls"] == 3:  # mid-batch: both lost, back 0.3 s later
            for e in engines:
                e.lose(back_after=0.3)
        return await real(prompt_ids, sampling)

    engines[0].submit = losing
    try:
        got = fleet.generate(PROMPTS[:12], SPEC)
        m = fleet.pop_metrics()
    finally:
        fleet.close()
    assert [[c.token_ids for c in g] for g in got] == _reference()[:12]
    assert sorted(set(revived)) == ["e0", "e1"] and threads and not any(threads)
    assert lag and max(lag) < 0.05, lag
    assert m["rollout/revivals"] == 1 and m["rollout/requeued_requests"] >= 2 and m["rollout/engines_up"] == 2
    assert {c.weight_version for g in got for c in g} <= {0, 7}
    # nothing comes back within rollout.start_timeout_s: the request fails, naming the engines
    engines = [Lost("a")]
    fleet = EngineFleet(engines, dataclasses.replace(cfg, num_engines=1, start_timeout_s=0.5))
    fleet.set_reviver(lambda: None)
    engines[0].lose(back_after=60.0)
    try:
        t0 = time.monotonic()
        with pytest.raises(EngineError, match=r"none came back within rollout.start_timeout_s=0.5s: a down"):
            fleet.generate(PROMPTS[:1], SPEC)
        assert time.monotonic() - t0 < 3.0
    finally:
        fleet.close()


def test_fleet_hold_pauses_every_engine_a_sync_loads_so_nothing_computes_until_its_finish():
    """A losing hedged copy still runs when the sync starts, and a request is dispatched during the
    sync: ``hold`` pauses every engine the round loads (not a DOWN one), so neither computes until the
    engine is resumed after its finish (``resume_paused``); what it returns then is held until it is
    admitted."""
    engines = [Frozen("e0"), Frozen("e1"), Lost("e2")]
    fleet = EngineFleet(engines, _cfg(room=4))
    try:
        engines[2].lose(back_after=60.0)
        fleet.mark_down("e2", "lost")
        fleet.hold()
        assert [e.running.is_set() for e in engines[:2]] == [False, False] and engines[2].running.is_set()
        assert [s.paused for s in fleet.members.slots] == [True, True, False]
        fleet.hold()  # idempotent: nothing paused twice
        future = fleet.submit_threadsafe(PROMPTS[0], SPEC)
        time.sleep(0.2)
        assert not future.done() and sum(s.outstanding for s in fleet.members.slots) == 2  # it waits on a paused engine
        for e in engines[:2]:
            fleet.resume_paused(e)
        time.sleep(0.2)
        assert not future.done(), "delivered before the engine was verified"
        for e in engines[:2]:
            fleet.admit(e)
        assert [c.token_ids for c in future.result(timeout=5)] == _reference()[0]
        assert not any(s.paused for s in fleet.members.slots)
    finally:
        fleet.close()


class Tokenwise(Seeded):
    """A server that generates token by token (``per_token`` seconds each; sample length and tokens a
    function of prompt and seed + j) and honours vLLM's pause modes: ``abort`` answers every request
    at once with the tokens it has (finish reason ``abort`` for the samples it stopped), requests sent
    while paused wait for ``resume``."""

    def __init__(self, name, per_token):
        super().__init__(name)
        self.per_token = per_token
        self.paused = self.abort_now = False
        self.prompts: list[list[int]] = []

    async def submit(self, prompt_ids, sampling, request_id=None):
        self.prompts.append(list(prompt_ids))
        while self.paused:
            await asyncio.sleep(0.005)
        rngs = [random.Random(hash((tuple(prompt_ids), sampling.seed + j))) for j in range(sampling.n)]
        lengths = [min(sampling.max_tokens, r.randrange(3, 24)) for r in rngs]
        ids: list[list[int]] = [[] for _ in range(sampling.n)]
        for t in range(max(lengths)):
            if self.abort_now:
                break
            await asyncio.sleep(self.per_token)
            for j, r in enumerate(rngs):
                if t < lengths[j]:
                    ids[j].append(r.randrange(100))
        return [Completion(token_ids=x, logprobs=[-0.5] * len(x), text="".join(f"<{t}>" for t in x),
                           finish_reason=("stop" if len(x) < sampling.max_tokens else "length") if len(x) == n
                           else "abort", truncated=len(x) == sampling.max_tokens, weight_version=self.weight_version,
                           engine=self.name) for x, n in zip(ids, lengths)]

    def pause(self, mode="keep"):
        self.paused, self.abort_now = True, mode == "abort"

    def resume(self):
        self.paused = self.abort_now = False


def test_a_preemption_mid_generation_keeps_finished_groups_and_continues_partial_ones(caplog):
    """A stop request while a step waits for its groups (preemption): the step is given up; the
    servers answer every request at once with what they generated (/pause?mode=abort); the scheduler
    saves the finished groups whole and the partial responses with their tokens, log-probs and
    versions (the count logged); a scheduler restored from that state trains the finished groups
    as they were (not generated again) and continues each stopped sample from its partial tokens
    (prompt + partial, the rest of the length, the sample's seed), joined end to end."""
    import logging

    from megatron_rl.algo.config import AlgoConfig
    from megatron_rl.data.dataset import PromptRecord
    from megatron_rl.data.loader import PromptLoader
    from megatron_rl.rewards import RewardManager
    from megatron_rl.rewards.config import RewardConfig
    from megatron_rl.trainer.async_rollout import Interrupted, RolloutScheduler

    records = [PromptRecord(prompt_ids=p, prompt_text="", ground_truth="1", style="exact_boxed", data_source="t",
                            uid=str(i)) for i, p in enumerate(PROMPTS)]
    rcfg = RolloutConfig(engine="vllm_server", rollout_batch_size=8, group_size=2, timeout_s=10.0, hedge_after=0.0,
                         max_num_seqs=64, async_=AsyncConfig(oversample=0.25))

    def scheduler(fleet):
        return RolloutScheduler(fleet, PromptLoader(records, 8, seed=1), RewardManager(RewardConfig()), rcfg,
                                AlgoConfig(filter_zero_variance_groups=False), run_seed=3, max_response_len=20)

    engines = [Tokenwise("fast", 0.002), Tokenwise("slow", 0.05)]
    fleet = EngineFleet(engines, rcfg)
    try:
        sched = scheduler(fleet)
        t0 = time.monotonic()
        with pytest.raises(Interrupted):  # the stop comes while the slow server's requests generate
            sched.next_rollout(0, 0, 0, lambda name: contextlib.nullcontext(),
                               stop=lambda: time.monotonic() - t0 > 0.4)
        state = sched.state_dict()
        saved = {(d["wave"], d["index"]): d for d in state["groups"]}
        finished = [k for k, d in saved.items() if d["completions"] and
                    all(c["finish_reason"] != "abort" for c in d["completions"])]
        partial = {k: d for k, d in saved.items() if d["completions"] and
                   any(c["finish_reason"] == "abort" and c["token_ids"] for c in d["completions"])}
        assert len(finished) >= 3 and partial, saved
        assert len(saved) == 10  # the step's 8 prompts and 25% more: none lost, none twice
        import tempfile
        from pathlib import Path
        with tempfile.TemporaryDirectory() as tmp, caplog.at_level(logging.INFO, logger="megatron_rl"):
            sched.save(Path(tmp))
        logged = "\n".join(r.getMessage() for r in caplog.records)
        n_partial = sum(c["finish_reason"] == "abort" for d in saved.values() if d["completions"]
                        for c in d["completions"])
        kept = sum(d["completions"] is not None for d in saved.values())
        assert (f"rollouts saved with the checkpoint: {kept} groups generated and not trained on "
                f"({n_partial} partial responses among them") in logged, logged
        sent_before = {e.name: len(e.prompts) for e in engines}
    finally:
        fleet.close()
    # the resumed run: fresh servers, the saved state
    engines = [Tokenwise("fast", 0.002), Tokenwise("slow", 0.002)]
    fleet = EngineFleet(engines, rcfg)
    try:
        sched = scheduler(fleet)
        sched.loader.take(10)  # (the saved loader state: the wave was drawn)
        sched.load_state_dict(state, version=0, global_step=0, step=0)
        ro, _ = sched.next_rollout(0, 0, 0, lambda name: contextlib.nullcontext())
        sched.close()
    finally:
        fleet.close()
    assert sent_before and len(ro.records) == 8
    sent = [p for e in engines for p in e.prompts]
    groups = {}
    for k, c in zip(ro.group_ids.tolist(), ro.completions):
        groups.setdefault(k, []).append(c)
    uid_to_key = {str(d["record"]): k for k, d in saved.items()}
    for k, comps in groups.items():
        key = uid_to_key[ro.records[k].uid]
        d = saved[key]
        prompt = records[d["record"]].prompt_ids
        assert all(c.finish_reason != "abort" and len(c.token_ids) <= 20 for c in comps)
        if key in finished:  # trained as saved, never sent again
            assert [c.token_ids for c in comps] == [c["token_ids"] for c in d["completions"]]
            assert prompt not in sent
        elif key in partial:
            for c, was in zip(comps, d["completions"]):
                assert c.token_ids[:len(was["token_ids"])] == was["token_ids"]
                assert c.logprobs[:len(was["logprobs"])] == was["logprobs"]
                if was["finish_reason"] == "abort":  # continued: prompt + its partial tokens, the rest of 20
                    assert prompt + was["token_ids"] in sent and len(c.token_ids) >= len(was["token_ids"])
    assert any(key in partial for key in (uid_to_key[ro.records[k].uid] for k in groups)) or len(finished) >= 8


def test_a_sync_round_that_reached_no_engine_is_loaded_again_from_the_host_copy():
    """The weight sync's control loop around a round (the round itself stands in): when every engine
    dies during a round, the same weights, from the sender's host copy, go into the engines that come
    back (no second export); a mismatch is raised at once; engines that answer but keep failing get
    sync.retries more rounds, then the failure."""
    pytest.importorskip("vllm")
    import torch

    from megatron_rl.sync.base import SendPlan, SyncError, SyncMetrics, SyncMismatch
    from megatron_rl.sync.config import SyncConfig
    from megatron_rl.sync.server_transport import ServerTransport
    from megatron_rl.sync.vllm_protocol import ServerWeightSync

    engines = [Lost("e0"), Lost("e1")]
    fleet = EngineFleet(engines, RolloutConfig(engine="vllm_server", num_engines=2, start_timeout_s=5.0, hedge_after=0.0))
    meta = [("a", torch.float32, (3,)), ("b", torch.float32, (2,))]
    sync = ServerWeightSync(SyncConfig(transport="gloo", retries=1), fleet, rank=0, plan=SendPlan.of(meta),
                            transport=ServerTransport("stand-in", lambda *a, **k: None))
    rounds: list = []

    def dies_once(named, version, reference):
        rounds.append([(n, t.clone()) for n, t in named])
        if len(rounds) == 1:
            for e in engines:
                e.lose(back_after=0.3)
                fleet.mark_down(e, "killed during the round")
            raise SyncError("the round was cut")
        for e in fleet.sync_targets():
            fleet.admit(e)
        return SyncMetrics(version=version, engines=len(fleet.live()))

    def failing(kind):
        def round_(named, version, reference):
            rounds.append(list(named))
            raise kind("no answer")
        return round_

    try:
        assert fleet.reviver == sync.revive
        sync._round = dies_once
        exported = iter([("a", torch.arange(3.0)), ("b", torch.ones(2))])  # walked once, as the export is
        m = sync.sync(exported, 7)
        assert len(rounds) == 2 and m.engines == 2 and [e.name for e in fleet.live()] == ["e0", "e1"]
        assert [n for n, _ in rounds[1]] == ["a", "b"]
        assert all(torch.equal(x, y) for (_, x), (_, y) in zip(rounds[0], rounds[1]))
        for kind, calls in ((SyncMismatch, 1), (SyncError, 2)):  # engines up: retries=1 more round
            rounds.clear()
            sync._round = failing(kind)
            with pytest.raises(kind):
                sync.sync(iter([("a", torch.zeros(3)), ("b", torch.zeros(2))]), 8)
            assert len(rounds) == calls, (kind, len(rounds))
    finally:
        sync.close()
        fleet.close()
    assert fleet.reviver is None
