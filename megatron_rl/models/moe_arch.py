"""The Mixture-of-Experts part of a Hugging Face ``config.json`` (Qwen3-MoE, Qwen2-MoE).

:func:`read_moe_arch` reads what Megatron's MoE layer needs into :class:`MoEArch` and refuses what
we do not map, naming the file and the field: dense layers between the MoE ones
(``mlp_only_layers``, ``decoder_sparse_step``), other MoE families (Mixtral, DeepSeek, ...).

How each field becomes Megatron's (``gpt.transformer_config``):

* ``num_experts`` (Qwen3-MoE's config may save it as ``num_local_experts``) -> ``num_moe_experts``;
  ``num_experts_per_tok`` -> ``moe_router_topk``; ``moe_intermediate_size`` -> ``moe_ffn_hidden_size``;
* ``norm_topk_prob``: HF takes the softmax over all experts, keeps the top k and (if true)
  renormalises them, which is the softmax over the top k logits: Megatron's
  ``moe_router_pre_softmax=False``; false keeps the top k of the full softmax:
  ``moe_router_pre_softmax=True``. ``moe_router_score_function`` is softmax either way;
* Qwen2-MoE's shared expert (``shared_expert_intermediate_size``) with its sigmoid gate
  (``mlp.shared_expert_gate``) -> ``moe_shared_expert_intermediate_size`` and
  ``moe_shared_expert_gate=True``;
* ``router_aux_loss_coef`` -> the default load-balancing coefficient (``policy.moe.aux_loss_coef``
  overrides it).
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

from megatron_rl.models.hf_errors import HFModelError

# model_type -> whether its MoE layers carry a gated shared expert
MOE_TYPES = {"qwen3_moe": False, "qwen2_moe": True}
# Mixture-of-Experts families transformers knows that we do not map (named in the refusal).
UNMAPPED_MOE_TYPES = ("mixtral", "qwen3_next", "qwen3_omni_moe", "qwen3_vl_moe", "deepseek_v2",
                      "deepseek_v3", "dbrx", "granitemoe", "olmoe", "phimoe", "jamba", "gpt_oss",
                      "glm4_moe", "ernie4_5_moe", "llama4", "minimax", "hunyuan_v1_moe")


@dataclasses.dataclass(frozen=True)
class MoEArch:
    """What Megatron's MoE layer needs from the config (every layer is a MoE layer)."""

    num_experts: int
    top_k: int
    ffn_hidden_size: int  # each routed expert's SwiGLU width (moe_intermediate_size)
    norm_topk_prob: bool
    aux_loss_coef: float  # router_aux_loss_coef (the default load-balancing coefficient)
    shared_ffn_hidden_size: int = 0  # the shared expert's width; 0: no shared expert
    shared_expert_gate: bool = False  # the shared expert's output scaled by sigmoid(x . w_gate)

    @property
    def has_shared_expert(self) -> bool:
        return self.shared_ffn_hidden_size > 0


def _positive(cfg: dict, key: str, path: Path, *aliases: str) -> int:
    for name in (key, *aliases):
        if cfg.get(name) is not None:
            value = cfg[name]
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise HFModelError(f"{path}: {name} must be a positive integer, got {value!r}")
            return value
    raise HFModelError(f"{path}: {key} is missing")


def read_moe_arch(cfg: dict, path: Path) -> MoEArch:
    """The MoE fields of ``cfg`` (read from ``path``; its model_type is one of :data:`MOE_TYPES`)."""
    model_type = cfg["model_type"]
    if cfg.get("mlp_only_layers"):
        raise HFModelError(f"{path}: mlp_only_layers={cfg['mlp_only_layers']!r} is not supported "
                           f"(dense layers between the MoE layers are not mapped; only [])")
    step = cfg.get("decoder_sparse_step", 1)
    if step != 1:
        raise HFModelError(f"{path}: decoder_sparse_step={step!r} is not supported (every layer "
                           f"must be a MoE layer: 1)")
    experts = _positive(cfg, "num_experts", path, "num_local_experts")
    top_k = _positive(cfg, "num_experts_per_tok", path)
    if top_k > experts:
        raise HFModelError(f"{path}: num_experts_per_tok ({top_k}) > num_experts ({experts})")
    coef = cfg.get("router_aux_loss_coef", 0.001)
    if isinstance(coef, bool) or not isinstance(coef, int | float) or coef < 0:
        raise HFModelError(f"{path}: router_aux_loss_coef must be a number >= 0, got {coef!r}")
    norm = cfg.get("norm_topk_prob", model_type == "qwen3_moe")
    if not isinstance(norm, bool):
        raise HFModelError(f"{path}: norm_topk_prob must be true or false, got {norm!r}")
    if norm and top_k == 1:
        raise HFModelError(f"{path}: num_experts_per_tok=1 with norm_topk_prob=true (every token's "
                           f"expert weighted 1) is not supported: Megatron's router takes top 1 "
                           f"only from the full softmax")
    shared = 0
    if MOE_TYPES[model_type]:
        shared = _positive(cfg, "shared_expert_intermediate_size", path)
    return MoEArch(num_experts=experts, top_k=top_k,
                   ffn_hidden_size=_positive(cfg, "moe_intermediate_size", path),
                   norm_topk_prob=norm, aux_loss_coef=float(coef),
                   shared_ffn_hidden_size=shared, shared_expert_gate=bool(shared))


def megatron_moe_kwargs(moe: MoEArch, *, ep: int, etp: int, grouped_gemm: bool) -> dict:
    """Megatron ``TransformerConfig`` fields for ``moe`` at expert parallelism ``ep`` and expert
    tensor parallelism ``etp``; ``grouped_gemm``: the Transformer Engine spec's grouped experts.

    The load-balancing and z-loss coefficients start at 0 / off: the policy sets them for each
    training step (:class:`megatron_rl.models.moe_signals.MoESignals`).
    """
    return dict(
        num_moe_experts=moe.num_experts,
        moe_router_topk=moe.top_k,
        moe_ffn_hidden_size=moe.ffn_hidden_size,
        moe_router_score_function="softmax",
        moe_router_pre_softmax=not moe.norm_topk_prob,
        moe_shared_expert_intermediate_size=moe.shared_ffn_hidden_size or None,
        moe_shared_expert_gate=moe.shared_expert_gate,
        moe_grouped_gemm=grouped_gemm,
        # alltoall: the dispatcher that accepts variable sequence lengths (token-budget packing)
        # and runs under gloo (the allgather one aborts at EP > 1 unless every rank holds the same
        # number of tokens)
        moe_token_dispatcher_type="alltoall",
        moe_router_load_balancing_type="aux_loss",
        # routing replay (models/routing_replay.py): a RouterReplay per router, inert until the policy
        # sets an action on it (Megatron's own top-k otherwise)
        moe_enable_routing_replay=True,
        moe_aux_loss_coeff=0.0,
        moe_z_loss_coeff=None,
        expert_model_parallel_size=ep,
        expert_tensor_parallel_size=etp,
    )
