"""The async rollout scheduler's groups out on the engine's stream, and what comes back of them.

A wave's groups go out with consecutive indices in one call (prompt i seeded base + index); a group
whose samples were stopped part-way (finish reason ``abort``) is continued sample by sample (n=1,
its prompt followed by the tokens it has, the rest of the length, the sample's own seed), and each
continuation is joined to its sample (:func:`~megatron_rl.trainer.rollout_group.join_completions`).
Delivered groups land in ``done`` (arrival order), moved there from the engine's thread by
:meth:`GroupsInFlight.receive`, whose every wait is bounded (``rollout.timeout_s`` per request, a
multi-turn trajectory's turns and steps, extended to ``rollout.timeout_s`` after the engine's last
progress).

Owns: the groups in flight (``groups``), the continued samples, the partial groups an interrupt
kept, the finished groups not scored yet (``done``).
May call: the stream (:class:`~megatron_rl.rollout.streaming.GroupStream`: submit, abort,
last_progress), the loader's records, :mod:`megatron_rl.trainer.rollout_group`.
"""

from __future__ import annotations

import queue
import time

from megatron_rl.data import PromptLoader
from megatron_rl.rollout import Completion, RolloutConfig, SamplingSpec
from megatron_rl.rollout.streaming import GroupStream
from megatron_rl.trainer.phases import sampling_seed
from megatron_rl.trainer.rollout_group import Group, join_completions


class GroupsInFlight:
    """What one scheduler has out on ``stream`` (set once the stream is built)."""

    def __init__(self, loader: PromptLoader, r: RolloutConfig, *, run_seed: int, max_response_len: int):
        self.loader = loader
        self.r = r
        self.run_seed = run_seed
        self.max_response_len = max_response_len
        self.stream: GroupStream | None = None
        # How long a group may take (the scheduler sets it: one request, or a multi-turn trajectory).
        self.timeout_s = r.timeout_s
        self.groups: dict[tuple[int, int], Group] = {}
        # (wave, index, sample) -> the partial group a continued sample belongs to (in flight too)
        self.continuing: dict[tuple[int, int, int], Group] = {}
        self.partial: list[Group] = []  # stopped part-way by an interrupt: kept for the checkpoint
        self.interrupting = False
        self.wave_steps: dict[int, int] = {}  # wave -> the global step its seeds come from
        self.done: list[Group] = []  # finished, not scored yet (arrival order)
        self._inbox: queue.Queue = queue.Queue()

    def submit(self, wave: int, global_step: int, groups: list[Group]) -> None:
        """Groups of one wave; consecutive indices go in one call (prompt i seeded base + index)."""
        r = self.r
        self.wave_steps[wave] = global_step
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
                self.groups[g.tag] = g
            self.stream.submit([self.loader.records[g.record].prompt_ids for g in run], spec,
                               [g.tag for g in run], self._inbox.put)

    def record_of(self, tag):
        """The record a submitted prompt comes from (the multi-turn loop resolves its environment);
        a continued sample's tag is its group's + the sample."""
        return self.loader.records[self.groups[tag[:2]].record]

    def continue_group(self, g: Group, global_step: int) -> None:
        """Continue a partial group's stopped samples: each one alone (n=1), its prompt followed by
        the tokens it has, the rest of the length, the sample's own seed (base + index + j)."""
        r = self.r
        self.wave_steps[g.wave] = global_step
        base = sampling_seed(self.run_seed, global_step) + g.index
        prompt = self.loader.records[g.record].prompt_ids
        self.groups[g.tag] = g
        for j, c in enumerate(g.completions):
            left = self.max_response_len - len(c.token_ids)
            if c.finish_reason != "abort" or left <= 0:
                continue
            spec = SamplingSpec(n=1, temperature=r.temperature, top_p=r.top_p, top_k=r.top_k, max_tokens=left,
                                seed=(base + j) % (2**31 - 1))
            tag = (g.wave, g.index, j)
            self.continuing[tag] = g
            self.stream.submit([list(prompt) + list(c.token_ids)], spec, [tag], self._inbox.put)
        if not any(t[:2] == g.tag for t in self.continuing):  # nothing left to generate
            for c in g.completions:
                if c.finish_reason == "abort":
                    c.finish_reason, c.truncated = "length", True
            self.groups.pop(g.tag)
            self.done.append(g)

    def receive(self, block: bool, stop=None) -> bool:
        """Move delivered groups from the engine's thread into ``done`` (arrival order); a
        continued sample is joined to its partial group first. Blocking: until something arrives
        (within ``rollout.timeout_s``, multi-turn: a trajectory's turns and steps; extended to
        ``rollout.timeout_s`` after the engine's last progress: a request re-sent after its engine timed
        out, a fleet waiting for restarts, a tool running within its own timeout is not a hang), or
        until ``stop()`` is true (returns False)."""
        timeout = self.timeout_s
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
                deadline = self.extended(deadline)
                if time.monotonic() >= deadline:
                    raise TimeoutError(f"rollout.async: no group finished within {timeout:g}s (rollout.timeout_s="
                                       f"{self.r.timeout_s:g}s per request) nor rollout.timeout_s after the "
                                       f"engine's last progress")
                continue
            block = False
            self._take(batch)

    def _take(self, batch: list) -> None:
        for tag, result in batch:
            if isinstance(result, BaseException) and (tag in self.groups or tag in self.continuing):
                if self.interrupting:  # stopping anyway: left to redraw (or continue) on resume
                    continue
                raise RuntimeError(f"rollout engine failed on prompt {tag}: {result}") from result
            if tag in self.continuing:
                self._joined(tag, result[0])
                continue
            g = self.groups.get(tag)
            if g is None:  # aborted meanwhile
                continue
            g.completions = result
            self.groups.pop(tag)
            if not g.partial:
                self.done.append(g)
            elif self.interrupting:  # stopped part-way: kept for the checkpoint as it is
                self.partial.append(g)
            else:  # stopped by something else: the rest of it is generated now
                self.continue_group(g, self.wave_steps[g.wave])

    def _joined(self, tag: tuple, rest: Completion) -> None:
        g = self.continuing.pop(tag)
        j = tag[2]
        g.completions[j] = join_completions(g.completions[j], rest)
        if not any(t[:2] == g.tag for t in self.continuing):
            self.groups.pop(g.tag, None)
            self.done.append(g)

    def stream_tags(self, tag: tuple) -> list[tuple]:
        """The tags a group's requests carry on the stream: its own, or its continued samples'."""
        return [t for t in self.continuing if t[:2] == tag] or [tag]

    def abort(self, tags: list[tuple]) -> None:
        """Stop these groups on the stream (it must be able to) and forget them."""
        self.stream.abort([t for tag in tags for t in self.stream_tags(tag)])
        for t in tags:
            self.groups.pop(t)
            for c in [c for c in self.continuing if c[:2] == t]:
                del self.continuing[c]

    def continuing_groups(self) -> list[Group]:
        """Groups whose partial samples are being continued."""
        return list({id(g): g for g in self.continuing.values()}.values())

    def extended(self, deadline: float) -> float:
        """A watchdog's deadline (``time.monotonic()``) moved to ``rollout.timeout_s`` after the
        engine's last progress when that is later (see ``GroupStream.last_progress``)."""
        progress = self.stream.last_progress()
        return deadline if progress is None else max(deadline, progress + self.r.timeout_s)
