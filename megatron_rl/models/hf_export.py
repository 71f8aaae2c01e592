"""Export the policy as HF tensors, in two forms over one plan.

* :func:`export_plan` lists every HF tensor of the model in one fixed order with the global rank
  that sends it (:class:`ExportItem`); every rank computes the same plan without communicating.
* :func:`export_owned`: every rank yields exactly the plan's items it sends (the weight sync's
  stream). With the owners' plan (the default) each pipeline stage's TP-rank-0 of data/context
  replica 0 sends its own stage's tensors, each gathered only over its TP group: no rank receives
  another stage's tensors and none holds the whole model.
* :func:`export_hf_weights`: the whole model gathered onto global rank 0 (the HF export and the
  checkpoints, which one rank writes), i.e. :func:`export_owned` over the plan ``to_rank=0``.

Mixture-of-Experts models: each routed expert is held by one expert-parallel rank; the owners' plan
sends it from that rank's expert-TP rank 0 in expert-data-parallel replica 0 (gathered only over its
expert-TP group), so every EP rank streams its own experts and none receives another's; the router
and the shared expert go with their stage's other tensors.

Both are collective: every rank of the world must run the iterator to its end.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Iterator
from typing import NamedTuple

import torch
import torch.distributed as dist

from megatron_rl.models.hf_config import HFArch
from megatron_rl.models.hf_rules import (EMBED, FINAL_NORM, LM_HEAD, Rule, hf_shape, layer_rules,
                                         split_of, unshard)
from megatron_rl.models.moe_rules import expert_owner, local_experts
from megatron_rl.models.name_schemes import Scheme
from megatron_rl.models.parallel import ParallelGroups


class ExportItem(NamedTuple):
    """One HF tensor of the export: its name, dtype, full shape, and the global rank that sends it
    (holds it whole after the gathers it needs)."""

    name: str
    dtype: torch.dtype
    shape: tuple[int, ...]
    sender: int


@dataclasses.dataclass(frozen=True)
class _Entry:
    """One Megatron parameter of the plan: its rule (the HF tensors it makes), the pipeline rank and
    virtual stage holding it, its layer (None: embedding, final norm, head), its name in the
    model chunk (layer-relative for a layer's parameters; a routed expert's on the rank holding it)
    and, for a routed expert, the expert-parallel rank holding it."""

    rule: Rule
    pp_rank: int
    vp: int
    layer: int | None
    suffix: str
    ep_rank: int | None = None


def _owner(arch: HFArch, groups: ParallelGroups, layer: int | None, last: bool) -> tuple[int, int]:
    """(pipeline rank, virtual stage) holding ``layer`` (None: embedding or, if ``last``, the head)."""
    if layer is None:
        return (groups.pp - 1, groups.vpp - 1) if last else (0, 0)
    per_chunk = arch.num_layers // (groups.pp * groups.vpp)
    k = layer // per_chunk
    return k % groups.pp, k // groups.pp


def _layer_entries(arch: HFArch, groups: ParallelGroups, i: int, scheme: Scheme) -> list[_Entry]:
    """Layer ``i``'s parameters in a fixed order (a MoE layer's experts by global index), each named
    as the rank holding it names it (a routed expert: its local index on its expert-parallel rank)."""
    pp_rank, vp = _owner(arch, groups, i, False)
    if arch.moe is None:
        return [_Entry(rule, pp_rank, vp, i, suffix)
                for suffix, rule in layer_rules(arch, i, scheme).items()]
    held = {}  # HF names -> layer-relative name on the holding expert-parallel rank
    for r in range(groups.ep):
        held.update({rule.hf: name for name, rule in
                     layer_rules(arch, i, scheme, local_experts(arch.moe, groups.ep, r)).items()})
    return [_Entry(rule, pp_rank, vp, i, held[rule.hf],
                   None if rule.expert is None else expert_owner(arch.moe, groups.ep, rule.expert))
            for rule in layer_rules(arch, i, scheme).values()]


def _entries(arch: HFArch, groups: ParallelGroups, scheme: Scheme) -> list[_Entry]:
    """Every Megatron parameter in the export's fixed order (the same for every scheme and layout)."""
    out = [_Entry(EMBED, *_owner(arch, groups, None, False), None, "embedding.word_embeddings.weight")]
    for i in range(arch.num_layers):
        out += _layer_entries(arch, groups, i, scheme)
    out.append(_Entry(FINAL_NORM, *_owner(arch, groups, None, True), None, "decoder.final_layernorm.weight"))
    if not arch.tie_embeddings:
        out.append(_Entry(LM_HEAD, *_owner(arch, groups, None, True), None, "output_layer.weight"))
    return out


