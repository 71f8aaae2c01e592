"""The trainer side of the gloo weight-transfer backend: vLLM's ``TrainerWeightTransferEngine`` that
streams this rank's tensors as packed buckets on its group.

The driver (``rank`` 0) hosts the groups' rendezvous store (reachable from every engine and every
sender), drives the server routes through the fleet's client and streams its own tensors on its
group; another sender (``sender_index`` > 0, no client) joins its group at the driver's store and
streams its own tensors there. Each cuts its tensors into buckets (two alternating buffers: bucket
k+1 is gathered and packed while bucket k is in flight), hashes each one while it is in flight, and
collects every worker's checksums of its buckets in one all-gather (:attr:`report`), so the sync
knows which engine received what. No sender receives another's bytes.

Owns: this rank's group, its bucket buffers and the last round's :class:`RoundReport`.
May call: :mod:`megatron_rl.sync.gloo_wire`, :mod:`megatron_rl.sync.group`,
:mod:`megatron_rl.sync.buckets`, the fleet's client (vLLM's weight-transfer routes on every engine).
"""

from __future__ import annotations

import concurrent.futures as cf
import dataclasses
import time
from collections.abc import Iterator

import torch
from vllm.distributed.weight_transfer.base import ParamMeta, TrainerWeightTransferEngine, WeightSource

from megatron_rl.sync.buckets import group_by_dtype, pack
from megatron_rl.sync.gloo_wire import (BUCKET_HASH, GlooTrainerInitInfo, GlooWeightTransferInitInfo, abort_group,
                                        update_info)
from megatron_rl.sync.group import allgather, broadcast, host_store, make_group, sender_prefix, wait_works


@dataclasses.dataclass
class RoundReport:
    """What one ``send_weights`` did: per-bucket checksums sent and received (per group rank)."""

    buckets: int = 0
    tensors: int = 0
    bytes: int = 0
    seconds: float = 0.0
    hash_seconds: float = 0.0
    # seconds of the round by phase, on the sender: the start route (vLLM's layerwise reload set-up
    # on every engine; ~0 when the sync sent it ahead), the broadcast of the buckets (the engines
    # loading them as they arrive), the update route answering after the checksums' all-gather, and
    # the finish route (the reload's finalisation and the version tag; sent at the all-gather)
    phases: dict[str, float] = dataclasses.field(default_factory=dict)
    bucket_names: list[list[str]] = dataclasses.field(default_factory=list)
    sent: list[int] = dataclasses.field(default_factory=list)
    received: dict[int, list[int]] = dataclasses.field(default_factory=dict)
    # Several senders (the driver's merged report): global trainer rank -> bytes it sent.
    sender_bytes: dict[int, int] = dataclasses.field(default_factory=dict)


