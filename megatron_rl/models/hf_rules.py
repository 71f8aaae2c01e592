"""The name and layout rules between HF tensors and Megatron parameters, and the (un)sharding.

Fused QKV laid out per query group, gate/up fused into ``linear_fc1``, the vocabulary padded with
zero rows to a multiple of lcm(128, TP) (the policy keeps the padding out of the softmax).
:func:`shard` gives one TP rank's piece of a Megatron parameter, :func:`unshard` inverts it.

Megatron parameter names come in the scheme of the model's layer spec (``local`` or ``te``, see
:mod:`megatron_rl.models.name_schemes`); a rule is the same tensor under either name, so the two
specs load and export the same bytes.

Mixture-of-Experts layers (:mod:`megatron_rl.models.moe_rules`): a routed expert's rule names its
global expert index; it is split over the expert tensor-parallel group (not TP) and held by one
expert-parallel rank (:func:`split_of`).
"""

from __future__ import annotations

import dataclasses

import torch

from megatron_rl.models.hf_config import HFArch
from megatron_rl.models.moe_rules import moe_hf_shape, moe_mlp_entries
from megatron_rl.models.name_schemes import Scheme, layer_param_name


@dataclasses.dataclass(frozen=True)
class Rule:
    """One Megatron parameter and the HF tensor(s) it is made of.

    kind: "rep" (replicated), "col" (split on dim 0), "row" (split on dim 1), "vocab" (dim 0, padded
    to a multiple of TP), "qkv" (q, k, v interleaved per query group, split by groups), "fc1" (gate
    and up, each split on dim 0, then concatenated per rank).
    expert: the global index of the routed expert this parameter belongs to (split over the expert
    tensor-parallel group, held by one expert-parallel rank); None for every other parameter.
    """

    hf: tuple[str, ...]
    kind: str
    expert: int | None = None


def split_of(rule: Rule, groups) -> tuple[int, int]:
    """(size, this rank's index) of the tensor-parallel group ``rule``'s parameter is split over:
    the expert one for routed experts, else TP (``groups``: a ParallelGroups)."""
    return (groups.etp, groups.etp_rank) if rule.expert is not None else (groups.tp, groups.tp_rank)


def layer_rules(arch: HFArch, i: int, scheme: Scheme = "local",
                experts: range | None = None) -> dict[str, Rule]:
    """Layer-relative Megatron parameter name (in ``scheme``) -> rule, for HF layer ``i``; a MoE
    layer with the global ``experts`` (all when None) as its local experts, in order."""
    p = f"model.layers.{i}."
    a = p + "self_attn."
    rules = {
        "input_layernorm.weight": Rule((p + "input_layernorm.weight",), "rep"),
        "self_attention.linear_qkv.weight": Rule(
            (a + "q_proj.weight", a + "k_proj.weight", a + "v_proj.weight"), "qkv"),
        "self_attention.linear_proj.weight": Rule((a + "o_proj.weight",), "row"),
        "pre_mlp_layernorm.weight": Rule((p + "post_attention_layernorm.weight",), "rep"),
    }
    if arch.moe is None:
        rules["mlp.linear_fc1.weight"] = Rule(
            (p + "mlp.gate_proj.weight", p + "mlp.up_proj.weight"), "fc1")
        rules["mlp.linear_fc2.weight"] = Rule((p + "mlp.down_proj.weight",), "row")
    else:
        for name, hf, kind, expert in moe_mlp_entries(arch.moe, experts):
            rules[name] = Rule(tuple(p + n for n in hf), kind, expert)
    if arch.qkv_bias:
        rules["self_attention.linear_qkv.bias"] = Rule(
            (a + "q_proj.bias", a + "k_proj.bias", a + "v_proj.bias"), "qkv")
    if arch.qk_norm:
        rules["self_attention.q_layernorm.weight"] = Rule((a + "q_norm.weight",), "rep")
        rules["self_attention.k_layernorm.weight"] = Rule((a + "k_norm.weight",), "rep")
    return {layer_param_name(name, scheme, arch.is_moe): rule for name, rule in rules.items()}


EMBED = Rule(("model.embed_tokens.weight",), "vocab")
FINAL_NORM = Rule(("model.norm.weight",), "rep")
LM_HEAD = Rule(("lm_head.weight",), "vocab")


def model_rules(arch: HFArch, layers: list[int], *, first: bool, last: bool, output_layer: bool,
                scheme: Scheme = "local", experts: range | None = None) -> dict[str, Rule]:
    """Megatron parameter name -> rule for a model chunk holding HF ``layers`` (in order), the
    embedding if ``first``, the final norm if ``last`` and an output-layer weight if
    ``output_layer`` (untied, or the last stage's synchronised copy of a tied embedding); MoE
    layers holding the global ``experts`` (all when None)."""
    rules: dict[str, Rule] = {}
    if first:
        rules["embedding.word_embeddings.weight"] = EMBED
    for local, i in enumerate(layers):
        for suffix, rule in layer_rules(arch, i, scheme, experts).items():
            rules[f"decoder.layers.{local}.{suffix}"] = rule
    if last:
        rules["decoder.final_layernorm.weight"] = FINAL_NORM
        if output_layer:
            rules["output_layer.weight"] = EMBED if arch.tie_embeddings else LM_HEAD
    return rules


