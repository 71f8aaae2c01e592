"""Where a step's rollout comes from: one scheduler for the synchronous loop and asynchronous GRPO.

``rollout.async`` (:class:`~megatron_rl.rollout.config.AsyncConfig`) sets how far generation may
run ahead of training. Prompts are drawn in *waves*: wave ``j`` is step ``j``'s
``rollout_batch_size`` prompts (times ``1 + oversample``), sampled with step ``j``'s seed, so the
data order and the sampling seeds never depend on timing. Wave ``j`` is dispatched as soon as the
engine's weights are at most ``max_staleness`` versions behind what step ``j`` will train:

- ``max_staleness=0``: wave ``j`` is dispatched when step ``j`` asks for it, and waited for: today's
  loop, exactly (same prompts, seeds, one reward call).
- ``max_staleness>=1``: one-step-off. Wave ``j+1`` is generated while step ``j`` trains; before
  the weight sync the engine finishes it (or, with ``partial_rollout``, keeps it running across the
  update: its later tokens come from the new weights, and each token records its version). Waves
  are never dispatched more than one step ahead: staleness beyond 1 is slack for leftovers.

A step takes the first groups to finish among the waves up to its own; a group whose oldest token
is more than ``max_staleness`` versions behind the trainer is dropped (and counted); leftovers that
can no longer be trained on in time are aborted. With ``dynamic_sampling``, groups without reward
variance are dropped (counted) and replaced by new draws, up to ``max_draw_factor`` waves' worth.

Rewards are scored on the trainer's thread when a step collects its groups; generation runs on the
engine's thread (:mod:`megatron_rl.rollout.streaming`). A step's groups are trained in the order of
their draws (wave, then index), whatever order they finished in, so a resumed run trains the same
batches as an uninterrupted one.

Everything not yet trained on is saved with the checkpoint: finished groups in full; on a stop
request mid-generation (preemption: SIGUSR1 / SIGTERM) the step is given up (:class:`Interrupted`)
and what it generated so far is kept: its finished groups, and, where the engine can stop requests
with what they generated (vLLM servers: ``/pause?mode=abort``), partial responses with their tokens,
log-probs and weight versions, which a resumed run continues (prompt + partial tokens, the rest of
the length, the sample's own seed) instead of starting over. Groups with nothing generated are
redrawn on resume from the same prompts and seeds, at the checkpoint's weights.
"""

from __future__ import annotations

import json
import logging
import queue
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

from megatron_rl.algo import AlgoConfig, filter_groups
from megatron_rl.data import PromptLoader
from megatron_rl.rewards import RewardManager
from megatron_rl.rollout import Completion, RolloutConfig, RolloutEngine, SamplingSpec, group_stream
from megatron_rl.rollout.streaming import BackgroundGenerate, GroupStream
from megatron_rl.trainer.config import StageConfig
from megatron_rl.trainer.context import Context
from megatron_rl.trainer.phases import Rollout, answer_text, reward_item, sampling_seed
from megatron_rl.trainer.state import TrainerState

log = logging.getLogger("megatron_rl")

STATE_FILE = "rollouts.pt"


class Interrupted(Exception):
    """A stop was requested while a step waited for its groups: the step is given up (nothing is
    trained), what was generated stays in the scheduler for the checkpoint."""
# RUN_DIR/async_samples.jsonl: per step, the prompts trained on (their uids, in training order) and the
# weight versions of every response.
SAMPLE_LOG = "async_samples.jsonl"


def staleness_advice(rollout: RolloutConfig, algo: AlgoConfig) -> str | None:
    """A warning for a run that trains on stale samples without an off-policy correction (None: no
    advice). With one optimizer step per rollout the PPO ratio against the recomputed old policy is
    1, so only TIS / IcePop (``algo.mismatch.mode``) or the decoupled objective weigh a sample by
    how far the weights that sampled it are from the ones being updated."""
    stale = rollout.async_.max_staleness
    if stale < 1 or algo.mismatch.mode != "none" or algo.policy_loss == "decoupled_ppo":
        return None
    return (f"rollout.async.max_staleness={stale} trains on samples up to {stale} weight "
            f"version(s) old with algo.mismatch.mode='none' and "
            f"algo.policy_loss={algo.policy_loss!r}: nothing corrects for the staleness. The "
            f"measured one-step-off setting is algo.mismatch.mode=tis_token with half the "
            f"synchronous run's learning rate (README, asynchronous rollouts)")


