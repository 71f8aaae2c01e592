"""A ``gloo`` weight-transfer backend for vLLM: the CPU twin of vLLM's dense ``nccl`` backend.

vLLM 0.32 moves weights from a trainer into running servers through weight-transfer engines behind
a factory (``vllm.distributed.weight_transfer``): a trainer-side engine (``trainer_init`` /
``send_weights``) drives the server's RL routes (``/init_weight_transfer_engine``,
``/start_weight_update``, ``/update_weights``, ``/finish_weight_update``) through a client, while the
matching worker-side engine inside every vLLM worker receives. Its ``nccl`` backend needs GPUs (and
its packed-tensor producer/consumer are CUDA-stream code), so on CPU this module registers a ``gloo``
backend with both factories, following the same protocol: the update info carries the parameter
metadata (names, dtypes, shapes); both ends cut the stream into the same packed buckets from it
(:func:`megatron_rl.sync.buckets.group_by_dtype`), so only raw bucket bytes travel, broadcast over a
gloo group of a trainer sender (its rank 0) and every worker of every engine (ranks 1..N, each engine
at its own rank offset); workers load each bucket through the model's ``load_weights`` inside vLLM's
layerwise reload (started by ``start_weight_update``, finalised by ``finish_weight_update``).

Several senders (each pipeline stage's trainer rank sends its own layers: the update info names each
tensor's sender): one rendezvous store (hosted by the driver, which also drives the routes), one
group per sender over it (:func:`megatron_rl.sync.group.sender_prefix`), each with that sender and
every worker; each sender cuts its own tensors into buckets and broadcasts them on its group, all
senders at once; every worker receives from all of them (two buckets in flight per sender, loaded in
a fixed round-robin order). No sender receives another's bytes.

On top of vLLM's protocol: one checksum per packed bucket (:data:`BUCKET_HASH`, the one definition
both ends use: XXH3-64 of the bucket's bytes in host memory), computed by the sender while the
bucket is in flight and by every worker on a side thread while it loads the bucket (and the next
one arrives), exchanged in one all-gather at the end of the round, so the sender knows which engine
received what (``GlooTrainerWeightTransferEngine.report``); whether a round is checksummed travels
with its update info (``verify``);
every wait has a timeout; a worker whose stream is cut restores the layers the reload had displaced
(the weights are then a mix of old and new, which the sender records as an unknown version).

Registration: importing this module registers the backend in both factories. The servers import it
through ``--worker-extension-cls megatron_rl.sync.gloo.GlooWorkerExtension`` (vLLM imports that
class in every worker before it builds the worker's weight-transfer engine); the trainer imports it
when it builds the sync.
"""

from __future__ import annotations

import concurrent.futures as cf
import dataclasses
import logging
import time
from collections import deque
from collections.abc import Iterator
from typing import ClassVar

import torch
from vllm.distributed.weight_transfer.base import (ParamMeta, TrainerInitInfo, TrainerWeightTransferEngine,
                                                   WeightSource, WeightTransferEngine,
                                                   WeightTransferInitInfo, WeightTransferUpdateInfo)
from vllm.distributed.weight_transfer.factory import (WeightTransferEngineFactory,
                                                      WeightTransferTrainerFactory)
from vllm.distributed.weight_transfer.packed_tensor import unpack_tensor

from megatron_rl.rollout.reload import refresh_cpu_moe_experts, refresh_tied_layers
from megatron_rl.rollout.route_capture import RoutesWorkerExtension
from megatron_rl.sync.buckets import bucket_nbytes, group_by_dtype, host_digest, meta_tensors, nbytes, pack
from megatron_rl.sync.group import allgather, broadcast, host_store, make_group, sender_prefix, wait_works
from megatron_rl.sync.server_transport import ServerTransport
from megatron_rl.sync.vllm_protocol import ServerWeightSync

log = logging.getLogger("megatron_rl")

BACKEND = "gloo"
# The bucket checksum of this transport, on both ends: the buckets travel through host memory.
BUCKET_HASH = host_digest


