"""The fleet's membership: which engines it has, the state each is in, and the changes of state.

An engine is UP (serving, holding the weight version it was verified with), JOINING (it answers
again, or answers with unknown weights: it takes part in the next sync, then is admitted) or DOWN
(failed: out until it answers and a sync loads and verifies the current weights into it). Every
change of state is made under one lock, from any thread, and announced on the fleet's event loop:
a slot's ``down`` event cancels the requests in flight there (they are re-sent elsewhere), its
``verified`` event releases the results held while it ran unverified weights, and the ``changed``
condition wakes the requests that wait for room.

Owns: :class:`EngineState`, :class:`Slot` (the book-keeping of one engine), :class:`Members`.
May call: the engines' ``weight_version`` (set to UNKNOWN_VERSION when one is taken out); nothing
else of the fleet.
"""

from __future__ import annotations

import asyncio
import enum
import logging
import statistics
import threading
from collections import deque
from dataclasses import dataclass, field

from megatron_rl.rollout.base import UNKNOWN_VERSION, RolloutEngine

log = logging.getLogger("megatron_rl")


class EngineState(enum.Enum):
    UP = "up"            # serving; holds the verified weight version
    JOINING = "joining"  # answers again (restarted); takes part in the next sync, then UP
    DOWN = "down"        # failed; not used until it answers and is synced


@dataclass
class Slot:
    """The fleet's book-keeping for one engine."""

    engine: RolloutEngine
    state: EngineState = EngineState.UP
    outstanding: int = 0  # sequences in flight
    reason: str = ""      # why it went down
    down: asyncio.Event | None = None
    # Clear while the engine runs new weights not verified yet (resumed before its probe, partial
    # rollouts): what it returns meanwhile is held until it is admitted (or re-sent if it fails).
    verified: asyncio.Event | None = None
    served: int = 0       # sequences served since the last pop_metrics
    # Paused by the fleet (pause(), hold()): the engine schedules nothing until it is resumed.
    paused: bool = False
    tasks: set = field(default_factory=set)
    # seconds its recent answered requests took (what tail hedging compares against)
    latencies: deque = field(default_factory=lambda: deque(maxlen=32))

    def typical(self) -> float | None:
        """Median time of its recent answered requests (None before the first)."""
        return statistics.median(self.latencies) if self.latencies else None

    def has_room(self, n: int, capacity: int) -> bool:
        return self.outstanding == 0 or self.outstanding + n <= capacity


class Members:
    """The engines of one fleet and their states. The asyncio parts (each slot's events, the
    ``changed`` condition) live on the fleet's ``loop`` (set before :meth:`open` makes them there)."""

    def __init__(self, engines: list[RolloutEngine], loop: asyncio.AbstractEventLoop | None = None):
        if not engines:
            raise ValueError("EngineFleet needs at least one engine")
        names = [e.name for e in engines]
        if len(set(names)) != len(names):
            raise ValueError(f"engine names must be unique, got {names}")
        self.slots = [Slot(e) for e in engines]
        self.lock = threading.Lock()
        self.loop = loop
        self.changed: asyncio.Condition | None = None  # a slot's state or room changed
        # The whole fleet paused (between pause() and resume()), and in which mode.
        self.paused = False
        self.pause_mode = "keep"

    async def open(self) -> None:
        """On the fleet's loop: each slot's events and the ``changed`` condition."""
        for slot in self.slots:
            slot.down = asyncio.Event()
            slot.verified = asyncio.Event()
            slot.verified.set()
        self.changed = asyncio.Condition()

    # ------------------------------------------------------------------------------- reading
    @property
    def engines(self) -> list[RolloutEngine]:
        return [s.engine for s in self.slots]

    def slot(self, engine: RolloutEngine | str) -> Slot:
        name = engine if isinstance(engine, str) else engine.name
        for slot in self.slots:
            if slot.engine.name == name:
                return slot
        raise KeyError(f"no engine {name!r} in the fleet (engines: {[s.engine.name for s in self.slots]})")

    def states(self) -> dict[str, str]:
        return {s.engine.name: s.state.value for s in self.slots}

    def up(self) -> list[Slot]:
        return [s for s in self.slots if s.state is EngineState.UP]

    def live(self) -> list[RolloutEngine]:
        """Engines that serve requests now."""
        return [s.engine for s in self.up()]

    def sync_targets(self) -> list[RolloutEngine]:
        """Engines the next weight sync should load: the live ones and those rejoining."""
        return [s.engine for s in self.slots if s.state is not EngineState.DOWN]

    def describe(self) -> str:
        return "; ".join(f"{s.engine.name} {s.state.value}" + (f" ({s.reason})" if s.reason else "")
                         for s in self.slots)

    # ---------------------------------------------------------------------- changes of state
    def mark_down(self, engine: RolloutEngine | str, reason: str) -> None:
        """Take ``engine`` out: its weights are unknown, its outstanding requests are re-sent."""
        slot = self.slot(engine)
        with self.lock:
            if slot.state is EngineState.DOWN:
                return
            slot.state, slot.reason = EngineState.DOWN, reason
        slot.engine.weight_version = UNKNOWN_VERSION
        log.warning("engine %s is down: %s", slot.engine.name, reason)
        self.loop.call_soon_threadsafe(self.signal_down, slot)

    def mark_unknown(self, engine: RolloutEngine | str, reason: str) -> None:
        """``engine`` answers but holds unknown weights (a failed sync): it serves nothing, its
        outstanding requests are re-sent, and it takes part in the next sync."""
        slot = self.slot(engine)
        with self.lock:
            slot.state, slot.reason = EngineState.JOINING, reason
        slot.engine.weight_version = UNKNOWN_VERSION
        log.warning("engine %s holds unknown weights: %s", slot.engine.name, reason)
        self.loop.call_soon_threadsafe(self.signal_down, slot)

    def rejoin(self, slot: Slot) -> None:
        """``slot`` answers again (found by the probe): it takes part in the next sync."""
        with self.lock:
            slot.state, slot.reason = EngineState.JOINING, ""

    def admit(self, engine: RolloutEngine | str) -> None:
        """Put ``engine`` back into service (after a verified sync)."""
        slot = self.slot(engine)
        with self.lock:
            was, slot.state, slot.reason = slot.state, EngineState.UP, ""
        if was is not EngineState.UP:
            log.info("engine %s is back in service (weight version %d)", slot.engine.name,
                     slot.engine.weight_version)
        self.loop.call_soon_threadsafe(self._reopen, slot)

    # ------------------------------------------------------------------ on the fleet's loop
    def signal_down(self, slot: Slot) -> None:
        """Its requests in flight are cancelled (and re-sent elsewhere)."""
        slot.down.set()
        self.notify()

    def _reopen(self, slot: Slot) -> None:
        slot.down.clear()
        slot.verified.set()
        self.notify()

    async def unverify(self, slot: Slot) -> None:
        """What ``slot`` returns from now on is held until it is admitted (or re-sent)."""
        slot.verified.clear()

    def notify(self) -> None:
        """Wake every request waiting for room (a slot's state or room changed)."""
        async def wake():
            async with self.changed:
                self.changed.notify_all()
        asyncio.ensure_future(wake())
