"""This rank's Megatron-Core ``GPTModel`` chunk(s) for an HF architecture.

:func:`build_model_chunks` uses the Transformer Engine or the local layer spec (``layers.py``;
RMSNorm, SwiGLU, RoPE with the HF theta, GQA, qkv bias, q/k norm, tied or untied embeddings, MoE
layers with this rank's experts: ``moe_arch.megatron_moe_kwargs``) and a
last stage that returns hidden states: log-probs come from them and :func:`output_weight` without
forming the logits.
"""

from __future__ import annotations

import torch

from megatron_rl.models.hf_config import HFArch
from megatron_rl.models.moe_arch import megatron_moe_kwargs
from megatron_rl.models.parallel import ParallelGroups, chunk_ends


def transformer_config(arch: HFArch, groups: ParallelGroups, params_dtype: torch.dtype, *,
                       layer_spec: str = "local", recompute: dict | None = None,
                       cp_comm_type: str = "p2p"):
    """Megatron ``TransformerConfig`` equal to the HF architecture, for the CPU or GPU.

    ``layer_spec``: the resolved spec (te / local); ``recompute``: Megatron's recompute fields
    (:meth:`RecomputeConfig.megatron_kwargs`); ``cp_comm_type``: TE's CP exchange (te only).
    """
    from megatron.core.transformer import TransformerConfig

    bf16 = params_dtype == torch.bfloat16
    cp_kwargs = {"context_parallel_size": groups.cp}
    if groups.cp > 1 and layer_spec == "te":
        cp_kwargs["cp_comm_type"] = cp_comm_type
    # (a dense model still names a dispatcher: the default refuses variable sequence lengths)
    moe_kwargs = {"moe_token_dispatcher_type": "alltoall"}
    if arch.moe is not None:
        moe_kwargs = megatron_moe_kwargs(arch.moe, ep=groups.ep, etp=groups.etp,
                                         grouped_gemm=layer_spec == "te")
    return TransformerConfig(
        **cp_kwargs,
        **moe_kwargs,
        **(recompute or {}),
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
        # batch_p2p_comm with the interleaved schedule corrupts gradients on gloo (measured on
        # megatron-core 0.16.1: the interleaved PP tests fail with it).
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


def build_model_chunks(arch: HFArch, groups: ParallelGroups, params_dtype: torch.dtype, *,
                       layer_spec: str = "local", recompute: dict | None = None,
                       cp_comm_type: str = "p2p") -> list:
    """This rank's model chunks (one per virtual pipeline stage), randomly initialised, with the
    resolved ``layer_spec`` (te / local); see :func:`transformer_config` for the rest."""
    from megatron_rl.models.layers import gpt_block_spec

    groups.check_current()
    config = transformer_config(arch, groups, params_dtype, layer_spec=layer_spec,
                                recompute=recompute, cp_comm_type=cp_comm_type)
    cls = _gpt_class()
    chunks = []
    for vp in range(groups.vpp):
        vp_stage = vp if groups.vpp > 1 else None
        first, last = chunk_ends(groups, vp_stage)
        chunks.append(cls(
            config=config,
            transformer_layer_spec=gpt_block_spec(config, arch.qk_norm, vp_stage, groups.pp_rank,
                                                  layer_spec),
            vocab_size=arch.padded_vocab(groups.tp),
            max_sequence_length=arch.max_position_embeddings,
            pre_process=first,
            post_process=last,
            parallel_output=True,
            share_embeddings_and_output_weights=arch.tie_embeddings,
            position_embedding_type="rope",
            rotary_percent=1.0,
            rotary_base=arch.rope_theta,
            vp_stage=vp_stage,
        ))
    if arch.moe is not None:
        _experts_always_expert_parallel(chunks)
    return chunks


def _experts_always_expert_parallel(chunks: list) -> None:
    """Mark every routed expert's parameters expert-parallel (``allreduce = False``) also at EP = 1.

    Megatron marks them only when EP > 1; the optimizer then puts them in a second, chained optimizer
    (its gradients reduced over the expert-data-parallel group, which at EP = 1 is data x context
    parallel: the same sum) and its checkpoint keys carry the chain (``chained_1.``...). Marked
    always, the optimizer and its checkpoints have one structure at every EP size: a checkpoint
    saved at EP = 2 loads at EP = 1 and back.
    """
    for chunk in chunks:
        for layer in chunk.decoder.layers:
            for param in layer.mlp.experts.parameters():
                param.allreduce = False


def output_weight(chunk) -> torch.Tensor:
    """The (TP-local) output-layer weight of a last-stage chunk; the embedding when tied."""
    if chunk.share_embeddings_and_output_weights:
        return chunk.shared_embedding_or_output_weight()
    return chunk.output_layer.weight
