"""Many engines behind one: continuous, straggler-aware dispatch with fault handling.

Every prompt is one request (``n`` samples, the prompt's own seed), sent to the engine with the least
outstanding work (sequences in flight) that has room (``rollout.max_inflight_seqs``); the others wait
and go out as engines finish, so a slow engine simply gets fewer prompts. The prompt's seed does not
depend on which engine serves it, so the fleet samples exactly what one engine would.

Tail hedging (``rollout.hedge_after``): the work a slow engine took at the start (a full room of it)
is the step's tail. When no request waits for room, an engine with room also takes a request that
has run elsewhere for longer than ``hedge_after`` times its own median request time; both copies
carry the same seed, so they sample the same tokens; the first answer is taken. The other copy is
aborted on its engine (``/abort_requests``) but still awaited there, within ``rollout.timeout_s``
of when it was sent, its result dropped: an engine whose requests were all hedged away (stopped,
hung) is thus still found out within that time, and marked down, as without hedging. Only engines
holding the same weight version hedge each other, and none while the fleet is paused.

Faults: a request that fails (the engine died, refused or cut the connection, answered an error,
or did not answer within ``rollout.timeout_s``; a hedged request's losing copy included) marks its
engine DOWN; that engine's outstanding
requests are cancelled and re-sent to the others with the same seeds (counted in
``rollout/requeued_requests``). A DOWN engine stays out until :meth:`probe` finds it answering again
(its launcher restarted it), the weight sync loads and verifies the current weights into it, and
:meth:`admit` puts it back. An engine that answers but says it holds other weights than those it was
verified with (restarted silently between steps) is taken out the same way.

Losing every engine: when none is up, a request waits (up to ``rollout.start_timeout_s``) for the
launchers to restart some, and the fleet's *reviver* (:meth:`set_reviver`: the weight sync, which
keeps the last weights it sent) loads the current weights into each one that answers again and
verifies them before it is admitted (``rollout/revivals``); then the waiting requests go out, with
their own seeds. Without a reviver (or when none comes back in time) the request fails.

Weight loads: a sync round takes each engine's weights apart between vLLM's ``/start_weight_update``
and ``/finish_weight_update`` (its layerwise reload leaves them on the meta device), and a forward
pass in between kills the engine core. So :meth:`hold` pauses every engine a round loads (mode
keep: nothing is scheduled, whatever still runs there: a hedged request's losing copy being
aborted, a request the fleet gave up on, one dispatched meanwhile, which waits) and the sync resumes
each one only after its finish, before its probe (:meth:`resume_paused`; what it returns before its
probe passed is held, and re-sent if it fails).

The fleet runs its own asyncio loop in a background thread: :meth:`generate` (a batch, blocking) and
:meth:`submit` (one prompt; a coroutine for that loop) and :meth:`submit_threadsafe` (one prompt,
from any thread: a ``concurrent.futures.Future``) all dispatch through it, so an asynchronous
trainer can keep requests flowing across steps.
"""

from __future__ import annotations

import asyncio
import concurrent.futures as cf
import enum
import logging
import statistics
import threading
import time
import uuid
from collections import deque
from dataclasses import dataclass, field

from megatron_rl.common.cpus import float_over_all
from megatron_rl.rollout.base import (UNKNOWN_VERSION, Completion, EngineDied, EngineError, EngineTimeout,
                                      PauseMode, RolloutEngine, SamplingSpec)
from megatron_rl.rollout.config import RolloutConfig

log = logging.getLogger("megatron_rl")


class EngineState(enum.Enum):
    UP = "up"            # serving; holds the verified weight version
    JOINING = "joining"  # answers again (restarted); takes part in the next sync, then UP
    DOWN = "down"        # failed; not used until it answers and is synced


@dataclass
class _Slot:
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


@dataclass(eq=False)
class _Flight:
    """One prompt's request and the copies of it in flight (more than one when hedged)."""

    prompt_ids: list[int]
    sampling: SamplingSpec
    request_id: str | None
    changed: asyncio.Event
    copies: dict = field(default_factory=dict)  # copy task -> the slot serving it
    primary: _Slot | None = None                # the slot the request was dispatched to
    started: float = 0.0                        # loop time the primary copy was sent
    # The id its copies carry on engines that can abort (the caller's request_id; with hedging, one
    # of the fleet's, so that a losing copy can be aborted); None: none.
    wire_id: str | None = None
    answered: bool = False                      # a copy's answer was taken (the others lost)


