"""Hugging Face <-> Megatron-Core mapping for Llama, Qwen2 and Qwen3 decoder-only models.

* :func:`read_hf_config` reads ``config.json`` into an :class:`HFArch` (refusing what we cannot map:
  rope scaling, sliding windows, biases Megatron's local layers lack, non-SiLU MLPs).
* :func:`build_model_chunks` builds this rank's Megatron ``GPTModel`` chunk(s) with the local layer
  spec (RMSNorm, SwiGLU, RoPE with the HF theta, GQA, qkv bias, q/k norm, tied or untied embeddings).
* :func:`load_hf_weights` copies the HF safetensors into any TP x PP layout: fused QKV laid out per
  query group, gate/up fused into ``linear_fc1``, the vocabulary padded with zero rows to a
  multiple of lcm(128, TP) (the policy keeps the padding out of the softmax).
* :func:`export_hf_weights` yields ``(HF name, full tensor)`` gathered over TP and PP onto global
  rank 0 (other ranks get ``None`` but must iterate too: the gathers are collective).

Megatron-Bridge needs Python >= 3.12, so on Python 3.11 this mapping is ours.
"""

from __future__ import annotations

import dataclasses
import json
import math
from collections.abc import Callable, Iterator
from pathlib import Path

import torch
import torch.distributed as dist

from megatron_rl.models.parallel import ModelShape, ParallelGroups

SUPPORTED = ("llama", "qwen2", "qwen3")
# Megatron's vocabulary is padded to a multiple of lcm(VOCAB_MULTIPLE, TP) (see HFArch.padded_vocab).
VOCAB_MULTIPLE = 128


