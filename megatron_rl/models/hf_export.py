"""Export the policy as HF tensors: ``(HF name, full tensor)`` gathered over TP and PP (and a MoE
model's experts over expert TP and EP) onto global rank 0 (other ranks get ``None`` but must
iterate too: the gathers are collective)."""

from __future__ import annotations

from collections.abc import Callable, Iterator

import torch
import torch.distributed as dist

from megatron_rl.models.hf_config import HFArch
from megatron_rl.models.hf_rules import (EMBED, FINAL_NORM, LM_HEAD, hf_shape, layer_rules, split_of,
                                         unshard)
from megatron_rl.models.moe_rules import expert_owner, local_experts
from megatron_rl.models.name_schemes import Scheme
from megatron_rl.models.parallel import ParallelGroups


def _owner(arch: HFArch, groups: ParallelGroups, layer: int | None, last: bool) -> tuple[int, int]:
    """(pipeline rank, virtual stage) holding ``layer`` (None: embedding or, if ``last``, the head)."""
    if layer is None:
        return (groups.pp - 1, groups.vpp - 1) if last else (0, 0)
    per_chunk = arch.num_layers // (groups.pp * groups.vpp)
    k = layer // per_chunk
    return k % groups.pp, k // groups.pp


def _layer_plan(arch: HFArch, groups: ParallelGroups, i: int, scheme: Scheme):
    """Layer ``i``'s rules in a fixed order (a MoE layer's experts by global index), each with the
    layer-relative name its holder gives it (a routed expert: the name on its expert-parallel rank)."""
    if arch.moe is None:
        return list(layer_rules(arch, i, scheme).items())
    held = {}  # HF names -> the holder's layer-relative name, per expert-parallel rank
    for r in range(groups.ep):
        held.update({rule.hf: name for name, rule in
                     layer_rules(arch, i, scheme, local_experts(arch.moe, groups.ep, r)).items()})
    return [(held[rule.hf], rule) for rule in layer_rules(arch, i, scheme).values()]


def _export_plan(arch: HFArch, groups: ParallelGroups, scheme: Scheme):
    """Every HF tensor group in a fixed order (the same for every scheme and layout): (rule, pp
    rank, vp stage, layer or None, Megatron name in ``scheme`` on the rank holding it)."""
    plan = [(EMBED, *_owner(arch, groups, None, False), None, "embedding.word_embeddings.weight")]
    for i in range(arch.num_layers):
        pp_rank, vp = _owner(arch, groups, i, False)
        for suffix, rule in _layer_plan(arch, groups, i, scheme):
            plan.append((rule, pp_rank, vp, i, suffix))
    plan.append((FINAL_NORM, *_owner(arch, groups, None, True), None,
                 "decoder.final_layernorm.weight"))
    if not arch.tie_embeddings:
        plan.append((LM_HEAD, *_owner(arch, groups, None, True), None, "output_layer.weight"))
    return plan


def _local_param(chunk, layer: int | None, suffix: str) -> torch.Tensor:
    if layer is None:
        return dict(chunk.named_parameters())[suffix]
    for local, mod in enumerate(chunk.decoder.layers):
        if mod.layer_number - 1 == layer:
            return dict(mod.named_parameters())[suffix]
    raise KeyError(f"layer {layer} is not in this model chunk")


@torch.no_grad()
def export_hf_weights(arch: HFArch, chunks: list, groups: ParallelGroups,
                      value: Callable[[torch.nn.Parameter], torch.Tensor] = lambda p: p,
                      scheme: Scheme = "local") -> Iterator[tuple[str, torch.Tensor | None]]:
    """Yield ``(HF name, full tensor)`` on global rank 0 and ``(HF name, None)`` elsewhere.

    Collective: every rank of the world must run the iterator to the end. Each tensor is gathered
    over TP by its owning stage (data-parallel replica 0, context-parallel rank 0: the CP ranks
    hold the same weights) and sent to global rank 0; a routed expert over expert TP by the
    expert-parallel rank holding it (expert-data-parallel replica 0). ``value`` picks what is
    exported per parameter (the weight; e.g. ``lambda p: p.main_grad`` for gradients).
    ``scheme``: the chunks' parameter names (their layer spec's); the output is the same in either.
    """
    groups.check_current()
    dtype = value(next(chunks[0].parameters())).dtype
    for rule, pp_rank, vp, layer, suffix in _export_plan(arch, groups, scheme):
        if rule.expert is None:
            holds = groups.dp_rank == 0 and groups.cp_rank == 0
            group = groups.tp_group
            source = groups.stage_owners[pp_rank]
        else:
            ep_rank = expert_owner(arch.moe, groups.ep, rule.expert)
            holds = groups.ep_rank == ep_rank and groups.edp_rank == 0
            group = groups.etp_group
            source = groups.expert_owners[pp_rank][ep_rank]
        size, rank_in_group = split_of(rule, groups)
        tensors = None
        if holds and groups.pp_rank == pp_rank:
            local = value(_local_param(chunks[vp], layer, suffix)).detach()
            if rule.kind == "rep" or size == 1:
                shards = [local]
            else:
                shards = [torch.empty_like(local) for _ in range(size)]
                dist.all_gather(shards, local.contiguous(), group=group)
            if rank_in_group == 0:
                tensors = unshard(arch, rule, shards)
        if groups.rank == 0 and source != 0:
            tensors = []
            for name in rule.hf:
                buf = torch.empty(hf_shape(arch, name), dtype=dtype, device=groups.device)
                dist.recv(buf, src=source)
                tensors.append(buf)
        elif tensors is not None and groups.rank != 0:
            for t in tensors:
                dist.send(t.contiguous(), dst=0)
        for j, name in enumerate(rule.hf):
            yield name, (tensors[j] if groups.rank == 0 else None)


def export_hf_metadata(arch: HFArch, chunks: list, groups: ParallelGroups, scheme: Scheme = "local"
                       ) -> list[tuple[str, torch.dtype, tuple[int, ...]]]:
    """``(HF name, dtype, full shape)`` of every tensor :func:`export_hf_weights` yields, in its
    order, without gathering anything (what a receiver sizes its buffers from)."""
    dtype = next(chunks[0].parameters()).dtype
    return [(name, dtype, tuple(hf_shape(arch, name)))
            for rule, *_ in _export_plan(arch, groups, scheme) for name in rule.hf]
