"""Multi-turn rollouts: trajectories that interleave the model's turns with tool observations.

:class:`MultiTurnStream` is a :class:`~megatron_rl.rollout.streaming.GroupStream` over any other one
(the in-process engine, the streaming engine, the fleet of servers), so the synchronous loop, async
GRPO and the evaluation all sample trajectories the same way. A prompt whose data selects an
environment (``megatron_rl.envs``) gets ``n`` trajectories; each, token in, token out:

1. the first turn is the environment's (``reset``: the record's prompt);
2. the model samples a turn: one request (n = 1) with the whole trajectory so far as its prompt (the
   engines' prefix cache holds the earlier turns), at most the room left in the stage's
   ``max_response_len``, which bounds the whole trajectory (model and observation tokens);
3. the environment steps on the turn's text (on a worker thread; tools have their own limits). Done:
   the trajectory ends, its answer is what the reward scores. Otherwise the observation's tokens
   (rendered as the chat template renders a tool message, ``envs/render.py``) are appended and the
   model takes the next turn, up to ``rollout.max_turns`` turns. An observation with no room left
   after it ends the trajectory as truncated.

A multi-turn stream cannot stop with partial responses (``stop_with_partials`` is False): on a
preemption its groups still generating are redrawn on resume, never continued token-wise.

The trajectory is one :class:`~megatron_rl.rollout.base.Completion`: its token ids are exactly what
the engine saw (sampled turns and appended observations, never re-tokenized), the model's tokens
keep their sampled log-probs and weight versions (a turn sampled across a weight update keeps its
spans; later turns run on newer weights), observation tokens have loss mask 0 and log-prob 0.0.
``extra["episode"]`` records the turns and the tool calls, errors and timeouts.

MoE routes (engines started with ``return_routes``: routing replay, ``megatron_rl.rollout.routes``):
the trajectory's ``routes`` has a row for every position of the whole interleaved sequence but the
last, each from the forward that computed it. Turn ``k``'s request (whose prompt is the history)
returns rows up to its own last sampled token; of those the trajectory keeps the ones past what the
earlier turns gave: the rows of turn ``k - 1``'s last token (never fed through the model by its own
turn) and of the observation after it, both computed by turn ``k``'s forward, and those of turn
``k``'s sampled tokens. The prompt's and turn ``k``'s own rows are never taken from a later request,
which may have recomputed them on newer weights (a history served from the prefix cache brings its
rows from the forward that computed that KV: the engine's route capture, as for any prompt). A turn
that returned no routes (an aborted request) leaves the trajectory without routes.

Seeds: turn 0 of trajectory j of a prompt with seed s is sampled with s + j (what the j-th sample of
a single-turn request with seed s uses), turn t > 0 with a seed derived from (s, j, t): a trajectory
re-sent (a failed engine, a resumed run) samples the same turns. Turns that are ready together go to
the engine as one batch (each with its own seed and length).

Prompts without an environment are passed to the inner stream as they are (single-turn, unchanged).

Progress (``last_progress``, the trainer's watchdog): the inner stream's, or the trajectories' own (a
turn sent or answered, environments stepping) when later.
"""

from __future__ import annotations

import dataclasses
import hashlib
import itertools
import logging
import queue
import threading
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Callable, Hashable

import numpy as np

from megatron_rl.envs.base import BUDGET, StepResult
from megatron_rl.envs.tools import TIMEOUT
from megatron_rl.rollout.base import Completion, SamplingSpec
from megatron_rl.rollout.routes import RoutesError
from megatron_rl.rollout.streaming import GroupStream, OnDone

if TYPE_CHECKING:
    from megatron_rl.envs.base import Environment
    from megatron_rl.envs.episodes import Environments
    from megatron_rl.rollout.base import RolloutEngine

log = logging.getLogger("megatron_rl")

_SEED_MOD = 2**31 - 1


def turn_seed(seed: int | None, sample: int, turn: int) -> int | None:
    """The sampling seed of turn ``turn`` of trajectory ``sample`` of a prompt seeded ``seed``: turn 0
    is the single-turn rule (``seed + sample``), a later turn a hash of the three."""
    if seed is None:
        return None
    if turn == 0:
        return (seed + sample) % _SEED_MOD
    digest = hashlib.blake2b(f"{seed}:{sample}:{turn}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") % _SEED_MOD


