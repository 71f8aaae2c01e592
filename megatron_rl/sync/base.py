"""The weight-sync interface: one abstract class, one file per transport, one factory."""

from __future__ import annotations

import abc
import dataclasses
from collections.abc import Iterable, Sequence

import torch

from megatron_rl.sync.config import SyncConfig

NamedTensors = Iterable[tuple[str, torch.Tensor]]

# The weight version of an engine whose last sync failed part-way: its weights are a mix of old
# and new (or corrupted) tensors until the next successful sync. Rollouts tagged with it are void.
UNKNOWN_VERSION = -1


class SyncError(RuntimeError):
    """A sync failed: an engine died, hung past the timeout, or loaded different bytes."""


class SyncTimeout(SyncError):
    """An engine did not answer within ``sync.timeout_s``."""


class SyncMismatch(SyncError):
    """An engine's checksum of a tensor differs from the sender's."""


@dataclasses.dataclass
class SyncMetrics:
    """What one sync did; ``as_dict`` feeds the step's metrics (``sync/...``)."""

    version: int
    seconds: float = 0.0
    bytes: int = 0
    tensors: int = 0
    buckets: int = 0
    engines: int = 0
    verified: bool = False

    def as_dict(self) -> dict[str, float]:
        gb_s = self.bytes / self.seconds / 1e9 if self.seconds > 0 else 0.0
        return {"sync/seconds": self.seconds, "sync/bytes": float(self.bytes),
                "sync/tensors": float(self.tensors), "sync/buckets": float(self.buckets),
                "sync/gb_per_s": gb_s, "sync/version": float(self.version)}


def compare_checksums(engine: str, expected: dict[str, int], got: dict[str, int]) -> None:
    """Raise :class:`SyncMismatch` naming ``engine`` and the first differing tensor."""
    missing = sorted(set(expected) - set(got))
    if missing:
        raise SyncMismatch(f"engine {engine}: tensor {missing[0]!r} was not received "
                           f"({len(missing)} missing)")
    extra = sorted(set(got) - set(expected))
    if extra:
        raise SyncMismatch(f"engine {engine}: received unexpected tensor {extra[0]!r}")
    bad = [name for name in expected if expected[name] != got[name]]
    if bad:
        raise SyncMismatch(f"engine {engine}: checksum mismatch on tensor {bad[0]!r} "
                           f"({len(bad)} of {len(expected)} tensors differ)")


def drain(named_tensors: NamedTensors, version: int) -> SyncMetrics:
    """A non-sending trainer rank: run the (collective) export iterator to its end, send nothing."""
    for _ in named_tensors:
        pass
    return SyncMetrics(version=version)


def invalidate(engines, timeout_s: float) -> None:
    """Tag every live engine :data:`UNKNOWN_VERSION` after a failed sync (best effort: an engine
    that cannot be reached is dead and will be restarted anyway)."""
    for engine in engines:
        if not getattr(engine, "alive", True):
            continue
        try:
            engine.set_weight_version(UNKNOWN_VERSION, timeout_s=timeout_s)
        except Exception:  # noqa: BLE001 - the sync's own error is the one to report
            pass


def commit(replies: list, expected: dict[str, int], version: int, verify: bool,
           timeout_s: float) -> None:
    """After a transfer: check every engine worker's checksums, then reset prefix caches and tag
    the new ``version`` (only once every engine has verified, so no engine is tagged too early).

    ``replies`` pairs each engine with its per-worker results (``{"checksums": ...}`` each).
    """
    if verify:
        try:
            for engine, per_worker in replies:
                for rank, reply in enumerate(per_worker):
                    compare_checksums(f"{engine.name} (worker {rank})", expected,
                                      reply["checksums"])
        except SyncMismatch:
            invalidate([engine for engine, _ in replies], timeout_s)
            raise
    for engine, _ in replies:
        engine.reset_prefix_cache()
        engine.set_weight_version(version, timeout_s=timeout_s)


class WeightSync(abc.ABC):
    """Moves HF-named weights from the trainer to every rollout engine.

    Lifecycle: ``connect()`` once (forms the transport's group), ``sync(...)`` after every update,
    ``close()`` at the end. After an engine restarts, ``close()`` then ``connect()`` re-forms it.
    ``sync`` is called on every trainer rank (the export iterator is collective); only the sending
    rank moves data, the others drain the iterator.
    """

    def __init__(self, config: SyncConfig):
        self.config = config

    def connect(self) -> None:
        """Form the transport (process group, handles). Idempotent."""

    @abc.abstractmethod
    def sync(self, named_tensors: NamedTensors, version: int) -> SyncMetrics:
        """Send all tensors, have engines load them and reset prefix caches, tag ``version``."""

    def close(self) -> None:
        """Tear the transport down; engines stay up."""

    def __enter__(self):
        self.connect()
        return self

    def __exit__(self, *exc):
        self.close()


def build_weight_sync(config: SyncConfig, engines: Sequence, *, sender: bool = True) -> WeightSync:
    """The transport named by ``config.transport`` for ``engines``.

    ``sender`` says whether this trainer rank holds the full exported tensors (global rank 0);
    other ranks only drain the export iterator.
    """
    config.validate()
    if config.transport == "inprocess":
        from megatron_rl.sync.inprocess import InProcessWeightSync
        return InProcessWeightSync(config, engines, sender=sender)
    if config.transport in ("gloo", "nccl"):
        from megatron_rl.sync.collective import CollectiveWeightSync
        return CollectiveWeightSync(config, engines, sender=sender)
    if config.transport == "cuda_ipc":
        from megatron_rl.sync.cuda_ipc import CudaIpcWeightSync
        return CudaIpcWeightSync(config, engines, sender=sender)
    raise AssertionError(config.transport)  # validate() rejected anything else
