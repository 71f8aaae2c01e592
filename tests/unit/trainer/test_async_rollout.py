"""The async rollout scheduler against stand-in engines (pure logic; the real engine is tested in
tests/integration/rollout/test_streaming_engine.py and the whole loop in tests/e2e/test_async_grpo.py).

References: today's synchronous phases (generate + score) for ``max_staleness=0``; for the rest,
invariants read off the per-sample weight versions the stand-in engines stamp.
"""

from __future__ import annotations

import random
from contextlib import nullcontext

import pytest
import torch

from megatron_rl.algo.config import AlgoConfig, MismatchConfig
from megatron_rl.data.dataset import PromptRecord
from megatron_rl.data.loader import PromptLoader
from megatron_rl.rewards import RewardManager
from megatron_rl.rewards.config import RewardConfig
from megatron_rl.rollout import Completion, RolloutEngine
from megatron_rl.rollout.config import AsyncConfig, RolloutConfig
from megatron_rl.rollout.streaming import GroupStream
from megatron_rl.trainer import phases
from megatron_rl.trainer.async_rollout import RolloutScheduler, staleness_advice
from megatron_rl.trainer.rollout_metrics import merge_reward_metrics
from megatron_rl.trainer.config import TrainerConfig
from megatron_rl.trainer.schema import RunConfig


def timer(_name):
    return nullcontext()


def _records(n=40):
    return [PromptRecord(prompt_ids=[1 + i % 7, 2 + i % 5, 3 + i], prompt_text=f"q{i}",
                         ground_truth=str(i % 10), style="exact_boxed", data_source="t", uid=str(i))
            for i in range(n)]


def _cfg(n=4, group=4, algo=None, **async_kw) -> RunConfig:
    return RunConfig(rollout=RolloutConfig(rollout_batch_size=n, group_size=group, temperature=1.0,
                                           timeout_s=5.0, async_=AsyncConfig(**async_kw)),
                     trainer=TrainerConfig(seed=11), algo=algo or AlgoConfig(filter_zero_variance_groups=True))


def _sample(prompt, seed, child, version, p_correct=0.5):
    """A deterministic response: a function of (prompt, seed, child, weights)."""
    r = random.Random(f"{tuple(prompt)}:{seed}:{child}:{version}")
    answer = prompt[2] - 3 if r.random() < p_correct else 99
    k = r.randint(2, 6)
    return [r.randint(5, 50) for _ in range(k)], [-r.random() for _ in range(k)], f"\\boxed{{{answer % 10 if answer != 99 else 99}}}"


class FakeEngine(RolloutEngine):
    """Whole-list generation (like the in-process or remote engine); records what it was asked."""

    def __init__(self, p_correct=0.5):
        self.weight_version = 0
        self.log: list = []
        self.p_correct = p_correct

    def generate(self, prompt_ids, sampling):
        self.log.append(("generate", self.weight_version, [sampling.prompt_seed(i) for i in range(len(prompt_ids))]))
        out = []
        for i, p in enumerate(prompt_ids):
            group = []
            for c in range(sampling.n):
                ids, lps, text = _sample(p, sampling.prompt_seed(i), c, self.weight_version, self.p_correct)
                group.append(Completion(token_ids=ids, logprobs=lps, text=text, finish_reason="stop",
                                        truncated=False, weight_version=self.weight_version))
            out.append(group)
        return out

    def update_weights(self, named_tensors, version):
        self.log.append(("update", version))
        self.weight_version = version
        return {}

    def reset_prefix_cache(self):
        pass


