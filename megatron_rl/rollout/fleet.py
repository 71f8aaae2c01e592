"""Many engines behind one: continuous, straggler-aware dispatch with fault handling.

:class:`EngineFleet` is a :class:`~megatron_rl.rollout.base.RolloutEngine` over several engines (vLLM
servers), made of one part per concern:

- membership and engine states (UP, JOINING, DOWN): :mod:`megatron_rl.rollout.fleet_members`;
- dispatch to the least-loaded engine with room, re-sending what a failed engine held, aborts:
  :mod:`megatron_rl.rollout.fleet_dispatch`; one copy of a request on one engine and the hold of
  what an engine with unverified weights returns: :mod:`megatron_rl.rollout.fleet_request`;
  tail hedging (``rollout.hedge_after``): :mod:`megatron_rl.rollout.fleet_hedge`;
- engines coming back (the probe before a sync, the wait for restarts, the revival after a total
  loss): :mod:`megatron_rl.rollout.fleet_revival`;
- pause / resume, the weight sync's hold, sleep: :mod:`megatron_rl.rollout.fleet_control`.

Faults: a request that fails (the engine died, refused or cut the connection, answered an error,
or did not answer within ``rollout.timeout_s``; a hedged request's losing copy included) marks its
engine DOWN; that engine's outstanding requests are cancelled and re-sent to the others with the
same seeds (counted in ``rollout/requeued_requests``). A DOWN engine stays out until :meth:`probe`
finds it answering again (its launcher restarted it), the weight sync loads and verifies the current
weights into it, and :meth:`admit` puts it back. An engine that answers but says it holds other
weights than those it was verified with (restarted silently between steps) is taken out the same way.

The fleet runs its own asyncio loop in a background thread: :meth:`generate` (a batch, blocking) and
:meth:`submit` (one prompt; a coroutine for that loop) and :meth:`submit_threadsafe` (one prompt,
from any thread: a ``concurrent.futures.Future``) all dispatch through it, so an asynchronous
trainer can keep requests flowing across steps.

Owns: the event loop and its thread, the parts above, the ``rollout/*`` fleet metrics.
May call: its parts (this module is what the trainer, the weight sync and the streams call).
"""

from __future__ import annotations

import asyncio
import concurrent.futures as cf
import threading
import time

from megatron_rl.common.cpus import float_over_all
from megatron_rl.rollout.base import UNKNOWN_VERSION, Completion, PauseMode, RolloutEngine, SamplingSpec
from megatron_rl.rollout.config import RolloutConfig
from megatron_rl.rollout.fleet_control import Control
from megatron_rl.rollout.fleet_dispatch import Dispatcher
from megatron_rl.rollout.fleet_members import EngineState, Members
from megatron_rl.rollout.fleet_revival import Revival

__all__ = ["EngineFleet", "EngineState"]


