"""Weights into a fleet of vLLM servers through vLLM's own weight-transfer protocol.

vLLM's trainer-side engines (``WeightTransferTrainerFactory``: ``nccl``, ``ipc``, and our ``gloo``)
drive each server through a client of its RL routes; :class:`ServerWeightSync` is the
:class:`~megatron_rl.sync.base.WeightSync` on top, and keeps what vLLM leaves to the caller, one
part per concern:

- the client of every server at once: :mod:`megatron_rl.sync.fleet_client`; what differs between
  the backends and the weights' source: :mod:`megatron_rl.sync.server_transport`;
- the transfer group (formed, joined, torn down): :mod:`megatron_rl.sync.transfer_group`;
- one round (which engines take part, the route calls, the metrics): :mod:`megatron_rl.sync.server_round`;
  per-engine verification after it (checksums, :attr:`ServerWeightSync.checks`, the probe) and what
  befalls an engine that failed: :mod:`megatron_rl.sync.server_checks`;
- several senders (each pipeline stage streams its own tensors): :mod:`megatron_rl.sync.server_senders`.

Each engine's verified version is :data:`UNKNOWN_VERSION` after a failed sync (it then serves
nothing). An engine that died is taken out of the fleet; one that failed but answers rejoins the
next sync.

Engine loss (this module): the sender keeps a host copy of the last weights it sent (and the probe they
were checked with), so when the fleet finds no engine up mid-generation the engines its launchers
restart are loaded and verified without the trainer (:meth:`ServerWeightSync.revive`, the fleet's
reviver); a round that reached no engine is sent again from that copy (:meth:`ServerWeightSync.sync`).
With several senders the driver holds only its own tensors: no host copy, so no revival or re-send
of a round from it (a lost fleet waits for the trainer's next sync, which exports again).

Owns: the host copy of the last weights sent, one round at a time (the trainer's syncs and the
fleet's revivals).
May call: the parts above; the fleet (set_reviver, live, state, wait_for_engines).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable

from megatron_rl.rollout.base import RolloutEngine
from megatron_rl.rollout.fleet_members import EngineState
from megatron_rl.sync.base import (DRIVER, NamedTensors, SenderRound, SendPlan, SyncError, SyncMetrics, SyncMismatch,
                                   WeightSync)
from megatron_rl.sync.config import SyncConfig
from megatron_rl.sync.server_checks import check_reported_version
from megatron_rl.sync.server_round import ServerRound
from megatron_rl.sync.server_senders import follow
from megatron_rl.sync.server_transport import ServerTransport, StreamSource
from megatron_rl.sync.transfer_group import TransferGroup

log = logging.getLogger("megatron_rl")


class ServerWeightSync(WeightSync):
    """Sync a fleet of vLLM servers (``fleet`` on the driver, global rank 0; None on the others),
    each tensor from the trainer rank that ``plan`` names."""

    def __init__(self, config: SyncConfig, fleet, *, rank: int, plan: SendPlan | None,
                 transport: ServerTransport, group=None):
        super().__init__(config)
        if plan is None:
            raise ValueError(f"sync.transport={config.transport!r} needs the export's metadata "
                             "(names, dtypes, shapes, senders) up front")
        driver = rank == DRIVER
        if driver and fleet is None:
            raise ValueError("the driver (rank 0) needs the fleet of engines")
        if len(plan.senders) > 1 and transport.host is None:
            raise ValueError(f"sync.transport={config.transport!r} sends from one trainer rank (vLLM's "
                             f"{transport.name} engine), but the export plan has {len(plan.senders)} senders "
                             f"(ranks {list(plan.senders)}): set sync.senders=gather (rank 0 gathers the "
                             f"model and sends it) or use sync.transport=gloo")
        self.fleet = fleet
        self.rank = rank
        self.driver = driver
        self.plan = plan
        self.several = len(plan.senders) > 1
        self.round = SenderRound(group) if self.several else None
        self.transport = transport
        self.source = StreamSource(plan, rank)
        self.placeholders = transport.placeholders
        # Checks each engine must pass after loading, in order: fn(engine, version) raising
        # SyncError; then the probe (self.probe, when the trainer set one).
        self.checks: list[Callable[[RolloutEngine, int], None]] = [check_reported_version]
        self.transfer = TransferGroup(config, transport, self.source, plan, rank)
        self.rounds = ServerRound(config, fleet, self.transfer, self.round, self.checks) if driver else None
        # one round at a time: the trainer's syncs and the fleet's revivals (another thread)
        self._rounds = threading.RLock()
        # (version, host copy of the tensors, probe reference) of the last weights sent (one sender)
        self._last: tuple[int, list, object] | None = None
        if driver and transport.revivable and not self.several and hasattr(fleet, "set_reviver"):
            fleet.set_reviver(self.revive)

    def connect(self) -> None:
        """Form the transfer group now (one sender); with several the first sync forms it (the other
        senders learn of it in the round's announcement)."""
        if self.transfer.engine is not None:
            return
        if not self.driver:
            self.transfer.connect_walker()
            return
        if not self.several:
            self.transfer.form(self.fleet.sync_targets())

    def close(self) -> None:
        if self.driver:
            if getattr(self.fleet, "reviver", None) == self.revive:
                self.fleet.set_reviver(None)
            with self._rounds:
                self.transfer.teardown()
                self._last = None
        else:
            self.transfer.drop_engine()

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

    def sync(self, named_tensors: NamedTensors, version: int) -> SyncMetrics:
        if not self.driver:
            return follow(self.transfer, self.round, self.transport, named_tensors, version)
        with self._rounds:
            if self.several:  # no host copy: the other senders' tensors never pass through here
                return self._round(named_tensors, version, self.probe)
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
        """One round to the fleet's sync targets (:meth:`ServerRound.run`); ``reference``: the probe
        every engine must pass."""
        return self.rounds.run(named_tensors, version, reference)


def _keeping(named: NamedTensors, kept: list) -> NamedTensors:
    """``named`` unchanged, each tensor also copied into ``kept`` (host memory: what a revival
    loads into restarted engines after the trainer's weights moved on)."""
    for name, tensor in named:
        kept.append((name, tensor.detach().to("cpu", copy=True)))
        yield name, tensor
