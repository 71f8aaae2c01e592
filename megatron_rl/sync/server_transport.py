"""What the weight sync of vLLM servers hands vLLM's trainer-side engines: the transport's
differences (:class:`ServerTransport`) and the weights' source (:class:`StreamSource`).

Owns: nothing that lives longer than a sync (the source holds the current export until it is read).
May call: vLLM's ``WeightSource`` / ``ParamMeta`` types; the export plan (:class:`SendPlan`).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterator
from typing import Any

import torch
from vllm.distributed.weight_transfer.base import ParamMeta, WeightSource

from megatron_rl.sync.base import NamedTensors, SendPlan
from megatron_rl.sync.config import SyncConfig


class StreamSource(WeightSource):
    """vLLM's ``WeightSource`` over our export: the metadata is the whole model's (every rank), each
    item's sender is known (:meth:`sender_index`), the stream is set per sync (the Megatron export is
    a collective generator that can be walked once) and yields this rank's items only
    (:meth:`held_names`)."""

    def __init__(self, plan: SendPlan, rank: int):
        self._meta = [ParamMeta(name, dtype, tuple(shape)) for name, dtype, shape, _ in plan.items]
        self._senders = plan.sender_index()
        self._held = {name for name, _, _, r in plan.items if r == rank}
        self.stream: NamedTensors | None = None

    def metadata(self) -> list[ParamMeta]:
        return self._meta

    def sender_index(self) -> list[int]:
        return self._senders

    def held_names(self):
        return self._held

    def __iter__(self) -> Iterator[tuple[str, torch.Tensor]]:
        stream, self.stream = self.stream, None
        if stream is None:
            raise RuntimeError("no export stream was given for this sync")
        yield from stream


@dataclasses.dataclass(frozen=True)
class ServerTransport:
    """What differs between the backends: the trainer-side init info (``rank`` 0 drives), and for a
    backend that takes several senders the store the driver hosts for them."""

    name: str
    # (config, world size, rank, **several-sender keys: senders, sender_index, port, store) -> TrainerInitInfo
    init_info: Callable[..., Any]
    # Wrap the export so the backend's source suits it (ipc: full tensors on every rank).
    wrap: Callable[[NamedTensors, list[ParamMeta]], NamedTensors] = lambda named, meta: named
    # (config, world size) -> the driver's store (``.port``) for several senders; None: one sender only.
    host: Callable[[SyncConfig, int], Any] | None = None
    # The export on every rank names every item ((name, None) where the rank does not send it).
    placeholders: bool = False
    # The sending rank alone can load its copy of the last weights into restarted engines (ipc
    # needs every trainer rank: a lost fleet then waits for the next sync).
    revivable: bool = True
