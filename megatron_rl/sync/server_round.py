"""One round of the weight sync of vLLM servers, on the driver: the fleet's sync targets loaded with
one export, checked, and admitted.

Which engines take part: the fleet's live and rejoining engines; the transfer group is re-formed
when that set changes. Every engine a round loads is paused first (``fleet.hold()``) and resumed
only after vLLM's finish route (no forward pass while its weights are taken apart). A round that
finds no engine at all waits for restarts up to ``rollout.start_timeout_s``.

Round trips: a round is the route calls on the critical path, each HTTP -> engine core -> worker and
back, on every engine at once. The fleet's check (/weight_info: a silently restarted engine must
rejoin) runs while vLLM's /start_weight_update goes out to the standing group (undone, rarely, when
the check finds an engine to add); the version rides on /finish_weight_update (vLLM's finish route
takes it), which the gloo backend sends as soon as every worker has received everything; then each
engine's /reset_prefix_cache runs beside its version check (/weight_info)
(:func:`~megatron_rl.sync.server_checks.commit`).

Owns: the round's phases and its ``sync/*`` metrics.
May call: the fleet (hold, probe, sync_targets, wait_for_engines, states),
:class:`~megatron_rl.sync.transfer_group.TransferGroup`, :mod:`~megatron_rl.sync.server_checks`,
:mod:`~megatron_rl.sync.server_senders` (several senders), the transport's ``host`` and ``wrap``.
"""

from __future__ import annotations

import concurrent.futures as cf
import logging
import time

from megatron_rl.rollout.base import EngineError
from megatron_rl.rollout.fleet_members import EngineState
from megatron_rl.sync.base import (DRIVER, NamedTensors, SenderRound, SyncError, SyncMetrics, SyncMismatch,
                                   SyncTimeout, drain)
from megatron_rl.sync.config import SyncConfig
from megatron_rl.sync.fleet_client import EngineCallFailed
from megatron_rl.sync.server_checks import attribute, commit, compare, fail, timed_out
from megatron_rl.sync.server_senders import merge
from megatron_rl.sync.transfer_group import TransferGroup

log = logging.getLogger("megatron_rl")
# Seconds between the driver's "wait" announcements while it waits for restarted engines (each is a
# collective the other trainer ranks block in: well under any torch.distributed timeout).
WAIT_CHUNK_S = 60.0