class FakeStream(GroupStream):
    """A streaming engine: groups with ``slow(index)`` finish only after ``hold`` weight updates
    (their tokens then span every version in between); the others finish at once."""

    keeps_in_flight = True
    can_abort = True

    def __init__(self, slow=lambda index: index % 3 == 2, hold=1):
        self.weight_version = 0
        self.slow, self.hold = slow, hold
        self.held: list = []  # [tag, prompt, seed, n, start_version, updates_left, on_done]
        self.aborted: list = []

    def _group(self, prompt, seed, n, versions):
        group = []
        for c in range(n):
            ids, lps, text = _sample(prompt, seed, c, versions[0])
            k = len(ids)
            bounds = [round(i * k / len(versions)) for i in range(len(versions) + 1)]
            spans = [(v, a, b) for v, a, b in zip(versions, bounds[:-1], bounds[1:]) if b > a]
            group.append(Completion(token_ids=ids, logprobs=lps, text=text, finish_reason="stop",
                                    truncated=False, weight_version=spans[0][0],
                                    version_spans=spans if len(spans) > 1 else []))
        return group

    def submit(self, prompt_ids, sampling, tags, on_done):
        now = []
        for i, (p, tag) in enumerate(zip(prompt_ids, tags)):
            if self.slow(tag[1]):
                self.held.append([tag, p, sampling.prompt_seed(i), sampling.n, self.weight_version, self.hold, on_done])
            else:
                now.append((tag, self._group(p, sampling.prompt_seed(i), sampling.n, [self.weight_version])))
        if now:
            on_done(now)

    def update_weights(self, named, version):
        self.weight_version = version
        still = []
        for h in self.held:
            h[5] -= 1
            if h[5] <= 0:
                tag, p, seed, n, v0, _, on_done = h
                on_done([(tag, self._group(p, seed, n, list(range(v0, version + 1))))])
            else:
                still.append(h)
        self.held = still

    def abort(self, tags):
        tags = set(tags)
        self.aborted += [h[0] for h in self.held if h[0] in tags]
        self.held = [h for h in self.held if h[0] not in tags]

    def busy_seconds(self):
        return 0.0

    def in_flight(self):
        return len(self.held)


def _scheduler(cfg, engine, records=None, step=0):
    records = records or _records()
    loader = PromptLoader(records, cfg.rollout.rollout_batch_size, seed=5)
    return RolloutScheduler(engine, loader, RewardManager(RewardConfig()), cfg.rollout, cfg.algo,
                            run_seed=cfg.trainer.seed, max_response_len=8, step=step), loader


def _run(sched, engine, steps, start=0, version=0):
    """The loop's calls in its order: rollout, (train), before_sync, sync, after_sync."""
    out = []
    for step in range(start, start + steps):
        ro, m = sched.next_rollout(step, 100 + step, version, timer)
        out.append((ro, m, version))
        version += 1
        sched.before_sync()
        engine.update_weights([], version)
        sched.after_sync()
    return out


def _same_rollout(a, b):
    assert [r.uid for r in a.records] == [r.uid for r in b.records]
    assert [c.token_ids for c in a.completions] == [c.token_ids for c in b.completions]
    assert [c.logprobs for c in a.completions] == [c.logprobs for c in b.completions]
    assert torch.equal(a.group_ids, b.group_ids) and torch.equal(a.rewards, b.rewards)
    assert torch.equal(a.truncated, b.truncated)


def test_async_off_is_todays_generate_and_score():
    """max_staleness=0: the same prompts, seeds, samples, one reward call and the same metrics as
    today's phases.generate + phases.score, step after step."""
    cfg = _cfg()
    eng_a, eng_b = FakeEngine(), FakeEngine()
    sched, _ = _scheduler(cfg, eng_a)
    ref_loader = PromptLoader(_records(), 4, seed=5)
    mgr = RewardManager(RewardConfig())
    for step, (ro, m, version) in enumerate(_run(sched, eng_a, 4)):
        ref = phases.generate(eng_b, ref_loader.next_batch(), cfg.rollout, 8, seed=phases.sampling_seed(11, 100 + step))
        ref_m = phases.score(mgr, ref)
        _same_rollout(ro, ref)
        assert {k: v for k, v in m.items() if k != "reward/time_s"} == \
               {k: v for k, v in ref_m.items() if k != "reward/time_s"}
        assert not any(k.startswith("async/") for k in m)  # no new metrics with async off
        eng_b.update_weights([], version + 1)
    assert eng_a.log == eng_b.log  # generate, update, generate, ...: nothing overlaps