class EngineFleet(RolloutEngine):
    """``engines`` (each with an awaitable ``submit``) dispatched as one engine."""

    def __init__(self, engines: list[RolloutEngine], cfg: RolloutConfig, *, name: str = "fleet",
                 locate=None):
        """``locate(name)``, when given, returns where engine ``name`` is now (its registered URL):
        :meth:`probe` looks a DOWN engine up again, as its launcher may restart it elsewhere."""
        self.members = Members(engines)  # (checks the engines first)
        self._loop = self.members.loop = asyncio.new_event_loop()
        self.cfg = cfg
        self.name = name
        self.revival = Revival(self.members, cfg, locate)
        self.dispatcher = Dispatcher(self.members, self.revival, cfg, name)
        self.control = Control(self.members, self.dispatcher.hedger, self._run)
        self._thread = threading.Thread(target=self._run_loop, name=f"{name}-loop", daemon=True)
        self._thread.start()
        self._run(self.members.open())

    def _run_loop(self) -> None:
        float_over_all()  # trainer.cpu_cores: the wave's HTTP traffic runs where a core is free
        self._loop.run_forever()

    def _run(self, coro):
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result()

    # ------------------------------------------------------------------------------ membership
    @property
    def engines(self) -> list[RolloutEngine]:
        return self.members.engines

    def state(self, engine: RolloutEngine | str) -> EngineState:
        return self.members.slot(engine).state

    def states(self) -> dict[str, str]:
        return self.members.states()

    def live(self) -> list[RolloutEngine]:
        """Engines that serve requests now."""
        return self.members.live()

    def sync_targets(self) -> list[RolloutEngine]:
        """Engines the next weight sync should load: the live ones and those rejoining."""
        return self.members.sync_targets()

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
        self.members.mark_down(engine, reason)

    def mark_unknown(self, engine: RolloutEngine | str, reason: str) -> None:
        """``engine`` answers but holds unknown weights (a failed sync): it serves nothing, its
        outstanding requests are re-sent, and it takes part in the next sync."""
        self.members.mark_unknown(engine, reason)

    def admit(self, engine: RolloutEngine | str) -> None:
        """Put ``engine`` back into service (after a verified sync)."""
        self.members.admit(engine)

    # ----------------------------------------------------------------------- engines coming back
    def probe(self) -> list[RolloutEngine]:
        """Check the engines before a sync; returns those rejoining (:meth:`Revival.probe`)."""
        return self.revival.probe()

    def wait_for_engines(self, timeout_s: float, poll_s: float = 1.0) -> list[RolloutEngine]:
        """Until some engine can take part in a sync, at most ``timeout_s``: the engines a sync would
        load (empty: none came back). See :meth:`Revival.wait_for_engines`."""
        return self.revival.wait_for_engines(timeout_s, poll_s)

    def set_reviver(self, reviver) -> None:
        """``reviver()`` (from a worker thread, when no engine is up and some answer again): load the
        current weights into the engines :meth:`sync_targets` names, verify and :meth:`admit` them (the
        weight sync registers itself); raises or leaves none up when it cannot. None: no revival."""
        self.revival.reviver = reviver

    @property
    def reviver(self):
        return self.revival.reviver

    def last_progress(self) -> float:
        """``time.monotonic()`` of the fleet's last progress: a request sent or re-sent, a copy
        answered, or now while a revival runs (it waits up to ``rollout.start_timeout_s`` for
        restarts, bounded by itself). A caller's watchdog counts ``rollout.timeout_s`` from it: a request
        re-sent after its engine timed out, or waiting for a revival, has not hung."""
        if self.revival.running():
            return time.monotonic()
        return self.dispatcher.progress

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
        """One prompt to the least-loaded live engine (:meth:`Dispatcher.submit`); ``request_id``
        (unique among the requests in flight) lets :meth:`abort` stop it."""
        return await self.dispatcher.submit(prompt_ids, sampling, request_id)

    def abort(self, request_ids: list[str]) -> int:
        """Stop these requests (from any thread): their :meth:`submit` is cancelled, and the engines
        serving them drop them (``/abort_requests``). Returns how many were still in flight."""
        return self._run(self.dispatcher.abort(list(request_ids)))

    # ------------------------------------------------------------------------- fan-out control
    def reset_prefix_cache(self) -> None:
        self.control.each_live(lambda e: e.reset_prefix_cache())

    def pause(self, mode: PauseMode = "keep") -> None:
        self.control.pause(mode)

    def hold(self) -> None:
        """Before each weight-sync round: pause every engine the round may load (:meth:`Control.hold`)."""
        self.control.hold()

    def resume(self) -> None:
        """Every engine that is not down, those rejoining too (:meth:`Control.resume`)."""
        self.control.resume()

    def resume_paused(self, engine: RolloutEngine) -> None:
        """After a sync round's finish, before its probe: let ``engine`` run again, what it returns
        held until :meth:`admit` (:meth:`Control.resume_paused`). Raises EngineError."""
        self.control.resume_paused(engine)

    def sleep(self) -> None:
        self.control.each_live(lambda e: e.sleep())

    def wake_up(self) -> None:
        self.control.each_live(lambda e: e.wake_up())

    def health(self) -> bool:
        return bool(self.live())

    def pop_metrics(self) -> dict[str, float]:
        slots, hedger = self.members.slots, self.dispatcher.hedger
        with self.members.lock:
            requeued, self.dispatcher.requeued = self.dispatcher.requeued, 0
            hedged, wins, hedger.hedged, hedger.wins = hedger.hedged, hedger.wins, 0, 0
            served = {s.engine.name: s.served for s in slots}
            for s in slots:
                s.served = 0
            revivals, self.revival.count = self.revival.count, 0
        up = len(self.members.up())
        out = {"rollout/requeued_requests": float(requeued), "rollout/engines_up": float(up),
               "rollout/revivals": float(revivals),
               "rollout/engines_down": float(len(slots) - up),
               "rollout/hedged_requests": float(hedged), "rollout/hedge_wins": float(wins)}
        total = sum(served.values())
        if total:  # the share of the step's sequences each engine sampled
            out["rollout/engine_share_max"] = max(served.values()) / total
            out["rollout/engine_share_min"] = min(served.values()) / total
        return out

    def close(self) -> None:
        async def cancel_pending():
            self.dispatcher.hedger.cancel()
            tasks = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

        self._run(cancel_pending())
        self.control.close_engines()
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(timeout=5)
