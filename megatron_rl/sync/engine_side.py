"""Functions run inside each vLLM worker (``llm.collective_rpc(fn, args=...)``), next to the model.

vLLM calls ``fn(worker, *args)``; module-level functions travel by reference, so the same code
serves an in-process worker and vLLM's own worker processes (engine TP > 1). Each worker joins the
sync group under its own rank (engine offset + vLLM rank), receives every bucket, and feeds the
tensors to vLLM's weight loader (``worker.reload_weights``) as they arrive, so a layer is loaded as
soon as all of its tensors are in.
"""

from __future__ import annotations

import time

import torch

from megatron_rl.sync.buckets import checksum, unpack
from megatron_rl.sync.group import make_group, recv_buckets

_GROUP_ATTR = "_mrl_sync_group"
_BACKEND_ATTR = "_mrl_sync_backend"


def _device(backend: str) -> torch.device:
    if backend == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def join_group(worker, addr: str, port: int, rank_offset: int, world_size: int, backend: str,
               timeout_s: float) -> int:
    """Join the sync group hosted by the trainer at ``addr:port``; returns this worker's rank."""
    leave_group(worker)
    rank = rank_offset + int(getattr(worker, "rank", 0))
    setattr(worker, _GROUP_ATTR, make_group(backend, addr, port, rank, world_size, timeout_s))
    setattr(worker, _BACKEND_ATTR, backend)
    return rank


def leave_group(worker) -> None:
    group = getattr(worker, _GROUP_ATTR, None)
    setattr(worker, _GROUP_ATTR, None)
    if group is not None:
        try:
            group.abort()
        except Exception:  # noqa: BLE001 - a broken group may refuse to abort; it is dropped anyway
            pass


def load_named_stream(worker, named, verify: bool) -> dict:
    """Load ``named`` (an iterator of ``(hf_name, tensor)``) through vLLM's weight loader.

    Returns ``{"checksums": {name: int}, "bytes": int, "tensors": int, "seconds": float}``,
    checksums computed on exactly the bytes handed to the loader (empty unless ``verify``).
    """
    sums: dict[str, int] = {}
    stats = {"bytes": 0, "tensors": 0}

    def tracked():
        for name, tensor in named:
            if verify:
                sums[name] = checksum(tensor)
            stats["bytes"] += tensor.numel() * tensor.element_size()
            stats["tensors"] += 1
            yield name, tensor

    t0 = time.perf_counter()
    stream = tracked()
    try:
        worker.reload_weights(weights_iterator=stream, is_checkpoint_format=True)
    finally:
        for _ in stream:  # keep the sender unblocked if the loader stopped early
            pass
    return {"checksums": sums, "seconds": time.perf_counter() - t0, **stats}


def receive_weights(worker, verify: bool, timeout_s: float) -> dict:
    """Receive one sync from the group and load it; on any error leave the (broken) group."""
    group = getattr(worker, _GROUP_ATTR, None)
    if group is None:
        raise RuntimeError("this engine worker has not joined a sync group (join_group first)")
    device = _device(getattr(worker, _BACKEND_ATTR))

    def named():
        for meta, data in recv_buckets(group, device, timeout_s):
            yield from unpack(meta, data)

    try:
        return load_named_stream(worker, named(), verify)
    except BaseException:
        leave_group(worker)
        raise
