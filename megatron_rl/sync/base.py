"""The weight-sync interface: one abstract class, one file per transport, one registry.

The registry (:data:`megatron_rl.sync.registry.TRANSPORTS`) names each transport's module, imported
only when that transport is built, so this file imports none of them and they can import it. Each
transport module defines ``build(config, engines, *, rank, plan, group)``.

Senders: each tensor of a sync is sent by the trainer rank that holds it (the metadata's fourth
field; :func:`megatron_rl.models.hf_export.export_plan`): with pipeline parallelism every stage's
TP-rank-0 of replica 0 streams its own layers, so no rank gathers the whole model. Global rank 0
(the driver) also drives the engines; with several senders it tells the others, over the trainer's
process group, when a round starts and where its transfer group is (:class:`SenderRound`), and
collects what each sent.
"""

from __future__ import annotations

import abc
import dataclasses
import importlib
import json
import math
from collections.abc import Iterable, Sequence

import torch

from megatron_rl.rollout.base import UNKNOWN_VERSION  # noqa: F401  (re-exported: the sync sets it)
from megatron_rl.sync.config import SyncConfig
from megatron_rl.sync.registry import TRANSPORTS, Transport

NamedTensors = Iterable[tuple[str, torch.Tensor]]
# (HF name, dtype, shape[, sender]) of every tensor a sync sends, in export order; the sender is the
# global trainer rank that sends it (without one: rank 0). ``ExportItem``s are such tuples.
Metadata = Sequence[tuple]
DRIVER = 0  # the trainer rank that drives the engines (and sends the first pipeline stage's tensors)


@dataclasses.dataclass(frozen=True)
class SendPlan:
    """Every tensor of a sync with its sender, and the distinct senders (ascending global ranks; a
    sender's place in ``senders`` is its index in a transfer)."""

    items: tuple[tuple[str, torch.dtype, tuple[int, ...], int], ...]
    senders: tuple[int, ...]

    @classmethod
    def of(cls, metadata: Metadata) -> SendPlan:
        items = tuple((m[0], m[1], tuple(m[2]), int(m[3]) if len(m) > 3 else DRIVER) for m in metadata)
        senders = tuple(sorted({item[3] for item in items})) or (DRIVER,)
        if DRIVER not in senders:
            raise ValueError(f"the driver (rank {DRIVER}) sends none of the tensors (senders {list(senders)}): "
                             f"it must send the first pipeline stage's")
        return cls(items, senders)

    def index(self, rank: int) -> int | None:
        """``rank``'s index among the senders (None: it sends nothing)."""
        return self.senders.index(rank) if rank in self.senders else None

    def sender_index(self) -> list[int]:
        """Per item, its sender's index."""
        where = {r: k for k, r in enumerate(self.senders)}
        return [where[item[3]] for item in self.items]

    def owned(self, rank: int) -> list[tuple[str, torch.dtype, tuple[int, ...]]]:
        """(name, dtype, shape) of the items ``rank`` sends, in order."""
        return [item[:3] for item in self.items if item[3] == rank]

    def nbytes(self, rank: int | None = None) -> int:
        """Bytes of every item (of ``rank``'s items)."""
        return sum(d.itemsize * math.prod(s) for _, d, s, r in self.items if rank is None or r == rank)


class SyncError(RuntimeError):
    """A sync failed: an engine died, hung past the timeout, or loaded different bytes."""


class SyncTimeout(SyncError):
    """An engine did not answer within ``sync.timeout_s``."""


class SyncMismatch(SyncError):
    """What an engine received or computes differs from what was sent (checksum of a packed bucket,
    the probe's log-probs)."""


@dataclasses.dataclass
class SyncMetrics:
    """What one sync did; ``as_dict`` feeds the step's metrics (``sync/...``)."""

    version: int
    seconds: float = 0.0
    bytes: int = 0
    tensors: int = 0
    buckets: int = 0
    # Engines that hold ``version`` after this sync, verified; and those that failed it.
    engines: int = 0
    failed_engines: int = 0
    verified: bool = False
    # Seconds the sender spent hashing buckets (overlapped with the transfer).
    verify_seconds: float = 0.0
    # Every engine that took part and is still reachable holds the new version (else: sync again).
    complete: bool = True
    # engine name -> why it failed this sync.
    failures: dict[str, str] = dataclasses.field(default_factory=dict)
    # With a probe (``sync.verify``): the largest mean / max |engine - trainer| log-prob gap of the
    # probe sequence over the engines that passed it (None: no probe).
    probe_gap_mean: float | None = None
    probe_gap_max: float | None = None
    # Seconds by phase, where the transport measures them (servers: ``start`` = the fleet's health
    # and version check, and vLLM's start route sent meanwhile, ``form`` = a new transfer group, the
    # backend's round phases (``broadcast``, ``load_tail``, ``finish``: vLLM's finish route, which
    # also tags the version), ``commit`` = prefix-cache reset beside the version check, then the
    # probe, on every engine at once).
    phases: dict[str, float] = dataclasses.field(default_factory=dict)
    # Trainer ranks that sent tensors, and what each sent (global rank -> bytes), on the driver.
    senders: int = 1
    sender_bytes: dict[int, int] = dataclasses.field(default_factory=dict)

    def add_probe_gap(self, gap: dict) -> None:
        self.probe_gap_mean = max(gap["mean"], self.probe_gap_mean or 0.0)
        self.probe_gap_max = max(gap["max"], self.probe_gap_max or 0.0)

    def as_dict(self) -> dict[str, float]:
        gb_s = self.bytes / self.seconds / 1e9 if self.seconds > 0 else 0.0
        probe = ({} if self.probe_gap_mean is None else
                 {"sync/probe_gap_mean": self.probe_gap_mean, "sync/probe_gap_max": self.probe_gap_max})
        return {**probe, "sync/seconds": self.seconds, "sync/bytes": float(self.bytes),
                "sync/tensors": float(self.tensors), "sync/buckets": float(self.buckets),
                "sync/gb_per_s": gb_s, "sync/version": float(self.version),
                "sync/engines": float(self.engines), "sync/failed_engines": float(self.failed_engines),
                "sync/verify_seconds": self.verify_seconds, "sync/senders": float(self.senders),
                "sync/sender_bytes_max": float(max(self.sender_bytes.values(), default=self.bytes))}