# ------------------------------------------------------------------------------------- wire info
@dataclasses.dataclass(kw_only=True)
class GlooWeightTransferInitInfo(WeightTransferInitInfo):
    """Worker side: where the group is and which ranks this engine's workers take."""

    master_address: str
    master_port: int
    rank_offset: int
    world_size: int
    bucket_bytes: int
    verify: bool = True
    timeout_s: float = 120.0
    # Trainer ranks that send (one group each; ``world_size`` is each group's size).
    senders: int = 1


@dataclasses.dataclass(kw_only=True)
class GlooTrainerInitInfo(TrainerInitInfo):
    """Trainer side. ``master_address`` is where the driver (``rank`` 0) hosts the groups' store
    (reachable from every engine and every sender); ``world_size`` counts one sender and every worker
    of every engine (each sender's group). With several senders the driver hosts the store before the
    others learn its ``master_port`` (``store``: the driver's); ``sender_index`` is this rank's
    group (None: it sends nothing)."""

    backend: ClassVar[str] = BACKEND
    master_address: str
    world_size: int
    bucket_bytes: int = 64 * 1024 * 1024
    verify: bool = True
    timeout_s: float = 120.0
    senders: int = 1
    sender_index: int | None = 0
    master_port: int = 0
    store: object = dataclasses.field(default=None, repr=False, compare=False)


@dataclasses.dataclass
class GlooWeightTransferUpdateInfo(WeightTransferUpdateInfo):
    """Per round: the parameters in export order, each one's sender (its index; empty: all from
    sender 0), and whether the round is checksummed (every worker hashes each bucket it receives)."""

    names: list[str]
    dtype_names: list[str]
    shapes: list[list[int]]
    verify: bool = True
    senders: list[int] = dataclasses.field(default_factory=list)

    def __post_init__(self):
        if not len(self.names) == len(self.dtype_names) == len(self.shapes):
            raise ValueError(f"update info: {len(self.names)} names, {len(self.dtype_names)} dtypes, "
                             f"{len(self.shapes)} shapes")
        if self.senders and len(self.senders) != len(self.names):
            raise ValueError(f"update info: {len(self.names)} names, {len(self.senders)} senders")

    def sender_of(self, i: int) -> int:
        return self.senders[i] if self.senders else 0


def update_info(meta: list[ParamMeta], verify: bool = True, senders: list[int] | None = None) -> dict:
    return dataclasses.asdict(GlooWeightTransferUpdateInfo(
        names=[m.name for m in meta], dtype_names=[str(m.dtype).removeprefix("torch.") for m in meta],
        shapes=[list(m.shape) for m in meta], verify=verify, senders=list(senders or [])))


def sender_plans(info: GlooWeightTransferUpdateInfo, senders: int, bucket_bytes: int) -> list[list]:
    """Per sender, its buckets (lists of (name, meta tensor)): what it sends and every worker
    receives from it, cut by both ends alike."""
    metas = list(meta_tensors(info.names, info.dtype_names, info.shapes))
    if info.senders and not 0 <= min(info.senders) <= max(info.senders) < senders:
        raise ValueError(f"update info names senders {sorted(set(info.senders))}, the transfer has {senders}")
    out = []
    for k in range(senders):
        mine = [m for i, m in enumerate(metas) if info.sender_of(i) == k]
        out.append(list(group_by_dtype(mine, bucket_bytes)))
    return out