def open_rollouts(ctx: Context, stage: StageConfig, state: TrainerState,
                  loader: PromptLoader | None) -> RolloutScheduler | None:
    """The driver's scheduler for ``stage``, with what the checkpoint it resumes from saved."""
    if not ctx.is_driver:
        return None
    cfg = ctx.cfg
    advice = staleness_advice(cfg.rollout, cfg.algo)
    if advice:
        log.warning("stage %s: %s", stage.name, advice)
    rollouts = RolloutScheduler(ctx.engine, loader, ctx.reward_mgr, cfg.rollout, cfg.algo,
                                run_seed=cfg.trainer.seed, max_response_len=stage.max_response_len,
                                step=state.step, sample_log=ctx.run.root / SAMPLE_LOG, stage=stage.name,
                                envs=ctx.envs)
    if rollouts.restore(ctx.run.latest_step_checkpoint(stage.name), state.weight_version,
                        state.global_step, state.step):
        log.info("stage %s: %d groups generated before the checkpoint kept, %d partial ones continued, %d "
                 "redrawn", stage.name, len(rollouts.done), len(rollouts.continuing_groups()),
                 len(rollouts.in_flight) - len(rollouts.continuing_groups()))
    return rollouts


@dataclass
class Group:
    """One prompt's ``group_size`` samples, from dispatch to training."""

    wave: int  # the step the prompt was drawn for
    index: int  # its position among that step's draws (its seed offset)
    record: int  # index into the loader's records
    dispatch_version: int  # the engine's weights when it was dispatched
    completions: list[Completion] | None = None
    rewards: list[float] | None = None
    # The verifier's verdict per completion ({"status", "extracted", ...}): the rollout dumps' answers.
    outcomes: list[dict] | None = None

    @property
    def tag(self) -> tuple[int, int]:
        return (self.wave, self.index)

    @property
    def version(self) -> int:
        """Its oldest token's weight version."""
        return min(c.weight_version for c in self.completions) if self.completions else self.dispatch_version

    @property
    def partial(self) -> bool:
        """Some of its samples were stopped part-way (finish reason ``abort``): to be continued."""
        return bool(self.completions) and any(c.finish_reason == "abort" for c in self.completions)


@dataclass
class _Step:
    """What one step's collection saw (its metrics)."""

    reward_calls: list[tuple[dict, list[dict]]] = field(default_factory=list)
    generated: int = 0  # groups of this step's waves that finished (and were scored)
    dropped_stale: int = 0
    dropped_zero_variance: int = 0
    aborted: int = 0
    drawn: int = 0
    wait_s: float = 0.0


def merge_reward_metrics(calls: list[tuple[dict, list[dict]]]) -> dict:
    """One step's reward metrics from several reward calls: counts add up, means are recomputed
    from the per-sample details (one call: its metrics unchanged)."""
    if len(calls) == 1:
        return dict(calls[0][0])
    out: dict = {}
    for metrics, _ in calls:
        for k, v in metrics.items():
            out[k] = out.get(k, 0.0) + v
    details = [d for _, ds in calls for d in ds]
    out["reward/mean"] = sum(d["score"] for d in details) / max(len(details), 1)
    for style in {d["style"] for d in details}:
        vals = [d["score"] for d in details if d["style"] == style]
        out[f"reward/{style}/mean"] = sum(vals) / len(vals)
    return out