def test_async_one_step_off_generates_next_wave_before_the_update_and_is_one_version_old():
    cfg = _cfg(max_staleness=1)
    eng = FakeEngine()
    sched, _ = _scheduler(cfg, eng)
    runs = _run(sched, eng, 5)
    # wave j+1 is generated (with the weights of before step j's update) before that update
    assert [e[0] for e in eng.log] == ["generate"] + ["generate", "update"] * 5
    assert [e[1] for e in eng.log if e[0] == "generate"] == [0, 0, 1, 2, 3, 4]
    for step, (ro, m, version) in enumerate(runs):
        stale = {version - c.weight_version for c in ro.completions}
        assert stale == ({0} if step == 0 else {1}), (step, stale)
        assert m["async/staleness_max"] == (0.0 if step == 0 else 1.0)
        assert m["async/staleness_1"] == (0.0 if step == 0 else 1.0)
        assert m["async/groups_trained"] == 4.0
    # the data order and seeds are the synchronous run's: only the weights that sampled differ
    sync_sched, _ = _scheduler(_cfg(), FakeEngine())
    sync_runs = _run(sync_sched, sync_sched.stream.engine, 5)
    for (a, _, _), (b, _, _) in zip(runs, sync_runs):
        assert [r.uid for r in a.records] == [r.uid for r in b.records]


def test_async_partial_rollout_with_oversample_takes_first_groups_and_bounds_staleness():
    """Oversample 50%: each wave has 6 prompts for 4 groups; indices 2, 5 are slow and finish only
    across a weight update (tokens of two versions). With max_staleness=2 the step after takes
    them; nothing trained on is older than 2 versions, and partial responses are counted."""
    cfg = _cfg(max_staleness=2, partial_rollout=True, oversample=0.5)
    eng = FakeStream(hold=1)
    sched, _ = _scheduler(cfg, eng)
    runs = _run(sched, eng, 5)
    seen_partial = False
    for step, (ro, m, version) in enumerate(runs):
        assert len(ro.completions) == 4 * 4
        for c in ro.completions:
            assert version - c.weight_version <= 2
            assert c.token_versions() == sorted(c.token_versions())
            seen_partial |= c.partial
        assert m["async/partial_frac"] == sum(c.partial for c in ro.completions) / 16
    assert seen_partial and any(m["async/partial_frac"] > 0 for _, m, _ in runs)
    # the first groups to finish were taken: step 0 took wave 0's four fast prompts (draws 0, 1, 3, 4)
    wave0 = PromptLoader(_records(), 4, seed=5).take(6)
    assert [r.uid for r in runs[0][0].records] == [str(wave0[i]) for i in (0, 1, 3, 4)]
    assert runs[0][1]["async/prompts_drawn"] == 12  # waves 0 and 1
    # with max_staleness=1 a leftover is hopeless one step later: aborted, counted
    cfg1 = _cfg(max_staleness=1, partial_rollout=True, oversample=0.5)
    eng1 = FakeStream(hold=2)
    sched1, _ = _scheduler(cfg1, eng1)
    runs1 = _run(sched1, eng1, 4)
    assert sum(m["async/groups_aborted"] for _, m, _ in runs1) == len(eng1.aborted) > 0
    for ro, m, version in runs1:
        assert all(version - c.weight_version <= 1 for c in ro.completions)


def test_async_dynamic_sampling_refills_until_every_group_has_variance_within_the_cap():
    # p_correct 0.15 with 4 samples: many all-wrong groups, which are dropped and replaced
    cfg = _cfg(n=4, group=4, dynamic_sampling=True, max_draw_factor=3.0)
    eng = FakeEngine(p_correct=0.15)
    sched, _ = _scheduler(cfg, eng, _records(200))
    for ro, m, _ in _run(sched, eng, 4):
        rewards = ro.rewards.view(-1, 4)
        var = rewards.std(dim=1) > 0
        trained = int(var.sum())
        assert m["async/groups_trained"] == trained
        assert m["async/groups_dropped_zero_variance"] == int((~var).sum())
        assert m["async/prompts_drawn"] == trained + int((~var).sum()) <= 12
        assert trained == 4 or m["async/prompts_drawn"] == 12  # full, or the cap was reached
    # the batch make_batch builds keeps exactly the groups with variance
    batch, fm = phases.make_batch(ro, cfg.algo)
    assert fm["filter/kept_groups"] == trained and fm["filter/zero_variance"] == m["async/groups_dropped_zero_variance"]