@dataclass(eq=False)
class _Group:
    tag: Hashable
    on_done: OnDone
    spec: SamplingSpec  # the group's sampling (n = its number of trajectories)
    trajectories: list["_Trajectory"] = field(default_factory=list)
    left: int = 0  # trajectories not finished
    aborted: bool = False


@dataclass(eq=False)
class _Trajectory:
    group: _Group
    env: "Environment"
    env_name: str
    prompt_ids: list[int]
    seed: int | None  # the prompt's
    sample: int  # j: the trajectory's index in its group
    ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    mask: list[int] = field(default_factory=list)
    versions: list[int | None] = field(default_factory=list)  # None: an observation before any model token
    # MoE routes of prompt + ids[:-1] as far as the turns so far computed them (None: no routes)
    routes: "np.ndarray | None" = None
    turns: list[dict] = field(default_factory=list)
    pieces: list[str] = field(default_factory=list)  # the trajectory's text, turn by turn
    model_turns: int = 0
    tool_calls: int = 0
    tool_errors: int = 0
    tool_timeouts: int = 0
    budget_refused: int = 0
    observations_cut: int = 0
    last_text: str = ""
    engine: str = ""
    finish_reason: str = "stop"
    done: bool = False
    ended: str = ""  # "done" (the environment's verdict), "max_turns", "length", or the finish reason
    answer: str = ""  # what the reward scores

    @property
    def room(self) -> int:
        return self.group.spec.max_tokens - len(self.ids)


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
        self._groups: dict[Hashable, _Group] = {}      # outer tag -> group (env prompts)
        self._plain: dict[Hashable, Hashable] = {}     # inner tag -> outer tag (single-turn prompts)
        self._flying: dict[Hashable, _Trajectory] = {}  # inner tag -> trajectory whose turn is out
        self._ids = itertools.count()
        self._events: queue.Queue = queue.Queue()
        self._closed = False
        # progress of the trajectories' own loop (time.monotonic()): a turn sent or answered, a
        # group delivered; ``_stepping_until``: environments stepping now, bounded by envs.wait_s
        self._progress: float | None = None
        self._stepping_until: float | None = None
        self._steps = _Workers(max(8, 4 * envs.cfg.num_workers), "env-step")
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
            group = _Group(tag, on_done, dataclasses.replace(sampling, max_tokens=sampling.prompt_max_tokens(i),
                                                             seeds=(), max_tokens_each=()))
            base = sampling.prompt_seed(i)
            for j in range(sampling.n):
                env = self.envs.open(record)
                first = env.reset(record)
                traj = _Trajectory(group, env, env_name, list(record.prompt_ids), base, j)
                extra = first[len(record.prompt_ids):]
                if first[:len(record.prompt_ids)] != list(record.prompt_ids):
                    raise ValueError(f"environment {env_name}: reset() must start with the record's prompt")
                if extra:  # the environment adds to the first turn: an observation before any model turn
                    self._append_observation(traj, extra, self.envs.tokenizer.decode(extra))
                    if traj.room < 1:
                        self._end(traj, "length")
                group.trajectories.append(traj)
            group.left = len(group.trajectories)
            starts += group.trajectories
            with self._lock:
                self._groups[tag] = group
        if plain:
            inner_tags = [("plain", next(self._ids)) for _ in plain]
            with self._lock:
                self._plain.update({it: tags[i] for it, i in zip(inner_tags, plain)})
            spec = dataclasses.replace(sampling, seeds=tuple(sampling.prompt_seed(i) for i in plain)
                                       if sampling.seed is not None or sampling.seeds else (),
                                       max_tokens_each=tuple(sampling.prompt_max_tokens(i) for i in plain)
                                       if sampling.max_tokens_each else ())
            self.inner.submit([prompt_ids[i] for i in plain], spec, inner_tags,
                              lambda results: self._plain_done(results, on_done))
        if starts:
            self._events.put(("start", starts))

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

    def _round(self, starts: list[_Trajectory], turns: list) -> None:
        """Apply the finished turns, step the environments, send the next turns (one batch)."""
        failed: dict[int, tuple[_Group, BaseException]] = {}
        stepping: list[_Trajectory] = []
        for inner_tag, result in turns:
            with self._lock:
                traj = self._flying.pop(inner_tag, None)
            if traj is None or traj.group.aborted:
                continue
            if isinstance(result, BaseException):
                failed[id(traj.group)] = (traj.group, result)
                continue
            (c,) = result
            self._append_turn(traj, c)
            stepping.append(traj)
        finished = [t for t in stepping if t.done]
        stepping = [t for t in stepping if not t.done and id(t.group) not in failed]
        deadline = time.monotonic() + self.envs.wait_s
        if stepping:
            with self._lock:
                self._stepping_until = deadline
        futures = [(t, self._steps.submit(t.env.step, t.last_text)) for t in stepping]
        for traj, fut in futures:
            try:
                res = fut.result(timeout=max(0.0, deadline - time.monotonic()))
            except TimeoutError:
                res = StepResult(observation=f"error: the environment did not answer within "
                                             f"{self.envs.wait_s:g} s", tool=traj.env_name, error=TIMEOUT)
            except Exception as exc:  # noqa: BLE001 - an environment's own failure ends its episode
                log.warning("environment %s failed on a turn: %s: %s", traj.env_name, type(exc).__name__, exc)
                traj.tool_errors += 1
                res = StepResult(done=True)
            self._apply_step(traj, res)
        if stepping:
            with self._lock:
                self._stepping_until = None
            self._progressed()
        ready = [t for t in starts + stepping if not t.done and not t.group.aborted
                 and id(t.group) not in failed]
        finished += [t for t in starts + stepping if t.done]
        self._send(ready, failed)
        if failed:
            self._fail(list(failed.values()))
        self._finish(finished)

    def _append_turn(self, traj: _Trajectory, c: Completion) -> None:
        """Add a sampled turn. The trajectory ends here when the turn did not stop by itself (cut at
        the room left: "length") or was the last of rollout.max_turns; else the environment steps."""
        traj.routes = _join_routes(traj, c)
        traj.turns.append({"role": "assistant", "text": c.text, "tokens": len(c.token_ids), "start": len(traj.ids)})
        traj.pieces.append(c.text)
        traj.ids += c.token_ids
        traj.logprobs += c.logprobs
        traj.mask += [1] * len(c.token_ids)
        traj.versions += c.token_versions()
        traj.model_turns += 1
        traj.last_text, traj.engine, traj.finish_reason = c.text, c.engine, c.finish_reason
        if c.finish_reason != "stop":
            # cut at its room; a turn the engine stopped ("abort") ends the trajectory as truncated
            # too: a trajectory is never continued token-wise (its environment's episode would not be)
            traj.finish_reason = "length"
            self._end(traj, "length")
        elif traj.model_turns >= self.envs.max_turns:
            self._end(traj, "max_turns")

    def _apply_step(self, traj: _Trajectory, res: StepResult) -> None:
        if res.tool:
            traj.tool_calls += res.error != BUDGET
            traj.budget_refused += res.error == BUDGET
            traj.tool_errors += res.error not in ("", BUDGET)
            traj.tool_timeouts += res.error == TIMEOUT
            traj.observations_cut += res.cut
        if res.done:
            self._end(traj, "done", res.answer)
            return
        text = res.observation or ""
        obs = self.envs.renderer.observation_ids(text)
        if len(obs) + 1 > traj.room:  # no room for the observation and one more model token
            traj.finish_reason = "length"
            self._end(traj, "length")
            return
        self._append_observation(traj, obs, text)

    def _append_observation(self, traj: _Trajectory, obs: list[int], text: str) -> None:
        """Append a tool's observation tokens: trained on never (mask 0, log-prob 0.0), at the
        version of the model token before them."""
        traj.turns.append({"role": "tool", "text": text, "tokens": len(obs), "start": len(traj.ids)})
        traj.pieces.append(self.envs.tokenizer.decode(obs))
        version = traj.versions[-1] if traj.versions else None
        traj.ids += obs
        traj.logprobs += [0.0] * len(obs)
        traj.mask += [0] * len(obs)
        traj.versions += [version] * len(obs)

    def _end(self, traj: _Trajectory, how: str, answer: str | None = None) -> None:
        traj.done = True
        traj.ended = how
        traj.answer = traj.last_text if answer is None else answer

    def _send(self, ready: list[_Trajectory], failed: dict) -> None:
        """The next turn of every ready trajectory, one inner submit per sampling spec."""
        by_spec: dict[SamplingSpec, list[_Trajectory]] = {}
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

    def _fail(self, failures: list[tuple[_Group, BaseException]]) -> None:
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

    def _finish(self, finished: list[_Trajectory]) -> None:
        complete = []
        for traj in finished:
            group = traj.group
            group.left -= 1
            if group.left == 0 and not group.aborted:
                with self._lock:
                    mine = self._groups.pop(group.tag, None) is group
                if mine:
                    complete.append((group, [self._completion(t) for t in group.trajectories]))
        self._deliver(complete)

    def _deliver(self, results: list[tuple[_Group, object]]) -> None:
        by_callback: dict[int, tuple[OnDone, list]] = {}
        for group, out in results:
            by_callback.setdefault(id(group.on_done), (group.on_done, []))[1].append((group.tag, out))
        for on_done, groups in by_callback.values():
            on_done(groups)

    def _completion(self, t: _Trajectory) -> Completion:
        first = next((v for v in t.versions if v is not None), 0)
        spans = _spans([first if v is None else v for v in t.versions])
        episode = {
            "env": t.env_name, "turns": t.model_turns, "ended": t.ended, "answer": t.answer,
            "tool_calls": t.tool_calls, "tool_errors": t.tool_errors, "tool_timeouts": t.tool_timeouts,
            "budget_refused": t.budget_refused, "observations_cut": t.observations_cut,
            "observation_tokens": len(t.mask) - sum(t.mask), "messages": t.turns,
        }
        return Completion(token_ids=list(t.ids), logprobs=list(t.logprobs),
                          text="".join(t.pieces), finish_reason=t.finish_reason,
                          truncated=t.ended == "length", weight_version=first,
                          version_spans=spans if len({v for v, _, _ in spans}) > 1 else [], engine=t.engine,
                          loss_mask=list(t.mask), routes=t.routes, extra={"episode": episode})


