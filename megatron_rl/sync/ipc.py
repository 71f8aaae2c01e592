"""``sync.transport=ipc``: vLLM servers on the trainer's own GPUs (colocated), through vLLM's CUDA IPC
backend (``IPCTrainerWeightTransferEngine``): each trainer rank shares its GPU's copy of every
bucket as an IPC handle, the sender merges the handles by GPU and ships them over HTTP, and each
engine worker maps the buffer of its own GPU. That backend expects the full tensors on every trainer
rank, so the export (gathered on global rank 0: one sender, ``sync.senders=gather`` or one pipeline
stage; several are refused) is broadcast to all ranks first; NCCL refuses two processes on one GPU,
which is why colocated engines need this path."""

from __future__ import annotations

import torch

from megatron_rl.sync.base import SyncError
from megatron_rl.sync.server_transport import ServerTransport
from megatron_rl.sync.vllm_protocol import ServerWeightSync


def _init_info(config, world_size: int, rank: int, **_one_sender):
    from vllm.distributed.weight_transfer.ipc_engine import IPCTrainerInitInfo

    return IPCTrainerInitInfo(rank=rank, packed=True, packed_buffer_size_bytes=config.bucket_bytes)


def on_every_rank(named, meta):
    """The export (full tensors on global rank 0, ``(name, None)`` placeholders elsewhere: the
    transport sets ``placeholders``) with each tensor broadcast from rank 0 to every trainer rank's
    own GPU."""
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


def build(config, fleet, *, rank: int, plan, group=None):
    if not torch.cuda.is_available():
        raise SyncError("sync.transport='ipc' shares CUDA memory: it needs CUDA; on CPU use 'gloo'")
    return ServerWeightSync(config, fleet, rank=rank, plan=plan, group=group,
                            transport=ServerTransport("ipc", _init_info, wrap=on_every_rank, placeholders=True,
                                                      revivable=False))