# ------------------------------------------------------------------------------- worker side
class GlooWeightTransferEngine(WeightTransferEngine[GlooWeightTransferInitInfo, GlooWeightTransferUpdateInfo]):
    """Inside every vLLM worker: join the group, receive packed buckets, load them in place."""

    init_info_cls = GlooWeightTransferInitInfo
    update_info_cls = GlooWeightTransferUpdateInfo
    supports_draft_weight_update = False

    def __init__(self, config, vllm_config, device, model) -> None:
        super().__init__(config, vllm_config, device, model)
        self.groups: list = []  # one per sender
        self.info: GlooWeightTransferInitInfo | None = None
        self.rank = -1
        self.reloading = False
        self._loaded: list[str] = []  # the checkpoint names loaded in this reload
        # What the last round received (also readable through /collective_rpc, see the extension).
        self.last_round: dict = {}
        self._reload_seconds: dict[str, float] = {}  # vLLM's layerwise reload: start, finish

    def init_transfer_engine(self, init_info: GlooWeightTransferInitInfo) -> None:
        self.shutdown()
        pc = self.parallel_config
        self.rank = init_info.rank_offset + pc.data_parallel_index * pc.world_size + pc.rank
        self.info = init_info
        n = init_info.senders
        for k in range(n):  # in sender order: sender k joins its group while the others wait in theirs
            self.groups.append(make_group(init_info.master_address, init_info.master_port, self.rank,
                                          init_info.world_size, init_info.timeout_s,
                                          prefix=sender_prefix(k, n)))

    def start_weight_update(self) -> None:
        from vllm.model_executor.model_loader.reload import initialize_layerwise_reload

        t0 = time.perf_counter()
        initialize_layerwise_reload(self.model)
        self.reloading = True
        self._loaded = []
        self._reload_seconds = {"start_seconds": time.perf_counter() - t0}

    def finish_weight_update(self) -> None:
        t0 = time.perf_counter()
        self._finish_reload()
        self.last_round["finish_seconds"] = time.perf_counter() - t0

    def _finish_reload(self) -> None:
        if self.reloading:
            from vllm.model_executor.model_loader.reload import finalize_layerwise_reload

            self.reloading = False
            finalize_layerwise_reload(self.model, self.model_config)
            refresh_tied_layers(self.model)  # a tied output layer's packed copy follows the embedding
            refresh_cpu_moe_experts(self.model, self._loaded)  # CPU experts: packed again
            self._loaded = []

    def update_weights(self, update_info: dict) -> None:
        # The base class ends with torch.accelerator.synchronize(), which CPU builds lack; the
        # receive below is synchronous.
        self.receive_weights(self.parse_update_info(update_info))

    def receive_weights(self, update_info: GlooWeightTransferUpdateInfo) -> None:
        if not self.groups or self.info is None:
            raise RuntimeError("gloo weight transfer is not initialised (init_weight_transfer_engine first)")
        info = self.info
        t0 = time.perf_counter()
        verify = update_info.verify
        received = tensors = 0
        wait_s = load_s = 0.0  # blocked on the broadcasts, in load_weights
        # the checksums run on a side thread, beside load_weights and the next bucket's receive (the
        # hash releases the GIL); each keeps its buffer alive until it is hashed
        hasher = cf.ThreadPoolExecutor(max_workers=1, thread_name_prefix="gloo-hash") if verify else None
        digests: list = []
        try:
            plans = sender_plans(update_info, len(self.groups), info.bucket_bytes)
            sums: list[list[cf.Future]] = [[] for _ in plans]
            # per sender: its buckets in flight (at most two: the next arrives while one loads)
            pending: list[deque] = [deque() for _ in plans]
            posted = [0] * len(plans)

            def post(k: int) -> None:
                if posted[k] < len(plans[k]):
                    items = plans[k][posted[k]]
                    buf = torch.empty(bucket_nbytes(items), dtype=torch.uint8)
                    pending[k].append((items, buf, broadcast(self.groups[k], buf)))
                    posted[k] += 1

            for k in range(len(plans)):
                post(k)
            while any(pending):
                for k in range(len(plans)):  # a fixed round-robin over the senders
                    if not pending[k]:
                        continue
                    post(k)  # its next bucket arrives while this one is waited for and loaded
                    items, data, work = pending[k].popleft()
                    t1 = time.perf_counter()
                    work.wait()
                    t2 = time.perf_counter()
                    if hasher is not None:
                        sums[k].append(hasher.submit(_timed_digest, data))
                    self.model.load_weights(unpack_tensor(
                        data, [n for n, _ in items], [list(t.shape) for _, t in items],
                        [t.dtype for _, t in items], [nbytes(t) for _, t in items]))
                    self._loaded.extend(n for n, _ in items)
                    wait_s, load_s = wait_s + t2 - t1, load_s + time.perf_counter() - t2
                    received += data.numel()
                    tensors += len(items)
            t3 = time.perf_counter()
            digests = [[f.result(timeout=info.timeout_s) for f in fs] for fs in sums]
            hash_tail = time.perf_counter() - t3  # what hashing added after the last load
            # each sender collects what every worker received of its buckets
            vectors = [torch.tensor([d for d, _ in ds], dtype=torch.int64) if ds
                       else torch.zeros(len(p), dtype=torch.int64) for ds, p in zip(digests, plans)]
            works = [allgather(g, v)[0] for g, v in zip(self.groups, vectors)]
            for work in works:
                work.wait()
        except BaseException:
            # The stream was cut: put back the layers the reload had displaced (they keep a mix of old and
            # new weights, which the sender records as an unknown version), leave the broken groups.
            self._finish_reload()
            self.shutdown()
            raise
        finally:
            if hasher is not None:
                hasher.shutdown(wait=False)
        hash_s = sum(s for ds in digests for _, s in ds)
        # seconds: the whole receive; of it, wait: blocked on the broadcasts, load: vLLM's
        # load_weights (its layerwise reload processes each layer as it completes); hash: checksums
        # (on the side thread, overlapped), of which hash_tail came after the last load
        self.last_round = {"buckets": sum(len(p) for p in plans), "tensors": tensors, "bytes": received,
                           "seconds": time.perf_counter() - t0, "wait_seconds": wait_s,
                           "load_seconds": load_s, "hash_seconds": hash_s, "hash_tail_seconds": hash_tail,
                           **self._reload_seconds, "senders": len(plans),
                           "sender_buckets": [len(p) for p in plans],
                           "checksums": [int(x) for v in vectors for x in v.tolist()]}

    def shutdown(self) -> None:
        groups, self.groups = self.groups, []
        for group in groups:
            _abort(group)