class RolloutScheduler:
    """The driver's source of rollouts for one stage (see the module docstring)."""

    def __init__(self, engine: RolloutEngine, loader: PromptLoader, reward_mgr: RewardManager,
                 r: RolloutConfig, algo: AlgoConfig, *, run_seed: int, max_response_len: int,
                 step: int = 0, sample_log: Path | None = None, stage: str = "", envs=None):
        """``step``: the stage's next step (its wave is the first to draw). ``sample_log``: a JSONL
        file that gets, per step with rollout.async on, the weight versions (oldest, newest token)
        of every response trained on. ``envs``: the run's environments
        (:class:`~megatron_rl.envs.Environments`; prompts with one are sampled as multi-turn
        trajectories)."""
        self.r, self.algo, self.run_seed = r, algo, run_seed
        self.sample_log, self.stage = sample_log, stage
        self.acfg = r.async_
        self.loader = loader
        self.reward_mgr = reward_mgr
        self.max_response_len = max_response_len
        self.stream: GroupStream = group_stream(engine, self.acfg.needs_streaming)
        if self.acfg.needs_streaming and not (self.stream.keeps_in_flight and self.stream.can_abort):
            raise ValueError(f"rollout.async: partial_rollout / oversample need an engine that loads weights "
                             f"with requests in flight; {type(engine).__name__} cannot")
        # How long a group may take: one request; a multi-turn trajectory is up to max_turns requests and
        # environment steps, each bounded by rollout.timeout_s.
        self.group_timeout_s = r.timeout_s
        if envs is not None:  # multi-turn trajectories for the prompts with an environment
            from megatron_rl.rollout.multi_turn import MultiTurnStream

            self.stream = MultiTurnStream(self.stream, envs, record_of=self._record_of)
            self.group_timeout_s = 2 * envs.max_turns * r.timeout_s
        self.n = r.rollout_batch_size
        self.per_wave = self.n + round(self.n * self.acfg.oversample)
        self.next_wave = step  # the first wave not dispatched yet
        self.drawn: dict[int, int] = {}  # wave -> prompts drawn for it so far
        self.in_flight: dict[tuple[int, int], Group] = {}
        # (wave, index, sample) -> the partial group a continued sample belongs to (in flight too)
        self._continuing: dict[tuple[int, int, int], Group] = {}
        self._partial: list[Group] = []  # stopped part-way by interrupt(): kept for the checkpoint
        self._interrupting = False
        self._wave_steps: dict[int, int] = {}  # wave -> the global step its seeds come from
        self.done: list[Group] = []  # finished, not scored yet (arrival order)
        self.ready: list[Group] = []  # finished and scored, not trained on (arrival order)
        self._inbox: queue.Queue = queue.Queue()
        self._step = _Step()
        self._busy_mark = self.stream.busy_seconds()
        self._time_mark = time.perf_counter()

    # -- the loop's calls -------------------------------------------------------------------------
    def next_rollout(self, step: int, global_step: int, version: int, timer,
                     stop=None) -> tuple[Rollout | None, dict]:
        """Step ``step``'s groups (``version``: the trainer's weights) and the collection's metrics.
        ``stop()`` (polled while waiting for groups) true: raises :class:`Interrupted` after stopping
        what is generating (see :meth:`interrupt`), the step's groups kept for the checkpoint."""
        s = self.acfg.max_staleness
        self._step = st = _Step()
        self._dispatch_ahead(step, global_step, version)
        taken: list[Group] = []
        resolved: list[Group] = []  # taken + dropped for zero variance, in arrival order
        while True:
            self._receive(block=False)
            mine = [g for g in self.done if g.wave <= step]  # later waves are scored in their step
            if mine:
                with timer("reward"):
                    self._score(mine)
                self.done = [g for g in self.done if g.wave > step]
                self.ready.extend(mine)
            for g in [g for g in self.ready if g.wave <= step]:
                if len(taken) == self.n:
                    break
                self.ready.remove(g)
                if version - g.version > s:
                    st.dropped_stale += 1
                elif self.acfg.dynamic_sampling and not self._has_variance(g):
                    st.dropped_zero_variance += 1
                    resolved.append(g)
                else:
                    taken.append(g)
                    resolved.append(g)
            if len(taken) == self.n:
                break
            if not any(g.wave <= step for g in self.in_flight.values()):
                missing = self.n - len(taken)
                cap = round(self.acfg.max_draw_factor * self.n)
                room = cap - self.drawn.get(step, 0)
                if not self.acfg.dynamic_sampling or room <= 0:
                    break  # train on what there is
                self._dispatch(step, global_step, version, min(room, missing))
            with timer("gen"):
                t0 = time.perf_counter()
                stopped = not self._receive(block=True, stop=stop)
                st.wait_s += time.perf_counter() - t0
            if stopped:
                self.ready[:0] = resolved  # not trained: back in their place, for the checkpoint
                self.interrupt()
                raise Interrupted(f"stop requested while step {step} was generating")
        self._drop_hopeless(step, version)
        metrics = merge_reward_metrics(st.reward_calls) if st.reward_calls else {}
        if self.acfg.enabled:
            metrics.update(self._metrics(taken, version))
            self._log_versions(step, global_step, version, taken)
        if not resolved:
            return None, metrics
        return self._as_rollout(sorted(resolved, key=lambda g: g.tag)), metrics

    def interrupt(self, timeout_s: float | None = None) -> None:
        """Stop generating, keeping what was generated: an engine that can (vLLM servers) answers
        every request at once with the tokens it has (partial responses, finish reason ``abort``);
        they are collected, up to ``timeout_s`` (``rollout.control_timeout_s``)."""
        self._interrupting = True
        if not self.stream.stop_with_partials():
            return
        # the servers answer at once; a request that was still waiting for room never will (it
        # queues on a paused server): saved to redraw
        deadline = time.monotonic() + (self.r.control_timeout_s if timeout_s is None else timeout_s)
        quiet_since, left = time.monotonic(), len(self.in_flight)
        while self.in_flight and time.monotonic() < deadline and time.monotonic() - quiet_since < 1.0:
            self._receive(block=False)
            if len(self.in_flight) < left:
                quiet_since, left = time.monotonic(), len(self.in_flight)
            time.sleep(0.02)

    def before_sync(self) -> dict:
        """Before a weight update: without partial rollouts, the requests in flight finish first;
        with them, they are frozen (servers: paused in mode keep) until :meth:`after_sync`."""
        report = {"async/sync_wait_s": 0.0} if self.acfg.enabled else {}
        if self.acfg.partial_rollout:
            self.stream.before_weight_update()
            return report
        if not self.stream.in_flight():
            return report
        t0 = time.perf_counter()
        deadline = time.monotonic() + self.group_timeout_s
        while self.stream.in_flight():
            deadline = self._extended(deadline)
            if time.monotonic() > deadline:
                raise TimeoutError(f"rollout.async: requests in flight did not finish within "
                                   f"{self.group_timeout_s:g}s (rollout.timeout_s={self.r.timeout_s}s per request) "
                                   f"nor rollout.timeout_s after the engine's last progress "
                                   f"before a weight update")
            time.sleep(0.005)
        return {k: time.perf_counter() - t0 for k in report}

    def _extended(self, deadline: float) -> float:
        """A watchdog's deadline (``time.monotonic()``) moved to ``rollout.timeout_s`` after the
        engine's last progress when that is later (see ``GroupStream.last_progress``)."""
        progress = self.stream.last_progress()
        return deadline if progress is None else max(deadline, progress + self.r.timeout_s)

    def after_sync(self) -> None:
        """After a weight update: partial rollouts continue, their later tokens from the new weights."""
        if self.acfg.partial_rollout:
            self.stream.after_weight_update()

    def continuing_groups(self) -> list[Group]:
        """Groups whose partial samples are being continued."""
        return list({id(g): g for g in self._continuing.values()}.values())

    def close(self) -> None:
        """End of the stage: stop what is in flight (or let it finish) and forget the leftovers."""
        if self.in_flight and self.stream.can_abort:
            self.stream.abort([t for tag in self.in_flight for t in self._stream_tags(tag)])
        elif self.in_flight:
            self.before_sync()
        inner = getattr(self.stream, "inner", None)
        if inner is not None:  # the multi-turn loop over the engine's stream
            self.stream.close()
        if isinstance(inner or self.stream, BackgroundGenerate):
            (inner or self.stream).close()
        self.in_flight.clear()
        self._continuing.clear()
        self.done, self.ready = [], []

    # -- checkpoint -------------------------------------------------------------------------------
    def state_dict(self) -> dict:
        """Everything not trained on yet: finished groups and partial ones (their samples so far)
        in full; groups still generating with nothing kept as (prompt, seed), redrawn on resume."""
        self._receive(block=False)
        groups = []
        kept = self.ready + self.done + self._partial + self.continuing_groups()
        for g in kept + [g for g in self.in_flight.values() if g.completions is None]:
            groups.append({"wave": g.wave, "index": g.index, "record": g.record,
                           "dispatch_version": g.dispatch_version,
                           "completions": None if g.completions is None else
                           [_completion_dict(c) for c in g.completions]})
        return {"next_wave": self.next_wave, "drawn": dict(self.drawn), "groups": groups}

    def load_state_dict(self, state: dict, version: int, global_step: int, step: int) -> None:
        groups = [d for d in state["groups"]
                  if self.acfg.max_staleness > 0 or _fresh(d, version, step)]
        if len(groups) < len(state["groups"]):  # generated ahead (async), now too old to train on
            log.warning("rollouts: the checkpoint holds %d groups generated ahead, but rollout.async."
                        "max_staleness is 0 now: dropped (their prompts are skipped)",
                        len(state["groups"]) - len(groups))
            if not groups:
                self.next_wave = step
                return
        self.next_wave = int(state["next_wave"])
        self.drawn = {int(k): int(v) for k, v in state["drawn"].items()}
        redraw: dict[int, list[Group]] = {}
        for d in groups:
            g = Group(wave=d["wave"], index=d["index"], record=d["record"], dispatch_version=d["dispatch_version"])
            if d["completions"] is None:
                g.dispatch_version = version
                redraw.setdefault(g.wave, []).append(g)
                continue
            g.completions = [_completion_from_dict(c) for c in d["completions"]]
            if g.partial:
                self._continue(g, global_step + (g.wave - step))
            else:
                self.done.append(g)
        for wave, gs in sorted(redraw.items()):
            self._submit(wave, global_step + (wave - step), gs)

    def save(self, ckpt) -> None:
        state = self.state_dict()
        torch.save(state, ckpt / STATE_FILE)
        kept = [d for d in state["groups"] if d["completions"] is not None]
        partial = sum(c["finish_reason"] == "abort" for d in kept for c in d["completions"])
        log.info("rollouts saved with the checkpoint: %d groups generated and not trained on (%d partial "
                 "responses among them, continued on resume), %d to redraw", len(kept), partial,
                 len(state["groups"]) - len(kept))

    def restore(self, ckpt, version: int, global_step: int, step: int) -> bool:
        path = None if ckpt is None else ckpt / STATE_FILE
        if path is None or not path.exists():
            return False
        self.load_state_dict(torch.load(path, weights_only=True), version, global_step, step)
        return True

    # -- internals --------------------------------------------------------------------------------
    def _dispatch_ahead(self, step: int, global_step: int, version: int) -> None:
        """Waves up to one step ahead (none with max_staleness 0). Staleness beyond 1 is the slack
        that leftovers (oversampled groups, the long tail) may use in later steps."""
        while self.next_wave <= step + min(self.acfg.max_staleness, 1):
            wave = self.next_wave
            self._dispatch(wave, global_step + (wave - step), version, self.per_wave - self.drawn.get(wave, 0))
            self.next_wave += 1

    def _dispatch(self, wave: int, global_step: int, version: int, count: int) -> None:
        if count <= 0:
            return
        first = self.drawn.get(wave, 0)
        records = self.loader.take(count)
        self.drawn[wave] = first + count
        self._step.drawn += count
        groups = [Group(wave=wave, index=first + i, record=r, dispatch_version=version) for i, r in enumerate(records)]
        self._submit(wave, global_step, groups)

    def _submit(self, wave: int, global_step: int, groups: list[Group]) -> None:
        """Groups of one wave; consecutive indices go in one call (prompt i seeded base + index)."""
        r = self.r
        self._wave_steps[wave] = global_step
        base = sampling_seed(self.run_seed, global_step)
        runs: list[list[Group]] = []
        for g in sorted(groups, key=lambda g: g.index):
            if runs and runs[-1][-1].index + 1 == g.index:
                runs[-1].append(g)
            else:
                runs.append([g])
        for run in runs:
            spec = SamplingSpec(n=r.group_size, temperature=r.temperature, top_p=r.top_p, top_k=r.top_k,
                                max_tokens=self.max_response_len, seed=base + run[0].index)
            for g in run:
                self.in_flight[g.tag] = g
            self.stream.submit([self.loader.records[g.record].prompt_ids for g in run], spec,
                               [g.tag for g in run], self._inbox.put)

    def _record_of(self, tag):
        """The record a submitted prompt comes from (the multi-turn loop resolves its environment);
        a continued sample's tag is its group's + the sample."""
        return self.loader.records[self.in_flight[tag[:2]].record]

    def _continue(self, g: Group, global_step: int) -> None:
        """Continue a partial group's stopped samples: each one alone (n=1), its prompt followed by
        the tokens it has, the rest of the length, the sample's own seed (base + index + j)."""
        r = self.r
        self._wave_steps[g.wave] = global_step
        base = sampling_seed(self.run_seed, global_step) + g.index
        prompt = self.loader.records[g.record].prompt_ids
        self.in_flight[g.tag] = g
        for j, c in enumerate(g.completions):
            left = self.max_response_len - len(c.token_ids)
            if c.finish_reason != "abort" or left <= 0:
                continue
            spec = SamplingSpec(n=1, temperature=r.temperature, top_p=r.top_p, top_k=r.top_k, max_tokens=left,
                                seed=(base + j) % (2**31 - 1))
            tag = (g.wave, g.index, j)
            self._continuing[tag] = g
            self.stream.submit([list(prompt) + list(c.token_ids)], spec, [tag], self._inbox.put)
        if not any(t[:2] == g.tag for t in self._continuing):  # nothing left to generate
            for c in g.completions:
                if c.finish_reason == "abort":
                    c.finish_reason, c.truncated = "length", True
            self.in_flight.pop(g.tag)
            self.done.append(g)

    def _receive(self, block: bool, stop=None) -> bool:
        """Move delivered groups from the engine's thread into ``done`` (arrival order); a
        continued sample is joined to its partial group first. Blocking: until something arrives
        (within ``rollout.timeout_s``, multi-turn: a trajectory's turns and steps; extended to
        ``rollout.timeout_s`` after the engine's last progress: a request re-sent after its engine timed
        out, a fleet waiting for restarts, a tool running within its own timeout is not a hang), or
        until ``stop()`` is true (returns False)."""
        timeout = self.group_timeout_s
        deadline = time.monotonic() + timeout
        while True:
            if block and stop is not None and stop():
                return False
            try:
                wait = min(0.25, max(0.0, deadline - time.monotonic())) if stop is not None else timeout
                batch = self._inbox.get(block=block, timeout=wait if block else None)
            except queue.Empty:
                if not block:
                    return True
                deadline = self._extended(deadline)
                if time.monotonic() >= deadline:
                    raise TimeoutError(f"rollout.async: no group finished within {timeout:g}s (rollout.timeout_s="
                                       f"{self.r.timeout_s:g}s per request) nor rollout.timeout_s after the "
                                       f"engine's last progress")
                continue
            block = False
            for tag, result in batch:
                if isinstance(result, BaseException) and (tag in self.in_flight or tag in self._continuing):
                    if self._interrupting:  # stopping anyway: left to redraw (or continue) on resume
                        continue
                    raise RuntimeError(f"rollout engine failed on prompt {tag}: {result}") from result
                if tag in self._continuing:
                    self._joined(tag, result[0])
                    continue
                g = self.in_flight.get(tag)
                if g is None:  # aborted meanwhile
                    continue
                g.completions = result
                self.in_flight.pop(tag)
                if not g.partial:
                    self.done.append(g)
                elif self._interrupting:  # stopped part-way: kept for the checkpoint as it is
                    self._partial.append(g)
                else:  # stopped by something else: the rest of it is generated now
                    self._continue(g, self._wave_steps[g.wave])

    def _stream_tags(self, tag: tuple) -> list[tuple]:
        """The tags a group's requests carry on the stream: its own, or its continued samples'."""
        return [t for t in self._continuing if t[:2] == tag] or [tag]

    def _joined(self, tag: tuple, rest: Completion) -> None:
        g = self._continuing.pop(tag)
        j = tag[2]
        g.completions[j] = join_completions(g.completions[j], rest)
        if not any(t[:2] == g.tag for t in self._continuing):
            self.in_flight.pop(g.tag, None)
            self.done.append(g)

    def _score(self, groups: list[Group]) -> None:
        records = self.loader.records
        items = [reward_item(records[g.record], answer_text(c)) for g in groups for c in g.completions]
        scores, metrics, details = self.reward_mgr.score(items, return_details=True)
        self._step.reward_calls.append((metrics, details))
        self._step.generated += len(groups)
        k = 0
        for g in groups:
            g.rewards = scores[k: k + len(g.completions)]
            g.outcomes = details[k: k + len(g.completions)]
            k += len(g.completions)

    def _has_variance(self, g: Group) -> bool:
        rewards = torch.tensor(g.rewards, dtype=torch.float32)
        keep, _ = filter_groups(rewards, torch.zeros(len(g.rewards), dtype=torch.long), self.algo)
        return bool(keep.all())

    def _drop_hopeless(self, step: int, version: int) -> None:
        """Leftovers of this step's waves that will be too old by the next step: stop / forget."""
        s = self.acfg.max_staleness
        for g in [g for g in self.ready if g.wave <= step and version + 1 - g.version > s]:
            self.ready.remove(g)
            self._step.dropped_stale += 1
        hopeless = [t for t, g in self.in_flight.items() if g.wave <= step and version + 1 - g.dispatch_version > s]
        if hopeless and self.stream.can_abort:
            self.stream.abort([t for tag in hopeless for t in self._stream_tags(tag)])
            for t in hopeless:
                self.in_flight.pop(t)
                for c in [c for c in self._continuing if c[:2] == t]:
                    del self._continuing[c]
            self._step.aborted += len(hopeless)

    def _as_rollout(self, groups: list[Group]) -> Rollout:
        records = [self.loader.records[g.record] for g in groups]
        flat = [c for g in groups for c in g.completions]
        gids = torch.tensor([i for i, g in enumerate(groups) for _ in g.completions], dtype=torch.long)
        return Rollout(records=records, completions=flat, group_ids=gids,
                       rewards=torch.tensor([r for g in groups for r in g.rewards], dtype=torch.float32),
                       truncated=torch.tensor([c.truncated for c in flat], dtype=torch.bool),
                       outcomes=[o for g in groups for o in (g.outcomes or [{}] * len(g.completions))])

    def _log_versions(self, step: int, global_step: int, version: int, taken: list[Group]) -> None:
        if self.sample_log is None:
            return
        taken = sorted(taken, key=lambda g: g.tag)  # (the order they are trained in)
        row = {"stage": self.stage, "step": global_step + 1, "stage_step": step, "trainer_version": version,
               "prompts": [self.loader.records[g.record].uid for g in taken],
               "versions": [[c.weight_version, c.newest_version] for g in taken for c in g.completions]}
        with open(self.sample_log, "a") as f:
            f.write(json.dumps(row) + "\n")

    def _metrics(self, taken: list[Group], version: int) -> dict:
        st = self._step
        s = self.acfg.max_staleness
        comps = [c for g in taken for c in g.completions]
        stale = [version - c.weight_version for c in comps]
        now, busy = time.perf_counter(), self.stream.busy_seconds()
        window, busy_delta = now - self._time_mark, busy - self._busy_mark
        self._time_mark, self._busy_mark = now, busy
        m = {
            "async/staleness_mean": sum(stale) / max(len(stale), 1),
            "async/staleness_max": float(max(stale, default=0)),
            "async/partial_frac": sum(c.partial for c in comps) / max(len(comps), 1),
            "async/groups_generated": float(st.generated),
            "async/groups_trained": float(len(taken)),
            "async/groups_dropped_stale": float(st.dropped_stale),
            "async/groups_dropped_zero_variance": float(st.dropped_zero_variance),
            "async/groups_aborted": float(st.aborted),
            "async/prompts_drawn": float(st.drawn),
            "async/groups_in_flight": float(len(self.in_flight)),
            "async/groups_buffered": float(len(self.ready) + len(self.done)),
            "async/trainer_wait_s": st.wait_s,
            "async/engine_idle_s": max(0.0, window - busy_delta),
        }
        for d in range(s + 1):
            m[f"async/staleness_{d}"] = sum(x == d for x in stale) / max(len(stale), 1)
        return m


