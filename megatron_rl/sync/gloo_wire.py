"""What travels between the two ends of the gloo weight-transfer backend (:mod:`megatron_rl.sync.gloo`):
the init and update infos vLLM's routes carry, and how both ends cut the stream into the same
packed buckets from them.

The update info carries the parameter metadata (names, dtypes, shapes) and, with several senders,
each tensor's sender; both ends cut each sender's tensors into the same packed buckets from it
(:func:`megatron_rl.sync.buckets.group_by_dtype`), so only raw bucket bytes travel. One checksum per
bucket (:data:`BUCKET_HASH`, the one definition both ends use: XXH3-64 of the bucket's bytes in host
memory).

Owns: the wire formats, :data:`BACKEND`, :data:`BUCKET_HASH`.
May call: :mod:`megatron_rl.sync.buckets`; vLLM's weight-transfer info base classes.
"""

from __future__ import annotations

import dataclasses
from typing import ClassVar

from vllm.distributed.weight_transfer.base import (ParamMeta, TrainerInitInfo, WeightTransferInitInfo,
                                                   WeightTransferUpdateInfo)

from megatron_rl.sync.buckets import group_by_dtype, host_digest, meta_tensors

BACKEND = "gloo"
# The bucket checksum of this transport, on both ends: the buckets travel through host memory.
BUCKET_HASH = host_digest


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


def abort_group(group) -> None:
    """Leave a transfer group (unblocks peers still waiting on it); a broken one may refuse."""
    try:
        group.abort()
    except Exception:  # noqa: BLE001 - a broken group may refuse; it is dropped either way
        pass
