"""vLLM's weight-sync client protocol over a whole fleet of servers at once.

vLLM's trainer-side engines (``WeightTransferTrainerFactory``: ``nccl``, ``ipc``, and our ``gloo``)
drive a server through a client of its RL routes (``HTTPVLLMWeightSyncClient``). :class:`FleetClient`
is that client for many servers at once: every call goes to all of them concurrently, and the
group-joining call gives each server its own rank offset, so one transfer group spans the sender and
every worker of every engine.

Owns: the per-server clients, each server's rank offset, the round's version and whether its start
was sent ahead.
May call: the engines' ``weight_sync_client()`` (vLLM's HTTP client of one server).
"""

from __future__ import annotations

import concurrent.futures as cf
from collections.abc import Callable
from typing import Any

from megatron_rl.sync.base import SyncError


class EngineCallFailed(SyncError):
    """A weight-transfer route failed on some engines; ``failures`` maps engine name -> reason."""

    def __init__(self, route: str, failures: dict[str, str]):
        self.route, self.failures = route, failures
        super().__init__(f"{route} failed on " + "; ".join(f"{n}: {r}" for n, r in failures.items()))


class FleetClient:
    """vLLM's ``VLLMWeightSyncClient`` protocol over several servers (``engines`` with
    ``weight_sync_client()`` and ``workers``). Each call goes to every server concurrently and returns
    once all answered, or raises :class:`EngineCallFailed` as soon as any failed.

    What it adds to the protocol, per round (so vLLM's trainer-side engines drive it unchanged):
    :meth:`begin` sets the round's weight version, which every ``finish_weight_update`` carries (vLLM's
    finish route tags the engine with it: no separate tagging call); and a round whose start was sent
    ahead (:meth:`start_ahead`, while the fleet's check runs) makes the backend's own
    ``start_weight_update`` a no-op."""

    def __init__(self, engines: list, timeout_s: float):
        self.engines = list(engines)
        self.timeout_s = timeout_s
        self.clients = [e.weight_sync_client(timeout_s) for e in self.engines]
        offsets, offset = [], 1  # rank 0 is the sender
        for e in self.engines:
            offsets.append(offset)
            offset += e.workers
        self.offsets = offsets
        self.world_size = offset
        # two calls may be in flight per server (a backend may send the finish behind the update)
        self._pool = cf.ThreadPoolExecutor(max_workers=max(2, 2 * len(self.engines)), thread_name_prefix="wt-client")
        self._in_flight: set[cf.Future] = set()
        self.version: str | None = None  # the round's weight version (finish tags it)
        self._started = False            # the round's start was sent ahead

    def _fanout(self, route: str, call: Callable[[int, Any], Any], timeout_s: float | None = None) -> None:
        futures = {self._pool.submit(call, i, c): i for i, c in enumerate(self.clients)}
        self._in_flight = {f for f in self._in_flight if not f.done()} | set(futures)
        done, pending = cf.wait(futures, timeout=timeout_s or self.timeout_s, return_when=cf.FIRST_EXCEPTION)
        failures = {}
        for fut in done:
            if fut.exception() is not None:
                exc = fut.exception()
                failures[self.engines[futures[fut]].name] = f"{type(exc).__name__}: {exc}"
        if not failures and pending:
            failures = {self.engines[futures[f]].name: f"no answer within {timeout_s or self.timeout_s:g}s"
                        for f in pending}
        if failures:
            raise EngineCallFailed(route, failures)

    def wait_idle(self, timeout_s: float) -> None:
        """Wait (bounded) for calls still running after a failure: the servers must have left the
        broken round before the group is re-formed."""
        cf.wait(self._in_flight, timeout=timeout_s)

    def start_ahead(self) -> None:
        """vLLM's start route on every server, ahead of the round (raises :class:`EngineCallFailed`)."""
        self._fanout("start_weight_update", lambda i, c: c.start_weight_update())

    def undo_start(self) -> None:
        """Close a start sent ahead for a round that will not be sent after all (vLLM's finish route
        without a version: a layerwise reload that received nothing puts every layer back)."""
        self._fanout("finish_weight_update", lambda i, c: c.finish_weight_update(None))

    def begin(self, version: int | str | None, *, started: bool = False) -> None:
        """A new round: its version (``None``: finish tags nothing), and whether its start was sent
        ahead (:meth:`start_ahead`; the round's own ``start_weight_update`` then sends nothing)."""
        self.version = None if version is None else str(version)
        self._started = started

    def init_weight_transfer_engine(self, init_info: dict[str, Any]) -> None:
        def call(i, c):
            info = dict(init_info)
            if "rank_offset" in info:
                info["rank_offset"] = self.offsets[i]
            c.init_weight_transfer_engine(info)
        self._fanout("init_weight_transfer_engine", call)

    def start_weight_update(self) -> None:
        if self._started:
            self._started = False
            return
        self._fanout("start_weight_update", lambda i, c: c.start_weight_update())

    def update_weights(self, update_info) -> None:
        self._fanout("update_weights", lambda i, c: c.update_weights(update_info))

    def finish_weight_update(self, weight_version: str | None = None) -> None:
        version = weight_version if weight_version is not None else self.version
        self._fanout("finish_weight_update", lambda i, c: c.finish_weight_update(version))

    def shutdown_weight_transfer_engine(self) -> None:
        self._fanout("shutdown_weight_transfer_engine", lambda i, c: c.shutdown_weight_transfer_engine())

    def close(self) -> None:
        self._pool.shutdown(wait=False)