def _holder(groups: ParallelGroups, entry: _Entry, replica: int = 0) -> int:
    """The global rank that holds ``entry`` whole after its TP gather: its stage's TP-rank-0 of data-
    parallel replica ``replica``, context-parallel rank 0 (the CP ranks hold the same weights, so do
    the DP replicas); a routed expert's: its expert-parallel rank's expert-TP-rank-0 of
    expert-data-parallel replica 0."""
    if entry.ep_rank is not None:
        return groups.expert_owners[entry.pp_rank][entry.ep_rank]
    return groups.global_rank(pp=entry.pp_rank, dp=replica)


def _replicas(groups: ParallelGroups, pp_rank: int) -> dict[int, int]:
    """The stage's ranks that can hold a replicated (non-expert) parameter whole after a TP gather
    (TP rank 0, CP rank 0 of each data-parallel replica): global rank -> data-parallel index."""
    return {groups.global_rank(pp=pp_rank, dp=d): d for d in range(groups.dp)}


def _gathers(groups: ParallelGroups, entry: _Entry, replica: int = 0) -> bool:
    """Whether this rank takes part in ``entry``'s gather (it holds a shard the holder collects)."""
    if groups.pp_rank != entry.pp_rank:
        return False
    if entry.ep_rank is not None:
        return groups.ep_rank == entry.ep_rank and groups.edp_rank == 0
    return groups.dp_rank == replica and groups.cp_rank == 0


def _owners(arch: HFArch, groups: ParallelGroups, entries: list[_Entry]) -> list[int]:
    """Each entry's sender in the owners' plan. A routed expert: the rank holding it. A dense
    model's parameter (or any at EP=1): its stage's replica 0. With expert parallelism the
    replicated parameters (attention, norms, routers, embedding, head) are held whole by every
    expert-parallel rank that is also a dense replica's TP-0/CP-0 rank, so they are spread over
    those ranks, largest first onto the least loaded (expert bytes counted), so that each EP rank
    sends about 1/EP of the whole model rather than one of them all of the rest. Deterministic:
    every rank computes the same plan locally."""
    size = [sum(math.prod(hf_shape(arch, name)) for name in e.rule.hf) for e in entries]
    senders: list[int | None] = [None] * len(entries)
    load: dict[int, int] = {}
    spread = []
    for i, e in enumerate(entries):
        if e.ep_rank is None and groups.ep > 1:
            spread.append(i)
            continue
        senders[i] = _holder(groups, e)
        load[senders[i]] = load.get(senders[i], 0) + size[i]
    for i in sorted(spread, key=lambda i: (-size[i], i)):
        e = entries[i]
        owners = set(groups.expert_owners[e.pp_rank])
        candidates = [r for r in _replicas(groups, e.pp_rank) if r in owners] or [_holder(groups, e)]
        senders[i] = min(candidates, key=lambda r: (load.get(r, 0), r))
        load[senders[i]] = load.get(senders[i], 0) + size[i]
    return senders


def export_plan(arch: HFArch, groups: ParallelGroups, dtype: torch.dtype, scheme: Scheme = "local",
                to_rank: int | None = None) -> list[ExportItem]:
    """Every HF tensor of the model, in the export's fixed order, with its sender.

    ``to_rank=None`` (the owners' plan): each tensor is sent by a rank that holds it after its TP
    gather (:func:`_owners`): one sender per pipeline stage, or with expert parallelism one per
    (stage, EP rank), the replicated parameters spread over them. ``to_rank=r``: every
    tensor is sent by global rank ``r`` (the other stages ship theirs to it first). Computed locally,
    the same on every rank. ``dtype``: the exported tensors' (the parameters')."""
    if to_rank is not None and not 0 <= to_rank < groups.world_size:
        raise ValueError(f"to_rank {to_rank} is not a rank of this world of {groups.world_size}")
    entries = _entries(arch, groups, scheme)
    senders = _owners(arch, groups, entries) if to_rank is None else [to_rank] * len(entries)
    return [ExportItem(name, dtype, tuple(hf_shape(arch, name)), sender)
            for e, sender in zip(entries, senders) for name in e.rule.hf]


def plan_senders(plan: list[ExportItem]) -> list[int]:
    """The plan's distinct senders, ascending (a sender's index in a transfer is its place here)."""
    return sorted({item.sender for item in plan})


def _local_param(chunk, layer: int | None, suffix: str) -> torch.Tensor:
    if layer is None:
        return dict(chunk.named_parameters())[suffix]
    for mod in chunk.decoder.layers:
        if mod.layer_number - 1 == layer:
            return dict(mod.named_parameters())[suffix]
    raise KeyError(f"layer {layer} is not in this model chunk")


