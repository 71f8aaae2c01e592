"""Tail hedging in the fleet (``rollout.hedge_after``): extra copies of slow requests, and the copies
that lost.

The work a slow engine took at the start (a full room of it) is the step's tail. When no request
waits for room, an engine with room also takes a request that has run elsewhere for longer than
``hedge_after`` times its own median request time; both copies carry the same seed, so they sample
the same tokens; the first answer is taken. The other copy is aborted on its engine
(``/abort_requests``) but still awaited there, within ``rollout.timeout_s`` of when it was sent,
its result dropped: an engine whose requests were all hedged away (stopped, hung) is thus still
found out within that time, and marked down, as without hedging. Only engines holding the same
weight version hedge each other, and none while the fleet is paused.

Owns: the hedging timer and the ``rollout/hedged_requests`` / ``rollout/hedge_wins`` counts.
May call: the dispatcher it serves (its flights, how many requests wait, ``launch``: duck-typed,
see :class:`Flights`), :class:`~megatron_rl.rollout.fleet_members.Members`, the engines' ``abort``.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Protocol

from megatron_rl.rollout.base import EngineDied, EngineError, EngineTimeout
from megatron_rl.rollout.fleet_members import Members, Slot
from megatron_rl.rollout.fleet_request import Flight, consume

log = logging.getLogger("megatron_rl")


class Flights(Protocol):
    """What the hedger reads of the dispatcher: the requests in flight, how many wait for room."""

    flights: set[Flight]
    waiting: int

    def launch(self, flight: Flight, slot: Slot) -> None: ...


class Hedger:
    """Hedges ``dispatch``'s slow requests onto engines with room (see the module doc)."""

    def __init__(self, dispatch: Flights, members: Members, hedge_after: float, capacity: int):
        self.dispatch = dispatch
        self.members = members
        self.hedge_after = hedge_after
        self.capacity = capacity
        self._timer: asyncio.TimerHandle | None = None
        self.hedged = 0  # copies sent since the last pop_metrics
        self.wins = 0    # of the requests answered, those a hedged copy answered first

    def soon(self) -> None:
        """On the fleet's loop: look again once the current callback is done."""
        if self.hedge_after > 0:
            self.members.loop.call_soon(self.hedge)

    def soon_threadsafe(self) -> None:
        if self.hedge_after > 0:
            self.members.loop.call_soon_threadsafe(self.hedge)

    def cancel(self) -> None:
        if self._timer is not None:
            self._timer.cancel()

    def hedge(self) -> None:
        """While nothing waits for room, give engines with room a copy of the oldest requests that
        ran elsewhere for longer than ``hedge_after`` x their own median request time; wake up again
        when the next one is due."""
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        if self.dispatch.waiting or self.members.paused or not self.dispatch.flights:
            return
        loop = self.members.loop
        now, due_next = loop.time(), None
        up = [s for s in self.members.up() if not s.paused and s.typical() is not None]
        for flight in sorted(self.dispatch.flights, key=lambda f: f.started):
            if len(flight.copies) != 1:
                continue
            (other,) = flight.copies.values()
            n = flight.sampling.n
            able = [s for s in up if s is not other and s.has_room(n, self.capacity)
                    and s.engine.weight_version == other.engine.weight_version]
            if not able:
                continue
            due = {id(s): flight.started + self.hedge_after * s.typical() for s in able}
            ready = [s for s in able if due[id(s)] <= now]
            if not ready:
                soonest = min(due.values())
                due_next = soonest if due_next is None else min(due_next, soonest)
                continue
            slot = min(ready, key=lambda s: s.outstanding)
            slot.outstanding += n
            with self.members.lock:
                self.hedged += 1
            log.debug("hedging a request of engine %s on %s", other.engine.name, slot.engine.name)
            self.dispatch.launch(flight, slot)
        if due_next is not None:
            self._timer = loop.call_at(due_next, self.hedge)

    def retire(self, flight: Flight) -> None:
        """The copies that lost a hedged request's race: each engine is asked to abort its copy, and
        the copy is still awaited (its result dropped; its room stays taken until it answers):
        within ``rollout.timeout_s`` of when it was sent, or its engine is marked down (a stopped
        engine whose every request was hedged away is found out as one that kept them)."""
        for task, slot in flight.copies.items():
            task.add_done_callback(consume)
            stop = getattr(slot.engine, "abort", None)
            if stop is not None and flight.wire_id is not None:
                asyncio.ensure_future(self._abort_copy(slot, stop, flight.wire_id)).add_done_callback(consume)
        flight.copies.clear()

    async def _abort_copy(self, slot: Slot, stop, wire_id: str) -> None:
        try:
            await stop([wire_id])
        except (EngineDied, EngineTimeout) as exc:
            self.members.mark_down(slot.engine, f"aborting a hedged request's losing copy failed: {exc}")
        except EngineError as exc:  # the copy is still bounded by its own timeout
            log.warning("engine %s: aborting a hedged request's losing copy failed: %s", slot.engine.name, exc)