class ServerRound:
    """Rounds of one weight sync into ``fleet`` over ``group`` (``senders``: the side channel to
    the other senders, None with one); ``checks``: what each engine must pass after loading."""

    def __init__(self, config: SyncConfig, fleet, group: TransferGroup, senders: SenderRound | None,
                 checks: list):
        self.config = config
        self.fleet = fleet
        self.group = group
        self.senders = senders
        self.checks = checks

    def run(self, named_tensors: NamedTensors, version: int, reference) -> SyncMetrics:
        """One round to the fleet's sync targets; ``reference``: the probe every engine must pass."""
        t0 = time.perf_counter()
        started, rejoining = self._prepare(version)
        phases = {"start": time.perf_counter() - t0}
        members = self.fleet.sync_targets()
        if started and (rejoining or [e.name for e in members] != self.group.members):
            self._undo_start()  # an engine joins (or left): the round starts afresh
            started = False
        if not members:
            if self.senders is not None:
                self.senders.announce({"send": False, "form": None})
                self.senders.collect(None)
            drain(named_tensors, version)
            raise SyncError(f"weight sync v{version}: no engine to load it; engines: {self.fleet.states()}")
        forming = rejoining or [e.name for e in members] != self.group.members or self.group.engine is None
        failures = self._send(named_tensors, version, members, started, forming, phases)
        report = getattr(self.group.engine, "report", None) if not failures else None
        if self.senders is not None:
            report, failures = merge(self.senders, self.group, report, failures, members)
        mismatched = compare(report, members) if (self.config.verify and report is not None) else {}
        failures.update(mismatched)
        metrics = self._sent(version, report, phases)
        self._settle(members, version, reference, failures, mismatched, metrics)
        metrics.seconds = time.perf_counter() - t0
        return self._outcome(metrics, version, members, failures, mismatched)

    def _prepare(self, version: int) -> tuple[bool, list]:
        """Hold the engines, check the fleet (starting the standing group's round meanwhile), wait
        for restarts when no engine is left. Returns (whether the start went out, those rejoining)."""
        self.fleet.hold()  # nothing may compute while a round's start takes the weights apart
        started, rejoining = self._check_and_start()
        self._wait_for_restarts(version)
        self.fleet.hold()  # the engines the check found rejoining too
        return started, rejoining

    def _send(self, named_tensors: NamedTensors, version: int, members: list, started: bool,
              forming: bool, phases: dict) -> dict[str, str]:
        """The export to ``members`` (the group (re-)formed first when ``forming``); the engines
        that failed, by name (empty: every engine received it)."""
        cfg, group = self.config, self.group
        stream = iter(group.transport.wrap(named_tensors, group.source.metadata()))
        failures: dict[str, str] = {}
        store, hosting = None, None
        if self.senders is not None:  # the other senders learn of the round (and of a new group: its store)
            world = 1 + sum(e.workers for e in members)
            try:
                if forming:
                    group.teardown()
                    store = group.transport.host(cfg, world)
            except Exception as exc:  # noqa: BLE001 - the round is off; raised below, after the announcement
                hosting = exc
            self.senders.announce({"send": hosting is None,
                                   "form": None if store is None else {"port": store.port, "world": world}})
        try:
            if hosting is not None:
                raise hosting
            if forming:
                t1 = time.perf_counter()
                group.form(members, store)
                phases["form"] = time.perf_counter() - t1
            group.client.begin(version, started=started)  # the finish route tags the version
            group.source.stream = stream
            group.engine.send_weights()
        except Exception as exc:  # noqa: BLE001 - attributed to engines below
            failures = attribute(exc, members)
            group.teardown()  # the group is unusable after a failed round
        finally:
            for _ in stream:  # the export is collective: walk it to the end whatever happened
                pass
        return failures

    def _sent(self, version: int, report, phases: dict) -> SyncMetrics:
        """The round's metrics of what was sent (the backend's report, else the plan's)."""
        plan = self.group.plan
        metrics = SyncMetrics(version=version, verified=self.config.verify, senders=len(plan.senders))
        if report is not None:
            metrics.bytes, metrics.tensors, metrics.buckets = report.bytes, report.tensors, report.buckets
            metrics.verify_seconds = report.hash_seconds
            metrics.sender_bytes = dict(getattr(report, "sender_bytes", {}) or {DRIVER: report.bytes})
            for k, v in (getattr(report, "phases", {}) or {}).items():
                phases[k] = phases.get(k, 0.0) + v
        else:
            metrics.bytes = plan.nbytes()
            metrics.tensors = len(plan.items)
            metrics.sender_bytes = {r: plan.nbytes(r) for r in plan.senders}
        metrics.phases = phases
        return metrics

    def _settle(self, members: list, version: int, reference, failures: dict[str, str],
                mismatched: dict[str, str], metrics: SyncMetrics) -> None:
        """Every engine at once: commit (checks, probe, admit) one that received the round, fail
        one that did not or whose checks failed."""
        probed: list[dict] = []

        def settle(engine) -> None:  # per engine, all engines at once (each is a few HTTP calls)
            if engine.name not in failures:
                try:
                    gap = commit(self.fleet, engine, version, pool, reference, self.checks, self.config)
                    if gap is not None:
                        probed.append(gap)
                except (SyncError, EngineError) as exc:
                    failures[engine.name] = str(exc)
                    if isinstance(exc, SyncMismatch):
                        mismatched[engine.name] = str(exc)
            if engine.name in failures:
                fail(self.fleet, engine, failures[engine.name])

        t1 = time.perf_counter()
        # two workers per engine: its commit, and its prefix-cache reset beside the checks
        with cf.ThreadPoolExecutor(max_workers=2 * len(members), thread_name_prefix="wt-commit") as pool:
            list(pool.map(settle, members))
        metrics.phases["commit"] = time.perf_counter() - t1
        for gap in probed:
            metrics.add_probe_gap(gap)

    def _outcome(self, metrics: SyncMetrics, version: int, members: list, failures: dict[str, str],
                 mismatched: dict[str, str]) -> SyncMetrics:
        """The metrics of a round that reached some engine; raised when it reached none."""
        metrics.failures = failures
        metrics.failed_engines = len(failures)
        metrics.engines = len(members) - len(failures)
        metrics.complete = all(self.fleet.state(e) is not EngineState.JOINING for e in members)
        if metrics.engines == 0:
            kind = SyncMismatch if mismatched else (SyncTimeout if timed_out(failures) else SyncError)
            raise kind(f"weight sync v{version} reached no engine: " +
                       "; ".join(f"{n}: {r}" for n, r in failures.items()))
        if failures:
            log.warning("weight sync v%d: %d of %d engines failed: %s", version, len(failures), len(members),
                        failures)
        return metrics

    def _wait_for_restarts(self, version: int) -> None:
        """No engine to load (all lost): wait up to ``rollout.start_timeout_s`` for their launchers'
        restarts; with several senders the others hear "wait" every minute meanwhile."""
        fleet = self.fleet
        if fleet.sync_targets() or not hasattr(fleet, "wait_for_engines"):
            return
        timeout = fleet.cfg.start_timeout_s
        log.warning("weight sync v%d: no engine to load it (%s): waiting up to rollout.start_timeout_s"
                    "=%gs for restarts", version, fleet.states(), timeout)
        deadline = time.monotonic() + timeout
        while not fleet.sync_targets() and time.monotonic() < deadline:
            fleet.wait_for_engines(min(WAIT_CHUNK_S, max(0.0, deadline - time.monotonic())))
            if self.senders is not None:
                self.senders.announce({"wait": True})

    def _check_and_start(self) -> tuple[bool, list]:
        """The fleet's check before a sync (:meth:`EngineFleet.probe`: DOWN engines that answer
        again, live ones that report other weights than they were verified with: restarted) and,
        while it runs, vLLM's start route on the members of the standing transfer group (the round
        starts a route's round trip earlier). Returns (whether the start went out, the engines
        rejoining). An engine whose start failed is out of this sync (down, or unknown weights)."""
        client, members = self.group.client, self.fleet.sync_targets()
        if not self.group.standing(members):
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
                fail(self.fleet, engine, f"/start_weight_update failed: {failed[engine.name]}")
        self.group.teardown()  # re-formed around the engines left
        return False, rejoining

    def _undo_start(self) -> None:
        try:
            self.group.client.undo_start()
        except SyncError as exc:  # such an engine fails its next start, then this sync
            log.warning("weight sync: closing the start sent ahead failed: %s", exc)
