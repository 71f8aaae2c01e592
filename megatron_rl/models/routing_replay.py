"""MoE routing replay inside the policy's forward passes: which experts each token goes through.

A pass of :class:`~megatron_rl.models.forward.PolicyForward` (``compute_logprobs``, ``train_step``)
takes a :class:`Routes` request: route freely, or replay given routes (one ``[len(sequence),
moe_layers, top_k]`` integer tensor per sequence of the batch), and optionally record what the
routers chose (returned the same way, gathered onto every rank).

Megatron-Core's ``RouterReplay`` (``moe_enable_routing_replay``; one instance per router) does the
forcing. Its instance list is class-level (every model in the process, the reference policy's
too), so :class:`RoutingReplay` never uses it: it holds the routers of *this* policy's chunks and
sets each one's target, action and clears it itself; a model it does not hold (the KL reference)
keeps routing freely.

Layout. A router sees its micro-batch's tokens as Megatron lays them out: ``[s, b, h]`` flattened,
so router row ``j * rows + b`` is local position ``j`` of model-input row ``b`` (sequence-major), where
the local positions are this rank's: the CP rank's chunks (``cp_positions`` of the layout's
segments), then this TP rank's contiguous slice of them under sequence parallelism.
:func:`router_tokens` names the token of every router row through the micro-batch's
:class:`~megatron_rl.models.packing.TokenLayout` (padded rows or one packed row: the same code), and
:func:`micro_batch_routes` / :func:`place_recorded` follow it both ways: padding rows get filler
routes (distinct experts, spread round-robin: they only feed outputs nobody reads) and are dropped
when recording.

Recomputation. With activation recomputation the routers run again in the backward pass; Megatron
then pops the targets in the order they were set (``REPLAY_BACKWARD``), one list per router: after
each micro-batch's forward the action switches to backward replay, and the next forward sets
forward replay again. Without recomputation those lists only grow: :meth:`RoutingReplay.finish`
clears every instance after each pass.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable

import torch

from megatron_rl.models.context_parallel import cp_positions


@dataclasses.dataclass
class Routes:
    """What the routers do in one policy pass."""

    # Per sequence of the pass's batch, ``[len(sequence), moe_layers, top_k]`` expert ids to force
    # (None: the routers choose). Rows of positions that predict nothing (the last token) may hold
    # anything valid.
    replay: list[torch.Tensor] | None = None
    # Record what the routers chose (the forced routes when replaying), into ``recorded``.
    record: bool = False
    # Filled by the pass when ``record``: per sequence ``[len(sequence), moe_layers, top_k]``
    # (int16), on every rank; sequences the pass did not run (no response tokens) are zeros.
    recorded: list[torch.Tensor] | None = None


def filler(count: int, layers: int, top_k: int, num_experts: int, offset: int = 0) -> torch.Tensor:
    """``[count, layers, top_k]`` valid routes for positions whose outputs nobody reads: distinct
    experts per row, spread round-robin so that no expert gets them all."""
    base = (torch.arange(count, dtype=torch.long)[:, None] + offset) * top_k + torch.arange(top_k)
    return (base % num_experts)[:, None, :].expand(count, layers, top_k).clone()


def router_tokens(layout, cp_size: int = 1, cp_rank: int = 0, tp_size: int = 1, tp_rank: int = 0,
                  sequence_parallel: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """The token ``(k, p)`` (sequence ``k`` of the micro-batch, its position ``p``) each of this rank's
    router rows holds, -1 in both at padding: ``[local positions * layout.rows]`` in router-row order
    (row ``j * layout.rows + b``: local position ``j`` of model-input row ``b``).

    ``layout``: the micro-batch's :class:`~megatron_rl.models.packing.TokenLayout` (its
    :meth:`~megatron_rl.models.packing.TokenLayout.place` puts every token at ``(s, b)``); the local
    positions are the CP rank's (:func:`~megatron_rl.models.context_parallel.cp_positions` of the
    layout's segments), then this TP rank's contiguous slice under sequence parallelism."""
    seq_k = torch.full((layout.seq_len, layout.rows), -1, dtype=torch.long)
    seq_p = torch.full_like(seq_k, -1)
    k, p = layout.tokens()
    s, b = layout.place(k, p)
    seq_k[s, b], seq_p[s, b] = k, p
    held = cp_positions(layout.bounds, cp_size, cp_rank) if cp_size > 1 else torch.arange(layout.seq_len)
    if sequence_parallel and tp_size > 1:
        width = held.numel() // tp_size
        held = held[tp_rank * width:(tp_rank + 1) * width]
    return seq_k[held].reshape(-1), seq_p[held].reshape(-1)


def micro_batch_routes(routes: list[torch.Tensor], index: list[int], k: torch.Tensor, p: torch.Tensor,
                       num_experts: int) -> torch.Tensor:
    """The router rows ``[len(k), layers, top_k]`` (long) of a micro-batch holding sequences ``index``
    whose rows hold tokens ``(k, p)`` (:func:`router_tokens`), from the per-sequence ``routes``;
    padding rows (and positions past a sequence's routes) get :func:`filler` routes."""
    first = routes[index[0]]
    out = filler(k.numel(), first.shape[1], first.shape[2], num_experts)
    for j, i in enumerate(index):
        r = routes[i]
        at = torch.nonzero((k == j) & (p < r.shape[0]))[:, 0]
        out[at] = r[p[at]].long()
    return out


def place_recorded(recorded: torch.Tensor, flat: torch.Tensor, starts: list[int], index: list[int],
                   k: torch.Tensor, p: torch.Tensor, columns: Iterable[int]) -> None:
    """Inverse of :func:`micro_batch_routes`: write a micro-batch's recorded router rows (``recorded``
    ``[len(k), len(columns), top_k]``, rows holding tokens ``(k, p)``) into ``flat`` ``[total
    positions, moe_layers, top_k]``, where sequence ``i`` of the batch starts at ``starts[i]``;
    padding rows are dropped. ``columns``: the MoE-layer column of each recorded layer."""
    real = torch.nonzero(k >= 0)[:, 0]
    at = torch.tensor(starts, dtype=torch.long)[torch.tensor(index, dtype=torch.long)[k[real]]] + p[real]
    cols = torch.tensor(list(columns), dtype=torch.long)
    flat[at[:, None], cols[None, :]] = recorded[real].to(flat.dtype)


class RoutingReplay:
    """The replay state of one policy's routers (see the module doc); driven by the policy's
    schedule: :meth:`begin` before a pass, :meth:`before_forward` / :meth:`after_forward` around each
    chunk's forward of a micro-batch, :meth:`finish` after the pass."""

    def __init__(self, chunks: list, moe_layers: list[int], num_experts: int, top_k: int, groups,
                 recompute: bool):
        self.moe_layers = list(moe_layers)
        self.num_experts, self.top_k = num_experts, top_k
        self.groups = groups
        self.recompute = recompute
        column = {layer: i for i, layer in enumerate(self.moe_layers)}
        # per chunk (by id of its GPTModel): [(MoE column, the router's RouterReplay)]
        self.routers: dict[int, list[tuple[int, object]]] = {}
        for chunk in chunks:
            held = []
            for layer in chunk.decoder.layers:
                router = getattr(layer.mlp, "router", None)
                if router is None:
                    continue
                replay = getattr(router, "router_replay", None)
                if replay is None:
                    raise ValueError("routing replay needs the MoE routers built with "
                                     "moe_enable_routing_replay=True (megatron-core's RouterReplay)")
                held.append((column[layer.layer_number - 1], replay))
            self.routers[id(chunk)] = held
        self.routes: Routes | None = None
        self._recorded: list = []

    @property
    def instances(self) -> list:
        return [r for held in self.routers.values() for _, r in held]

    # ------------------------------------------------------------------ a pass
    def begin(self, routes: Routes | None) -> None:
        self.finish()
        self.routes = routes if routes is not None and (routes.replay is not None or routes.record) else None

    def before_forward(self, chunk, mb) -> None:
        routes = self.routes
        if routes is None:
            return
        from megatron.core.transformer.moe.router_replay import RouterReplayAction

        held = self.routers[id(chunk)]
        if routes.replay is not None:
            rows = micro_batch_routes(routes.replay, mb.index, *self._tokens(mb),
                                      self.num_experts).to(mb.input_ids.device)
            for column, replay in held:
                replay.set_target_indices(rows[:, column].contiguous())
                replay.set_router_replay_action(RouterReplayAction.REPLAY_FORWARD)
        else:
            for _, replay in held:
                replay.set_router_replay_action(RouterReplayAction.RECORD)

    def after_forward(self, chunk, mb) -> None:
        routes = self.routes
        if routes is None:
            return
        from megatron.core.transformer.moe.router_replay import RouterReplayAction

        held = self.routers[id(chunk)]
        if routes.record and not mb.dummy:
            if routes.replay is not None:
                recorded = torch.stack([replay.target_topk_idx for _, replay in held], 1)
            else:
                recorded = torch.stack([replay.get_recorded_indices() for _, replay in held], 1)
            self._recorded.append((mb, [c for c, _ in held], recorded.detach().cpu()))
        if routes.replay is not None and self.recompute:
            for _, replay in held:  # the recomputation in backward pops this micro-batch's targets
                replay.set_router_replay_action(RouterReplayAction.REPLAY_BACKWARD)

    def gather(self, batch) -> None:
        """Fill ``routes.recorded`` for ``batch`` from what this pass recorded (collective)."""
        routes = self.routes
        if routes is None or not routes.record:
            return
        import torch.distributed as dist

        g = self.groups
        lengths = [len(s) for s in batch.sequences]
        starts = [0]
        for n in lengths:
            starts.append(starts[-1] + n)
        dtype = torch.uint8 if self.num_experts <= 256 else torch.int32  # (NCCL has no int16)
        flat = torch.zeros(starts[-1], len(self.moe_layers), self.top_k, dtype=dtype)
        # one writer per (position, layer): the tensor-parallel rank 0 without sequence parallelism
        writes = g.sequence_parallel or g.tp_rank == 0
        for mb, columns, recorded in self._recorded if writes else ():
            place_recorded(recorded, flat, starts, mb.index, *self._tokens(mb), columns)
        if g.world_size > 1:
            on = flat.to(g.device)
            dist.all_reduce(on)  # disjoint contributions: the sum is the gather
            flat = on.cpu()
        routes.recorded = [flat[starts[i]:starts[i + 1]].to(torch.int16) for i in range(len(lengths))]

    def finish(self) -> None:
        """Clear every held router's targets, recordings and action."""
        for replay in self.instances:
            replay.clear_indices()
            replay.clear_router_replay_action()
        self._recorded = []

    def _tokens(self, mb) -> tuple[torch.Tensor, torch.Tensor]:
        g = self.groups
        return router_tokens(mb.layout, g.cp, g.cp_rank, g.tp, g.tp_rank, g.sequence_parallel)
