"""Weights into a fleet of vLLM servers through vLLM's own weight-transfer protocol.

vLLM's trainer-side engines (``WeightTransferTrainerFactory``: ``nccl``, ``ipc``, and our ``gloo``)
drive a server through a client of its RL routes (``HTTPVLLMWeightSyncClient``). :class:`FleetClient`
is that client for many servers at once: every call goes to all of them concurrently, and the
group-joining call gives each server its own rank offset, so one transfer group spans the sender and
every worker of every engine.

:class:`ServerWeightSync` is the :class:`~megatron_rl.sync.base.WeightSync` on top, and keeps what
vLLM leaves to the caller: which engines take part (the fleet's live and rejoining engines; the group
is re-formed when that set changes), per-engine verification (one checksum per packed bucket where the
backend reports them, then each of :attr:`ServerWeightSync.checks`, then the probe: every engine
scores a fixed sequence and must match the trainer's log-probs, :mod:`megatron_rl.sync.probe`), the
prefix-cache reset, each engine's verified version (:data:`UNKNOWN_VERSION` after a failed sync: it
then serves nothing), timeouts, and the ``sync/*`` metrics. An engine that died is taken out of the
fleet; one that failed but answers rejoins the next sync. Every engine a round loads is paused first
(``fleet.hold()``) and resumed only after vLLM's finish route (no forward pass while its weights are
taken apart).

Engine loss: the sender keeps a host copy of the last weights it sent (and the probe they were
checked with), so when the fleet finds no engine up mid-generation the engines its launchers
restart are loaded and verified without the trainer (:meth:`ServerWeightSync.revive`, the fleet's
reviver); a sync that finds no engine at all waits for restarts up to ``rollout.start_timeout_s``.

Round trips: a sync is the route calls on the critical path, each HTTP -> engine core -> worker and
back, on every engine at once. The fleet's check (/weight_info: a silently restarted engine must
rejoin) runs while vLLM's /start_weight_update goes out to the standing group (undone, rarely, when
the check finds an engine to add); the version rides on /finish_weight_update (vLLM's finish route
takes it), which the gloo backend sends as soon as every worker has received everything; then each
engine's /reset_prefix_cache runs beside its version check (/weight_info).
"""

from __future__ import annotations

import concurrent.futures as cf
import dataclasses
import logging
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import torch
from vllm.distributed.weight_transfer.base import ParamMeta, WeightSource
from vllm.distributed.weight_transfer.factory import WeightTransferTrainerFactory

from megatron_rl.rollout.base import UNKNOWN_VERSION, EngineError, RolloutEngine
from megatron_rl.rollout.fleet import EngineState
from megatron_rl.sync.base import (Metadata, NamedTensors, SyncError, SyncMetrics, SyncMismatch,
                                   SyncTimeout, WeightSync, drain)
from megatron_rl.sync import probe
from megatron_rl.sync.config import SyncConfig

log = logging.getLogger("megatron_rl")


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


class StreamSource(WeightSource):
    """vLLM's ``WeightSource`` over our export: the metadata is fixed, the stream is set per sync (the
    Megatron export is a collective generator that can be walked once)."""

    def __init__(self, metadata: Metadata):
        self._meta = [ParamMeta(name, dtype, tuple(shape)) for name, dtype, shape in metadata]
        self.stream: NamedTensors | None = None

    def metadata(self) -> list[ParamMeta]:
        return self._meta

    def __iter__(self) -> Iterator[tuple[str, torch.Tensor]]:
        stream, self.stream = self.stream, None
        if stream is None:
            raise RuntimeError("no export stream was given for this sync")
        yield from stream


@dataclasses.dataclass(frozen=True)
class ServerTransport:
    """What differs between the backends: the trainer-side init info (``rank`` 0 sends)."""

    name: str
    init_info: Callable[[SyncConfig, int, int], Any]  # (config, world size, rank) -> TrainerInitInfo
    # Wrap the export so the backend's source suits it (ipc: full tensors on every rank).
    wrap: Callable[[NamedTensors, list[ParamMeta]], NamedTensors] = lambda named, meta: named
    # The sending rank alone can load its copy of the last weights into restarted engines (ipc
    # needs every trainer rank: a lost fleet then waits for the next sync).
    revivable: bool = True


