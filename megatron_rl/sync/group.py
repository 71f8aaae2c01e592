"""The dedicated sync process group and the bucket wire protocol on it.

Choice: a plain torch.distributed ``TCPStore`` + ``ProcessGroupGloo`` / ``ProcessGroupNCCL``
object built directly (no ``init_process_group``), so it never touches the trainer's default group
nor vLLM's own groups inside the engine workers. The sender is rank 0 and hosts the store on a free
port; engine workers are ranks 1..N. A re-formed group gets a fresh store and port.

Per bucket the sender broadcasts three messages: a 3-word int64 header ``[meta_len, data_len,
more]``, the JSON bucket header (:class:`BucketMeta`) as bytes, then the flat data. A header with
``more == 0`` ends the stream.
"""

from __future__ import annotations

import datetime
import time
from collections.abc import Callable, Iterator

import torch
import torch.distributed as dist

from megatron_rl.sync.buckets import BucketMeta

SENDER = 0


def make_group(backend: str, addr: str, port: int, rank: int, world_size: int,
               timeout_s: float, store: dist.Store | None = None):
    """Join (or, for rank 0 with ``store`` given, host) the sync group; returns the group."""
    timeout = datetime.timedelta(seconds=timeout_s)
    if store is None:
        store = dist.TCPStore(addr, port, world_size, is_master=False, timeout=timeout)
    if backend == "gloo":
        return dist.ProcessGroupGloo(store, rank, world_size, timeout)
    if backend == "nccl":
        opts = dist.ProcessGroupNCCL.Options()
        opts._timeout = timeout
        return dist.ProcessGroupNCCL(store, rank, world_size, opts)
    raise ValueError(f"sync backend must be 'gloo' or 'nccl', got {backend!r}")


def host_store(addr: str, world_size: int, timeout_s: float) -> dist.TCPStore:
    """The rank-0 store on a free port (read it back from ``store.port``)."""
    return dist.TCPStore(addr, 0, world_size, is_master=True, wait_for_workers=False,
                         timeout=datetime.timedelta(seconds=timeout_s))


def broadcast(group, tensor: torch.Tensor):
    opts = dist.BroadcastOptions()
    opts.rootRank = SENDER
    opts.rootTensor = 0
    return group.broadcast([tensor], opts)


def send_bucket(group, meta: BucketMeta | None, data: torch.Tensor | None,
                device: torch.device) -> list:
    """Post the three broadcasts of one bucket (or the end marker when ``meta`` is None)."""
    if meta is None:
        return [broadcast(group, torch.zeros(3, dtype=torch.int64, device=device))]
    raw = torch.frombuffer(bytearray(meta.encode()), dtype=torch.uint8).to(device)
    head = torch.tensor([raw.numel(), data.numel(), 1], dtype=torch.int64, device=device)
    # keep the small tensors alive with their works
    return [(broadcast(group, head), head), (broadcast(group, raw), raw), broadcast(group, data)]


def wait_works(works: list, deadline: float, check: Callable[[], None]) -> None:
    """Wait for ``works`` until ``deadline`` (time.monotonic), calling ``check`` while waiting.

    ``check`` raises when a peer is known dead, so a dead engine is named at once instead of
    surfacing as a bare transport error or a timeout.
    """
    for item in works:
        work = item[0] if isinstance(item, tuple) else item
        while not work.is_completed():
            check()
            if time.monotonic() > deadline:
                raise TimeoutError("sync collective did not complete in time")
            time.sleep(0.0005)
        work.wait()  # raises the transport error, if any


def recv_buckets(group, device: torch.device,
                 timeout_s: float) -> Iterator[tuple[BucketMeta, torch.Tensor]]:
    """Receive buckets until the end marker; each data buffer is freshly allocated.

    Fresh buffers matter: the weight loader may keep views of a bucket until a whole layer has
    arrived, so a received buffer must not be overwritten by the next bucket.
    """
    timeout = datetime.timedelta(seconds=timeout_s)
    while True:
        head = torch.empty(3, dtype=torch.int64, device=device)
        broadcast(group, head).wait(timeout)
        meta_len, data_len, more = (int(v) for v in head.tolist())
        if not more:
            return
        raw = torch.empty(meta_len, dtype=torch.uint8, device=device)
        broadcast(group, raw).wait(timeout)
        meta = BucketMeta.decode(bytes(raw.cpu().numpy()))
        data = torch.empty(data_len, dtype=torch.uint8, device=device)
        broadcast(group, data).wait(timeout)
        yield meta, data