class GlooTrainerWeightTransferEngine(TrainerWeightTransferEngine[GlooTrainerInitInfo]):
    """Trainer side. The driver (``rank`` 0) hosts the store, drives the routes, and streams its
    own tensors on its group; another sender (``sender_index`` > 0, no client) joins its group at
    the driver's store and streams its own tensors there. Each collects the checksums of its buckets
    (:attr:`report`)."""

    init_info_cls = GlooTrainerInitInfo

    def __init__(self, *, client, source: WeightSource, is_sender: bool, info: GlooTrainerInitInfo):
        super().__init__(client=client, source=source, is_sender=is_sender)
        self.info = info
        self.group = None
        self.report = RoundReport()
        self._buffers: list[torch.Tensor] = []
        self._store = None

    @classmethod
    def trainer_init(cls, init_info: GlooTrainerInitInfo, *, client, source: WeightSource | None = None):
        if source is None:
            raise ValueError("gloo trainer weight transfer requires a WeightSource")
        engine = cls(client=client, source=source, is_sender=init_info.is_sender, info=init_info)
        info = init_info
        if info.sender_index is None:
            return engine  # sends nothing: walks the (collective) export
        prefix = sender_prefix(info.sender_index, info.senders)
        if not engine.is_sender:  # another sender: join its group at the driver's store
            engine.group = make_group(info.master_address, info.master_port, 0, info.world_size,
                                      info.timeout_s, prefix=prefix)
            return engine
        store = info.store or host_store(info.master_address, info.world_size, info.timeout_s)
        worker_info = GlooWeightTransferInitInfo(
            master_address=info.master_address, master_port=store.port, rank_offset=1,
            world_size=info.world_size, bucket_bytes=info.bucket_bytes, verify=info.verify,
            timeout_s=info.timeout_s, senders=info.senders)
        # The workers block in init_weight_transfer_engine until their groups form; so does rank 0.
        exe = cf.ThreadPoolExecutor(max_workers=2, thread_name_prefix="gloo-init")
        try:
            joined = exe.submit(client.init_weight_transfer_engine, dataclasses.asdict(worker_info))
            formed = exe.submit(make_group, info.master_address, store.port, 0, info.world_size,
                                info.timeout_s, store, prefix)
            done, _ = cf.wait([joined, formed], timeout=info.timeout_s + 5,
                              return_when=cf.FIRST_EXCEPTION)
            for fut in done:
                fut.result()  # the first failure, named by the client
            if len(done) < 2:
                raise TimeoutError(f"the weight-transfer group of {info.world_size} ranks did not form "
                                   f"within {info.timeout_s:g}s")
            engine.group = formed.result()
        finally:
            exe.shutdown(wait=False)  # a failed rendezvous may still block a thread until its timeout
        engine._store = store
        return engine

    def _own(self, meta: list[ParamMeta]) -> tuple[list[ParamMeta], list[int]]:
        """This sender's part of the metadata, and every item's sender index."""
        index = getattr(self.source, "sender_index", None)
        senders = index() if callable(index) else [0] * len(meta)
        mine = self.info.sender_index
        return [m for m, k in zip(meta, senders) if k == mine], senders

    def send_weights(self) -> None:
        source = self.source
        meta = source.metadata()
        if self.info.sender_index is None:
            for _ in source:  # the export is collective: every trainer rank walks it
                pass
            return
        own, senders = self._own(meta)
        if not self.is_sender:  # another sender: stream its buckets, no routes to drive
            t0 = time.perf_counter()
            self.report = self._broadcast(checked(source, own), lambda: None)
            self.report.seconds = time.perf_counter() - t0
            return
        info = self.info
        t0 = time.perf_counter()
        self.client.start_weight_update()
        t1 = time.perf_counter()
        exe = cf.ThreadPoolExecutor(max_workers=2, thread_name_prefix="gloo-update")
        try:
            receiving = exe.submit(self.client.update_weights,
                                   update_info(meta, info.verify, senders if info.senders > 1 else None))

            def check() -> None:  # a worker that failed is named at once, not after a timeout
                if receiving.done():
                    receiving.result()

            report = self._broadcast(checked(source, own), check)
            t2 = time.perf_counter()
            # Every worker took part in the checksums' all-gather: it has received and loaded every
            # bucket, and its update call is returning. The finish goes out now, not after the update
            # route answers: each engine core runs its calls one at a time, in the order they came,
            # so the finish runs right after the update, a round trip earlier.
            finishing = exe.submit(self.client.finish_weight_update)
            receiving.result(timeout=info.timeout_s)
            t3 = time.perf_counter()
            finishing.result(timeout=info.timeout_s)
        finally:
            exe.shutdown(wait=False)  # after a failure the receivers may still be blocked
        report.seconds = time.perf_counter() - t0
        report.phases = {"start": t1 - t0, "broadcast": t2 - t1, "load_tail": t3 - t2,
                         "finish": report.seconds - (t3 - t0)}
        self.report = report

    def _buffer(self, slot: int) -> torch.Tensor:
        while len(self._buffers) <= slot:
            self._buffers.append(torch.empty(self.info.bucket_bytes, dtype=torch.uint8))
        return self._buffers[slot]

    def _broadcast(self, named: Iterator, check) -> RoundReport:
        """Two alternating buffers: bucket k+1 is gathered and packed while bucket k is in flight."""
        info, report = self.info, RoundReport()
        in_flight: list[list] = [[], []]
        hashes: list[int] = []
        for k, items in enumerate(group_by_dtype(named, info.bucket_bytes)):
            slot = k % 2
            wait_works(in_flight[slot], time.monotonic() + info.timeout_s, check)
            data = pack(items, self._buffer(slot))
            in_flight[slot] = [broadcast(self.group, data)]
            if info.verify:  # hashed while the broadcast is in flight
                h0 = time.perf_counter()
                hashes.append(BUCKET_HASH(data))
                report.hash_seconds += time.perf_counter() - h0
            report.buckets += 1
            report.tensors += len(items)
            report.bytes += data.numel()
            report.bucket_names.append([n for n, _ in items])
        wait_works(in_flight[0] + in_flight[1], time.monotonic() + info.timeout_s, check)
        mine = (torch.tensor(hashes, dtype=torch.int64) if hashes
                else torch.zeros(report.buckets, dtype=torch.int64))
        work, out = allgather(self.group, mine)
        wait_works([work], time.monotonic() + info.timeout_s, check)
        report.sent = [int(v) for v in mine.tolist()]
        report.received = {r: [int(v) for v in out[r].tolist()] for r in range(1, len(out))}
        return report

    def shutdown(self) -> None:
        group, self.group = self.group, None
        if group is not None:
            abort_group(group)
        self._store = None


def checked(source: WeightSource, meta: list[ParamMeta]) -> Iterator[tuple[str, torch.Tensor]]:
    """The source's pairs, checked against the metadata the workers plan with (a mismatch would cut
    the stream differently on both ends): an error names the first divergent parameter."""
    i = 0
    for name, tensor in source:
        if i >= len(meta):
            raise ValueError(f"the weight source yielded more tensors than its metadata declares "
                             f"({len(meta)}); first extra: {name!r}")
        m = meta[i]
        if name != m.name or tensor.dtype != m.dtype or tuple(tensor.shape) != tuple(m.shape):
            raise ValueError(f"weight source disagrees with its metadata at index {i}: declared "
                             f"{m.name!r} {m.dtype} {tuple(m.shape)}, got {name!r} {tensor.dtype} "
                             f"{tuple(tensor.shape)}")
        i += 1
        yield name, tensor
    if i != len(meta):
        raise ValueError(f"the weight source yielded {i} tensors, its metadata declares {len(meta)}")