def test_async_checkpoint_mid_run_resumes_exactly():
    """State saved after step 2 (one wave generated, not trained on) + loader state: a new
    scheduler continues with exactly the uninterrupted run's rollouts."""
    cfg = _cfg(max_staleness=1)
    eng = FakeEngine()
    sched, loader = _scheduler(cfg, eng)
    whole = _run(sched, eng, 6)

    eng2 = FakeEngine()
    sched2, loader2 = _scheduler(cfg, eng2)
    _run(sched2, eng2, 3)
    state, loader_state = sched2.state_dict(), loader2.state_dict()
    assert len(state["groups"]) == 4 and all(g["completions"] for g in state["groups"])

    eng3 = FakeEngine()
    eng3.weight_version = 3  # the checkpoint's weights, re-synced into a fresh engine
    sched3, loader3 = _scheduler(cfg, eng3)
    loader3.load_state_dict(loader_state)
    sched3.load_state_dict(state, version=3, global_step=103, step=3)
    rest = _run(sched3, eng3, 3, start=3, version=3)
    for (a, ma, _), (b, mb, _) in zip(whole[3:], rest):
        _same_rollout(a, b)
        assert ma["async/staleness_max"] == mb["async/staleness_max"] == 1.0


def test_async_turned_on_at_a_resume_without_saved_rollouts_starts_at_that_step():
    """A checkpoint from a synchronous run (no rollouts saved) resumed with max_staleness=1: the
    first wave drawn is the resumed step's, with that step's seed and the loader's next prompts."""
    eng = FakeEngine()
    sched, loader = _scheduler(_cfg(max_staleness=1), eng, step=5)
    expected = PromptLoader(_records(), 4, seed=5).take(4)
    ro, _, _ = _run(sched, eng, 1, start=5)[0]
    assert [r.uid for r in ro.records] == [str(i) for i in expected]
    assert eng.log[0][2][0] == phases.sampling_seed(11, 105)  # step 5's seed (global step 105)
    assert sched.next_wave == 7  # waves 5 and 6 drawn, no more


def test_async_checkpoint_redraws_groups_in_flight_with_their_seeds():
    cfg = _cfg(max_staleness=1, partial_rollout=True, oversample=0.5)
    eng = FakeStream(hold=2)
    sched, loader = _scheduler(cfg, eng)
    _run(sched, eng, 2)
    state = sched.state_dict()
    pending = [g for g in state["groups"] if g["completions"] is None]
    assert pending, "the slow groups of the wave ahead are in flight at the step boundary"
    eng2 = FakeStream(hold=2)
    eng2.weight_version = 2
    sched2, loader2 = _scheduler(cfg, eng2)
    loader2.load_state_dict(loader.state_dict())
    sched2.load_state_dict(state, version=2, global_step=102, step=2)
    assert sorted(h[0] for h in eng2.held) == sorted((g["wave"], g["index"]) for g in pending)
    assert all(h[4] == 2 for h in eng2.held)  # redrawn at the checkpoint's weights
    assert {g.dispatch_version for g in sched2.in_flight.values()} == {2}
    ro, m, _ = _run(sched2, eng2, 1, start=2, version=2)[0]
    assert len(ro.completions) == 16


