"""Where a Mixture-of-Experts layer's HF tensors go in Megatron (local-scheme names; the scheme
renaming is :mod:`megatron_rl.models.name_schemes`'s).

Per layer ``i`` (HF ``model.layers.i.mlp.``, Megatron ``decoder.layers.N.mlp.``)::

    gate.weight [E, H]                                 router.weight            (replicated)
    experts.G.{gate,up}_proj.weight [I, H] each        experts.local_experts.J.linear_fc1.weight
                                                         [gate; up], split over expert TP
    experts.G.down_proj.weight [H, I]                  experts.local_experts.J.linear_fc2.weight
                                                         split on dim 1 over expert TP
    shared_expert.{gate,up}_proj.weight [Is, H]        shared_experts.linear_fc1.weight (over TP)
    shared_expert.down_proj.weight [H, Is]             shared_experts.linear_fc2.weight (over TP)
    shared_expert_gate.weight [1, H]                   shared_experts.gate_weight (replicated)

Global expert G lives on expert-parallel rank ``G // (E / EP)`` as its local expert
``J = G % (E / EP)`` (Megatron's contiguous split).
"""

from __future__ import annotations

from megatron_rl.models.moe_arch import MoEArch

# (layer-relative local Megatron name, HF names under model.layers.i., shard kind, global expert)
MoEEntry = tuple[str, tuple[str, ...], str, int | None]


def local_experts(moe: MoEArch, ep: int, ep_rank: int) -> range:
    """The global indices of the experts expert-parallel rank ``ep_rank`` of ``ep`` holds."""
    n = moe.num_experts // ep
    return range(ep_rank * n, (ep_rank + 1) * n)


def expert_owner(moe: MoEArch, ep: int, expert: int) -> int:
    """The expert-parallel rank holding global expert ``expert``."""
    return expert // (moe.num_experts // ep)


def moe_mlp_entries(moe: MoEArch, experts: range | None = None) -> list[MoEEntry]:
    """The MoE MLP's parameters of one layer holding the global ``experts`` (all when None), in a
    fixed order: router, experts (by global index), shared expert."""
    experts = range(moe.num_experts) if experts is None else experts
    out: list[MoEEntry] = [("mlp.router.weight", ("mlp.gate.weight",), "rep", None)]
    for j, g in enumerate(experts):
        e = f"mlp.experts.{g}."
        local = f"mlp.experts.local_experts.{j}."
        out.append((local + "linear_fc1.weight", (e + "gate_proj.weight", e + "up_proj.weight"),
                    "fc1", g))
        out.append((local + "linear_fc2.weight", (e + "down_proj.weight",), "row", g))
    if moe.has_shared_expert:
        s = "mlp.shared_expert."
        out.append(("mlp.shared_experts.linear_fc1.weight",
                    (s + "gate_proj.weight", s + "up_proj.weight"), "fc1", None))
        out.append(("mlp.shared_experts.linear_fc2.weight", (s + "down_proj.weight",), "row", None))
        if moe.shared_expert_gate:
            out.append(("mlp.shared_experts.gate_weight", ("mlp.shared_expert_gate.weight",),
                        "rep", None))
    return out


def moe_hf_shape(moe: MoEArch, hidden: int, name: str) -> tuple[int, ...] | None:
    """Shape of a MoE MLP's HF tensor ``name`` (None: not a MoE MLP tensor)."""
    leaf = name.rsplit(".", 2)[-2] + "." + name.rsplit(".", 1)[-1]
    if ".mlp.experts." in name:
        width = moe.ffn_hidden_size
    elif ".mlp.shared_expert." in name:
        width = moe.shared_ffn_hidden_size
    elif name.endswith(".mlp.gate.weight"):
        return (moe.num_experts, hidden)
    elif name.endswith(".mlp.shared_expert_gate.weight"):
        return (1, hidden)
    else:
        return None
    return {"gate_proj.weight": (width, hidden), "up_proj.weight": (width, hidden),
            "down_proj.weight": (hidden, width)}[leaf]