def chunk_rules(arch: HFArch, chunk, scheme: Scheme = "local",
                experts: range | None = None) -> dict[str, Rule]:
    """Megatron parameter name (in ``chunk``) -> rule, for every parameter of the chunk (a MoE
    model's chunk holding the global ``experts``)."""
    return model_rules(arch, [layer.layer_number - 1 for layer in chunk.decoder.layers],
                       first=chunk.pre_process, last=chunk.post_process,
                       output_layer=chunk.post_process and chunk.output_layer.weight is not None,
                       scheme=scheme, experts=experts)


def qkv_per_group(arch: HFArch, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """[q; k; v] (HF) -> [groups, (q_per_group + 2) * head_dim, ...] (Megatron's fused layout)."""
    g, d = arch.num_kv_heads, arch.head_dim
    rest = q.shape[1:]
    qg = q.reshape(g, (arch.num_heads // g) * d, *rest)
    return torch.cat([qg, k.reshape(g, d, *rest), v.reshape(g, d, *rest)], dim=1)


def shard(arch: HFArch, rule: Rule, full: list[torch.Tensor], tp: int, rank: int) -> torch.Tensor:
    """This TP rank's shard of the Megatron parameter built from the HF tensors ``full``."""
    if rule.kind == "rep":
        return full[0]
    if rule.kind == "col":
        return full[0].chunk(tp, dim=0)[rank]
    if rule.kind == "row":
        return full[0].chunk(tp, dim=1)[rank]
    if rule.kind == "vocab":
        w = full[0]
        pad = arch.padded_vocab(tp) - w.shape[0]
        if pad:
            w = torch.cat([w, w.new_zeros(pad, *w.shape[1:])])
        return w.chunk(tp, dim=0)[rank]
    if rule.kind == "qkv":
        fused = qkv_per_group(arch, *full)
        return fused.chunk(tp, dim=0)[rank].reshape(-1, *fused.shape[2:])
    if rule.kind == "fc1":
        gate, up = full
        return torch.cat([gate.chunk(tp, dim=0)[rank], up.chunk(tp, dim=0)[rank]])
    raise AssertionError(rule.kind)


def unshard(arch: HFArch, rule: Rule, shards: list[torch.Tensor]) -> list[torch.Tensor]:
    """Inverse of :func:`shard`: the HF tensors from all TP ranks' shards (in rank order)."""
    if rule.kind == "rep":
        return [shards[0]]
    if rule.kind == "col":
        return [torch.cat(shards, dim=0)]
    if rule.kind == "row":
        return [torch.cat(shards, dim=1)]
    if rule.kind == "vocab":
        return [torch.cat(shards, dim=0)[: arch.vocab_size]]
    if rule.kind == "qkv":
        g, d, qpg = arch.num_kv_heads, arch.head_dim, arch.num_heads // arch.num_kv_heads
        rest = shards[0].shape[1:]
        fused = torch.cat(shards, dim=0).reshape(g, (qpg + 2) * d, *rest)
        q, k, v = fused.split([qpg * d, d, d], dim=1)
        return [q.reshape(g * qpg * d, *rest), k.reshape(g * d, *rest), v.reshape(g * d, *rest)]
    if rule.kind == "fc1":
        halves = [s.chunk(2, dim=0) for s in shards]
        return [torch.cat([h[0] for h in halves]), torch.cat([h[1] for h in halves])]
    raise AssertionError(rule.kind)


def expected_hf_names(arch: HFArch) -> set[str]:
    rules = model_rules(arch, list(range(arch.num_layers)), first=True, last=True,
                        output_layer=not arch.tie_embeddings)
    return {name for rule in rules.values() for name in rule.hf}


def hf_shape(arch: HFArch, name: str) -> tuple[int, ...]:
    """Shape of HF tensor ``name``."""
    h, d, f = arch.hidden_size, arch.head_dim, arch.ffn_hidden_size
    moe = moe_hf_shape(arch.moe, h, name) if arch.moe is not None else None
    if moe is not None:
        return moe
    leaf = name.rsplit(".", 2)[-2] + "." + name.rsplit(".", 1)[-1]
    shapes = {
        "embed_tokens.weight": (arch.vocab_size, h), "lm_head.weight": (arch.vocab_size, h),
        "norm.weight": (h,), "input_layernorm.weight": (h,),
        "post_attention_layernorm.weight": (h,),
        "q_proj.weight": (arch.num_heads * d, h), "k_proj.weight": (arch.num_kv_heads * d, h),
        "v_proj.weight": (arch.num_kv_heads * d, h), "o_proj.weight": (h, arch.num_heads * d),
        "q_proj.bias": (arch.num_heads * d,), "k_proj.bias": (arch.num_kv_heads * d,),
        "v_proj.bias": (arch.num_kv_heads * d,), "q_norm.weight": (d,), "k_norm.weight": (d,),
        "gate_proj.weight": (f, h), "up_proj.weight": (f, h), "down_proj.weight": (h, f),
    }
    return shapes[leaf]
