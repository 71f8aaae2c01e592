"""One multi-turn trajectory, token in, token out: the model's turns and the environment's
observations appended as the engine saw them, and the trajectory as one
:class:`~megatron_rl.rollout.base.Completion`.

Its token ids are exactly what the engine saw (sampled turns and appended observations, never
re-tokenized), the model's tokens keep their sampled log-probs and weight versions (a turn sampled
across a weight update keeps its spans; later turns run on newer weights), observation tokens have
loss mask 0 and log-prob 0.0. ``extra["episode"]`` records the turns and the tool calls, errors and
timeouts. The whole trajectory is bounded by the stage's ``max_response_len`` (model and observation
tokens): an observation with no room left after it ends the trajectory as truncated.

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

Seeds (:func:`turn_seed`): turn 0 of trajectory j of a prompt with seed s is sampled with s + j
(what the j-th sample of a single-turn request with seed s uses), turn t > 0 with a seed derived from
(s, j, t): a trajectory re-sent (a failed engine, a resumed run) samples the same turns.

Owns: :class:`Trajectory`, :class:`TrajectoryGroup` (a prompt's trajectories and where they go).
May call: the environments' ``open`` and ``reset`` (:func:`open_group`), their tokenizer and renderer;
nothing that runs a model or a step.
"""

from __future__ import annotations

import dataclasses
import hashlib
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Hashable

import numpy as np

from megatron_rl.envs.base import BUDGET, StepResult
from megatron_rl.envs.tools import TIMEOUT
from megatron_rl.rollout.base import Completion, SamplingSpec
from megatron_rl.rollout.routes import RoutesError
from megatron_rl.rollout.streaming import OnDone

if TYPE_CHECKING:
    from megatron_rl.envs.base import Environment

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
class TrajectoryGroup:
    """A prompt's ``n`` trajectories (``spec.n``), delivered together to ``on_done`` under ``tag``."""

    tag: Hashable
    on_done: OnDone
    spec: SamplingSpec  # the group's sampling (n = its number of trajectories)
    trajectories: list["Trajectory"] = field(default_factory=list)
    left: int = 0  # trajectories not finished
    aborted: bool = False


def open_group(envs, record, env_name: str, tag, on_done: OnDone, sampling: SamplingSpec,
               i: int) -> TrajectoryGroup:
    """Prompt ``i``'s trajectories (``record``'s, environment ``env_name`` of ``envs``), each with its
    environment reset (what the environment adds to the first turn is an observation before any
    model turn)."""
    group = TrajectoryGroup(tag, on_done, dataclasses.replace(sampling, max_tokens=sampling.prompt_max_tokens(i),
                                                              seeds=(), max_tokens_each=()))
    base = sampling.prompt_seed(i)
    for j in range(sampling.n):
        env = envs.open(record)
        first = env.reset(record)
        traj = Trajectory(group, env, env_name, list(record.prompt_ids), base, j)
        extra = first[len(record.prompt_ids):]
        if first[:len(record.prompt_ids)] != list(record.prompt_ids):
            raise ValueError(f"environment {env_name}: reset() must start with the record's prompt")
        if extra:  # the environment adds to the first turn: an observation before any model turn
            traj.append_observation(extra, envs.tokenizer.decode(extra), envs.tokenizer)
            if traj.room < 1:
                traj.end("length")
        group.trajectories.append(traj)
    group.left = len(group.trajectories)
    return group


@dataclass(eq=False)
class Trajectory:
    """One of a group's trajectories: its prompt, what was appended to it, and its episode's counts."""

    group: TrajectoryGroup
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

    def append_turn(self, c: Completion, max_turns: int) -> None:
        """Add a sampled turn. The trajectory ends here when the turn did not stop by itself (cut at
        the room left: "length") or was the last of ``max_turns``; else the environment steps."""
        self.routes = _join_routes(self, c)
        self.turns.append({"role": "assistant", "text": c.text, "tokens": len(c.token_ids), "start": len(self.ids)})
        self.pieces.append(c.text)
        self.ids += c.token_ids
        self.logprobs += c.logprobs
        self.mask += [1] * len(c.token_ids)
        self.versions += c.token_versions()
        self.model_turns += 1
        self.last_text, self.engine, self.finish_reason = c.text, c.engine, c.finish_reason
        if c.finish_reason != "stop":
            # cut at its room; a turn the engine stopped ("abort") ends the trajectory as truncated
            # too: a trajectory is never continued token-wise (its environment's episode would not be)
            self.finish_reason = "length"
            self.end("length")
        elif self.model_turns >= max_turns:
            self.end("max_turns")

    def apply_step(self, res: StepResult, renderer, tokenizer) -> None:
        """The environment's answer to the last turn: the end of the episode, or an observation
        (rendered as the chat template renders a tool message) when there is room for it."""
        if res.tool:
            self.tool_calls += res.error != BUDGET
            self.budget_refused += res.error == BUDGET
            self.tool_errors += res.error not in ("", BUDGET)
            self.tool_timeouts += res.error == TIMEOUT
            self.observations_cut += res.cut
        if res.done:
            self.end("done", res.answer)
            return
        text = res.observation or ""
        obs = renderer.observation_ids(text)
        if len(obs) + 1 > self.room:  # no room for the observation and one more model token
            self.finish_reason = "length"
            self.end("length")
            return
        self.append_observation(obs, text, tokenizer)

    def append_observation(self, obs: list[int], text: str, tokenizer) -> None:
        """Append a tool's observation tokens: trained on never (mask 0, log-prob 0.0), at the
        version of the model token before them."""
        self.turns.append({"role": "tool", "text": text, "tokens": len(obs), "start": len(self.ids)})
        self.pieces.append(tokenizer.decode(obs))
        version = self.versions[-1] if self.versions else None
        self.ids += obs
        self.logprobs += [0.0] * len(obs)
        self.mask += [0] * len(obs)
        self.versions += [version] * len(obs)

    def end(self, how: str, answer: str | None = None) -> None:
        self.done = True
        self.ended = how
        self.answer = self.last_text if answer is None else answer

    def completion(self) -> Completion:
        """The whole trajectory as one completion (see the module doc)."""
        first = next((v for v in self.versions if v is not None), 0)
        spans = _spans([first if v is None else v for v in self.versions])
        episode = {
            "env": self.env_name, "turns": self.model_turns, "ended": self.ended, "answer": self.answer,
            "tool_calls": self.tool_calls, "tool_errors": self.tool_errors, "tool_timeouts": self.tool_timeouts,
            "budget_refused": self.budget_refused, "observations_cut": self.observations_cut,
            "observation_tokens": len(self.mask) - sum(self.mask), "messages": self.turns,
        }
        return Completion(token_ids=list(self.ids), logprobs=list(self.logprobs),
                          text="".join(self.pieces), finish_reason=self.finish_reason,
                          truncated=self.ended == "length", weight_version=first,
                          version_spans=spans if len({v for v, _, _ in spans}) > 1 else [], engine=self.engine,
                          loss_mask=list(self.mask), routes=self.routes, extra={"episode": episode})


def _join_routes(t: Trajectory, c: Completion) -> "np.ndarray | None":
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
