"""The engine lives in the trainer's process (the CPU demo): hand it the tensors directly.

With several senders (pipeline stages streaming their own tensors, ``sync.senders=owners``) the
engine's rank (the driver, global rank 0) exports its own tensors and receives the other senders'
as packed buckets over the trainer's process group, one bucket at a time per sender
(:data:`FANIN_BUCKET_BYTES`), each sender's next bucket in flight while one is unpacked; the
engine loads them as they come. No other rank receives anything.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Iterator, Sequence

import torch

from megatron_rl.sync import probe
from megatron_rl.sync.base import DRIVER, NamedTensors, SendPlan, SyncError, SyncMetrics, WeightSync, drain
from megatron_rl.sync.buckets import bucket_nbytes, group_by_dtype, nbytes, pack
from megatron_rl.sync.config import SyncConfig

# Size of one packed bucket another sender ships to the engine's rank (CPU: the range where the gloo
# transfer pipelines well, benchmarks/RESULTS.md). A tensor larger than this travels alone.
FANIN_BUCKET_BYTES = 64 * 1024 * 1024


class InProcessWeightSync(WeightSync):
    """Calls ``engine.update_weights(named_tensors, version)`` on every engine (vLLM's in-place
    layerwise reload, then a prefix-cache reset: :class:`~megatron_rl.rollout.vllm_engine.VLLMEngine`).

    With ``verify`` the engine must then report ``weight_version == version`` and match the probe
    (:mod:`megatron_rl.sync.probe`) when the trainer set one; the bytes are the trainer's own
    tensors, so there is nothing in flight to checksum.
    """

    def __init__(self, config: SyncConfig, engines: Sequence, *, rank: int = DRIVER,
                 plan: SendPlan | None = None, group=None):
        super().__init__(config)
        self.engines = list(engines)
        self.rank = rank
        self.plan = plan
        self.group = group
        self.senders = plan.senders if plan is not None else (DRIVER,)

    def sync(self, named_tensors: NamedTensors, version: int) -> SyncMetrics:
        t0 = time.perf_counter()
        several = len(self.senders) > 1
        if self.rank != DRIVER:
            if several and self.rank in self.senders:
                send_to_driver(named_tensors, self.plan.owned(self.rank), self.group)
                return SyncMetrics(version=version)
            return drain(named_tensors, version)
        sent: dict[int, int] = {}
        stream = fan_in(named_tensors, self.plan, self.group, sent) if several else named_tensors
        # one engine streams; several need the tensors more than once
        tensors = stream if len(self.engines) == 1 else list(stream)
        counted: list[tuple[str, object]] = []

        def counting():
            for name, tensor in tensors:
                counted.append((name, tensor.numel() * tensor.element_size()))
                yield name, tensor

        metrics = SyncMetrics(version=version, engines=len(self.engines), verified=self.config.verify,
                              senders=len(self.senders))
        try:
            for i, engine in enumerate(self.engines):
                engine.update_weights(counting() if i == 0 else iter(tensors), version)
                if self.config.verify and engine.weight_version != version:
                    raise SyncError(f"engine {getattr(engine, 'name', i)}: weight_version is "
                                    f"{engine.weight_version} after loading version {version}")
                if self.config.verify and self.probe is not None:
                    metrics.add_probe_gap(probe.check(engine, self.probe))  # SyncMismatch past the tolerance
        finally:
            for _ in stream:  # the export (and the fan-in) is collective: walk it to the end
                pass
        metrics.seconds = time.perf_counter() - t0
        metrics.bytes, metrics.tensors = sum(n for _, n in counted), len(counted)
        metrics.sender_bytes = {DRIVER: metrics.bytes - sum(sent.values()), **sent}
        return metrics


def send_to_driver(named_tensors: NamedTensors, owned: list, group=None) -> None:
    """A sender other than the driver: its stream, packed into buckets as :func:`fan_in` cuts them
    (from ``owned``, the plan's items of this rank), to the driver; two buffers alternate (bucket
    k + 1 is packed while bucket k is in flight)."""
    import torch.distributed as dist

    buffers = [torch.empty(FANIN_BUCKET_BYTES, dtype=torch.uint8) for _ in range(2)]
    in_flight: list = [None, None]
    stream = iter(named_tensors)
    try:
        for k, items in enumerate(group_by_dtype(_checked(stream, owned), FANIN_BUCKET_BYTES)):
            slot = k % 2
            if in_flight[slot] is not None:
                in_flight[slot].wait()
            in_flight[slot] = dist.isend(pack(items, buffers[slot]), dst=DRIVER, group=group)
        for work in in_flight:
            if work is not None:
                work.wait()
    finally:
        for _ in stream:  # the export is collective: walk it to the end whatever happened
            pass


def fan_in(own: NamedTensors, plan: SendPlan, group, sent: dict[int, int]
           ) -> Iterator[tuple[str, torch.Tensor]]:
    """On the driver: its own stream, then every other sender's tensors as their buckets arrive
    (each sender's first two buckets are posted before the driver exports its own). ``sent`` gets
    the bytes each other sender shipped."""
    import torch.distributed as dist

    pending: dict[int, deque] = {}
    plans: dict[int, deque] = {}
    for rank in plan.senders:
        if rank == DRIVER:
            continue
        plans[rank] = deque(group_by_dtype(_meta(plan.owned(rank)), FANIN_BUCKET_BYTES))
        pending[rank] = deque()
        for _ in range(2):
            _post(rank, plans, pending, group, dist)
    own = iter(own)
    try:
        yield from _checked(own, plan.owned(DRIVER))
        for rank in pending:
            sent[rank] = 0
            while pending[rank]:
                items, buf, work = pending[rank].popleft()
                work.wait()
                _post(rank, plans, pending, group, dist)
                sent[rank] += buf.numel()
                offset = 0
                for name, meta in items:  # views of the bucket (a fresh buffer each: the engine keeps them)
                    n = nbytes(meta)
                    yield name, buf[offset:offset + n].view(meta.dtype).view(meta.shape)
                    offset += n
    finally:  # after a failure: the collectives still complete (the export, every posted receive)
        for _ in own:
            pass
        for rank in pending:
            while pending[rank]:
                pending[rank].popleft()[2].wait()
                _post(rank, plans, pending, group, dist)


def _post(rank: int, plans: dict, pending: dict, group, dist) -> None:
    if plans[rank]:
        items = plans[rank].popleft()
        buf = torch.empty(bucket_nbytes(items), dtype=torch.uint8)
        pending[rank].append((items, buf, dist.irecv(buf, src=rank, group=group)))


def _meta(owned: list) -> Iterator[tuple[str, torch.Tensor]]:
    for name, dtype, shape in owned:
        yield name, torch.empty(shape, dtype=dtype, device="meta")


def _checked(stream, owned: list) -> Iterator[tuple[str, torch.Tensor]]:
    """The stream, checked against the plan's items of its rank (both ends cut buckets from them)."""
    i = 0
    for name, tensor in stream:
        if i >= len(owned) or (name, tensor.dtype, tuple(tensor.shape)) != tuple(owned[i]):
            want = owned[i] if i < len(owned) else "nothing more"
            raise ValueError(f"weight sync: the export yielded {name!r} {tensor.dtype} {tuple(tensor.shape)} "
                             f"at index {i}, the plan has {want}")
        i += 1
        yield name, tensor
    if i != len(owned):
        raise ValueError(f"weight sync: the export yielded {i} tensors, the plan has {len(owned)}")


def build(config: SyncConfig, engines, *, rank: int = DRIVER, plan: SendPlan | None = None,
          group=None) -> InProcessWeightSync:
    """``engines``: the engine (or a list of them) on the driver; None on the other ranks."""
    if engines is None:
        engines = []
    elif not isinstance(engines, (list, tuple)):
        engines = [engines]
    return InProcessWeightSync(config, list(engines), rank=rank, plan=plan, group=group)
