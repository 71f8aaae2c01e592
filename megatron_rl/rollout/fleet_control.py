"""Control of the fleet's engines, all at once: pause and resume, the weight sync's hold, sleep.

Weight loads: a sync round takes each engine's weights apart between vLLM's ``/start_weight_update``
and ``/finish_weight_update`` (its layerwise reload leaves them on the meta device), and a forward
pass in between kills the engine core. So :meth:`Control.hold` pauses every engine a round loads (mode
keep: nothing is scheduled, whatever still runs there: a hedged request's losing copy being
aborted, a request the fleet gave up on, one dispatched meanwhile, which waits) and the sync resumes
each one only after its finish, before its probe (:meth:`Control.resume_paused`; what it returns
before its probe passed is held, and re-sent if it fails: :mod:`megatron_rl.rollout.fleet_request`).

An engine that fails a control call is marked down.

Owns: which engines the fleet paused (each slot's ``paused``, the fleet's pause and its mode).
May call: the engines' control routes (pause, resume, sleep, wake_up, reset_prefix_cache, aclose,
close), :class:`~megatron_rl.rollout.fleet_members.Members`, the hedger (resume lets it look again).
"""

from __future__ import annotations

import concurrent.futures as cf

from megatron_rl.rollout.base import EngineError, PauseMode, RolloutEngine
from megatron_rl.rollout.fleet_hedge import Hedger
from megatron_rl.rollout.fleet_members import EngineState, Members, Slot


class Control:
    """Fan-out control of ``members``' engines; ``run(coro)`` runs a coroutine on the fleet's loop."""

    def __init__(self, members: Members, hedger: Hedger, run):
        self.members = members
        self.hedger = hedger
        self._run = run

    def each_live(self, fn, *args) -> None:
        """``fn(engine)`` on every live engine, all at once (one that fails is marked down)."""
        def call(engine) -> None:
            try:
                fn(engine, *args)
            except EngineError as exc:
                self.members.mark_down(engine, str(exc))

        each(call, self.members.live())

    def pause(self, mode: PauseMode = "keep") -> None:
        self.members.paused, self.members.pause_mode = True, mode

        def pause(engine):
            engine.pause(mode)
            self.members.slot(engine).paused = True
        self.each_live(pause)

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
        members = self.members
        mode = members.pause_mode if members.paused else "keep"

        def pause(slot: Slot) -> None:
            try:
                slot.engine.pause(mode)
                slot.paused = True
            except EngineError as exc:
                members.mark_down(slot.engine, str(exc))

        each(pause, [s for s in members.slots if s.state is not EngineState.DOWN and not s.paused])

    def resume(self) -> None:
        """Every engine that is not down, those rejoining too: one that failed a sync while paused
        must not stay paused once it is admitted again."""
        self.members.paused = False
        for slot in self.members.slots:
            if slot.state is EngineState.DOWN:
                continue
            try:
                slot.engine.resume()
                slot.paused = False
            except EngineError as exc:
                self.members.mark_down(slot.engine, str(exc))
        self.hedger.soon_threadsafe()

    def resume_paused(self, engine: RolloutEngine) -> None:
        """After a sync round's finish, before its probe: let ``engine`` (paused by :meth:`hold`,
        or with the whole fleet for partial rollouts) run again, its new weights loaded but not
        verified yet (the probe needs it to compute: a server paused in mode keep schedules nothing,
        a probe included). Until it is admitted, what it returns is held; if it fails the sync
        instead, its requests are re-sent. Raises EngineError."""
        slot = self.members.slot(engine)
        if slot.paused:
            self._run(self.members.unverify(slot))
            engine.resume()
            slot.paused = False

    def close_engines(self) -> None:
        """Close every engine's handle; one the fleet left paused (it failed a sync) is resumed."""
        for slot in self.members.slots:
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


def each(fn, items: list) -> None:
    """``fn(item)`` for every item, all at once (one thread each)."""
    if len(items) == 1:
        fn(items[0])
    elif items:
        with cf.ThreadPoolExecutor(max_workers=len(items), thread_name_prefix="fleet-ctl") as pool:
            list(pool.map(fn, items))
