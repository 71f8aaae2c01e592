"""The fleet of vLLM servers as a :class:`~megatron_rl.rollout.streaming.GroupStream`: what the async
rollout scheduler (``rollout.async``) drives.

Every prompt is one request to the fleet (its own seed, any engine), delivered as soon as its group
finishes. Requests are named, so leftovers can be stopped (``abort``: the fleet cancels them and the
servers drop them through ``/abort_requests``). Partial rollouts: before a weight update the servers
freeze what they are generating (``/pause?mode=keep``); the weight sync loads the new weights, resets
every cached block, frozen requests' included (they are recomputed with the new weights), labels the
new version and resumes each server once its weights are checked, before its probe: a server
paused in mode keep schedules nothing (vLLM's ``PAUSED_ALL``), the probe's request included, so the
probe can only run once the server runs again. What a server returns between its resume and its
probe's verdict is held by the fleet (:meth:`EngineFleet.resume_paused`) until the sync admits it,
and re-sent to the other servers if it fails instead: no token of unverified weights reaches a step.
Whatever is still paused afterwards (a server that failed the sync) is resumed by
``after_weight_update``. vLLM labels each output token with the version that sampled it, which the
server handle returns as the completions' ``version_spans``.
"""

from __future__ import annotations

import itertools
import threading
import time
import uuid
from typing import Hashable, Iterable

from megatron_rl.rollout.fleet import EngineFleet
from megatron_rl.rollout.streaming import GroupStream, OnDone


class FleetStream(GroupStream):
    """``fleet``'s requests, group by group, with abort and pause-across-updates."""

    keeps_in_flight = True
    can_abort = True

    def __init__(self, fleet: EngineFleet):
        self.fleet = fleet
        self._lock = threading.Lock()
        self._pending: dict[Hashable, str] = {}  # tag -> request id
        self._prefix = f"mrl-{uuid.uuid4().hex[:8]}-"  # request ids unique across trainers on a server
        self._ids = itertools.count()
        self._busy = 0.0
        self._busy_since: float | None = None  # something in flight since

    def submit(self, prompt_ids, sampling, tags, on_done: OnDone) -> None:
        for i, (prompt, tag) in enumerate(zip(prompt_ids, tags)):
            rid = f"{self._prefix}{next(self._ids)}"
            with self._lock:
                self._pending[tag] = rid
                if self._busy_since is None:
                    self._busy_since = time.perf_counter()
            fut = self.fleet.submit_threadsafe(prompt, sampling.for_prompt(i), request_id=rid)
            fut.add_done_callback(lambda f, tag=tag, rid=rid: self._finished(tag, rid, f, on_done))

    def _finished(self, tag, rid: str, fut, on_done: OnDone) -> None:
        with self._lock:
            if self._pending.get(tag) != rid:  # aborted
                return
            del self._pending[tag]
            self._settle_busy()
        if fut.cancelled():
            return
        exc = fut.exception()
        on_done([(tag, exc if exc is not None else fut.result())])

    def _settle_busy(self) -> None:
        if not self._pending and self._busy_since is not None:
            self._busy += time.perf_counter() - self._busy_since
            self._busy_since = None

    def abort(self, tags: Iterable[Hashable]) -> None:
        with self._lock:
            rids = [self._pending.pop(t) for t in list(tags) if t in self._pending]
            self._settle_busy()
        if rids:
            self.fleet.abort(rids)

    def busy_seconds(self) -> float:
        """Seconds with at least one request in flight (the fleet's engines generating)."""
        with self._lock:
            running = time.perf_counter() - self._busy_since if self._busy_since is not None else 0.0
            return self._busy + running

    def in_flight(self) -> int:
        with self._lock:
            return len(self._pending)

    def last_progress(self) -> float | None:
        return self.fleet.last_progress()

    def stop_with_partials(self) -> bool:
        """vLLM's ``/pause?mode=abort`` on every server: each request answers at once with the tokens
        it has (a preemption keeps them); nothing is scheduled afterwards."""
        self.fleet.pause("abort")
        return True

    def before_weight_update(self) -> None:
        self.fleet.pause("keep")

    def after_weight_update(self) -> None:
        self.fleet.resume()