def test_async_group_older_than_max_staleness_is_dropped_and_counted():
    """A finished group restored from a checkpoint whose weights are now 2 versions behind is not
    trained on with max_staleness=1: dropped, counted, and the step is filled by the others."""
    cfg = _cfg(max_staleness=1, oversample=0.5, partial_rollout=True)
    eng = FakeStream(slow=lambda index: False)
    sched, loader = _scheduler(cfg, eng)
    _run(sched, eng, 1)  # wave 1 (6 groups) and wave 0's 2 spare ones, version 0, wait for step 1
    state = sched.state_dict()
    assert len(state["groups"]) == 8
    eng2 = FakeStream(slow=lambda index: False)
    eng2.weight_version = 2
    sched2, loader2 = _scheduler(cfg, eng2)
    loader2.load_state_dict(loader.state_dict())
    sched2.load_state_dict(state, version=2, global_step=101, step=1)
    ro, m, _ = _run(sched2, eng2, 1, start=1, version=2)[0]
    assert m["async/groups_dropped_stale"] == 8 and m["async/groups_trained"] == 0 and ro is None


def test_async_merged_reward_metrics_equal_one_call_over_the_union():
    mgr = RewardManager(RewardConfig())
    items = [phases.reward_item(r, f"\\boxed{{{i % 3}}}") for i, r in enumerate(_records(12))]
    whole = mgr.score(items, return_details=True)
    parts = [mgr.score(items[:5], return_details=True), mgr.score(items[5:], return_details=True)]
    merged = merge_reward_metrics([(m, d) for _, m, d in parts])
    for k, v in whole[1].items():
        if k != "reward/time_s":
            assert merged[k] == pytest.approx(v), k
    assert merge_reward_metrics([(whole[1], whole[2])]) == whole[1]


def test_async_config_refuses_what_it_cannot_do():
    from megatron_rl.config.base import ConfigError

    with pytest.raises(ConfigError, match="partial_rollout"):
        AsyncConfig(partial_rollout=True).validate()
    # the server fleet streams groups too (rollout.fleet_stream): partial rollouts and oversampling validate
    RolloutConfig(engine="vllm_server", placement="external", server_urls=["http://h:8000"],
                  async_=AsyncConfig(max_staleness=1, partial_rollout=True, oversample=0.5)).validate()
    with pytest.raises(ValueError, match="in flight"):
        _scheduler(_cfg(max_staleness=1, partial_rollout=True), FakeEngine())


def test_a_partial_sample_and_its_continuation_join_end_to_end_with_each_tokens_version():
    from megatron_rl.trainer.rollout_group import join_completions

    part = Completion(token_ids=[5, 6, 7], logprobs=[-0.1, -0.2, -0.3], text="abc", finish_reason="abort",
                      truncated=False, weight_version=3, engine="e0")
    rest = Completion(token_ids=[8, 9], logprobs=[-0.4, -0.5], text="de", finish_reason="stop", truncated=False,
                      weight_version=4, engine="e1")
    c = join_completions(part, rest)
    assert (c.token_ids, c.logprobs, c.text, c.finish_reason) == ([5, 6, 7, 8, 9], [-0.1, -0.2, -0.3, -0.4, -0.5],
                                                                  "abcde", "stop")
    assert c.token_versions() == [3, 3, 3, 4, 4] and c.weight_version == 3 and c.newest_version == 4 and c.partial
    # one version throughout: no spans; a partial that already spans two versions keeps them
    same = join_completions(part, Completion(**{**rest.__dict__, "weight_version": 3}))
    assert same.version_spans == [] and same.token_versions() == [3] * 5
    spanning = Completion(**{**part.__dict__, "version_spans": [(2, 0, 1), (3, 1, 3)]})
    assert join_completions(spanning, rest).token_versions() == [2, 3, 3, 4, 4]
    empty = Completion(**{**part.__dict__, "token_ids": [], "logprobs": [], "text": ""})
    assert join_completions(empty, rest).token_versions() == [4, 4]


