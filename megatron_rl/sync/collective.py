"""Bucketed broadcast to engines in their own processes: gloo on CPU, NCCL on GPUs.

The trainer's sending rank (rank 0 of a dedicated group, see :mod:`megatron_rl.sync.group`) packs
the export iterator's tensors into two alternating flat buffers; while bucket k is in flight
(asynchronous broadcast), bucket k+1 is gathered and packed into the other buffer. Engines
(:class:`~megatron_rl.rollout.remote.RemoteEngine`) receive in a call started before the
transfer, load through vLLM's weight loader, and reply with per-tensor checksums.
"""

from __future__ import annotations

import time
from collections.abc import Sequence

import torch

from megatron_rl.rollout.remote import EngineDied
from megatron_rl.sync import engine_side
from megatron_rl.sync.base import (NamedTensors, SyncError, SyncMetrics, SyncTimeout, WeightSync,
                                   commit, drain, invalidate)
from megatron_rl.sync.buckets import checksums, group_by_dtype, pack, unpack
from megatron_rl.sync.config import SyncConfig
from megatron_rl.sync.group import host_store, make_group, send_bucket, wait_works


def send_all(group, named_tensors: NamedTensors, buffers: list[torch.Tensor], device: torch.device,
             verify: bool, timeout_s: float, check=lambda: None,
             metrics: SyncMetrics | None = None) -> dict[str, int]:
    """Stream every tensor to the group in buckets through two alternating ``buffers``.

    While bucket k is being broadcast (asynchronously), bucket k+1 is gathered from the iterator
    and packed into the other buffer. Returns the per-tensor checksums (empty unless ``verify``)
    and fills ``metrics`` (buckets, tensors, bytes). Every wait ends by ``timeout_s``.
    """
    expected: dict[str, int] = {}
    in_flight: list[list] = [[], []]
    bucket_bytes = buffers[0].numel()
    for k, items in enumerate(group_by_dtype(named_tensors, bucket_bytes)):
        slot = k % 2
        wait_works(in_flight[slot], time.monotonic() + timeout_s, check)
        meta, data = pack(items, k, buffers[slot])
        in_flight[slot] = send_bucket(group, meta, data, device)
        if verify:  # hashed while the broadcast is in flight
            expected.update(checksums(unpack(meta, data)))
        if metrics is not None:
            metrics.buckets += 1
            metrics.tensors += len(meta.tensors)
            metrics.bytes += sum(t.nbytes for t in meta.tensors)
    end = send_bucket(group, None, None, device)
    wait_works(in_flight[0] + in_flight[1] + end, time.monotonic() + timeout_s, check)
    return expected