def drain(named_tensors: NamedTensors, version: int) -> SyncMetrics:
    """A non-sending trainer rank: run the (collective) export iterator to its end, send nothing."""
    for _ in named_tensors:
        pass
    return SyncMetrics(version=version)


class WeightSync(abc.ABC):
    """Moves HF-named weights from the trainer to every rollout engine.

    Lifecycle: ``connect()`` once (forms the transport), ``sync(...)`` after every update,
    ``close()`` at the end. ``sync`` is called on every trainer rank with that rank's export stream
    (collective: :meth:`MegatronPolicy.export_owned` of the sync's plan): each sender moves its own
    tensors, the other ranks drain the iterator. A sync whose
    ``complete`` is false left some reachable engine without the new weights: sync again (with a
    fresh export), which re-forms the transport around the engines that are left.
    """

    # The transport needs every item's place in the stream on every rank: ``(name, None)`` where the
    # rank does not send it (ipc: each tensor is broadcast to every trainer rank as it comes).
    placeholders: bool = False

    def __init__(self, config: SyncConfig):
        self.config = config
        # The trainer's side of the probe every engine must match after loading (sync.verify;
        # megatron_rl.sync.probe.ProbeReference); set by the trainer before each sync, None: no probe.
        self.probe = None

    def set_probe(self, reference) -> None:
        """What the engines must compute after the next syncs (the weights they send)."""
        self.probe = reference

    def connect(self) -> None:
        """Form the transport (process group, handles). Idempotent."""

    @abc.abstractmethod
    def sync(self, named_tensors: NamedTensors, version: int) -> SyncMetrics:
        """Send all tensors, have engines load and verify them, reset prefix caches, tag ``version``."""

    def close(self) -> None:
        """Tear the transport down; engines stay up."""

    def __enter__(self):
        self.connect()
        return self

    def __exit__(self, *exc):
        self.close()


def transport(name: str) -> Transport:
    if name not in TRANSPORTS:
        raise ValueError(f"unknown sync transport {name!r}; transports are {sorted(TRANSPORTS)}")
    return TRANSPORTS[name]


def build_weight_sync(config: SyncConfig, engines, *, rank: int = DRIVER, metadata: Metadata | None = None,
                      group=None) -> WeightSync:
    """The transport named by ``config.transport`` for ``engines`` (a list of in-process engines, or
    the fleet of servers; on the driver, global rank 0: None on the other ranks).

    ``rank``: this trainer rank's global rank. ``metadata`` lists what each sync sends and who sends
    it (:data:`Metadata`; the engines plan their receive buffers from it); without it the driver
    sends whatever stream it is given (in-process only). ``group``: the trainer's process group the
    senders coordinate over (None: the default world).
    """
    config.validate()
    module = importlib.import_module(transport(config.transport).module)
    plan = None if metadata is None else SendPlan.of(metadata)
    return module.build(config, engines, rank=rank, plan=plan, group=group)


class SenderRound:
    """The senders' side channel over the trainer's process group (several senders only): the
    driver's plan of a round to every rank (:meth:`announce`), every rank's report back to the driver
    (:meth:`collect`). Both are collective over ``group`` (every trainer rank calls ``sync``)."""

    def __init__(self, group=None):
        self.group = group

    def announce(self, plan: dict | None) -> dict:
        """The driver's ``plan`` on every rank."""
        import torch.distributed as dist

        box = [plan]
        dist.broadcast_object_list(box, src=DRIVER, group=self.group)
        return box[0]

    def collect(self, report) -> list | None:
        """Every rank's ``report`` on the driver (in rank order; None elsewhere)."""
        import torch.distributed as dist

        out = [None] * dist.get_world_size(self.group) if dist.get_rank() == DRIVER else None
        dist.gather_object(report, out, dst=DRIVER, group=self.group)
        return out


def server_args(config: SyncConfig) -> tuple[list[str], dict[str, str]]:
    """Extra vLLM server arguments and environment for ``config.transport``."""
    t = transport(config.transport)
    if t.backend is None:
        raise ValueError(f"sync.transport {config.transport!r} does not drive vLLM servers; use one of "
                         f"{sorted(n for n, x in TRANSPORTS.items() if x.backend)}")
    args = ["--weight-transfer-config", json.dumps({"backend": t.backend})]
    if t.worker_extension:
        args += ["--worker-extension-cls", t.worker_extension]
    return args, dict(t.server_env)