def test_routing_replay_a_continued_sample_keeps_each_rows_first_computation():
    """MoE routes of a joined sample: the part's rows (prompt + its tokens - 1, computed when they were
    sampled), then the continuation's rows from the one that predicts its first token on (its prefill
    recomputed the part's positions: those rows are not taken)."""
    import numpy as np

    from megatron_rl.trainer.rollout_group import join_completions
    from megatron_rl.trainer.rollout_state import completion_dict, completion_from_dict

    prompt = 4
    part_rows = np.full((prompt + 3 - 1, 2, 2), 1, np.uint8)
    rest_rows = np.full((prompt + 3 + 2 - 1, 2, 2), 2, np.uint8)
    part = Completion(token_ids=[5, 6, 7], logprobs=[-0.1] * 3, text="abc", finish_reason="abort", truncated=False,
                      weight_version=3, routes=part_rows)
    rest = Completion(token_ids=[8, 9], logprobs=[-0.4] * 2, text="de", finish_reason="stop", truncated=False,
                      weight_version=4, routes=rest_rows)
    rows = join_completions(part, rest).routes
    assert rows.shape == (prompt + 5 - 1, 2, 2)
    assert (rows[:prompt + 2] == 1).all() and (rows[prompt + 2:] == 2).all()
    # stopped before any row came back: the continuation's, all of them
    assert (join_completions(Completion(**{**part.__dict__, "routes": None}), rest).routes == rest_rows).all()
    assert join_completions(part, Completion(**{**rest.__dict__, "routes": None})).routes is None
    # a checkpointed group keeps its routes (weights-only state)
    back = completion_from_dict(completion_dict(part))
    assert back.routes.dtype == np.uint8 and (back.routes == part_rows).all()


class _LateStream(FakeStream):
    """Every group answers ``delay`` s after it was submitted (a fleet re-sending a request whose
    engine timed out, or waiting for restarts); ``progress``: the stream reports its progress as now
    (it is working on it), else it reports none."""

    def __init__(self, delay, progress):
        super().__init__(slow=lambda index: False)
        self.delay, self.progress = delay, progress

    def submit(self, prompt_ids, sampling, tags, on_done):
        import threading

        groups = [(tag, self._group(p, sampling.prompt_seed(i), sampling.n, [self.weight_version]))
                  for i, (p, tag) in enumerate(zip(prompt_ids, tags))]
        threading.Timer(self.delay, on_done, args=(groups,)).start()

    def last_progress(self):
        import time

        return time.monotonic() if self.progress else None


@pytest.mark.parametrize("progress", [True, False])
def test_async_watchdog_counts_timeout_from_the_engines_last_progress(progress):
    """A wave that takes 2.5x rollout.timeout_s is waited for while the engine reports progress (a
    re-sent request, a revival) and times out, naming the key, when it reports none."""
    import dataclasses

    cfg = _cfg(max_staleness=1)
    cfg = dataclasses.replace(cfg, rollout=dataclasses.replace(cfg.rollout, timeout_s=0.4))
    eng = _LateStream(delay=1.0, progress=progress)
    sched, _ = _scheduler(cfg, eng)
    if progress:
        ro, _m = sched.next_rollout(0, 100, 0, timer)
        assert len(ro.records) == cfg.rollout.rollout_batch_size
    else:
        with pytest.raises(TimeoutError, match="rollout.timeout_s"):
            sched.next_rollout(0, 100, 0, timer)
    sched.close()


def test_stale_samples_without_an_off_policy_correction_get_a_warning_naming_the_measured_setting():
    """One-step-off without TIS / IcePop / the decoupled objective: nothing weighs a stale sample
    (the ratio against the recomputed old policy is 1 with one optimizer step), so the run warns."""
    stale = RolloutConfig(async_=AsyncConfig(max_staleness=1))
    advice = staleness_advice(stale, AlgoConfig())
    assert advice is not None and "rollout.async.max_staleness=1" in advice and "tis_token" in advice
    assert staleness_advice(RolloutConfig(), AlgoConfig()) is None  # synchronous: on-policy
    for algo in (AlgoConfig(mismatch=MismatchConfig(mode="tis_token")), AlgoConfig(mismatch=MismatchConfig(mode="icepop")),
                 AlgoConfig(policy_loss="decoupled_ppo")):
        assert staleness_advice(stale, algo) is None, algo