class GlooWorkerExtension(RoutesWorkerExtension):
    """Mixed into every vLLM worker by ``--worker-extension-cls``: importing this module registers
    the gloo backend in the worker before its weight-transfer engine is built. Adds one read-only
    method, callable through the server's ``/collective_rpc``, to the MoE routes' methods (vLLM takes
    one extension class: a server of this transport can also return routes)."""

    def mrl_last_weight_round(self) -> dict:
        """What this worker's gloo engine received in the last round (buckets, bytes, checksums)."""
        engine = getattr(self, "weight_transfer_engine", None)
        return dict(getattr(engine, "last_round", {}) or {})


# ------------------------------------------------------------------------------ trainer side
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
            _abort(group)
        self._store = None


def _timed_digest(data: torch.Tensor) -> tuple[int, float]:
    t0 = time.perf_counter()
    return BUCKET_HASH(data), time.perf_counter() - t0


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


def _abort(group) -> None:
    try:
        group.abort()  # unblocks peers still waiting on it
    except Exception:  # noqa: BLE001 - a broken group may refuse; it is dropped either way
        pass


def register() -> None:
    """Register the backend with vLLM's worker-side and trainer-side factories (idempotent)."""
    if BACKEND not in WeightTransferEngineFactory._registry:
        WeightTransferEngineFactory.register_engine(BACKEND, GlooWeightTransferEngine)
    if BACKEND not in WeightTransferTrainerFactory._registry:
        WeightTransferTrainerFactory.register_engine(BACKEND, GlooTrainerWeightTransferEngine)


register()


# ------------------------------------------------------------------------------ the transport
def _init_info(config, world_size: int, rank: int, *, senders: int = 1, sender_index: int | None = 0,
               port: int = 0, store=None) -> GlooTrainerInitInfo:
    return GlooTrainerInitInfo(rank=rank, master_address=config.master_addr, world_size=world_size,
                               bucket_bytes=config.bucket_bytes, verify=config.verify,
                               timeout_s=config.timeout_s, senders=senders, sender_index=sender_index,
                               master_port=port, store=store)


def _host(config, world_size: int):
    """The driver's store for a transfer with several senders (its port goes to them first)."""
    return host_store(config.master_addr, world_size, config.timeout_s)


def build(config, fleet, *, rank: int, plan, group=None):
    """``sync.transport=gloo``: vLLM servers, through vLLM's protocol with this backend; every
    sender of ``plan`` streams its own tensors."""
    return ServerWeightSync(config, fleet, rank=rank, plan=plan, group=group,
                            transport=ServerTransport(BACKEND, _init_info, host=_host))
