"""``sync.transport=nccl``: vLLM servers on other GPUs (or nodes), through vLLM's own dense NCCL
backend (``NCCLTrainerWeightTransferEngine``: packed double-buffered broadcast from the trainer's
sender to every worker of every engine, one group for the whole fleet). Verification here is each
engine's reported version and the post-sync checks (vLLM's NCCL engine reports no checksums).

One sender: vLLM's NCCL engine broadcasts from trainer rank 0 alone, so the export must be gathered
there (``sync.senders=gather``, or a layout with one pipeline stage); a plan with several senders is
refused when the sync is built (and by the config check) rather than sent from rank 0 only. vLLM's
``nccl_m2n`` backend (every trainer rank sends its own shards, resharded by NCCL M2N) is the GPU
path for several senders; it is not wired here (no GPU to check it on)."""

from __future__ import annotations

from megatron_rl.sync.server_transport import ServerTransport
from megatron_rl.sync.vllm_protocol import ServerWeightSync


def _init_info(config, world_size: int, rank: int, **_one_sender):
    from vllm.distributed.weight_transfer.nccl_engine import NCCLTrainerInitInfo

    from megatron_rl.rollout.launcher import free_port

    port = free_port(config.master_addr) if rank == 0 else 0  # rank 0 hosts the rendezvous
    return NCCLTrainerInitInfo(rank=rank, master_address=config.master_addr, master_port=port,
                               world_size=world_size, packed=True,
                               packed_buffer_size_bytes=config.bucket_bytes)


def build(config, fleet, *, rank: int, plan, group=None):
    import torch

    from megatron_rl.sync.base import SyncError

    if not torch.cuda.is_available():
        raise SyncError("sync.transport='nccl' needs CUDA; on CPU use 'gloo'")
    return ServerWeightSync(config, fleet, rank=rank, plan=plan, group=group,
                            transport=ServerTransport("nccl", _init_info))
