"""Layer specs for the policy: Megatron's local (non-Transformer-Engine) GPT layer with an RMSNorm
that supports sequence parallelism.

Megatron's local spec uses ``WrappedTorchNorm``, which refuses ``sequence_parallel``. With sequence
parallelism each TP rank normalises a slice of the sequence, so the norm weights' gradients are
partial sums: :class:`RMSNorm` marks them ``sequence_parallel`` and Megatron's
``finalize_model_grads`` all-reduces them over the TP group (as it does for Transformer Engine's
norms). The q/k norms act on this rank's heads of the full sequence; Megatron reduces their
gradients by name, so they are never marked.
"""

from __future__ import annotations

import dataclasses

import torch


class RMSNorm(torch.nn.RMSNorm):
    """``torch.nn.RMSNorm`` with Megatron's norm constructor signature."""

    def __init__(self, config, hidden_size: int, eps: float = 1e-6, for_qk: bool = False,
                 **_unused):
        super().__init__(hidden_size, eps=eps, dtype=config.params_dtype)
        setattr(self.weight, "sequence_parallel", bool(config.sequence_parallel and not for_qk))


def gpt_block_spec(config, qk_norm: bool, vp_stage: int | None, pp_rank: int):
    """Block spec for this pipeline stage / virtual stage: local layers with :class:`RMSNorm`."""
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer.identity_op import IdentityOp
    from megatron.core.transformer.spec_utils import ModuleSpec
    from megatron.core.transformer.transformer_block import (TransformerBlockSubmodules,
                                                             get_num_layers_to_build)

    layer = get_gpt_layer_local_spec(qk_layernorm=qk_norm, normalization="RMSNorm")
    qk = ModuleSpec(module=RMSNorm, params={"for_qk": True}) if qk_norm else IdentityOp
    attn = layer.submodules.self_attention
    attn = dataclasses.replace(attn, submodules=dataclasses.replace(
        attn.submodules, q_layernorm=qk, k_layernorm=qk))
    layer = dataclasses.replace(layer, submodules=dataclasses.replace(
        layer.submodules, input_layernorm=RMSNorm, pre_mlp_layernorm=RMSNorm, self_attention=attn))
    n = get_num_layers_to_build(config, vp_stage=vp_stage, pp_rank=pp_rank)
    return TransformerBlockSubmodules(layer_specs=[layer] * n, layer_norm=RMSNorm)
