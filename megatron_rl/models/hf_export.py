"""Export the policy as HF tensors: ``(HF name, full tensor)`` gathered over TP and PP onto global
rank 0 (other ranks get ``None`` but must iterate too: the gathers are collective)."""

from __future__ import annotations

from collections.abc import Callable, Iterator

import torch
import torch.distributed as dist

from megatron_rl.models.hf_config import HFArch
from megatron_rl.models.hf_rules import EMBED, FINAL_NORM, LM_HEAD, hf_shape, layer_rules, unshard
from megatron_rl.models.name_schemes import Scheme
from megatron_rl.models.parallel import ParallelGroups


def _owner(arch: HFArch, groups: ParallelGroups, layer: int | None, last: bool) -> tuple[int, int]:
    """(pipeline rank, virtual stage) holding ``layer`` (None: embedding or, if ``last``, the head)."""
    if layer is None:
        return (groups.pp - 1, groups.vpp - 1) if last else (0, 0)
    per_chunk = arch.num_layers // (groups.pp * groups.vpp)
    k = layer // per_chunk
    return k % groups.pp, k // groups.pp


def _export_plan(arch: HFArch, groups: ParallelGroups, scheme: Scheme):
    """Every HF tensor group in a fixed order (the same for every scheme): (rule, pp rank, vp
    stage, layer or None, Megatron name in ``scheme``)."""
    plan = [(EMBED, *_owner(arch, groups, None, False), None, "embedding.word_embeddings.weight")]
    for i in range(arch.num_layers):
        pp_rank, vp = _owner(arch, groups, i, False)
        for suffix, rule in layer_rules(arch, i, scheme).items():
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
    hold the same weights) and sent to global rank 0. ``value`` picks what is exported per
    parameter (the weight; e.g. ``lambda p: p.main_grad`` for gradients). ``scheme``: the chunks'
    parameter names (their layer spec's); the output is the same in either.
    """
    groups.check_current()
    dtype = value(next(chunks[0].parameters())).dtype
    replica0 = groups.dp_rank == 0 and groups.cp_rank == 0
    for rule, pp_rank, vp, layer, suffix in _export_plan(arch, groups, scheme):
        owner_here = groups.pp_rank == pp_rank and replica0
        owner_global = groups.pp_ranks[pp_rank] if replica0 else None
        tensors = None
        if owner_here:
            local = value(_local_param(chunks[vp], layer, suffix)).detach()
            if rule.kind == "rep" or groups.tp == 1:
                shards = [local]
            else:
                shards = [torch.empty_like(local) for _ in range(groups.tp)]
                dist.all_gather(shards, local.contiguous(), group=groups.tp_group)
            if groups.tp_rank == 0:
                tensors = unshard(arch, rule, shards)
        # Stage pp_rank's TP-rank-0 of replica 0 is pp_ranks[pp_rank] in rank 0's pipeline.
        if groups.rank == 0 and pp_rank != 0:
            tensors = []
            for name in rule.hf:
                meta = hf_shape(arch, name)
                buf = torch.empty(meta, dtype=dtype, device=groups.device)
                dist.recv(buf, src=owner_global)
                tensors.append(buf)
        elif tensors is not None and groups.tp_rank == 0 and pp_rank != 0 and groups.rank != 0:
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