def _join_routes(t: _Trajectory, c: Completion) -> "np.ndarray | None":
    """The trajectory's routes once turn ``c`` is appended: those it has, then ``c``'s rows of the
    positions after them (see the module doc). ``c.routes`` covers its request's prompt (the
    history) and its own tokens but the last."""
    if c.routes is None or (t.routes is None and t.model_turns > 0):
        return None  # no routes (an engine without them, an aborted turn): none for the trajectory
    need = len(t.prompt_ids) + len(t.ids) + len(c.token_ids) - 1
    if len(c.routes) != need:
        raise RoutesError(f"multi-turn turn {t.model_turns} ({c.engine}): {len(c.routes)} rows of routes for a "
                          f"request of {len(t.prompt_ids) + len(t.ids)} prompt and {len(c.token_ids)} sampled "
                          f"tokens (need {need})")
    if t.routes is None:
        return c.routes
    return np.concatenate([t.routes, c.routes[len(t.routes):]])


def _spans(versions: list[int]) -> list[tuple[int, int, int]]:
    """``(version, start, end)`` runs of equal versions."""
    out: list[tuple[int, int, int]] = []
    for i, v in enumerate(versions):
        if out and out[-1][0] == v:
            out[-1] = (v, out[-1][1], i + 1)
        else:
            out.append((v, i, i + 1))
    return out


class _Workers:
    """A few daemon threads running environment steps (an environment stuck in a step cannot keep
    the process from exiting)."""

    def __init__(self, count: int, name: str):
        import concurrent.futures as cf

        self._cf = cf
        self._jobs: queue.Queue = queue.Queue()
        self._threads = [threading.Thread(target=self._work, name=f"{name}-{i}", daemon=True) for i in range(count)]
        for th in self._threads:
            th.start()

    def submit(self, fn, *args):
        fut = self._cf.Future()
        self._jobs.put((fn, args, fut))
        return fut

    def _work(self) -> None:
        while True:
            job = self._jobs.get()
            if job is None:
                return
            fn, args, fut = job
            if fut.set_running_or_notify_cancel():
                try:
                    fut.set_result(fn(*args))
                except BaseException as exc:  # noqa: BLE001 - delivered to the waiting round
                    fut.set_exception(exc)

    def close(self) -> None:
        for _ in self._threads:
            self._jobs.put(None)


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