def _walk(arch: HFArch, chunks: list, groups: ParallelGroups, plan: list[ExportItem],
          value: Callable[[torch.nn.Parameter], torch.Tensor], scheme: Scheme
          ) -> Iterator[tuple[ExportItem, torch.Tensor | None]]:
    """``(item, tensor)`` for every plan item on every rank, the tensor on the item's sender only.

    Per Megatron parameter: its stage's ranks of one replica (the sender's, when the sender holds one;
    else replica 0) gather it over their TP group onto TP rank 0
    (a routed expert: its EP rank's expert-data-parallel replica 0 over the expert-TP group; a
    gather: the other ranks receive nothing); when the plan's sender is another rank, that holder
    sends the HF tensors to it point to point."""
    groups.check_current()
    k = 0
    for entry in _entries(arch, groups, scheme):
        items = plan[k:k + len(entry.rule.hf)]
        k += len(items)
        if [i.name for i in items] != list(entry.rule.hf) or len({i.sender for i in items}) != 1:
            raise ValueError(f"the export plan does not match this model at {entry.rule.hf}: "
                             f"{[(i.name, i.sender) for i in items]}")
        sender = items[0].sender
        # a replicated parameter is gathered on the sender's replica when the sender holds one
        # (the owners' plan spreads them over the EP ranks), else on replica 0
        replica = _replicas(groups, entry.pp_rank).get(sender, 0) if entry.ep_rank is None else 0
        holder = _holder(groups, entry, replica)
        tensors = None
        if _gathers(groups, entry, replica):
            local = value(_local_param(chunks[entry.vp], entry.layer, entry.suffix)).detach()
            size, rank_in_group = split_of(entry.rule, groups)
            group = groups.tp_group if entry.ep_rank is None else groups.etp_group
            if entry.rule.kind == "rep" or size == 1:
                shards = [local]
            else:
                shards = ([torch.empty_like(local) for _ in range(size)] if rank_in_group == 0
                          else None)
                dist.gather(local.contiguous(), shards, dst=holder, group=group)
            if rank_in_group == 0:
                tensors = unshard(arch, entry.rule, shards)
        if sender != holder:
            if groups.rank == sender:
                tensors = []
                for item in items:
                    buf = torch.empty(item.shape, dtype=item.dtype, device=groups.device)
                    dist.recv(buf, src=holder)
                    tensors.append(buf)
            elif groups.rank == holder:
                for t in tensors:
                    dist.send(t.contiguous(), dst=sender)
                tensors = None
        for j, item in enumerate(items):
            yield item, (tensors[j] if groups.rank == sender else None)
    if k != len(plan):
        raise ValueError(f"the export plan lists {len(plan)} tensors, this model exports {k}")


@torch.no_grad()
def export_owned(arch: HFArch, chunks: list, groups: ParallelGroups, plan: list[ExportItem],
                 value: Callable[[torch.nn.Parameter], torch.Tensor] = lambda p: p,
                 scheme: Scheme = "local", placeholders: bool = False
                 ) -> Iterator[tuple[str, torch.Tensor | None]]:
    """``(HF name, full tensor)`` for exactly the items of ``plan`` whose sender is this rank, in
    plan order (nothing on a rank that sends nothing; with ``placeholders``, ``(HF name, None)`` for
    every other item, in its place).

    Collective: every rank of the world must run the iterator to the end. ``plan`` comes from
    :func:`export_plan` for this layout; ``value`` picks what is exported per parameter (the weight;
    e.g. ``lambda p: p.main_grad`` for gradients); ``scheme``: the chunks' parameter names (their
    layer spec's)."""
    for item, tensor in _walk(arch, chunks, groups, plan, value, scheme):
        if tensor is not None or placeholders:
            yield item.name, tensor


@torch.no_grad()
def export_hf_weights(arch: HFArch, chunks: list, groups: ParallelGroups,
                      value: Callable[[torch.nn.Parameter], torch.Tensor] = lambda p: p,
                      scheme: Scheme = "local") -> Iterator[tuple[str, torch.Tensor | None]]:
    """Yield ``(HF name, full tensor)`` on global rank 0 and ``(HF name, None)`` elsewhere, for
    every tensor of the model (what the HF export and the checkpoints write from rank 0).

    Collective, like :func:`export_owned`, over the plan that sends everything from rank 0."""
    dtype = value(next(chunks[0].parameters())).dtype
    plan = export_plan(arch, groups, dtype, scheme, to_rank=0)
    for item, tensor in _walk(arch, chunks, groups, plan, value, scheme):
        yield item.name, tensor
