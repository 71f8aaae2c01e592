"""Multi-turn rollouts: trajectories that interleave the model's turns with tool observations.

:class:`MultiTurnStream` is a :class:`~megatron_rl.rollout.streaming.GroupStream` over any other one
(the in-process engine, the streaming engine, the fleet of servers), so the synchronous loop, async
GRPO and the evaluation all sample trajectories the same way. A prompt whose data selects an
environment (``megatron_rl.envs``) gets ``n`` trajectories; each, token in, token out:

1. the first turn is the environment's (``reset``: the record's prompt);
2. the model samples a turn: one request (n = 1) with the whole trajectory so far as its prompt (the
   engines' prefix cache holds the earlier turns), at most the room left in the stage's
   ``max_response_len``, which bounds the whole trajectory (model and observation tokens);
3. the environment steps on the turn's text (on a worker thread; tools have their own limits:
   :mod:`megatron_rl.rollout.env_steps`). Done: the trajectory ends, its answer is what the reward
   scores. Otherwise the observation's tokens (rendered as the chat template renders a tool message,
   ``envs/render.py``) are appended and the model takes the next turn, up to ``rollout.max_turns``
   turns. An observation with no room left after it ends the trajectory as truncated.

What a trajectory holds, how it becomes one :class:`~megatron_rl.rollout.base.Completion` (tokens,
log-probs, versions, loss mask, MoE routes) and the seed of each turn: :mod:`megatron_rl.rollout.trajectory`.
Turns that are ready together go to the engine as one batch (each with its own seed and length).

A multi-turn stream cannot stop with partial responses (``stop_with_partials`` is False): on a
preemption its groups still generating are redrawn on resume, never continued token-wise.

Prompts without an environment are passed to the inner stream as they are (single-turn, unchanged).

Progress (``last_progress``, the trainer's watchdog): the inner stream's, or the trajectories' own (a
turn sent or answered, environments stepping) when later.

Owns: the groups and trajectories in flight, the driver thread that advances them.
May call: the inner stream, :mod:`~megatron_rl.rollout.trajectory` (which opens and resets the
environments), :mod:`~megatron_rl.rollout.env_steps` (their steps).
"""

from __future__ import annotations

import dataclasses
import itertools
import logging
import queue
import threading
import time
from typing import TYPE_CHECKING, Callable, Hashable

from megatron_rl.rollout.base import Completion, SamplingSpec
from megatron_rl.rollout.env_steps import StepWorkers, step_all
from megatron_rl.rollout.streaming import GroupStream, OnDone
from megatron_rl.rollout.trajectory import Trajectory, TrajectoryGroup, open_group, turn_seed

if TYPE_CHECKING:
    from megatron_rl.envs.episodes import Environments
    from megatron_rl.rollout.base import RolloutEngine

log = logging.getLogger("megatron_rl")