def check_reported_version(engine, version: int) -> None:
    """The engine says it holds ``version`` (what ``/weight_info`` reports after the finish route
    tagged it)."""
    reported = engine.server_weight_version()
    if reported != str(version):
        raise SyncError(f"engine {engine.name} reports weight version {reported!r}, expected {version}")


class ServerWeightSync(WeightSync):
    """Sync a fleet of vLLM servers (``fleet`` on the sending rank; None on the others)."""

    def __init__(self, config: SyncConfig, fleet, *, sender: bool, metadata: Metadata | None,
                 transport: ServerTransport):
        super().__init__(config)
        if metadata is None:
            raise ValueError(f"sync.transport={config.transport!r} needs the export's metadata "
                             "(names, dtypes, shapes) up front")
        if sender and fleet is None:
            raise ValueError("the sending rank needs the fleet of engines")
        self.fleet = fleet
        self.sender = sender
        self.transport = transport
        self.source = StreamSource(metadata)
        # Checks each engine must pass after loading, in order: fn(engine, version) raising
        # SyncError; then the probe (self.probe, when the trainer set one).
        self.checks: list[Callable[[RolloutEngine, int], None]] = [check_reported_version]
        self._engine = None   # vLLM's trainer-side weight-transfer engine
        self._client: FleetClient | None = None
        self._members: list[str] = []
        # one round at a time: the trainer's syncs and the fleet's revivals (another thread)
        self._rounds = threading.RLock()
        # (version, host copy of the tensors, probe reference) of the last weights sent
        self._last: tuple[int, list, object] | None = None
        if sender and transport.revivable and hasattr(fleet, "set_reviver"):
            fleet.set_reviver(self.revive)

    # ------------------------------------------------------------------------ group lifecycle
    def connect(self) -> None:
        if self._engine is not None:
            return
        if not self.sender:
            info = self.transport.init_info(self.config, 1, 1)  # rank != 0: no rendezvous
            self._engine = WeightTransferTrainerFactory.trainer_init(info, client=None, source=self.source)
            return
        self._form(self.fleet.sync_targets())

    def _form(self, members: list) -> None:
        self._teardown()
        client = FleetClient(members, self.config.timeout_s)
        info = self.transport.init_info(self.config, client.world_size, 0)
        try:
            self._engine = WeightTransferTrainerFactory.trainer_init(info, client=client, source=self.source)
        except BaseException:
            client.close()
            raise
        self._client = client
        self._members = [e.name for e in members]

    def _teardown(self) -> None:
        engine, self._engine = self._engine, None
        client, self._client = self._client, None
        self._members = []
        if engine is not None:
            try:
                engine.shutdown()
            except Exception:  # noqa: BLE001 - a broken group may refuse; it is dropped anyway
                pass
        if client is not None:
            client.wait_idle(self.config.timeout_s)
            try:
                client.shutdown_weight_transfer_engine()
            except SyncError:
                pass  # engines that are gone; the others re-initialise on the next init
            client.close()

    def close(self) -> None:
        if self.sender:
            if getattr(self.fleet, "reviver", None) == self.revive:
                self.fleet.set_reviver(None)
            with self._rounds:
                self._teardown()
                self._last = None
        else:
            self._engine = None

    def revive(self) -> None:
        """The fleet's reviver (no engine is up, some answer again): the last weights sent, loaded
        into every engine that can take them (:meth:`EngineFleet.sync_targets`) from the host copy,
        checked as that sync was (checksums, version, the same probe), and admitted. Raises
        :class:`SyncError` when there is nothing to load or it reached no engine."""
        with self._rounds:
            if self.fleet.live():  # a sync brought engines back meanwhile
                return
            if self._last is None:
                raise SyncError("no weights were sent yet: nothing to load into the engines that came back")
            version, kept, reference = self._last
            log.warning("weight sync: loading the last weights sent (v%d) into %s", version,
                        [e.name for e in self.fleet.sync_targets()])
            self._round(iter(kept), version, reference)

    # ------------------------------------------------------------------------------- one sync
    def sync(self, named_tensors: NamedTensors, version: int) -> SyncMetrics:
        cfg = self.config
        if not self.sender:
            self.connect()
            self.source.stream = self.transport.wrap(named_tensors, self.source.metadata())
            self._engine.send_weights()
            return SyncMetrics(version=version)
        with self._rounds:
            kept: list = []
            try:
                return self._round(_keeping(named_tensors, kept), version, self.probe)
            except SyncMismatch:
                raise  # an engine loaded or computes other weights: the trainer's to see
            except SyncError as exc:
                if len(kept) != len(self.source.metadata()):
                    raise
                return self._again(version, kept, self.probe, exc)  # it reached no engine
            finally:  # the trainer's weights of ``version``, whatever the round did with them
                if len(kept) == len(self.source.metadata()):
                    self._last = (version, kept, self.probe)

    def _all_lost(self) -> bool:
        return all(self.fleet.state(e) is EngineState.DOWN for e in self.fleet.engines)

    def _again(self, version: int, kept: list, reference, failure: SyncError) -> SyncMetrics:
        """A round that reached no engine (they died, hung or were cut off; not a mismatch): the same
        weights again, from the host copy. While every engine is lost, into those their launchers
        restart, within ``rollout.start_timeout_s``; while some answer, up to ``sync.retries`` more
        rounds. Raises the last failure past that."""
        timeout = self.fleet.cfg.start_timeout_s
        deadline, tries = time.monotonic() + timeout, 0
        while True:
            if not self._all_lost():
                if tries >= self.config.retries:
                    raise failure
                tries += 1
            elif time.monotonic() >= deadline:
                raise failure
            log.warning("weight sync v%d reached no engine (%s); loading it again into the engines that answer "
                        "or come back (rollout.start_timeout_s=%gs)", version, failure, timeout)
            self.fleet.wait_for_engines(max(0.0, deadline - time.monotonic()))
            try:
                return self._round(iter(kept), version, reference)
            except SyncMismatch:
                raise
            except SyncError as exc:
                failure = exc

    def _round(self, named_tensors: NamedTensors, version: int, reference) -> SyncMetrics:
        """One round to the fleet's sync targets; ``reference``: the probe every engine must pass."""
        cfg = self.config
        t0 = time.perf_counter()
        self.fleet.hold()  # nothing may compute while a round's start takes the weights apart
        started, rejoining = self._check_and_start()
        if not self.fleet.sync_targets() and hasattr(self.fleet, "wait_for_engines"):  # all lost: restarts
            timeout = self.fleet.cfg.start_timeout_s
            log.warning("weight sync v%d: no engine to load it (%s): waiting up to rollout.start_timeout_s"
                        "=%gs for restarts", version, self.fleet.states(), timeout)
            self.fleet.wait_for_engines(timeout)
        self.fleet.hold()  # the engines the check found rejoining too
        phases = {"start": time.perf_counter() - t0}
        members = self.fleet.sync_targets()
        if started and (rejoining or [e.name for e in members] != self._members):
            self._undo_start()  # an engine joins (or left): the round starts afresh
            started = False
        if not members:
            drain(named_tensors, version)
            raise SyncError(f"weight sync v{version}: no engine to load it; engines: {self.fleet.states()}")
        stream = iter(self.transport.wrap(named_tensors, self.source.metadata()))
        failures: dict[str, str] = {}
        try:
            if rejoining or [e.name for e in members] != self._members or self._engine is None:
                t1 = time.perf_counter()
                self._form(members)
                phases["form"] = time.perf_counter() - t1
            self._client.begin(version, started=started)  # the finish route tags the version
            self.source.stream = stream
            self._engine.send_weights()
        except Exception as exc:  # noqa: BLE001 - attributed to engines below
            failures = self._attribute(exc, members)
            self._teardown()  # the group is unusable after a failed round
        finally:
            for _ in stream:  # the export is collective: walk it to the end whatever happened
                pass
        report = getattr(self._engine, "report", None) if not failures else None
        mismatched = self._compare(report, members) if (cfg.verify and report is not None) else {}
        failures.update(mismatched)
        metrics = SyncMetrics(version=version, verified=cfg.verify)
        if report is not None:
            metrics.bytes, metrics.tensors, metrics.buckets = report.bytes, report.tensors, report.buckets
            metrics.verify_seconds = report.hash_seconds
            for k, v in (getattr(report, "phases", {}) or {}).items():
                phases[k] = phases.get(k, 0.0) + v
        else:
            metrics.bytes = sum(m.dtype.itemsize * _numel(m.shape) for m in self.source.metadata())
            metrics.tensors = len(self.source.metadata())
        probed: list[dict] = []

        def settle(engine) -> None:  # per engine, all engines at once (each is a few HTTP calls)
            if engine.name not in failures:
                try:
                    gap = self._commit(engine, version, pool, reference)
                    if gap is not None:
                        probed.append(gap)
                except (SyncError, EngineError) as exc:
                    failures[engine.name] = str(exc)
                    if isinstance(exc, SyncMismatch):
                        mismatched[engine.name] = str(exc)
            if engine.name in failures:
                self._fail(engine, failures[engine.name])

        t1 = time.perf_counter()
        # two workers per engine: its commit, and its prefix-cache reset beside the checks
        with cf.ThreadPoolExecutor(max_workers=2 * len(members), thread_name_prefix="wt-commit") as pool:
            list(pool.map(settle, members))
        phases["commit"] = time.perf_counter() - t1
        for gap in probed:
            metrics.add_probe_gap(gap)
        metrics.seconds = time.perf_counter() - t0
        metrics.phases = phases
        metrics.failures = failures
        metrics.failed_engines = len(failures)
        metrics.engines = len(members) - len(failures)
        metrics.complete = all(self.fleet.state(e) is not EngineState.JOINING for e in members)
        if metrics.engines == 0:
            kind = SyncMismatch if mismatched else (SyncTimeout if _timed_out(failures) else SyncError)
            raise kind(f"weight sync v{version} reached no engine: " +
                       "; ".join(f"{n}: {r}" for n, r in failures.items()))
        if failures:
            log.warning("weight sync v%d: %d of %d engines failed: %s", version, len(failures), len(members),
                        failures)
        return metrics

    def _check_and_start(self) -> tuple[bool, list]:
        """The fleet's check before a sync (:meth:`EngineFleet.probe`: DOWN engines that answer
        again, live ones that report other weights than they were verified with: restarted) and,
        while it runs, vLLM's start route on the members of the standing transfer group (the round
        starts a route's round trip earlier). Returns (whether the start went out, the engines
        rejoining). An engine whose start failed is out of this sync (down, or unknown weights)."""
        client, members = self._client, self.fleet.sync_targets()
        if client is None or self._engine is None or [e.name for e in members] != self._members:
            return False, self.fleet.probe()
        pool = cf.ThreadPoolExecutor(max_workers=1, thread_name_prefix="wt-start")
        try:
            starting = pool.submit(client.start_ahead)
            rejoining = self.fleet.probe()
            try:
                starting.result(timeout=self.config.timeout_s + 5)  # (the fan-out has its own timeout)
                return True, rejoining
            except EngineCallFailed as exc:
                failed = exc.failures
            except cf.TimeoutError:
                failed = {e.name: f"no answer within {self.config.timeout_s:g}s" for e in members}
        finally:
            pool.shutdown(wait=False)
        log.warning("weight sync: /start_weight_update failed on %s", failed)
        self._undo_start()
        for engine in members:
            if engine.name in failed:
                self._fail(engine, f"/start_weight_update failed: {failed[engine.name]}")
        self._teardown()  # re-formed around the engines left
        return False, rejoining

    def _undo_start(self) -> None:
        try:
            self._client.undo_start()
        except SyncError as exc:  # such an engine fails its next start, then this sync
            log.warning("weight sync: closing the start sent ahead failed: %s", exc)

    def _commit(self, engine, version: int, aside: cf.Executor, reference) -> dict | None:
        """After the finish route loaded and tagged ``version`` (vLLM's finish takes the version):
        reset the engine's prefix cache while its checks run (each :attr:`checks`, the reported
        version first), score the probe (what it computes with the new weights), then admit it.
        Returns its probe gap (None: no probe).

        The engine was paused for the round (``fleet.hold()``; partial rollouts: with the whole
        fleet): it resumes before the probe, which a server paused in mode keep would not schedule;
        what it kept frozen continues then, with the new weights (the reset dropped their KV, so it
        is recomputed), under the new version's label, and the fleet holds what it returns until
        :meth:`admit` (or re-sends it if the probe fails)."""
        # cached blocks (running requests' too) hold the old weights' KV; ``aside`` has a worker free
        resetting = aside.submit(engine.reset_prefix_cache)
        for check in self.checks:
            check(engine, version)
        try:
            resetting.result(timeout=self.config.timeout_s)  # (the call has its own timeout)
        except cf.TimeoutError:
            raise SyncTimeout(f"engine {engine.name}: /reset_prefix_cache did not answer within "
                              f"{self.config.timeout_s:g}s") from None
        engine.weight_version = version  # verified
        self.fleet.resume_paused(engine)
        gap = probe.check(engine, reference) if (self.config.verify and reference is not None) else None
        self.fleet.admit(engine)
        return gap

    def _fail(self, engine, reason: str) -> None:
        """After a failed sync: a reachable engine holds unknown weights and rejoins the next sync;
        an unreachable one is down (its launcher restarts it)."""
        if engine.health():
            try:
                engine.set_weight_version(UNKNOWN_VERSION)
            except EngineError:
                pass
            self.fleet.mark_unknown(engine, reason)
        else:
            self.fleet.mark_down(engine, f"failed weight sync: {reason}")

    def _attribute(self, exc: Exception, members: list) -> dict[str, str]:
        """Which engines a failed round is due to; when none can be named, all of them."""
        named = dict(getattr(exc, "failures", {}) or {})
        for engine in members:
            if engine.name not in named and not engine.health(timeout=5.0):
                named[engine.name] = f"died during the sync ({type(exc).__name__}: {exc})"
        survivors = {e.name for e in members} - set(named)
        cause = f"the round was cut ({type(exc).__name__}: {exc})"
        for name in survivors:  # their receive was cut by the failure: mixed weights
            named[name] = cause
        return named

    def _compare(self, report, members: list) -> dict[str, str]:
        """Engines whose workers received other bytes than were sent, naming the first bucket."""
        if not report.received:
            return {}
        bad: dict[str, str] = {}
        rank = 1
        for engine in members:
            for w in range(engine.workers):
                got = report.received.get(rank + w)
                if got is None:
                    continue
                diff = [k for k, (a, b) in enumerate(zip(report.sent, got)) if a != b]
                if diff and engine.name not in bad:
                    k = diff[0]
                    names = report.bucket_names[k]
                    bad[engine.name] = (f"checksum mismatch (worker {w}) in {len(diff)} of {report.buckets} "
                                        f"buckets, first bucket {k}: {names[:3]}"
                                        + (f" and {len(names) - 3} more tensors" if len(names) > 3 else ""))
            rank += engine.workers
        return bad


def _keeping(named: NamedTensors, kept: list) -> NamedTensors:
    """``named`` unchanged, each tensor also copied into ``kept`` (host memory: what a revival
    loads into restarted engines after the trainer's weights moved on)."""
    for name, tensor in named:
        kept.append((name, tensor.detach().to("cpu", copy=True)))
        yield name, tensor


def _numel(shape) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


def _timed_out(failures: dict[str, str]) -> bool:
    return bool(failures) and all("Timeout" in r or "no answer" in r or "timed out" in r.lower()
                                  for r in failures.values())