def _fresh(d: dict, version: int, step: int) -> bool:
    """A saved group that a synchronous run (max_staleness 0) may still train on: its own step's
    (drawn for ``step`` or later), generated (if at all) by the current weights."""
    if d["wave"] < step:
        return False
    return d["completions"] is None or all(c["weight_version"] == version for c in d["completions"])


def join_completions(part: Completion, rest: Completion) -> Completion:
    """A sample stopped part-way (``part``) and its continuation (``rest``, sampled from the prompt
    followed by ``part``'s tokens) as one completion: tokens, log-probs, text, and each token's
    weight version (spans) end to end; finish reason and truncation are the continuation's."""
    n = len(part.token_ids)
    spans = [(v, a, b) for v, a, b in (part.version_spans or [(part.weight_version, 0, n)]) if b > a]
    for v, a, b in rest.version_spans or [(rest.weight_version, 0, len(rest.token_ids))]:
        if b <= a:
            continue
        if spans and spans[-1][0] == v and spans[-1][2] == a + n:
            spans[-1] = (v, spans[-1][1], b + n)
        else:
            spans.append((v, a + n, b + n))
    versions = {v for v, _, _ in spans}
    return Completion(token_ids=list(part.token_ids) + list(rest.token_ids),
                      logprobs=list(part.logprobs) + list(rest.logprobs), text=part.text + rest.text,
                      finish_reason=rest.finish_reason, truncated=rest.truncated,
                      weight_version=spans[0][0] if spans else rest.weight_version,
                      version_spans=spans if len(versions) > 1 else [], engine=rest.engine,
                      extra={**part.extra, **rest.extra}, routes=_join_routes(part, rest))