class CollectiveWeightSync(WeightSync):
    """Sync over a torch.distributed gloo/NCCL group joining this rank and every engine worker.

    ``engines`` are :class:`RemoteEngine`-like: ``name``, ``workers`` (vLLM ranks), ``submit``,
    ``set_weight_version``, ``reset_prefix_cache``.
    """

    def __init__(self, config: SyncConfig, engines: Sequence, *, sender: bool = True):
        super().__init__(config)
        if config.transport not in ("gloo", "nccl"):
            raise ValueError(f"CollectiveWeightSync needs sync.transport gloo or nccl, "
                             f"got {config.transport!r}")
        if config.transport == "nccl" and not torch.cuda.is_available():
            raise SyncError("sync.transport='nccl' needs CUDA; use 'gloo' on CPU")
        if not engines and sender:
            raise ValueError("CollectiveWeightSync needs at least one engine")
        self.engines = list(engines)
        self.sender = sender
        self.backend = config.transport
        self.device = (torch.device("cuda", torch.cuda.current_device())
                       if self.backend == "nccl" else torch.device("cpu"))
        self.group = None
        self._store = None
        self._buffers: list[torch.Tensor] = []

    # ------------------------------------------------------------------ group lifecycle
    def connect(self) -> None:
        if not self.sender or self.group is not None:
            return
        cfg = self.config
        world = 1 + sum(e.workers for e in self.engines)
        self._store = host_store(cfg.master_addr, world, cfg.timeout_s)
        pending, offset = [], 1
        for engine in self.engines:
            pending.append((engine, engine.submit(
                "rpc", engine_side.join_group,
                (cfg.master_addr, self._store.port, offset, world, self.backend, cfg.timeout_s),
                drain_timeout_s=cfg.timeout_s)))
            offset += engine.workers
        try:
            self.group = make_group(self.backend, cfg.master_addr, self._store.port, 0, world,
                                    cfg.timeout_s, store=self._store)
        except Exception as exc:
            self._raise_engine_failures(pending)
            raise SyncError(f"sync group of {world} ranks did not form within "
                            f"sync.timeout_s={cfg.timeout_s}s: {exc}") from exc
        for engine, p in pending:
            p.result(cfg.timeout_s)

    def close(self) -> None:
        group, self.group, self._store = self.group, None, None
        if group is None:
            return
        try:
            group.abort()  # unblocks engines still waiting on it
        except Exception:  # noqa: BLE001 - an already broken group may refuse; it is dropped
            pass
        for engine in self.engines:
            if getattr(engine, "alive", True):
                try:
                    engine.submit("rpc", engine_side.leave_group, (),
                                  drain_timeout_s=self.config.timeout_s).result(self.config.timeout_s)
                except Exception:  # noqa: BLE001 - best effort; join_group also leaves first
                    pass

    def set_engines(self, engines: Sequence) -> None:
        """Replace the engine list (e.g. after a restart); the group is re-formed on next sync."""
        self.close()
        self.engines = list(engines)

    @staticmethod
    def _raise_engine_failures(pending) -> None:
        for engine, p in pending:
            p.poll()  # raises EngineDied / EngineError naming the engine

    # ------------------------------------------------------------------ one sync
    def _buffer(self, slot: int) -> torch.Tensor:
        while len(self._buffers) <= slot:
            self._buffers.append(torch.empty(self.config.bucket_bytes, dtype=torch.uint8,
                                             device=self.device))
        return self._buffers[slot]

    def sync(self, named_tensors: NamedTensors, version: int) -> SyncMetrics:
        if not self.sender:
            return drain(named_tensors, version)
        cfg = self.config
        t0 = time.perf_counter()
        self.connect()
        pending = [(e, e.submit("rpc", engine_side.receive_weights, (cfg.verify, cfg.timeout_s),
                             drain_timeout_s=cfg.timeout_s)) for e in self.engines]

        def check() -> None:
            self._raise_engine_failures(pending)

        metrics = SyncMetrics(version=version, engines=len(self.engines), verified=cfg.verify)
        try:
            expected = send_all(self.group, named_tensors, [self._buffer(0), self._buffer(1)],
                                self.device, cfg.verify, cfg.timeout_s, check, metrics)
            replies = [(e, p.result(cfg.timeout_s)) for e, p in pending]
        except TimeoutError as exc:
            faults = self._engine_faults(pending)
            self._fail()
            invalidate(self.engines, cfg.timeout_s)
            raise SyncTimeout(f"weight sync v{version}: {exc} within sync.timeout_s="
                              f"{cfg.timeout_s}s; {faults}") from exc
        except Exception as exc:
            faults = self._engine_faults(pending)
            self._fail()
            invalidate(self.engines, cfg.timeout_s)
            if isinstance(exc, SyncError):
                raise
            raise SyncError(f"weight sync v{version} failed: {faults}; transport said: {exc}") from exc
        commit(replies, expected, version, cfg.verify, cfg.timeout_s)
        metrics.seconds = time.perf_counter() - t0
        return metrics

    @staticmethod
    def _engine_faults(pending, grace_s: float = 3.0) -> str:
        """Name the engines that died or failed; a transport error usually means one of them did.

        A killed process is reaped a moment after its sockets close, so wait up to ``grace_s``.
        """
        deadline = time.monotonic() + grace_s
        while True:
            faults = []
            for engine, p in pending:
                try:
                    p.poll()
                except EngineDied as exc:  # the likely cause: named first
                    faults.insert(0, str(exc))
                except Exception as exc:  # noqa: BLE001 - collected into one message
                    faults.append(str(exc).splitlines()[0])
            if faults or time.monotonic() > deadline:
                break
            time.sleep(0.05)
        if faults:
            return "; ".join(faults)
        alive = ", ".join(f"{e.name}={'alive' if getattr(e, 'alive', True) else 'dead'}"
                          for e, _ in pending)
        return f"no engine reported a fault ({alive})"

    def _fail(self) -> None:
        """After a failed sync the group is unusable: drop it so the next sync re-forms it."""
        group, self.group = self.group, None
        if group is not None:
            try:
                group.abort()
            except Exception:  # noqa: BLE001
                pass
        self._store = None
