"""The fleet's dispatch: every request to the least-loaded engine with room, re-sent on failure.

Every prompt is one request (``n`` samples, the prompt's own seed), sent to the engine with the least
outstanding work (sequences in flight) that has room (``rollout.max_inflight_seqs``); the others wait
and go out as engines finish, so a slow engine simply gets fewer prompts. The prompt's seed does not
depend on which engine serves it, so the fleet samples exactly what one engine would.

A request whose copy fails (:class:`~megatron_rl.rollout.fleet_request.Requeue`) is re-sent to the
others with the same seed (``rollout/requeued_requests``); when no engine is up it waits for the
fleet's revival (:mod:`megatron_rl.rollout.fleet_revival`). A named request can be aborted: its
``submit`` is cancelled and the engines serving it drop it (``/abort_requests``). Everything here
runs on the fleet's event loop but :meth:`Dispatcher.abort`'s caller.

Owns: the requests in flight (``requests``: by id; ``flights``: with a copy out), how many wait for
room, the time of the last progress, the ``rollout/requeued_requests`` count.
May call: :mod:`~megatron_rl.rollout.fleet_request` (one copy on one engine),
:class:`~megatron_rl.rollout.fleet_hedge.Hedger`, :class:`~megatron_rl.rollout.fleet_revival.Revival`
(awaiting a revival), :class:`~megatron_rl.rollout.fleet_members.Members`.
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid

from megatron_rl.rollout.base import Completion, EngineError, SamplingSpec
from megatron_rl.rollout.config import RolloutConfig
from megatron_rl.rollout.fleet_hedge import Hedger
from megatron_rl.rollout.fleet_members import Members, Slot
from megatron_rl.rollout.fleet_request import Flight, Requeue, send, until_verified
from megatron_rl.rollout.fleet_revival import Revival

log = logging.getLogger("megatron_rl")


class Dispatcher:
    """Requests of one fleet onto its engines (see the module doc)."""

    def __init__(self, members: Members, revival: Revival, cfg: RolloutConfig, name: str):
        self.members = members
        self.revival = revival
        self.cfg = cfg
        self.name = name
        self.capacity = cfg.inflight_seqs()
        self.hedger = Hedger(self, members, cfg.hedge_after, self.capacity)
        self.requests: dict[str, list] = {}  # request id -> [its submit task, its flight]
        self.flights: set[Flight] = set()    # requests with a copy in flight
        self.waiting = 0                     # requests waiting for room
        self.requeued = 0                    # re-sent since the last pop_metrics
        # time.monotonic() of the last dispatch or answer (see EngineFleet.last_progress)
        self.progress = time.monotonic()
        self._lock = members.lock

    async def submit(self, prompt_ids: list[int], sampling: SamplingSpec,
                     request_id: str | None = None) -> list[Completion]:
        """One prompt to the least-loaded live engine; re-sent elsewhere if that engine fails (and
        hedged onto another one if it is slow). ``request_id`` (unique among the requests in
        flight) lets :meth:`abort` stop it."""
        wire_id = request_id if request_id is not None else (
            f"{self.name}-{uuid.uuid4().hex}" if self.hedger.hedge_after > 0 else None)
        flight = Flight(list(prompt_ids), sampling, request_id, asyncio.Event(), wire_id=wire_id)
        if request_id is not None:
            with self._lock:
                self.requests[request_id] = [asyncio.current_task(), flight]
        try:
            while True:
                slot = await self._acquire(sampling.n)
                self.launch(flight, slot)
                try:
                    return await self._race(flight)
                except Requeue as exc:
                    with self._lock:
                        self.requeued += 1
                    log.info("re-sending a request of engine %s: %s", slot.engine.name, exc)
        finally:
            self.flights.discard(flight)
            if flight.answered:
                self.hedger.retire(flight)  # the losing copies of a hedged request
            else:
                for task in flight.copies:  # aborted (or failed): every copy goes
                    task.cancel()
            if request_id is not None:
                with self._lock:
                    self.requests.pop(request_id, None)

    def launch(self, flight: Flight, slot: Slot) -> None:
        """Send a copy of ``flight`` to ``slot`` (its room is already taken)."""
        self.progress = time.monotonic()
        if not flight.copies:
            flight.primary, flight.started = slot, self.members.loop.time()
        flight.copies[asyncio.ensure_future(self._copy(flight, slot))] = slot
        self.flights.add(flight)
        flight.changed.set()
        self.hedger.soon()

    async def _copy(self, flight: Flight, slot: Slot) -> list[Completion]:
        loop = self.members.loop
        t0 = loop.time()
        try:
            out = await send(self.members, slot, flight.prompt_ids, flight.sampling, flight.wire_id,
                             self.cfg.timeout_s)
            self.progress = time.monotonic()
            if flight.answered:  # a losing copy, aborted: its time says nothing of the engine's speed
                return out
            slot.latencies.append(loop.time() - t0)
            if not slot.verified.is_set():
                await until_verified(self.members, slot, self.cfg.timeout_s)
            return out
        finally:
            self._release(slot, flight.sampling.n)

    async def _race(self, flight: Flight) -> list[Completion]:
        """The first copy's answer; raises Requeue when every copy failed."""
        failure: Requeue | None = None
        while True:
            flight.changed.clear()
            waiter = asyncio.ensure_future(flight.changed.wait())  # a hedged copy was added
            try:
                done, _ = await asyncio.wait({*flight.copies, waiter}, return_when=asyncio.FIRST_COMPLETED)
            finally:
                waiter.cancel()
            for task in done:
                if task is waiter:
                    continue
                slot = flight.copies.pop(task)
                exc = task.exception()
                if exc is None:
                    out = task.result()
                    flight.answered = True
                    slot.served += len(out)
                    if slot is not flight.primary:
                        with self._lock:
                            self.hedger.wins += 1
                    return out
                if not isinstance(exc, Requeue):
                    raise exc
                failure = exc
            if not flight.copies:
                self.flights.discard(flight)
                raise failure

    async def _acquire(self, n: int) -> Slot:
        members = self.members
        while True:
            async with members.changed:
                while True:
                    up = members.up()
                    if not up:
                        break
                    room = [s for s in up if s.has_room(n, self.capacity)]
                    if room:
                        slot = min(room, key=lambda s: s.outstanding)  # ties: the first engine
                        slot.outstanding += n
                        return slot
                    self.waiting += 1
                    try:
                        await members.changed.wait()
                    finally:
                        self.waiting -= 1
            if self.revival.reviver is None:
                raise EngineError("no engine is up: " + members.describe())
            await self.revival.revived()

    def _release(self, slot: Slot, n: int) -> None:
        slot.outstanding -= n
        self.members.notify()
        self.hedger.soon()

    async def abort(self, request_ids: list[str]) -> int:
        """Stop these requests: their :meth:`submit` is cancelled, and the engines serving them drop
        them (``/abort_requests``). Returns how many were still in flight."""
        serving: dict[int, tuple[Slot, list[str]]] = {}
        found = 0
        with self._lock:
            entries = [(rid, self.requests.pop(rid, None)) for rid in request_ids]
        for rid, entry in entries:
            if entry is None:  # finished (or never sent)
                continue
            found += 1
            task, flight = entry
            for slot in {id(s): s for s in flight.copies.values()}.values():  # each engine serving a copy
                serving.setdefault(id(slot), (slot, []))[1].append(rid)
            task.cancel()
        for slot, rids in serving.values():
            stop = getattr(slot.engine, "abort", None)
            if stop is None:
                continue
            try:
                await stop(rids)
            except EngineError as exc:  # its requests are cancelled here anyway
                log.warning("engine %s: aborting %d requests failed: %s", slot.engine.name, len(rids), exc)
        return found