class EngineFleet(RolloutEngine):
    """``engines`` (each with an awaitable ``submit``) dispatched as one engine."""

    def __init__(self, engines: list[RolloutEngine], cfg: RolloutConfig, *, name: str = "fleet",
                 locate=None):
        """``locate(name)``, when given, returns where engine ``name`` is now (its registered URL):
        :meth:`probe` looks a DOWN engine up again, as its launcher may restart it elsewhere."""
        if not engines:
            raise ValueError("EngineFleet needs at least one engine")
        names = [e.name for e in engines]
        if len(set(names)) != len(names):
            raise ValueError(f"engine names must be unique, got {names}")
        self.cfg = cfg
        self.name = name
        self.capacity = cfg.inflight_seqs()
        self.hedge_after = cfg.hedge_after
        self._locate = locate
        self._slots = [_Slot(e) for e in engines]
        self._lock = threading.Lock()
        self._requeued = 0
        self._hedged = self._hedge_wins = 0
        # request id -> [its submit task, its flight]
        self._requests: dict[str, list] = {}
        self._flights: set[_Flight] = set()  # requests with a copy in flight
        self._waiting = 0                    # requests waiting for room
        self._hedge_timer: asyncio.TimerHandle | None = None
        self._paused = False  # between pause() and resume()
        self._pause_mode: PauseMode = "keep"
        # When no engine is up: reviver(engines) loads and verifies the current weights into engines
        # that answer again (set by the weight sync); None: a request then fails.
        self._reviver = None
        self._revival: asyncio.Future | None = None
        self._revivals = 0
        # time.monotonic() of the last dispatch, answer or revival step (see last_progress)
        self._progress = time.monotonic()
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._run_loop, name=f"{name}-loop", daemon=True)
        self._thread.start()
        self._changed = self._run(self._make_condition())

    def _run_loop(self) -> None:
        float_over_all()  # trainer.cpu_cores: the wave's HTTP traffic runs where a core is free
        self._loop.run_forever()

    # ------------------------------------------------------------------------------ membership
    @property
    def engines(self) -> list[RolloutEngine]:
        return [s.engine for s in self._slots]

    def state(self, engine: RolloutEngine | str) -> EngineState:
        return self._slot(engine).state

    def states(self) -> dict[str, str]:
        return {s.engine.name: s.state.value for s in self._slots}

    def live(self) -> list[RolloutEngine]:
        """Engines that serve requests now."""
        return [s.engine for s in self._slots if s.state is EngineState.UP]

    def sync_targets(self) -> list[RolloutEngine]:
        """Engines the next weight sync should load: the live ones and those rejoining."""
        return [s.engine for s in self._slots if s.state is not EngineState.DOWN]

    @property
    def weight_version(self) -> int:
        """The oldest verified version any live engine holds (UNKNOWN_VERSION if none is live)."""
        live = self.live()
        return min(e.weight_version for e in live) if live else UNKNOWN_VERSION

    @weight_version.setter
    def weight_version(self, value: int) -> None:  # the sync sets each engine's own version
        pass

    def mark_down(self, engine: RolloutEngine | str, reason: str) -> None:
        """Take ``engine`` out: its weights are unknown, its outstanding requests are re-sent."""
        slot = self._slot(engine)
        with self._lock:
            if slot.state is EngineState.DOWN:
                return
            slot.state, slot.reason = EngineState.DOWN, reason
        slot.engine.weight_version = UNKNOWN_VERSION
        log.warning("engine %s is down: %s", slot.engine.name, reason)
        self._loop.call_soon_threadsafe(self._signal_down, slot)

    def mark_unknown(self, engine: RolloutEngine | str, reason: str) -> None:
        """``engine`` answers but holds unknown weights (a failed sync): it serves nothing, its
        outstanding requests are re-sent, and it takes part in the next sync."""
        slot = self._slot(engine)
        with self._lock:
            slot.state, slot.reason = EngineState.JOINING, reason
        slot.engine.weight_version = UNKNOWN_VERSION
        log.warning("engine %s holds unknown weights: %s", slot.engine.name, reason)
        self._loop.call_soon_threadsafe(self._signal_down, slot)

    def admit(self, engine: RolloutEngine | str) -> None:
        """Put ``engine`` back into service (after a verified sync)."""
        slot = self._slot(engine)
        with self._lock:
            was, slot.state, slot.reason = slot.state, EngineState.UP, ""
        if was is not EngineState.UP:
            log.info("engine %s is back in service (weight version %d)", slot.engine.name,
                     slot.engine.weight_version)
        self._loop.call_soon_threadsafe(self._reopen, slot)

    def probe(self) -> list[RolloutEngine]:
        """Check the engines before a sync: a DOWN engine that answers /health again rejoins; a
        live one that answers but reports other weights than it was verified with (it restarted)
        rejoins too. Returns the engines that are rejoining."""
        with cf.ThreadPoolExecutor(max_workers=len(self._slots), thread_name_prefix="probe") as pool:
            rejoined = list(pool.map(self._probe_one, self._slots))
        return [slot.engine for slot, yes in zip(self._slots, rejoined) if yes]

    def _probe_one(self, slot: _Slot) -> bool:
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
            self._loop.call_soon_threadsafe(self._signal_down, slot)  # its requests go elsewhere
            slot.paused = _reported_paused(engine)
        else:
            return False
        with self._lock:
            slot.state, slot.reason = EngineState.JOINING, ""
        return True

    def wait_for_engines(self, timeout_s: float, poll_s: float = 1.0) -> list[RolloutEngine]:
        """Until some engine can take part in a sync (live, rejoining, or DOWN and answering again:
        :meth:`probe`), at most ``timeout_s``: the engines a sync would load (empty: none came back)."""
        deadline = time.monotonic() + timeout_s
        while True:
            self.probe()
            targets = self.sync_targets()
            if targets or time.monotonic() >= deadline:
                return targets
            time.sleep(min(poll_s, max(0.0, deadline - time.monotonic())))

    def set_reviver(self, reviver) -> None:
        """``reviver()`` (from a worker thread, when no engine is up and some answer again): load the
        current weights into the engines :meth:`sync_targets` names, verify and :meth:`admit` them (the
        weight sync registers itself); raises or leaves none up when it cannot. None: no revival."""
        self._reviver = reviver

    @property
    def reviver(self):
        return self._reviver

    def _revive(self) -> None:
        """No engine is up: wait up to ``rollout.start_timeout_s`` for restarts, and have the reviver
        load and verify the current weights into those that answer again (runs in a worker thread)."""
        timeout = self.cfg.start_timeout_s
        deadline = time.monotonic() + timeout
        log.warning("no engine is up (%s): waiting up to rollout.start_timeout_s=%gs for restarts",
                    self._describe(), timeout)
        last = ""
        while not self.live():
            left = deadline - time.monotonic()
            if left <= 0 or not self.wait_for_engines(left):
                raise EngineError(f"no engine is up, and none came back within rollout.start_timeout_s="
                                  f"{timeout:g}s: {self._describe()}" + (f"; last revival: {last}" if last else ""))
            reviver = self._reviver
            if reviver is None:
                raise EngineError(f"no engine is up and nothing can load weights into those that came back: "
                                  f"{self._describe()}")
            try:
                reviver()
            except Exception as exc:  # noqa: BLE001 - the engines it failed are out again; try until the deadline
                last = f"{type(exc).__name__}: {exc}"
                log.warning("reviving the fleet failed: %s", last)
                time.sleep(min(1.0, max(0.0, deadline - time.monotonic())))
        with self._lock:
            self._revivals += 1
        log.info("engines back in service after a total loss: %s", [e.name for e in self.live()])

    def last_progress(self) -> float:
        """``time.monotonic()`` of the fleet's last progress: a request sent or re-sent, a copy
        answered, or now while a revival runs (it waits up to ``rollout.start_timeout_s`` for
        restarts, bounded by itself). A caller's watchdog counts ``rollout.timeout_s`` from it: a request
        re-sent after its engine timed out, or waiting for a revival, has not hung."""
        if self._revival is not None and not self._revival.done():
            return time.monotonic()
        return self._progress

    def _describe(self) -> str:
        return "; ".join(f"{s.engine.name} {s.state.value}" + (f" ({s.reason})" if s.reason else "")
                         for s in self._slots)

    # ------------------------------------------------------------------------------- dispatch
    def generate(self, prompt_ids: list[list[int]], sampling: SamplingSpec) -> list[list[Completion]]:
        return self._run(self.agenerate(prompt_ids, sampling))

    async def agenerate(self, prompt_ids: list[list[int]], sampling: SamplingSpec) -> list[list[Completion]]:
        """All prompts at once; prompt i is sampled with ``sampling.prompt_seed(i)``."""
        return list(await asyncio.gather(*(self.submit(p, sampling.for_prompt(i))
                                           for i, p in enumerate(prompt_ids))))

    def submit_threadsafe(self, prompt_ids: list[int], sampling: SamplingSpec,
                          request_id: str | None = None) -> cf.Future:
        """:meth:`submit` from any thread; the result is a ``concurrent.futures.Future``."""
        return asyncio.run_coroutine_threadsafe(self.submit(prompt_ids, sampling, request_id), self._loop)

    async def submit(self, prompt_ids: list[int], sampling: SamplingSpec,
                     request_id: str | None = None) -> list[Completion]:
        """One prompt to the least-loaded live engine; re-sent elsewhere if that engine fails (and
        hedged onto another one if it is slow, see the module doc). ``request_id`` (unique among the
        requests in flight) lets :meth:`abort` stop it."""
        wire_id = request_id if request_id is not None else (
            f"{self.name}-{uuid.uuid4().hex}" if self.hedge_after > 0 else None)
        flight = _Flight(list(prompt_ids), sampling, request_id, asyncio.Event(), wire_id=wire_id)
        if request_id is not None:
            with self._lock:
                self._requests[request_id] = [asyncio.current_task(), flight]
        try:
            while True:
                slot = await self._acquire(sampling.n)
                self._launch(flight, slot)
                try:
                    return await self._race(flight)
                except _Requeue as exc:
                    with self._lock:
                        self._requeued += 1
                    log.info("re-sending a request of engine %s: %s", slot.engine.name, exc)
        finally:
            self._flights.discard(flight)
            if flight.answered:
                self._retire(flight)  # the losing copies of a hedged request
            else:
                for task in flight.copies:  # aborted (or failed): every copy goes
                    task.cancel()
            if request_id is not None:
                with self._lock:
                    self._requests.pop(request_id, None)

    def _launch(self, flight: _Flight, slot: _Slot) -> None:
        """Send a copy of ``flight`` to ``slot`` (its room is already taken)."""
        self._progress = time.monotonic()
        if not flight.copies:
            flight.primary, flight.started = slot, self._loop.time()
        flight.copies[asyncio.ensure_future(self._copy(flight, slot))] = slot
        self._flights.add(flight)
        flight.changed.set()
        self._hedge_soon()

    async def _copy(self, flight: _Flight, slot: _Slot) -> list[Completion]:
        t0 = self._loop.time()
        try:
            out = await self._send(slot, flight.prompt_ids, flight.sampling, flight.wire_id)
            self._progress = time.monotonic()
            if flight.answered:  # a losing copy, aborted: its time says nothing of the engine's speed
                return out
            slot.latencies.append(self._loop.time() - t0)
            if not slot.verified.is_set():
                await self._until_verified(slot)
            return out
        finally:
            self._release(slot, flight.sampling.n)

    def _retire(self, flight: _Flight) -> None:
        """The copies that lost a hedged request's race: each engine is asked to abort its copy, and
        the copy is still awaited (its result dropped; its room stays taken until it answers):
        within ``rollout.timeout_s`` of when it was sent, or its engine is marked down (a stopped
        engine whose every request was hedged away is found out as one that kept them)."""
        for task, slot in flight.copies.items():
            task.add_done_callback(_consume)
            stop = getattr(slot.engine, "abort", None)
            if stop is not None and flight.wire_id is not None:
                asyncio.ensure_future(self._abort_copy(slot, stop, flight.wire_id)).add_done_callback(_consume)
        flight.copies.clear()

    async def _abort_copy(self, slot: _Slot, stop, wire_id: str) -> None:
        try:
            await stop([wire_id])
        except (EngineDied, EngineTimeout) as exc:
            self.mark_down(slot.engine, f"aborting a hedged request's losing copy failed: {exc}")
        except EngineError as exc:  # the copy is still bounded by its own timeout
            log.warning("engine %s: aborting a hedged request's losing copy failed: %s", slot.engine.name, exc)

    async def _race(self, flight: _Flight) -> list[Completion]:
        """The first copy's answer; raises _Requeue when every copy failed."""
        failure: _Requeue | None = None
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
                            self._hedge_wins += 1
                    return out
                if not isinstance(exc, _Requeue):
                    raise exc
                failure = exc
            if not flight.copies:
                self._flights.discard(flight)
                raise failure

    def _hedge_soon(self) -> None:
        if self.hedge_after > 0:
            self._loop.call_soon(self._hedge)

    def _hedge(self) -> None:
        """Tail hedging: while nothing waits for room, give engines with room a copy of the oldest
        requests that ran elsewhere for longer than ``hedge_after`` x their own median request time;
        wake up again when the next one is due."""
        if self._hedge_timer is not None:
            self._hedge_timer.cancel()
            self._hedge_timer = None
        if self._waiting or self._paused or not self._flights:
            return
        now, due_next = self._loop.time(), None
        up = [s for s in self._slots if s.state is EngineState.UP and not s.paused and s.typical() is not None]
        for flight in sorted(self._flights, key=lambda f: f.started):
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
            with self._lock:
                self._hedged += 1
            log.debug("hedging a request of engine %s on %s", other.engine.name, slot.engine.name)
            self._launch(flight, slot)
        if due_next is not None:
            self._hedge_timer = self._loop.call_at(due_next, self._hedge)

    def abort(self, request_ids: list[str]) -> int:
        """Stop these requests (from any thread): their :meth:`submit` is cancelled, and the engines
        serving them drop them (``/abort_requests``). Returns how many were still in flight."""
        return self._run(self._abort(list(request_ids)))

    async def _abort(self, request_ids: list[str]) -> int:
        serving: dict[int, tuple[_Slot, list[str]]] = {}
        found = 0
        with self._lock:
            entries = [(rid, self._requests.pop(rid, None)) for rid in request_ids]
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

    async def _send(self, slot: _Slot, prompt_ids: list[int], sampling: SamplingSpec,
                    request_id: str | None = None) -> list[Completion]:
        from megatron_rl.rollout.server import RequestRejected

        can_abort = getattr(slot.engine, "abort", None) is not None
        extra = {} if request_id is None or not can_abort else {"request_id": request_id}
        request = asyncio.ensure_future(slot.engine.submit(prompt_ids, sampling, **extra))
        down = asyncio.ensure_future(slot.down.wait())
        slot.tasks.add(request)
        try:  # (a server bounds its request by the same timeout; this bounds any engine's)
            await asyncio.wait({request, down}, timeout=self.cfg.timeout_s, return_when=asyncio.FIRST_COMPLETED)
        except asyncio.CancelledError:  # aborted: the HTTP request goes too
            request.cancel()
            raise
        finally:
            slot.tasks.discard(request)
            down.cancel()
        if not request.done():
            request.cancel()
            if not slot.down.is_set():
                self.mark_down(slot.engine, f"engine {slot.engine.name}: no answer to a generation request "
                                            f"within rollout.timeout_s={self.cfg.timeout_s:g}s")
                raise _Requeue(slot.reason)
            raise _Requeue(f"engine {slot.engine.name} went down ({slot.reason})")
        try:
            out = request.result()
        except RequestRejected:
            raise
        except EngineError as exc:
            self.mark_down(slot.engine, str(exc))
            raise _Requeue(str(exc)) from exc
        return out

    async def _until_verified(self, slot: _Slot) -> None:
        """Hold a result of an engine that runs unverified weights until the sync admits it; if the
        sync fails it instead, the request is re-sent: its later tokens came from weights that failed
        their check. One not verified within ``rollout.timeout_s`` is taken out (unknown weights,
        it rejoins the next sync) and the request re-sent elsewhere."""
        verified = asyncio.ensure_future(slot.verified.wait())
        down = asyncio.ensure_future(slot.down.wait())
        try:
            await asyncio.wait({verified, down}, timeout=self.cfg.timeout_s, return_when=asyncio.FIRST_COMPLETED)
        finally:
            verified.cancel()
            down.cancel()
        if slot.down.is_set():
            raise _Requeue(f"engine {slot.engine.name} resumed with new weights that failed their check "
                           f"({slot.reason})")
        if not slot.verified.is_set():  # out until a sync verifies it (the other requests held there too)
            reason = (f"engine {slot.engine.name} resumed with new weights that were not verified within "
                      f"rollout.timeout_s={self.cfg.timeout_s:g}s")
            if slot.state is EngineState.UP:
                self.mark_unknown(slot.engine, reason)
            raise _Requeue(reason)

    async def _acquire(self, n: int) -> _Slot:
        while True:
            async with self._changed:
                while True:
                    up = [s for s in self._slots if s.state is EngineState.UP]
                    if not up:
                        break
                    room = [s for s in up if s.has_room(n, self.capacity)]
                    if room:
                        slot = min(room, key=lambda s: s.outstanding)  # ties: the first engine
                        slot.outstanding += n
                        return slot
                    self._waiting += 1
                    try:
                        await self._changed.wait()
                    finally:
                        self._waiting -= 1
            if self._reviver is None:
                raise EngineError("no engine is up: " + self._describe())
            await self._revived()

    async def _revived(self) -> None:
        """One revival at a time (:meth:`_revive`, in a worker thread), awaited by every request
        that found no engine up; its failure is theirs."""
        if self._revival is None or self._revival.done():
            self._revival = asyncio.ensure_future(asyncio.to_thread(self._revive))
            self._revival.add_done_callback(lambda _: self._notify())
        await asyncio.shield(self._revival)

    def _release(self, slot: _Slot, n: int) -> None:
        slot.outstanding -= n
        self._notify()
        self._hedge_soon()

    def _notify(self) -> None:
        async def wake():
            async with self._changed:
                self._changed.notify_all()
        asyncio.ensure_future(wake())

    def _signal_down(self, slot: _Slot) -> None:
        slot.down.set()
        self._notify()

    def _reopen(self, slot: _Slot) -> None:
        slot.down.clear()
        slot.verified.set()
        self._notify()

    async def _unverify(self, slot: _Slot) -> None:
        slot.verified.clear()

    async def _make_condition(self) -> asyncio.Condition:
        for slot in self._slots:
            slot.down = asyncio.Event()
            slot.verified = asyncio.Event()
            slot.verified.set()
        return asyncio.Condition()

    def _run(self, coro):
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result()

    # ------------------------------------------------------------------------- fan-out control
    def _each_live(self, fn, *args) -> None:
        """``fn(engine)`` on every live engine, all at once (one that fails is marked down)."""
        def call(engine) -> None:
            try:
                fn(engine, *args)
            except EngineError as exc:
                self.mark_down(engine, str(exc))

        self._each(call, self.live())

    @staticmethod
    def _each(fn, items: list) -> None:
        if len(items) == 1:
            fn(items[0])
        elif items:
            with cf.ThreadPoolExecutor(max_workers=len(items), thread_name_prefix="fleet-ctl") as pool:
                list(pool.map(fn, items))

    def reset_prefix_cache(self) -> None:
        self._each_live(lambda e: e.reset_prefix_cache())

    def pause(self, mode: PauseMode = "keep") -> None:
        self._paused, self._pause_mode = True, mode

        def pause(engine):
            engine.pause(mode)
            self._slot(engine).paused = True
        self._each_live(pause)

    def hold(self) -> None:
        """Before each weight-sync round: every engine the round may load (live or rejoining) that
        is not paused yet is paused (mode keep, or the fleet's own mode), so that none computes when
        the round's /start_weight_update takes its weights apart (vLLM's layerwise reload leaves them
        on the meta device until the finish: a forward pass in between kills the engine core,
        "onednn_mm ... Meta tensors"). Whatever still runs there stops being scheduled: a hedged
        request's losing copy that is being aborted, a request the fleet stopped waiting for, an
        engine :meth:`resume_paused` let run for an earlier round's probe (sync_weights' retry), a
        request dispatched during the sync (it waits on the server). Idempotent; an engine that
        does not answer is marked down (the round then leaves it out)."""
        mode = self._pause_mode if self._paused else "keep"

        def pause(slot: _Slot) -> None:
            try:
                slot.engine.pause(mode)
                slot.paused = True
            except EngineError as exc:
                self.mark_down(slot.engine, str(exc))

        self._each(pause, [s for s in self._slots if s.state is not EngineState.DOWN and not s.paused])

    def resume(self) -> None:
        """Every engine that is not down, those rejoining too: one that failed a sync while paused
        must not stay paused once it is admitted again."""
        self._paused = False
        for slot in self._slots:
            if slot.state is EngineState.DOWN:
                continue
            try:
                slot.engine.resume()
                slot.paused = False
            except EngineError as exc:
                self.mark_down(slot.engine, str(exc))
        if self.hedge_after > 0:
            self._loop.call_soon_threadsafe(self._hedge)

    def resume_paused(self, engine: RolloutEngine) -> None:
        """After a sync round's finish, before its probe: let ``engine`` (paused by :meth:`hold`,
        or with the whole fleet for partial rollouts) run again, its new weights loaded but not
        verified yet (the probe needs it to compute: a server paused in mode keep schedules nothing,
        a probe included). Until :meth:`admit`, what it returns is held; if it fails the sync
        instead, its requests are re-sent. Raises EngineError."""
        slot = self._slot(engine)
        if slot.paused:
            self._run(self._unverify(slot))
            engine.resume()
            slot.paused = False

    def sleep(self) -> None:
        self._each_live(lambda e: e.sleep())

    def wake_up(self) -> None:
        self._each_live(lambda e: e.wake_up())

    def health(self) -> bool:
        return bool(self.live())

    def pop_metrics(self) -> dict[str, float]:
        with self._lock:
            requeued, self._requeued = self._requeued, 0
            hedged, wins, self._hedged, self._hedge_wins = self._hedged, self._hedge_wins, 0, 0
            served = {s.engine.name: s.served for s in self._slots}
            for s in self._slots:
                s.served = 0
            revivals, self._revivals = self._revivals, 0
        up = sum(s.state is EngineState.UP for s in self._slots)
        out = {"rollout/requeued_requests": float(requeued), "rollout/engines_up": float(up),
               "rollout/revivals": float(revivals),
               "rollout/engines_down": float(len(self._slots) - up),
               "rollout/hedged_requests": float(hedged), "rollout/hedge_wins": float(wins)}
        total = sum(served.values())
        if total:  # the share of the step's sequences each engine sampled
            out["rollout/engine_share_max"] = max(served.values()) / total
            out["rollout/engine_share_min"] = min(served.values()) / total
        return out

    def close(self) -> None:
        async def cancel_pending():
            if self._hedge_timer is not None:
                self._hedge_timer.cancel()
            tasks = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

        self._run(cancel_pending())
        for slot in self._slots:
            if slot.paused and slot.state is not EngineState.DOWN:  # (one that failed a sync): not left paused
                try:
                    slot.engine.resume()
                except EngineError:
                    pass
            aclose = getattr(slot.engine, "aclose", None)
            if aclose is not None:
                try:
                    self._run(aclose())
                except Exception:  # noqa: BLE001 - closing is best effort
                    pass
            slot.engine.close()
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(timeout=5)

    # ---------------------------------------------------------------------------------- helpers
    def _slot(self, engine: RolloutEngine | str) -> _Slot:
        name = engine if isinstance(engine, str) else engine.name
        for slot in self._slots:
            if slot.engine.name == name:
                return slot
        raise KeyError(f"no engine {name!r} in the fleet (engines: {[s.engine.name for s in self._slots]})")


class _Requeue(Exception):
    """The request must go to another engine."""


def _consume(task: asyncio.Future) -> None:
    """Done callback of a task nobody awaits: its exception (an engine failure, already handled)
    is retrieved so asyncio does not report it."""
    if not task.cancelled():
        task.exception()


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
