"""``sync.transport=ipc``: vLLM servers on the trainer's own GPUs (colocated), through vLLM's CUDA IPC
backend (``IPCTrainerWeightTransferEngine``): each trainer rank shares its GPU's copy of every
bucket as an IPC handle, the sender merges the handles by GPU and ships them over HTTP, and each
engine worker maps the buffer of its own GPU. That backend expects the full tensors on every trainer
rank, so the export (gathered on global rank 0) is broadcast to all ranks first; NCCL refuses two
processes on one GPU, which is why colocated engines need this path."""

from __future__ import annotations

import torch

from megatron_rl.sync.base import SyncError
from megatron_rl.sync.vllm_protocol import ServerTransport, ServerWeightSync


def _init_info(config, world_size: int, rank: int):
    from vllm.distributed.weight_transfer.ipc_engine import IPCTrainerInitInfo

    return IPCTrainerInitInfo(rank=rank, packed=True, packed_buffer_size_bytes=config.bucket_bytes)


def on_every_rank(named, meta):
    """The export (full tensors on global rank 0, None elsewhere) with each tensor broadcast from
    rank 0 to every trainer rank's own GPU."""
    import torch.distributed as dist

    device = torch.device("cuda", torch.cuda.current_device())
    several = dist.is_initialized() and dist.get_world_size() > 1
    for (name, tensor), m in zip(named, meta, strict=True):
        if not several or dist.get_rank() == 0:
            full = tensor.to(device).contiguous()
        else:
            full = torch.empty(m.shape, dtype=m.dtype, device=device)
        if several:
            dist.broadcast(full, src=0)
        yield name, full


def build(config, fleet, *, sender: bool, metadata):
    if not torch.cuda.is_available():
        raise SyncError("sync.transport='ipc' shares CUDA memory: it needs CUDA; on CPU use 'gloo'")
    return ServerWeightSync(config, fleet, sender=sender, metadata=metadata,
                            transport=ServerTransport("ipc", _init_info, wrap=on_every_rank, revivable=False))
