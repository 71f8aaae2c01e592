"""Functions run inside each vLLM worker (``llm.collective_rpc(fn, args=...)``), next to the model.

vLLM calls ``fn(worker, *args)``; module-level functions travel by reference, so the same code
serves an in-process worker and vLLM's own worker processes (engine TP > 1). Each worker joins the
sync group under its own rank (engine offset + vLLM rank), receives every bucket, and feeds the
tensors to vLLM's weight loader (``worker_ext.reload_in_place``) as they arrive, so a layer is loaded as
soon as all of its tensors are in.
"""

from __future__ import annotations

import time
from collections.abc import Iterator

import torch

from megatron_rl.rollout.worker_ext import reload_in_place
from megatron_rl.sync.buckets import BucketMeta, checksums, unpack
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


def load_buckets(worker, buckets: Iterator[tuple[BucketMeta, torch.Tensor]], verify: bool) -> dict:
    """Feed every tensor of ``buckets`` to vLLM's weight loader as the buckets arrive.

    Returns ``{"checksums": {name: int}, "bytes": int, "tensors": int, "seconds": float}``,
    checksums computed on exactly the bytes handed to the loader (empty unless ``verify``).

    vLLM's in-place reload first moves every layer to the meta device and restores it when the
    stream ends; a stream cut by a transport error must therefore *end* (not raise through the
    loader), or the model is left unusable. The error is re-raised once the loader has finished;
    the weights are then a mix of old and new, which the sender records as an unknown version.
    """
    sums: dict[str, int] = {}
    stats = {"bytes": 0, "tensors": 0}
    cut: list[BaseException] = []

    def named():
        try:
            for meta, data in buckets:
                tensors = unpack(meta, data)
                if verify:
                    sums.update(checksums(tensors))
                stats["bytes"] += sum(t.nbytes for t in meta.tensors)
                stats["tensors"] += len(tensors)
                yield from tensors
        except Exception as exc:  # noqa: BLE001 - re-raised after the loader has finalised
            cut.append(exc)

    t0 = time.perf_counter()
    stream = named()
    try:
        reload_in_place(worker, stream)
    except BaseException:
        _finalize_reload(worker)  # the loader itself failed: restore the layers it displaced
        raise
    finally:
        for _ in stream:  # keep the sender unblocked if the loader stopped early
            pass
    if cut:
        raise cut[0]
    return {"checksums": sums, "seconds": time.perf_counter() - t0, **stats}


def _finalize_reload(worker) -> None:
    """Best effort: bring layers displaced by an interrupted ``reload_weights`` back to memory."""
    try:
        from vllm.model_executor.model_loader.reload.layerwise import finalize_layerwise_reload

        finalize_layerwise_reload(worker.model_runner.get_model(),
                                  worker.vllm_config.model_config)
    except Exception:  # noqa: BLE001 - the original error is the one to report
        pass


def receive_weights(worker, verify: bool, timeout_s: float) -> dict:
    """Receive one sync from the group and load it; on any error leave the (broken) group."""
    group = getattr(worker, _GROUP_ATTR, None)
    if group is None:
        raise RuntimeError("this engine worker has not joined a sync group (join_group first)")
    device = _device(getattr(worker, _BACKEND_ATTR))

    try:
        return load_buckets(worker, recv_buckets(group, device, timeout_s), verify)
    except BaseException:
        leave_group(worker)
        raise