def _join_routes(part: Completion, rest: Completion):
    """MoE routes of a joined sample: each row from the forward that sampled with it first. ``rest``
    (prompt + ``part``'s tokens) recomputed every position; the rows that predicted ``part``'s tokens
    (all of ``part``'s rows) keep their own, the continuation's rows follow."""
    if rest.routes is None:
        return None
    if part.routes is None:  # stopped before any row came back: the continuation computed them all
        return rest.routes
    import numpy as np

    return np.concatenate([part.routes, rest.routes[len(part.routes):]])


def _completion_dict(c: Completion) -> dict:
    return {"token_ids": list(c.token_ids), "logprobs": list(c.logprobs), "text": c.text,
            "finish_reason": c.finish_reason, "truncated": bool(c.truncated),
            "weight_version": int(c.weight_version), "version_spans": [list(s) for s in c.version_spans],
            "loss_mask": list(c.loss_mask), "extra": dict(c.extra),
            # MoE routing replay: the engine's routes (a tensor: the state is loaded weights-only)
            "routes": None if c.routes is None else torch.from_numpy(c.routes)}


def _completion_from_dict(d: dict) -> Completion:
    routes = d.get("routes")
    return Completion(**{**d, "version_spans": [tuple(x) for x in d["version_spans"]],
                         "routes": None if routes is None else routes.numpy()})