class MultiTurnStream(GroupStream):
    """``inner``'s requests as multi-turn trajectories for the prompts that have an environment."""

    def __init__(self, inner: GroupStream, envs: "Environments",
                 record_of: Callable[[Hashable], object] | None = None):
        """``record_of(tag)``: the :class:`~megatron_rl.data.PromptRecord` a submitted prompt comes
        from (its environment is resolved from it)."""
        self.inner = inner
        self.envs = envs
        self.record_of = record_of
        self.keeps_in_flight = inner.keeps_in_flight
        self.can_abort = inner.can_abort
        self._lock = threading.Lock()
        self._groups: dict[Hashable, TrajectoryGroup] = {}      # outer tag -> group (env prompts)
        self._plain: dict[Hashable, Hashable] = {}     # inner tag -> outer tag (single-turn prompts)
        self._flying: dict[Hashable, Trajectory] = {}  # inner tag -> trajectory whose turn is out
        self._ids = itertools.count()
        self._events: queue.Queue = queue.Queue()
        self._closed = False
        # progress of the trajectories' own loop (time.monotonic()): a turn sent or answered, a
        # group delivered; ``_stepping_until``: environments stepping now, bounded by envs.wait_s
        self._progress: float | None = None
        self._stepping_until: float | None = None
        self._steps = StepWorkers(max(8, 4 * envs.cfg.num_workers), "env-step")
        self._thread = threading.Thread(target=self._drive, name="multi-turn", daemon=True)
        self._thread.start()

    # -- GroupStream ------------------------------------------------------------------------------
    def submit(self, prompt_ids, sampling, tags, on_done) -> None:
        if self.record_of is None:
            raise RuntimeError("MultiTurnStream.submit needs record_of (or use submit_records)")
        self.submit_records([self.record_of(t) for t in tags], sampling, tags, on_done, prompt_ids)

    def submit_records(self, records, sampling: SamplingSpec, tags, on_done: OnDone, prompt_ids=None) -> None:
        """Start ``sampling.n`` samples of each record's prompt (prompt i seeded ``prompt_seed(i)``):
        trajectories for those with an environment, plain requests for the others."""
        prompt_ids = prompt_ids if prompt_ids is not None else [r.prompt_ids for r in records]
        plain, starts = [], []
        for i, (record, tag) in enumerate(zip(records, tags)):
            env_name = self.envs.name(record)
            if env_name is None:
                plain.append(i)
                continue
            group = open_group(self.envs, record, env_name, tag, on_done, sampling, i)
            starts += group.trajectories
            with self._lock:
                self._groups[tag] = group
        if plain:
            self._submit_plain(plain, prompt_ids, sampling, tags, on_done)
        if starts:
            self._events.put(("start", starts))

    def _submit_plain(self, plain: list[int], prompt_ids, sampling: SamplingSpec, tags, on_done: OnDone) -> None:
        """The prompts without an environment (indices ``plain``), single-turn to the inner stream."""
        inner_tags = [("plain", next(self._ids)) for _ in plain]
        with self._lock:
            self._plain.update({it: tags[i] for it, i in zip(inner_tags, plain)})
        spec = dataclasses.replace(sampling, seeds=tuple(sampling.prompt_seed(i) for i in plain)
                                   if sampling.seed is not None or sampling.seeds else (),
                                   max_tokens_each=tuple(sampling.prompt_max_tokens(i) for i in plain)
                                   if sampling.max_tokens_each else ())
        self.inner.submit([prompt_ids[i] for i in plain], spec, inner_tags,
                          lambda results: self._plain_done(results, on_done))

    def abort(self, tags) -> None:
        tags = set(tags)
        with self._lock:
            inner = [it for it, t in self._plain.items() if t in tags]
            for it in inner:
                del self._plain[it]
            for tag in tags:
                group = self._groups.pop(tag, None)
                if group is not None:
                    group.aborted = True
            for it, traj in list(self._flying.items()):
                if traj.group.aborted:
                    del self._flying[it]
                    inner.append(it)
        if inner and self.inner.can_abort:  # else they finish, and what they return is dropped
            self.inner.abort(inner)

    def busy_seconds(self) -> float:
        return self.inner.busy_seconds()

    def last_progress(self) -> float | None:
        """The later of the inner stream's progress and the trajectories' own: a turn sent or
        answered, a group delivered, and now while environments step (tools run within their own
        timeout; at most until envs.wait_s after the round's steps began, so a step that never
        returns does not hold off the trainer's watchdog forever)."""
        now = time.monotonic()
        with self._lock:
            own, stepping = self._progress, self._stepping_until
        if stepping is not None:
            own = max(own or 0.0, min(now, stepping))
        inner = self.inner.last_progress()
        if inner is None or own is None:
            return own if inner is None else inner
        return max(inner, own)

    def _progressed(self) -> None:
        with self._lock:
            self._progress = time.monotonic()

    def in_flight(self) -> int:
        with self._lock:
            return len(self._groups) + len(self._plain)

    def before_weight_update(self) -> None:
        self.inner.before_weight_update()

    def after_weight_update(self) -> None:
        self.inner.after_weight_update()

    def generate_records(self, records, sampling: SamplingSpec) -> list[list[Completion]]:
        """Blocking: ``sampling.n`` samples (trajectories) of each record, in record order."""
        done = threading.Event()
        results: dict[int, list[Completion] | BaseException] = {}
        key = next(self._ids)

        def collect(groups):
            for (_, _, i), out in groups:
                results[i] = out
            if len(results) == len(records):
                done.set()

        tags = [("generate", key, i) for i in range(len(records))]
        self.submit_records(records, sampling, tags, collect)
        # every turn is one engine request and one environment step, each bounded by wait_s
        limit = 2 * (self.envs.max_turns + 1) * self.envs.wait_s
        if records and not done.wait(limit):
            self.abort(tags)
            raise TimeoutError(f"multi-turn generation did not finish within {limit:g} s")
        for r in results.values():
            if isinstance(r, BaseException):
                raise r
        return [results[i] for i in range(len(records))]

    def close(self) -> None:
        if not self._closed:
            self._closed = True
            self._events.put(("close", None))
            self._thread.join(timeout=30)
            self._steps.close()

    # -- the driver thread ------------------------------------------------------------------------
    def _plain_done(self, results, on_done: OnDone) -> None:
        out = []
        with self._lock:
            for inner_tag, result in results:
                tag = self._plain.pop(inner_tag, None)
                if tag is not None:  # else aborted meanwhile
                    out.append((tag, result))
        if out:
            on_done(out)

    def _on_turns(self, results) -> None:  # called from the engine's thread: never blocks
        self._progressed()
        self._events.put(("turns", results))

    def _drive(self) -> None:
        while True:
            events = [self._events.get()]
            while True:  # everything that is ready now goes in this round
                try:
                    events.append(self._events.get_nowait())
                except queue.Empty:
                    break
            starts, turns = [], []
            for kind, payload in events:
                if kind == "close":
                    return
                if kind == "start":
                    starts += payload
                else:
                    turns += payload
            try:
                self._round(starts, turns)
            except Exception as exc:  # noqa: BLE001 - a bug here must fail the groups, not hang them
                log.exception("multi-turn rollout loop failed")
                with self._lock:
                    groups = list(self._groups.values())
                    self._groups.clear()
                    self._flying.clear()
                self._deliver([(g, exc) for g in groups])

    def _round(self, starts: list[Trajectory], turns: list) -> None:
        """Apply the finished turns, step the environments, send the next turns (one batch)."""
        failed: dict[int, tuple[TrajectoryGroup, BaseException]] = {}
        stepping: list[Trajectory] = []
        for inner_tag, result in turns:
            with self._lock:
                traj = self._flying.pop(inner_tag, None)
            if traj is None or traj.group.aborted:
                continue
            if isinstance(result, BaseException):
                failed[id(traj.group)] = (traj.group, result)
                continue
            (c,) = result
            traj.append_turn(c, self.envs.max_turns)
            stepping.append(traj)
        finished = [t for t in stepping if t.done]
        stepping = [t for t in stepping if not t.done and id(t.group) not in failed]
        self._step_envs(stepping)
        ready = [t for t in starts + stepping if not t.done and not t.group.aborted
                 and id(t.group) not in failed]
        finished += [t for t in starts + stepping if t.done]
        self._send(ready, failed)
        if failed:
            self._fail(list(failed.values()))
        self._finish(finished)

    def _step_envs(self, stepping: list[Trajectory]) -> None:
        """Step these trajectories' environments, all at once within ``envs.wait_s`` (the watchdog's
        progress runs meanwhile, up to that deadline), and append what they answer."""
        deadline = time.monotonic() + self.envs.wait_s
        if stepping:
            with self._lock:
                self._stepping_until = deadline
        envs = self.envs
        step_all(stepping, self._steps, deadline, envs.wait_s,
                 lambda traj, res: traj.apply_step(res, envs.renderer, envs.tokenizer))
        if stepping:
            with self._lock:
                self._stepping_until = None
            self._progressed()

    def _send(self, ready: list[Trajectory], failed: dict) -> None:
        """The next turn of every ready trajectory, one inner submit per sampling spec."""
        by_spec: dict[SamplingSpec, list[Trajectory]] = {}
        for t in ready:
            by_spec.setdefault(t.group.spec, []).append(t)
        for spec, trajs in by_spec.items():
            tags = [("turn", next(self._ids)) for _ in trajs]
            seeds = tuple(turn_seed(t.seed, t.sample, t.model_turns) for t in trajs)
            turn_spec = dataclasses.replace(spec, n=1, seeds=seeds if spec.seed is not None else (),
                                            max_tokens_each=tuple(t.room for t in trajs))
            with self._lock:
                for tag, t in zip(tags, trajs):
                    self._flying[tag] = t
            try:
                self.inner.submit([t.prompt_ids + t.ids for t in trajs], turn_spec, tags, self._on_turns)
                self._progressed()
            except Exception as exc:  # noqa: BLE001 - the engine refused: those groups fail
                with self._lock:
                    for tag in tags:
                        self._flying.pop(tag, None)
                for t in trajs:
                    failed[id(t.group)] = (t.group, exc)

    def _fail(self, failures: list[tuple[TrajectoryGroup, BaseException]]) -> None:
        stop = []
        with self._lock:
            for group, _ in failures:
                group.aborted = True
                self._groups.pop(group.tag, None)
                stop += [it for it, t in self._flying.items() if t.group is group]
            for it in stop:
                del self._flying[it]
        if stop and self.inner.can_abort:
            self.inner.abort(stop)
        self._deliver([(g, exc) for g, exc in failures])

    def _finish(self, finished: list[Trajectory]) -> None:
        complete = []
        for traj in finished:
            group = traj.group
            group.left -= 1
            if group.left == 0 and not group.aborted:
                with self._lock:
                    mine = self._groups.pop(group.tag, None) is group
                if mine:
                    complete.append((group, [t.completion() for t in group.trajectories]))
        self._deliver(complete)

    def _deliver(self, results: list[tuple[TrajectoryGroup, object]]) -> None:
        by_callback: dict[int, tuple[OnDone, list]] = {}
        for group, out in results:
            by_callback.setdefault(id(group.on_done), (group.on_done, []))[1].append((group.tag, out))
        for on_done, groups in by_callback.values():
            on_done(groups)


def generate(engine: "RolloutEngine", envs: "Environments", records, sampling: SamplingSpec) -> list[list[Completion]]:
    """``sampling.n`` samples of each record, in record order: trajectories for the records with an
    environment, single-turn samples for the others (a blocking call: the evaluation's)."""
    from megatron_rl.rollout import group_stream
    from megatron_rl.rollout.streaming import BackgroundGenerate

    inner = group_stream(engine, streaming=True)
    stream = MultiTurnStream(inner, envs)
    try:
        return stream.generate_records(records, sampling)
    finally:
        stream.close()
        if isinstance(inner, BackgroundGenerate):
            inner.close()
