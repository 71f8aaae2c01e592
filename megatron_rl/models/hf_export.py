"""Export the policy as HF tensors, in two forms over one plan.

* :func:`export_plan` lists every HF tensor of the model in one fixed order with the global rank
  that sends it (:class:`ExportItem`); every rank computes the same plan without communicating.
* :func:`export_owned`: every rank yields exactly the plan's items it sends (the weight sync's
  stream). With the owners' plan (the default) each pipeline stage's TP-rank-0 of data/context
  replica 0 sends its own stage's tensors, each gathered only over its TP group: no rank receives
  another stage's tensors and none holds the whole model.
* :func:`export_hf_weights`: the whole model gathered onto global rank 0 (the HF export and the
  checkpoints, which one rank writes), i.e. :func:`export_owned` over the plan ``to_rank=0``.

Both are collective: every rank of the world must run the iterator to its end.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterator
from typing import NamedTuple

import torch
import torch.distributed as dist

from megatron_rl.models.hf_config import HFArch
from megatron_rl.models.hf_rules import EMBED, FINAL_NORM, LM_HEAD, Rule, hf_shape, layer_rules, unshard
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
    virtual stage holding it, its layer (None: embedding, final norm, head) and its name in the
    model chunk (layer-relative for a layer's parameters)."""

    rule: Rule
    pp_rank: int
    vp: int
    layer: int | None
    suffix: str


def _owner(arch: HFArch, groups: ParallelGroups, layer: int | None, last: bool) -> tuple[int, int]:
    """(pipeline rank, virtual stage) holding ``layer`` (None: embedding or, if ``last``, the head)."""
    if layer is None:
        return (groups.pp - 1, groups.vpp - 1) if last else (0, 0)
    per_chunk = arch.num_layers // (groups.pp * groups.vpp)
    k = layer // per_chunk
    return k % groups.pp, k // groups.pp


def _entries(arch: HFArch, groups: ParallelGroups, scheme: Scheme) -> list[_Entry]:
    """Every Megatron parameter in the export's fixed order (the same for every scheme and layout)."""
    out = [_Entry(EMBED, *_owner(arch, groups, None, False), None, "embedding.word_embeddings.weight")]
    for i in range(arch.num_layers):
        pp_rank, vp = _owner(arch, groups, i, False)
        for suffix, rule in layer_rules(arch, i, scheme).items():
            out.append(_Entry(rule, pp_rank, vp, i, suffix))
    out.append(_Entry(FINAL_NORM, *_owner(arch, groups, None, True), None, "decoder.final_layernorm.weight"))
    if not arch.tie_embeddings:
        out.append(_Entry(LM_HEAD, *_owner(arch, groups, None, True), None, "output_layer.weight"))
    return out


def _holder(groups: ParallelGroups, entry: _Entry) -> int:
    """The global rank that holds ``entry`` whole after its TP gather: its stage's TP-rank-0 of data-
    and context-parallel replica 0 (the CP ranks hold the same weights, so do the DP replicas)."""
    return groups.global_rank(pp=entry.pp_rank)


def export_plan(arch: HFArch, groups: ParallelGroups, dtype: torch.dtype, scheme: Scheme = "local",
                to_rank: int | None = None) -> list[ExportItem]:
    """Every HF tensor of the model, in the export's fixed order, with its sender.

    ``to_rank=None`` (the owners' plan): each tensor is sent by the rank that holds it after its TP
    gather (:func:`_holder`); the plan then has one sender per pipeline stage. ``to_rank=r``: every
    tensor is sent by global rank ``r`` (the other stages ship theirs to it first). Computed locally,
    the same on every rank. ``dtype``: the exported tensors' (the parameters')."""
    if to_rank is not None and not 0 <= to_rank < groups.world_size:
        raise ValueError(f"to_rank {to_rank} is not a rank of this world of {groups.world_size}")
    return [ExportItem(name, dtype, tuple(hf_shape(arch, name)),
                       _holder(groups, e) if to_rank is None else to_rank)
            for e in _entries(arch, groups, scheme) for name in e.rule.hf]


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

    Per Megatron parameter: its stage's replica-0 ranks gather it over their TP group onto TP rank 0
    (a gather: the other TP ranks receive nothing); when the plan's sender is another rank, that
    holder sends the HF tensors to it point to point."""
    groups.check_current()
    replica0 = groups.dp_rank == 0 and groups.cp_rank == 0
    k = 0
    for entry in _entries(arch, groups, scheme):
        items = plan[k:k + len(entry.rule.hf)]
        k += len(items)
        if [i.name for i in items] != list(entry.rule.hf) or len({i.sender for i in items}) != 1:
            raise ValueError(f"the export plan does not match this model at {entry.rule.hf}: "
                             f"{[(i.name, i.sender) for i in items]}")
        sender, holder = items[0].sender, _holder(groups, entry)
        tensors = None
        if replica0 and groups.pp_rank == entry.pp_rank:
            local = value(_local_param(chunks[entry.vp], entry.layer, entry.suffix)).detach()
            if entry.rule.kind == "rep" or groups.tp == 1:
                shards = [local]
            else:
                shards = ([torch.empty_like(local) for _ in range(groups.tp)] if groups.tp_rank == 0
                          else None)
                dist.gather(local.contiguous(), shards, dst=holder, group=groups.tp_group)
            if groups.tp_rank == 0:
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
