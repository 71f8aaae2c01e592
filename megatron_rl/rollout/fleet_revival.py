"""Engines coming back into the fleet: the probe before a sync, the wait for restarts, the revival.

Probe (:meth:`Revival.probe`, before each weight sync): a DOWN engine that answers ``/health`` again
(its launcher restarted it, maybe elsewhere: ``locate`` gives its registered URL) rejoins; so does a
live one that answers but reports other weights than it was verified with (restarted silently
between steps). A rejoining engine takes part in the next sync, which loads, verifies and admits it.

Losing every engine: when none is up, a request waits (up to ``rollout.start_timeout_s``) for the
launchers to restart some, and the fleet's *reviver* (the weight sync, which keeps the last weights
it sent) loads the current weights into each one that answers again and verifies them before it is
admitted (``rollout/revivals``); then the waiting requests go out, with their own seeds. Without a
reviver (or when none comes back in time) the request fails. One revival runs at a time, in a
worker thread, awaited by every request that found no engine up.

Owns: the reviver, the revival in progress and the count of revivals.
May call: :class:`~megatron_rl.rollout.fleet_members.Members` (states, rejoin), the engines' health,
connect, retarget, ``is_paused`` and ``server_weight_version``; the reviver.
"""

from __future__ import annotations

import asyncio
import concurrent.futures as cf
import logging
import time

from megatron_rl.rollout.base import UNKNOWN_VERSION, EngineError, RolloutEngine
from megatron_rl.rollout.config import RolloutConfig
from megatron_rl.rollout.fleet_members import EngineState, Members, Slot

log = logging.getLogger("megatron_rl")


class Revival:
    """How the fleet's engines come back (see the module doc)."""

    def __init__(self, members: Members, cfg: RolloutConfig, locate=None):
        self.members = members
        self.cfg = cfg
        self._locate = locate
        # When no engine is up: reviver() loads and verifies the current weights into engines that
        # answer again (set by the weight sync); None: a request then fails.
        self.reviver = None
        self._running: asyncio.Future | None = None
        self.count = 0  # revivals since the last pop_metrics

    # ----------------------------------------------------------------------------- the probe
    def probe(self) -> list[RolloutEngine]:
        """Check the engines before a sync: a DOWN engine that answers /health again rejoins; a
        live one that answers but reports other weights than it was verified with (it restarted)
        rejoins too. Returns the engines that are rejoining."""
        slots = self.members.slots
        with cf.ThreadPoolExecutor(max_workers=len(slots), thread_name_prefix="probe") as pool:
            rejoined = list(pool.map(self._probe_one, slots))
        return [slot.engine for slot, yes in zip(slots, rejoined) if yes]

    def _probe_one(self, slot: Slot) -> bool:
        engine = slot.engine
        if slot.state is EngineState.DOWN:
            url = self._locate(engine.name) if self._locate is not None else None
            if url is not None and hasattr(engine, "retarget"):
                engine.retarget(url)
            if not engine.health():
                return False
            connect = getattr(engine, "connect", None)
            try:
                if connect is not None:
                    connect()
            except EngineError:
                return False
            slot.paused = _reported_paused(engine)  # a new process is not; a stopped one may be
        elif slot.state is EngineState.UP:
            reported = _reported_version(engine)
            if reported is None or reported == str(engine.weight_version):
                return False
            log.warning("engine %s reports weight version %r, verified %d: it restarted",
                        engine.name, reported, engine.weight_version)
            engine.weight_version = UNKNOWN_VERSION
            self.members.loop.call_soon_threadsafe(self.members.signal_down, slot)  # its requests go elsewhere
            slot.paused = _reported_paused(engine)
        else:
            return False
        self.members.rejoin(slot)
        return True

    def wait_for_engines(self, timeout_s: float, poll_s: float = 1.0) -> list[RolloutEngine]:
        """Until some engine can take part in a sync (live, rejoining, or DOWN and answering again:
        :meth:`probe`), at most ``timeout_s``: the engines a sync would load (empty: none came back)."""
        deadline = time.monotonic() + timeout_s
        while True:
            self.probe()
            targets = self.members.sync_targets()
            if targets or time.monotonic() >= deadline:
                return targets
            time.sleep(min(poll_s, max(0.0, deadline - time.monotonic())))

    # --------------------------------------------------------------------------- the revival
    async def revived(self) -> None:
        """On the fleet's loop: one revival at a time (:meth:`revive`, in a worker thread), awaited
        by every request that found no engine up; its failure is theirs."""
        if self._running is None or self._running.done():
            self._running = asyncio.ensure_future(asyncio.to_thread(self.revive))
            self._running.add_done_callback(lambda _: self.members.notify())
        await asyncio.shield(self._running)

    def running(self) -> bool:
        """A revival is in progress (it waits up to ``rollout.start_timeout_s``, bounded by itself)."""
        return self._running is not None and not self._running.done()

    def revive(self) -> None:
        """No engine is up: wait up to ``rollout.start_timeout_s`` for restarts, and have the reviver
        load and verify the current weights into those that answer again (runs in a worker thread)."""
        members = self.members
        timeout = self.cfg.start_timeout_s
        deadline = time.monotonic() + timeout
        log.warning("no engine is up (%s): waiting up to rollout.start_timeout_s=%gs for restarts",
                    members.describe(), timeout)
        last = ""
        while not members.live():
            left = deadline - time.monotonic()
            if left <= 0 or not self.wait_for_engines(left):
                raise EngineError(f"no engine is up, and none came back within rollout.start_timeout_s="
                                  f"{timeout:g}s: {members.describe()}" + (f"; last revival: {last}" if last else ""))
            reviver = self.reviver
            if reviver is None:
                raise EngineError(f"no engine is up and nothing can load weights into those that came back: "
                                  f"{members.describe()}")
            try:
                reviver()
            except Exception as exc:  # noqa: BLE001 - the engines it failed are out again; try until the deadline
                last = f"{type(exc).__name__}: {exc}"
                log.warning("reviving the fleet failed: %s", last)
                time.sleep(min(1.0, max(0.0, deadline - time.monotonic())))
        with members.lock:
            self.count += 1
        log.info("engines back in service after a total loss: %s", [e.name for e in members.live()])


def _reported_paused(engine: RolloutEngine) -> bool:
    """Whether the engine says it is paused (False when it cannot say)."""
    ask = getattr(engine, "is_paused", None)
    if ask is None:
        return False
    try:
        return bool(ask())
    except EngineError:
        return False


def _reported_version(engine: RolloutEngine) -> str | None:
    """The engine's own view of its weight version, or None if it has none / cannot say."""
    ask = getattr(engine, "server_weight_version", None)
    if ask is None:
        return None
    try:
        return ask()
    except EngineError:
        return None
