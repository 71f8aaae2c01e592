"""Layer specs for the policy: Megatron's Transformer Engine spec, or its local spec with our norm
and attention.

``te``: ``get_gpt_layer_with_transformer_engine_spec`` unchanged (fused norm + linear, TE's fused /
flash attention with context parallelism, FP8-ready), with ``TENorm`` as the final norm. Needs
CUDA and transformer-engine.

``local``: ``get_gpt_layer_local_spec`` with two substitutions.

* Norms: Megatron's local spec uses ``WrappedTorchNorm``, which refuses ``sequence_parallel``. With
  sequence parallelism each TP rank normalises a slice of the sequence, so the norm weights'
  gradients are partial sums: :class:`RMSNorm` marks them ``sequence_parallel`` and Megatron's
  ``finalize_model_grads`` all-reduces them over the TP group (as it does for Transformer Engine's
  norms). The q/k norms act on this rank's heads of the full sequence; Megatron reduces their
  gradients by name, so they are never marked.
* Core attention: :class:`~megatron_rl.models.attention.SDPAttention` (torch's fused
  ``scaled_dot_product_attention``, no S x S scores; context parallelism on the CPU) instead of
  ``DotProductAttention``.

Both specs keep Megatron's ``sharded_state_dict_keys_map`` (the local spec's checkpoints store its
norms under the TE names; loading one spec's checkpoint into the other is untested here, where TE
cannot run); the parameter names differ only where TE folds the norms into the linears
(:mod:`megatron_rl.models.name_schemes`).

Mixture-of-Experts models (every layer's MLP a ``MoELayer``): ``te`` builds the routed experts as
``TEGroupedMLP`` (grouped GEMMs, ``moe_grouped_gemm``), ``local`` as ``SequentialMLP`` (one
Megatron MLP per local expert); both route with :class:`~megatron_rl.models.moe_signals.Router`
(Megatron's top-k router with per-micro-batch auxiliary losses) and dispatch tokens by all-to-all.
A MoE layer keeps its pre-MLP norm as a module in both (TE cannot fold it into the experts), so the
local spec's keys map drops that entry (Megatron's local spec maps it as for a dense MLP).
"""

from __future__ import annotations

import dataclasses

import torch

from megatron_rl.config.base import ConfigError

LAYER_SPECS = ("auto", "te", "local")


class RMSNorm(torch.nn.RMSNorm):
    """``torch.nn.RMSNorm`` with Megatron's norm constructor signature."""

    def __init__(self, config, hidden_size: int, eps: float = 1e-6, for_qk: bool = False,
                 **_unused):
        super().__init__(hidden_size, eps=eps, dtype=config.params_dtype)
        setattr(self.weight, "sequence_parallel", bool(config.sequence_parallel and not for_qk))


def te_available() -> bool:
    """Whether the Transformer Engine spec can run here: CUDA and an importable transformer_engine."""
    if not torch.cuda.is_available():
        return False
    try:
        import transformer_engine  # noqa: F401
    except ImportError:
        return False
    return True


def resolve_layer_spec(name: str, key: str = "policy.layer_spec") -> str:
    """``auto`` -> ``te`` where it can run, else ``local``; ``te`` where it cannot -> ConfigError."""
    if name not in LAYER_SPECS:
        raise ConfigError(key, f"must be one of {list(LAYER_SPECS)}, got {name!r}")
    if name == "auto":
        return "te" if te_available() else "local"
    if name == "te" and not te_available():
        why = "no CUDA device" if not torch.cuda.is_available() else "transformer_engine does " \
            "not import"
        raise ConfigError(key, f"te needs CUDA and transformer-engine ({why}); use local or auto")
    return name


def _local_layer(qk_norm: bool, num_experts: int | None = None):
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer.identity_op import IdentityOp
    from megatron.core.transformer.spec_utils import ModuleSpec

    from megatron_rl.models.attention import SDPAttention

    layer = get_gpt_layer_local_spec(num_experts=num_experts, moe_grouped_gemm=False,
                                     qk_layernorm=qk_norm, normalization="RMSNorm")
    qk = ModuleSpec(module=RMSNorm, params={"for_qk": True}) if qk_norm else IdentityOp
    attn = layer.submodules.self_attention
    attn = dataclasses.replace(attn, submodules=dataclasses.replace(
        attn.submodules, q_layernorm=qk, k_layernorm=qk, core_attention=SDPAttention))
    return dataclasses.replace(layer, submodules=dataclasses.replace(
        layer.submodules, input_layernorm=RMSNorm, pre_mlp_layernorm=RMSNorm, self_attention=attn))


def local_layer_spec(qk_norm: bool, num_experts: int | None = None):
    """The local spec's layer (a MoE layer with ``num_experts``), as the policy builds it."""
    layer = _local_layer(qk_norm, num_experts)
    return moe_layer(layer) if num_experts else layer


def moe_layer(layer):
    """A MoE layer spec of Megatron's with our router, and (local spec) the keys map without the
    pre-MLP norm entry (see the module doc)."""
    from megatron_rl.models.moe_signals import router_class

    sub = layer.submodules
    mlp = dataclasses.replace(sub.mlp, submodules=dataclasses.replace(sub.mlp.submodules,
                                                                      router=router_class()))
    keys = {k: v for k, v in (sub.sharded_state_dict_keys_map or {}).items()
            if k != "pre_mlp_layernorm."}
    return dataclasses.replace(layer, submodules=dataclasses.replace(
        sub, mlp=mlp, sharded_state_dict_keys_map=keys))


def gpt_block_spec(config, qk_norm: bool, vp_stage: int | None, pp_rank: int,
                   layer_spec: str = "local"):
    """Block spec for this pipeline stage / virtual stage with the resolved ``layer_spec``; MoE
    layers where ``config.num_moe_experts`` is set."""
    from megatron.core.transformer.transformer_block import (TransformerBlockSubmodules,
                                                             get_num_layers_to_build)

    experts = config.num_moe_experts
    if layer_spec == "te":
        from megatron.core.extensions.transformer_engine import TENorm
        from megatron.core.models.gpt.gpt_layer_specs import (
            get_gpt_layer_with_transformer_engine_spec)

        layer = get_gpt_layer_with_transformer_engine_spec(
            num_experts=experts, moe_grouped_gemm=bool(experts), qk_layernorm=qk_norm)
        final_norm = TENorm
    elif layer_spec == "local":
        layer, final_norm = _local_layer(qk_norm, experts), RMSNorm
    else:
        raise ValueError(f"gpt_block_spec: layer_spec must be resolved to te or local, got "
                         f"{layer_spec!r}")
    if experts:
        layer = moe_layer(layer)
    n = get_num_layers_to_build(config, vp_stage=vp_stage, pp_rank=pp_rank)
    return TransformerBlockSubmodules(layer_specs=[layer] * n, layer_norm=final_norm)