@dataclasses.dataclass(frozen=True)
class HFArch:
    """What we need from a HF ``config.json``."""

    model_type: str
    vocab_size: int
    hidden_size: int
    ffn_hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rope_theta: float
    rms_eps: float
    tie_embeddings: bool
    qkv_bias: bool
    qk_norm: bool
    max_position_embeddings: int

    @property
    def shape(self) -> ModelShape:
        return ModelShape(num_layers=self.num_layers, num_heads=self.num_heads,
                          num_kv_heads=self.num_kv_heads, vocab_size=self.vocab_size)

    def padded_vocab(self, tp: int) -> int:
        """Vocabulary rows in Megatron: the HF vocabulary rounded up to a multiple of lcm(128, TP).

        The same for every TP that divides 128, so checkpoints move between those layouts; no
        padding at all for vocabularies that are multiples of 128 (Qwen2.5, Qwen3, Llama 3).
        """
        multiple = math.lcm(VOCAB_MULTIPLE, tp)
        return -(-self.vocab_size // multiple) * multiple


def _rope_theta(cfg: dict, path: Path) -> float:
    params = cfg.get("rope_parameters") or {}
    scaling = cfg.get("rope_scaling") or {}
    for where, spec in (("rope_parameters", params), ("rope_scaling", scaling)):
        kind = spec.get("rope_type", spec.get("type", "default"))
        if kind not in ("default", None):
            raise ValueError(f"{path}: {where}.rope_type={kind!r} is not supported (only default "
                             f"RoPE)")
    theta = params.get("rope_theta", cfg.get("rope_theta"))
    if theta is None:
        raise ValueError(f"{path}: no rope_theta (looked in rope_parameters and the top level)")
    return float(theta)


def read_hf_config(hf_dir: str | Path) -> HFArch:
    """Parse ``hf_dir/config.json``; raise ValueError naming the file and field on anything
    unsupported."""
    path = Path(hf_dir) / "config.json"
    if not path.is_file():
        raise FileNotFoundError(f"no HF config at {path}")
    cfg = json.loads(path.read_text())
    model_type = cfg.get("model_type")
    if model_type not in SUPPORTED:
        raise ValueError(f"{path}: model_type={model_type!r} is not supported; supported: "
                         f"{list(SUPPORTED)}")
    act = cfg.get("hidden_act", "silu")
    if act != "silu":
        raise ValueError(f"{path}: hidden_act={act!r} is not supported (only silu / SwiGLU)")
    if cfg.get("use_sliding_window"):
        raise ValueError(f"{path}: use_sliding_window=true is not supported")
    if model_type == "llama":
        for key in ("attention_bias", "mlp_bias"):
            if cfg.get(key):
                raise ValueError(f"{path}: {key}=true is not supported for llama")
        qkv_bias = False
    elif model_type == "qwen2":
        qkv_bias = True
    else:
        if cfg.get("attention_bias"):
            raise ValueError(f"{path}: attention_bias=true is not supported for qwen3")
        qkv_bias = False
    heads = int(cfg["num_attention_heads"])
    hidden = int(cfg["hidden_size"])
    return HFArch(
        model_type=model_type,
        vocab_size=int(cfg["vocab_size"]),
        hidden_size=hidden,
        ffn_hidden_size=int(cfg["intermediate_size"]),
        num_layers=int(cfg["num_hidden_layers"]),
        num_heads=heads,
        num_kv_heads=int(cfg.get("num_key_value_heads") or heads),
        head_dim=int(cfg.get("head_dim") or hidden // heads),
        rope_theta=_rope_theta(cfg, path),
        rms_eps=float(cfg.get("rms_norm_eps", 1e-6)),
        tie_embeddings=bool(cfg.get("tie_word_embeddings", False)),
        qkv_bias=qkv_bias,
        qk_norm=model_type == "qwen3",
        max_position_embeddings=int(cfg.get("max_position_embeddings", 4096)),
    )


# --------------------------------------------------------------------------------------------------
# Model construction


def transformer_config(arch: HFArch, groups: ParallelGroups, params_dtype: torch.dtype):
    """Megatron ``TransformerConfig`` equal to the HF architecture, for the CPU or GPU."""
    from megatron.core.transformer import TransformerConfig

    bf16 = params_dtype == torch.bfloat16
    return TransformerConfig(
        num_layers=arch.num_layers,
        hidden_size=arch.hidden_size,
        ffn_hidden_size=arch.ffn_hidden_size,
        num_attention_heads=arch.num_heads,
        num_query_groups=arch.num_kv_heads,
        kv_channels=arch.head_dim,
        normalization="RMSNorm",
        layernorm_epsilon=arch.rms_eps,
        gated_linear_unit=True,
        activation_func=torch.nn.functional.silu,
        add_bias_linear=False,
        add_qkv_bias=arch.qkv_bias,
        qk_layernorm=arch.qk_norm,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        tensor_model_parallel_size=groups.tp,
        pipeline_model_parallel_size=groups.pp,
        virtual_pipeline_model_parallel_size=groups.vpp if groups.vpp > 1 else None,
        sequence_parallel=groups.sequence_parallel,
        use_cpu_initialization=True,
        params_dtype=params_dtype,
        pipeline_dtype=params_dtype,
        bf16=bf16,
        # Fused kernels that need CUDA extensions stay off; they do not change the math.
        gradient_accumulation_fusion=False,
        persist_layer_norm=False,
        apply_rope_fusion=False,
        bias_activation_fusion=False,
        bias_dropout_fusion=False,
        masked_softmax_fusion=False,
        # Losses are sums over the global batch (see MegatronPolicy.train_step): no averaging.
        calculate_per_token_loss=True,
        # Micro-batches have different lengths and sizes (token-budget packing); the interleaved
        # schedule gets one padded shape per step instead (see MegatronPolicy._micro_batches).
        variable_seq_lengths=groups.vpp == 1,
        moe_token_dispatcher_type="alltoall",  # (dense model; the default refuses variable lengths)
        # batch_p2p_comm with the interleaved schedule corrupts gradients on gloo (DESIGN.md).
        batch_p2p_comm=groups.vpp == 1 or groups.backend != "gloo",
        overlap_p2p_comm=False,
    )


def _gpt_class():
    from megatron.core.models.gpt import GPTModel

    class HiddenStateGPTModel(GPTModel):
        """GPTModel whose last stage returns the final-norm hidden states ``[s, b, h]``.

        The log-probs are computed from them and the output weight by
        :func:`megatron_rl.ops.fused_logprob_entropy`, so the ``[s, b, V]`` logits never exist.
        """

        def _postprocess(self, hidden_states, **kwargs):
            return hidden_states

    return HiddenStateGPTModel


def build_model_chunks(arch: HFArch, groups: ParallelGroups, params_dtype: torch.dtype) -> list:
    """This rank's model chunks (one per virtual pipeline stage), randomly initialised."""
    from megatron.core import parallel_state as ps

    from megatron_rl.models.layers import gpt_block_spec

    groups.check_current()
    config = transformer_config(arch, groups, params_dtype)
    cls = _gpt_class()
    chunks = []
    for vp in range(groups.vpp):
        vp_stage = vp if groups.vpp > 1 else None
        chunks.append(cls(
            config=config,
            transformer_layer_spec=gpt_block_spec(config, arch.qk_norm, vp_stage, groups.pp_rank),
            vocab_size=arch.padded_vocab(groups.tp),
            max_sequence_length=arch.max_position_embeddings,
            pre_process=ps.is_pipeline_first_stage(ignore_virtual=False, vp_stage=vp_stage),
            post_process=ps.is_pipeline_last_stage(ignore_virtual=False, vp_stage=vp_stage),
            parallel_output=True,
            share_embeddings_and_output_weights=arch.tie_embeddings,
            position_embedding_type="rope",
            rotary_percent=1.0,
            rotary_base=arch.rope_theta,
            vp_stage=vp_stage,
        ))
    return chunks


def output_weight(chunk) -> torch.Tensor:
    """The (TP-local) output-layer weight of a last-stage chunk; the embedding when tied."""
    if chunk.share_embeddings_and_output_weights:
        return chunk.shared_embedding_or_output_weight()
    return chunk.output_layer.weight


# --------------------------------------------------------------------------------------------------
# The name/layout mapping


@dataclasses.dataclass(frozen=True)
class _Rule:
    """One Megatron parameter and the HF tensor(s) it is made of.

    kind: "rep" (replicated), "col" (split on dim 0), "row" (split on dim 1), "vocab" (dim 0, padded
    to a multiple of TP), "qkv" (q, k, v interleaved per query group, split by groups), "fc1" (gate
    and up, each split on dim 0, then concatenated per rank).
    """

    hf: tuple[str, ...]
    kind: str


def _layer_rules(arch: HFArch, i: int) -> dict[str, _Rule]:
    p = f"model.layers.{i}."
    a = p + "self_attn."
    rules = {
        "input_layernorm.weight": _Rule((p + "input_layernorm.weight",), "rep"),
        "self_attention.linear_qkv.weight": _Rule(
            (a + "q_proj.weight", a + "k_proj.weight", a + "v_proj.weight"), "qkv"),
        "self_attention.linear_proj.weight": _Rule((a + "o_proj.weight",), "row"),
        "pre_mlp_layernorm.weight": _Rule((p + "post_attention_layernorm.weight",), "rep"),
        "mlp.linear_fc1.weight": _Rule(
            (p + "mlp.gate_proj.weight", p + "mlp.up_proj.weight"), "fc1"),
        "mlp.linear_fc2.weight": _Rule((p + "mlp.down_proj.weight",), "row"),
    }
    if arch.qkv_bias:
        rules["self_attention.linear_qkv.bias"] = _Rule(
            (a + "q_proj.bias", a + "k_proj.bias", a + "v_proj.bias"), "qkv")
    if arch.qk_norm:
        rules["self_attention.q_layernorm.weight"] = _Rule((a + "q_norm.weight",), "rep")
        rules["self_attention.k_layernorm.weight"] = _Rule((a + "k_norm.weight",), "rep")
    return rules


_EMBED = _Rule(("model.embed_tokens.weight",), "vocab")
_FINAL_NORM = _Rule(("model.norm.weight",), "rep")
_LM_HEAD = _Rule(("lm_head.weight",), "vocab")


def _chunk_rules(arch: HFArch, chunk) -> dict[str, _Rule]:
    """Megatron parameter name (in ``chunk``) -> rule, for every parameter of the chunk."""
    rules: dict[str, _Rule] = {}
    if chunk.pre_process:
        rules["embedding.word_embeddings.weight"] = _EMBED
    for local, layer in enumerate(chunk.decoder.layers):
        for suffix, rule in _layer_rules(arch, layer.layer_number - 1).items():
            rules[f"decoder.layers.{local}.{suffix}"] = rule
    if chunk.post_process:
        rules["decoder.final_layernorm.weight"] = _FINAL_NORM
        if chunk.output_layer.weight is not None:
            # Tied embeddings at PP > 1: the last stage keeps a synchronised copy of the embedding.
            rules["output_layer.weight"] = _EMBED if arch.tie_embeddings else _LM_HEAD
    return rules


def _qkv_per_group(arch: HFArch, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """[q; k; v] (HF) -> [groups, (q_per_group + 2) * head_dim, ...] (Megatron's fused layout)."""
    g, d = arch.num_kv_heads, arch.head_dim
    rest = q.shape[1:]
    qg = q.reshape(g, (arch.num_heads // g) * d, *rest)
    return torch.cat([qg, k.reshape(g, d, *rest), v.reshape(g, d, *rest)], dim=1)


def _shard(arch: HFArch, rule: _Rule, full: list[torch.Tensor], tp: int, rank: int) -> torch.Tensor:
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
        fused = _qkv_per_group(arch, *full)
        return fused.chunk(tp, dim=0)[rank].reshape(-1, *fused.shape[2:])
    if rule.kind == "fc1":
        gate, up = full
        return torch.cat([gate.chunk(tp, dim=0)[rank], up.chunk(tp, dim=0)[rank]])
    raise AssertionError(rule.kind)


def _unshard(arch: HFArch, rule: _Rule, shards: list[torch.Tensor]) -> list[torch.Tensor]:
    """Inverse of :func:`_shard`: the HF tensors from all TP ranks' shards (in rank order)."""
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


# --------------------------------------------------------------------------------------------------
# Loading


class HFCheckpoint:
    """Read tensors by name from a HF safetensors checkpoint (single file or sharded with index)."""

    def __init__(self, hf_dir: str | Path):
        self.dir = Path(hf_dir)
        index = self.dir / "model.safetensors.index.json"
        if index.is_file():
            weight_map = json.loads(index.read_text())["weight_map"]
            self.files = {name: self.dir / f for name, f in weight_map.items()}
        else:
            single = self.dir / "model.safetensors"
            if not single.is_file():
                raise FileNotFoundError(f"no model.safetensors or model.safetensors.index.json in "
                                        f"{self.dir}")
            from safetensors import safe_open

            with safe_open(single, "pt") as f:
                self.files = {name: single for name in f.keys()}

    def names(self) -> set[str]:
        return set(self.files)

    def get(self, name: str) -> torch.Tensor:
        from safetensors import safe_open

        if name not in self.files:
            raise KeyError(f"{self.dir}: tensor {name!r} is missing from the checkpoint")
        with safe_open(self.files[name], "pt") as f:
            return f.get_tensor(name)


def _expected_hf_names(arch: HFArch) -> set[str]:
    names = set(_EMBED.hf) | set(_FINAL_NORM.hf)
    if not arch.tie_embeddings:
        names |= set(_LM_HEAD.hf)
    for i in range(arch.num_layers):
        for rule in _layer_rules(arch, i).values():
            names |= set(rule.hf)
    return names


@torch.no_grad()
def load_hf_weights(arch: HFArch, chunks: list, hf_dir: str | Path, groups: ParallelGroups) -> None:
    """Copy the HF checkpoint into this rank's (unwrapped) model chunks.

    Raises if the checkpoint lacks a tensor the model needs or holds one we do not know how to map.
    """
    ckpt = HFCheckpoint(hf_dir)
    expected = _expected_hf_names(arch)
    unknown = sorted(n for n in ckpt.names() - expected if not n.endswith("rotary_emb.inv_freq"))
    if arch.tie_embeddings:
        unknown = [n for n in unknown if n != "lm_head.weight"]  # some tied checkpoints keep it
    if unknown:
        raise ValueError(f"{hf_dir}: tensors with no Megatron counterpart for {arch.model_type}: "
                         f"{unknown[:5]}{' ...' if len(unknown) > 5 else ''}")
    for chunk in chunks:
        rules = _chunk_rules(arch, chunk)
        params = dict(chunk.named_parameters())
        unmapped = sorted(set(params) - set(rules))
        if unmapped:
            raise RuntimeError(f"Megatron parameters with no HF mapping: {unmapped[:5]}")
        for name, rule in rules.items():
            full = [ckpt.get(n) for n in rule.hf]
            shard = _shard(arch, rule, full, groups.tp, groups.tp_rank)
            param = params[name]
            if tuple(shard.shape) != tuple(param.shape):
                raise ValueError(f"{hf_dir}: {rule.hf} give shape {tuple(shard.shape)} for Megatron "
                                 f"parameter {name} of shape {tuple(param.shape)}")
            param.copy_(shard.to(param.dtype))


# --------------------------------------------------------------------------------------------------
# Export


def _owner(arch: HFArch, groups: ParallelGroups, layer: int | None, last: bool) -> tuple[int, int]:
    """(pipeline rank, virtual stage) holding ``layer`` (None: embedding or, if ``last``, the head)."""
    if layer is None:
        return (groups.pp - 1, groups.vpp - 1) if last else (0, 0)
    per_chunk = arch.num_layers // (groups.pp * groups.vpp)
    k = layer // per_chunk
    return k % groups.pp, k // groups.pp


def _export_plan(arch: HFArch, groups: ParallelGroups):
    """Every HF tensor group in a fixed order: (rule, pp rank, vp stage, layer or None, suffix)."""
    plan = [(_EMBED, *_owner(arch, groups, None, False), None, "embedding.word_embeddings.weight")]
    for i in range(arch.num_layers):
        pp_rank, vp = _owner(arch, groups, i, False)
        for suffix, rule in _layer_rules(arch, i).items():
            plan.append((rule, pp_rank, vp, i, suffix))
    plan.append((_FINAL_NORM, *_owner(arch, groups, None, True), None,
                 "decoder.final_layernorm.weight"))
    if not arch.tie_embeddings:
        plan.append((_LM_HEAD, *_owner(arch, groups, None, True), None, "output_layer.weight"))
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
                      value: Callable[[torch.nn.Parameter], torch.Tensor] = lambda p: p
                      ) -> Iterator[tuple[str, torch.Tensor | None]]:
    """Yield ``(HF name, full tensor)`` on global rank 0 and ``(HF name, None)`` elsewhere.

    Collective: every rank of the world must run the iterator to the end. Each tensor is gathered
    over TP by its owning stage (data-parallel replica 0) and sent to global rank 0. ``value`` picks
    what is exported per parameter (the weight; e.g. ``lambda p: p.main_grad`` for gradients).
    """
    groups.check_current()
    dtype = value(next(chunks[0].parameters())).dtype
    for rule, pp_rank, vp, layer, suffix in _export_plan(arch, groups):
        owner_here = groups.pp_rank == pp_rank and groups.dp_rank == 0
        owner_global = groups.pp_ranks[pp_rank] if groups.dp_rank == 0 else None
        tensors = None
        if owner_here:
            local = value(_local_param(chunks[vp], layer, suffix)).detach()
            if rule.kind == "rep" or groups.tp == 1:
                shards = [local]
            else:
                shards = [torch.empty_like(local) for _ in range(groups.tp)]
                dist.all_gather(shards, local.contiguous(), group=groups.tp_group)
            if groups.tp_rank == 0:
                tensors = _unshard(arch, rule, shards)
        # Stage pp_rank's TP-rank-0 of replica 0 is pp_ranks[pp_rank] in rank 0's pipeline.
        if groups.rank == 0 and pp_rank != 0:
            tensors = []
            for name in rule.hf:
                meta = _hf_meta(arch, name)
                buf = torch.empty(meta, dtype=dtype, device=groups.device)
                dist.recv(buf, src=owner_global)
                tensors.append(buf)
        elif tensors is not None and groups.tp_rank == 0 and pp_rank != 0 and groups.rank != 0:
            for t in tensors:
                dist.send(t.contiguous(), dst=0)
        for j, name in enumerate(rule.hf):
            yield name, (tensors[j] if groups.rank == 0 else None)


def _hf_meta(arch: HFArch, name: str) -> tuple[int, ...]:
    """Shape of HF tensor ``name``."""
    h, d, f = arch.hidden_size, arch.head_dim, arch.ffn_hidden_size
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
