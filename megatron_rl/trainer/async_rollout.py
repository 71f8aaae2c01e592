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

The parts: :mod:`~megatron_rl.trainer.rollout_group` (a group, a continued sample joined),
:mod:`~megatron_rl.trainer.rollout_flight` (the groups out on the stream and what comes back),
:mod:`~megatron_rl.trainer.rollout_state` (what the checkpoint keeps),
:mod:`~megatron_rl.trainer.rollout_metrics` (``async/*`` metrics, the sample log).

Owns: the waves (which prompts are drawn for which step), the groups finished and scored, which
groups a step takes, and the stage's stream.
May call: the parts above, the prompt loader, the reward manager, ``algo.filter_groups``, the
rollout package's streams (:func:`~megatron_rl.rollout.group_stream`, the multi-turn stream).
"""

from __future__ import annotations

import logging
import time
from pathlib import Path

from megatron_rl.algo import AlgoConfig
from megatron_rl.data import PromptLoader
from megatron_rl.rewards import RewardManager
from megatron_rl.rollout import RolloutConfig, RolloutEngine, group_stream
from megatron_rl.rollout.streaming import BackgroundGenerate, GroupStream
from megatron_rl.trainer import rollout_state
from megatron_rl.trainer.config import StageConfig
from megatron_rl.trainer.context import Context
from megatron_rl.trainer.phases import Rollout, answer_text, reward_item
from megatron_rl.trainer.rollout_flight import GroupsInFlight
from megatron_rl.trainer.rollout_group import Group, as_rollout, has_variance
from megatron_rl.trainer.rollout_metrics import SAMPLE_LOG, StepTally, async_metrics, log_versions, merge_reward_metrics
from megatron_rl.trainer.state import TrainerState

log = logging.getLogger("megatron_rl")


class Interrupted(Exception):
    """A stop was requested while a step waited for its groups: the step is given up (nothing is
    trained), what was generated stays in the scheduler for the checkpoint."""


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
                 "redrawn", stage.name, len(rollouts.flight.done), len(rollouts.continuing_groups()),
                 len(rollouts.in_flight) - len(rollouts.continuing_groups()))
    return rollouts


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
        self.flight = GroupsInFlight(loader, r, run_seed=run_seed, max_response_len=max_response_len)
        self.stream: GroupStream = group_stream(engine, self.acfg.needs_streaming)
        if self.acfg.needs_streaming and not (self.stream.keeps_in_flight and self.stream.can_abort):
            raise ValueError(f"rollout.async: partial_rollout / oversample need an engine that loads weights "
                             f"with requests in flight; {type(engine).__name__} cannot")
        # How long a group may take: one request; a multi-turn trajectory is up to max_turns requests and
        # environment steps, each bounded by rollout.timeout_s.
        self.group_timeout_s = r.timeout_s
        if envs is not None:  # multi-turn trajectories for the prompts with an environment
            from megatron_rl.rollout.multi_turn import MultiTurnStream

            self.stream = MultiTurnStream(self.stream, envs, record_of=self.flight.record_of)
            self.group_timeout_s = 2 * envs.max_turns * r.timeout_s
        self.flight.stream, self.flight.timeout_s = self.stream, self.group_timeout_s
        self.n = r.rollout_batch_size
        self.per_wave = self.n + round(self.n * self.acfg.oversample)
        self.next_wave = step  # the first wave not dispatched yet
        self.drawn: dict[int, int] = {}  # wave -> prompts drawn for it so far
        self.ready: list[Group] = []  # finished and scored, not trained on (arrival order)
        self._step = StepTally()
        self._busy_mark = self.stream.busy_seconds()
        self._time_mark = time.perf_counter()

    @property
    def in_flight(self) -> dict[tuple[int, int], Group]:
        """The groups generating now, by (wave, index)."""
        return self.flight.groups

    # -- the loop's calls -------------------------------------------------------------------------
    def next_rollout(self, step: int, global_step: int, version: int, timer,
                     stop=None) -> tuple[Rollout | None, dict]:
        """Step ``step``'s groups (``version``: the trainer's weights) and the collection's metrics.
        ``stop()`` (polled while waiting for groups) true: raises :class:`Interrupted` after stopping
        what is generating (see :meth:`interrupt`), the step's groups kept for the checkpoint."""
        self._step = st = StepTally()
        self._dispatch_ahead(step, global_step, version)
        taken: list[Group] = []
        resolved: list[Group] = []  # taken + dropped for zero variance, in arrival order
        while True:
            self.flight.receive(block=False)
            self._score_finished(step, timer)
            self._take(step, version, taken, resolved)
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
                stopped = not self.flight.receive(block=True, stop=stop)
                st.wait_s += time.perf_counter() - t0
            if stopped:
                self.ready[:0] = resolved  # not trained: back in their place, for the checkpoint
                self.interrupt()
                raise Interrupted(f"stop requested while step {step} was generating")
        return self._collected(step, global_step, version, taken, resolved)

    def _score_finished(self, step: int, timer) -> None:
        """Score the finished groups of waves up to ``step`` (later waves are scored in their step)."""
        flight = self.flight
        mine = [g for g in flight.done if g.wave <= step]
        if mine:
            with timer("reward"):
                self._score(mine)
            flight.done = [g for g in flight.done if g.wave > step]
            self.ready.extend(mine)

    def _take(self, step: int, version: int, taken: list[Group], resolved: list[Group]) -> None:
        """From the scored groups of waves up to ``step``: take them until the step has its
        ``rollout_batch_size``, dropping (and counting) the stale ones and, with dynamic sampling,
        those without reward variance."""
        st, s = self._step, self.acfg.max_staleness
        for g in [g for g in self.ready if g.wave <= step]:
            if len(taken) == self.n:
                break
            self.ready.remove(g)
            if version - g.version > s:
                st.dropped_stale += 1
            elif self.acfg.dynamic_sampling and not has_variance(g, self.algo):
                st.dropped_zero_variance += 1
                resolved.append(g)
            else:
                taken.append(g)
                resolved.append(g)

    def _collected(self, step: int, global_step: int, version: int, taken: list[Group],
                   resolved: list[Group]) -> tuple[Rollout | None, dict]:
        """The step's rollout and metrics, once its groups are collected."""
        st = self._step
        self._drop_hopeless(step, version)
        metrics = merge_reward_metrics(st.reward_calls) if st.reward_calls else {}
        if self.acfg.enabled:
            metrics.update(self._metrics(taken, version))
            log_versions(self.sample_log, {"stage": self.stage, "step": global_step + 1, "stage_step": step,
                                           "trainer_version": version}, taken,
                         lambda g: self.loader.records[g.record].uid)
        if not resolved:
            return None, metrics
        return as_rollout(sorted(resolved, key=lambda g: g.tag), self.loader.records), metrics

    def interrupt(self, timeout_s: float | None = None) -> None:
        """Stop generating, keeping what was generated: an engine that can (vLLM servers) answers
        every request at once with the tokens it has (partial responses, finish reason ``abort``);
        they are collected, up to ``timeout_s`` (``rollout.control_timeout_s``)."""
        self.flight.interrupting = True
        if not self.stream.stop_with_partials():
            return
        # the servers answer at once; a request that was still waiting for room never will (it
        # queues on a paused server): saved to redraw
        deadline = time.monotonic() + (self.r.control_timeout_s if timeout_s is None else timeout_s)
        quiet_since, left = time.monotonic(), len(self.in_flight)
        while self.in_flight and time.monotonic() < deadline and time.monotonic() - quiet_since < 1.0:
            self.flight.receive(block=False)
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
            deadline = self.flight.extended(deadline)
            if time.monotonic() > deadline:
                raise TimeoutError(f"rollout.async: requests in flight did not finish within "
                                   f"{self.group_timeout_s:g}s (rollout.timeout_s={self.r.timeout_s}s per request) "
                                   f"nor rollout.timeout_s after the engine's last progress "
                                   f"before a weight update")
            time.sleep(0.005)
        return {k: time.perf_counter() - t0 for k in report}

    def after_sync(self) -> None:
        """After a weight update: partial rollouts continue, their later tokens from the new weights."""
        if self.acfg.partial_rollout:
            self.stream.after_weight_update()

    def continuing_groups(self) -> list[Group]:
        """Groups whose partial samples are being continued."""
        return self.flight.continuing_groups()

    def close(self) -> None:
        """End of the stage: stop what is in flight (or let it finish) and forget the leftovers."""
        if self.in_flight and self.stream.can_abort:
            self.flight.abort(list(self.in_flight))
        elif self.in_flight:
            self.before_sync()
        inner = getattr(self.stream, "inner", None)
        if inner is not None:  # the multi-turn loop over the engine's stream
            self.stream.close()
        if isinstance(inner or self.stream, BackgroundGenerate):
            (inner or self.stream).close()
        self.in_flight.clear()
        self.flight.continuing.clear()
        self.flight.done, self.ready = [], []

    # -- checkpoint -------------------------------------------------------------------------------
    def state_dict(self) -> dict:
        """Everything not trained on yet: finished groups and partial ones (their samples so far)
        in full; groups still generating with nothing kept as (prompt, seed), redrawn on resume."""
        flight = self.flight
        flight.receive(block=False)
        kept = self.ready + flight.done + flight.partial + flight.continuing_groups()
        groups = [rollout_state.group_dict(g)
                  for g in kept + [g for g in self.in_flight.values() if g.completions is None]]
        return {"next_wave": self.next_wave, "drawn": dict(self.drawn), "groups": groups}

    def load_state_dict(self, state: dict, version: int, global_step: int, step: int) -> None:
        groups = [d for d in state["groups"]
                  if self.acfg.max_staleness > 0 or rollout_state.fresh(d, version, step)]
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
            g = rollout_state.group_from_dict(d)
            if g.completions is None:
                g.dispatch_version = version
                redraw.setdefault(g.wave, []).append(g)
            elif g.partial:
                self.flight.continue_group(g, global_step + (g.wave - step))
            else:
                self.flight.done.append(g)
        for wave, gs in sorted(redraw.items()):
            self.flight.submit(wave, global_step + (wave - step), gs)

    def save(self, ckpt) -> None:
        state = self.state_dict()
        rollout_state.save(state, ckpt)
        kept = [d for d in state["groups"] if d["completions"] is not None]
        partial = sum(c["finish_reason"] == "abort" for d in kept for c in d["completions"])
        log.info("rollouts saved with the checkpoint: %d groups generated and not trained on (%d partial "
                 "responses among them, continued on resume), %d to redraw", len(kept), partial,
                 len(state["groups"]) - len(kept))

    def restore(self, ckpt, version: int, global_step: int, step: int) -> bool:
        state = rollout_state.load(ckpt)
        if state is None:
            return False
        self.load_state_dict(state, version, global_step, step)
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
        self.flight.submit(wave, global_step, groups)

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

    def _drop_hopeless(self, step: int, version: int) -> None:
        """Leftovers of this step's waves that will be too old by the next step: stop / forget."""
        s = self.acfg.max_staleness
        for g in [g for g in self.ready if g.wave <= step and version + 1 - g.version > s]:
            self.ready.remove(g)
            self._step.dropped_stale += 1
        hopeless = [t for t, g in self.in_flight.items() if g.wave <= step and version + 1 - g.dispatch_version > s]
        if hopeless and self.stream.can_abort:
            self.flight.abort(hopeless)
            self._step.aborted += len(hopeless)

    def _metrics(self, taken: list[Group], version: int) -> dict:
        now, busy = time.perf_counter(), self.stream.busy_seconds()
        window, busy_delta = now - self._time_mark, busy - self._busy_mark
        self._time_mark, self._busy_mark = now, busy
        return async_metrics(self._step, taken, version, self.acfg.max_staleness, len(self.in_flight),
                             len(self.ready) + len(self.flight.done), max(0.0, window - busy_delta))
