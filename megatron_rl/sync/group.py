"""The dedicated weight-transfer process group of the gloo backend (:mod:`megatron_rl.sync.gloo`).

Choice: a plain torch.distributed ``TCPStore`` + ``ProcessGroupGloo`` object built directly (no
``init_process_group``), so it never touches the trainer's default group nor vLLM's own groups
inside the engine workers. The driver hosts the store on a free port. Each sender has its own group
over that one store (:func:`sender_prefix`): the sender is rank 0 of it, the engine workers ranks
1..N, so a sender's broadcasts reach the workers and no other sender (gloo relays a broadcast through
its members). A re-formed group gets a fresh store and port.
"""

from __future__ import annotations

import datetime
import time
from collections.abc import Callable

import torch
import torch.distributed as dist

SENDER = 0


def sender_prefix(index: int, senders: int) -> str:
    """The store prefix of sender ``index``'s group (none with one sender: the group of old)."""
    return "" if senders == 1 else f"sender{index}/"


def make_group(addr: str, port: int, rank: int, world_size: int, timeout_s: float,
               store: dist.Store | None = None, prefix: str = "") -> dist.ProcessGroupGloo:
    """Join (or, with the host's ``store`` given, host) the gloo group named by ``prefix`` in the
    store; every op times out."""
    timeout = datetime.timedelta(seconds=timeout_s)
    if store is None:
        store = dist.TCPStore(addr, port, world_size, is_master=False, timeout=timeout)
    if prefix:
        store = dist.PrefixStore(prefix, store)
    return dist.ProcessGroupGloo(store, rank, world_size, timeout)


def host_store(addr: str, world_size: int, timeout_s: float) -> dist.TCPStore:
    """The rank-0 store on a free port (read it back from ``store.port``)."""
    return dist.TCPStore(addr, 0, world_size, is_master=True, wait_for_workers=False,
                         timeout=datetime.timedelta(seconds=timeout_s))


def broadcast(group, tensor: torch.Tensor):
    opts = dist.BroadcastOptions()
    opts.rootRank = SENDER
    opts.rootTensor = 0
    return group.broadcast([tensor], opts)


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


def allgather(group, tensor: torch.Tensor):
    """Start gathering every rank's ``tensor`` (same shape everywhere): ``(work, outputs)``, the
    outputs in rank order once the work completes."""
    out = [torch.empty_like(tensor) for _ in range(group.size())]
    return group.allgather([out], [tensor]), out
