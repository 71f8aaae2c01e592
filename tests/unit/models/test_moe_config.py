"""Mixture-of-Experts configs: what is read from config.json and handed to Megatron, what is refused
(naming the file and the field), and the expert layout checks (naming the values)."""

from __future__ import annotations

import json

import pytest

from megatron_rl.config.base import ConfigError
from megatron_rl.models.config import ParallelConfig
from megatron_rl.models.hf_config import HFModelError, read_hf_config
from megatron_rl.models.moe_arch import megatron_moe_kwargs
from megatron_rl.models.parallel import ModelShape, check_layout

QWEN3_MOE = {"model_type": "qwen3_moe", "vocab_size": 64, "hidden_size": 32, "intermediate_size": 48,
             "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
             "head_dim": 16, "max_position_embeddings": 128, "rope_theta": 10000.0,
             "num_experts": 8, "num_experts_per_tok": 2, "moe_intermediate_size": 24,
             "norm_topk_prob": True, "decoder_sparse_step": 1, "mlp_only_layers": [],
             "router_aux_loss_coef": 0.001}
QWEN2_MOE = {**QWEN3_MOE, "model_type": "qwen2_moe", "norm_topk_prob": False,
             "shared_expert_intermediate_size": 40}


def _read(tmp_path, cfg):
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    return read_hf_config(tmp_path)


def test_qwen3_moe_reads_and_maps_to_megatron(tmp_path):
    arch = _read(tmp_path, QWEN3_MOE)
    moe = arch.moe
    assert arch.is_moe and arch.qk_norm and not arch.qkv_bias
    assert (moe.num_experts, moe.top_k, moe.ffn_hidden_size, moe.aux_loss_coef) == (8, 2, 24, 0.001)
    assert not moe.has_shared_expert
    kw = megatron_moe_kwargs(moe, ep=2, etp=1, grouped_gemm=False)
    # renormalised top k == the softmax over the top-k logits: Megatron's pre_softmax off
    assert kw["moe_router_pre_softmax"] is False and kw["moe_router_score_function"] == "softmax"
    assert (kw["num_moe_experts"], kw["moe_router_topk"], kw["moe_ffn_hidden_size"]) == (8, 2, 24)
    assert kw["moe_shared_expert_intermediate_size"] is None
    assert (kw["expert_model_parallel_size"], kw["expert_tensor_parallel_size"]) == (2, 1)
    assert arch.shape.num_experts == 8 and arch.shape.moe_ffn_hidden_size == 24


def test_qwen3_moe_num_local_experts_spelling(tmp_path):
    """transformers 5 saves Qwen3-MoE's expert count as num_local_experts."""
    cfg = {k: v for k, v in QWEN3_MOE.items() if k != "num_experts"}
    assert _read(tmp_path, {**cfg, "num_local_experts": 4}).moe.num_experts == 4


def test_qwen2_moe_shared_expert_and_unnormalised_top_k(tmp_path):
    arch = _read(tmp_path, QWEN2_MOE)
    assert arch.qkv_bias and not arch.qk_norm
    assert arch.moe.shared_ffn_hidden_size == 40 and arch.moe.shared_expert_gate
    kw = megatron_moe_kwargs(arch.moe, ep=1, etp=1, grouped_gemm=True)
    assert kw["moe_router_pre_softmax"] is True  # top k of the full softmax, not renormalised
    assert kw["moe_shared_expert_intermediate_size"] == 40 and kw["moe_shared_expert_gate"]
    assert kw["moe_grouped_gemm"] is True
    assert not _read(tmp_path, {**QWEN2_MOE, "qkv_bias": False}).qkv_bias


@pytest.mark.parametrize("base,change,says", [
    (QWEN3_MOE, {"mlp_only_layers": [1]}, "mlp_only_layers=[1] is not supported"),
    (QWEN3_MOE, {"decoder_sparse_step": 2}, "decoder_sparse_step=2 is not supported"),
    (QWEN3_MOE, {"model_type": "mixtral"}, "model_type='mixtral': this Mixture-of-Experts family is not mapped"),
    (QWEN3_MOE, {"model_type": "deepseek_v3"}, "model_type='deepseek_v3'"),
    (QWEN3_MOE, {"num_experts": None}, "num_experts is missing"),
    (QWEN3_MOE, {"num_experts": 0}, "num_experts must be a positive integer"),
    (QWEN3_MOE, {"num_experts_per_tok": 9}, "num_experts_per_tok (9) > num_experts (8)"),
    (QWEN3_MOE, {"moe_intermediate_size": None}, "moe_intermediate_size is missing"),
    (QWEN3_MOE, {"norm_topk_prob": "yes"}, "norm_topk_prob must be true or false"),
    (QWEN3_MOE, {"num_experts_per_tok": 1}, "num_experts_per_tok=1 with norm_topk_prob=true"),
    (QWEN3_MOE, {"router_aux_loss_coef": -1}, "router_aux_loss_coef must be a number >= 0"),
    (QWEN3_MOE, {"attention_bias": True}, "attention_bias=true is not supported for qwen3_moe"),
    (QWEN2_MOE, {"shared_expert_intermediate_size": None}, "shared_expert_intermediate_size is missing"),
    (QWEN2_MOE, {"shared_expert_intermediate_size": 0}, "shared_expert_intermediate_size must be a positive integer"),
])
def test_unmapped_moe_configs_name_file_and_field(tmp_path, base, change, says):
    cfg = {k: v for k, v in {**base, **change}.items() if v is not None}
    with pytest.raises(HFModelError) as e:
        _read(tmp_path, cfg)
    assert str(tmp_path / "config.json") in str(e.value) and says in str(e.value), str(e.value)


MOE = ModelShape(num_layers=2, num_heads=4, num_kv_heads=2, vocab_size=64, num_experts=8,
                 moe_ffn_hidden_size=24)
DENSE = ModelShape(num_layers=2, num_heads=4, num_kv_heads=2, vocab_size=64)


@pytest.mark.parametrize("layout,world,shape,key,says", [
    (dict(expert_parallel=3), 3, MOE, "expert_parallel", "num_experts (8) is not divisible by expert_parallel (3)"),
    (dict(expert_parallel=4), 6, MOE, "expert_parallel",
     "expert_tensor_parallel (1) x expert_parallel (4) x pipeline_parallel (1) = 4 does not divide the world size 6"),
    (dict(expert_parallel=2, pipeline_parallel=2), 2, MOE, "expert_parallel",
     "= 4 does not divide the world size 2"),
    (dict(expert_tensor_parallel=5), 5, MOE, "expert_tensor_parallel",
     "moe_intermediate_size (24) is not divisible by the expert tensor-parallel size (5)"),
    (dict(tensor_parallel=2), 2, MOE, "sequence_parallel", "need sequence_parallel: true"),
    (dict(expert_parallel=2), 2, DENSE, "expert_parallel", "=2 needs a Mixture-of-Experts model; this model is dense"),
    (dict(expert_tensor_parallel=2), 2, DENSE, "expert_tensor_parallel", "needs a Mixture-of-Experts model"),
])
def test_moe_expert_layouts_that_do_not_fit_are_refused(layout, world, shape, key, says):
    with pytest.raises(ConfigError) as e:
        check_layout(ParallelConfig(**layout), world, shape)
    assert e.value.key.endswith(key) and says in str(e.value), str(e.value)


@pytest.mark.parametrize("layout,world,dp", [
    (dict(expert_parallel=2), 2, 2),  # EP carved out of data parallelism
    (dict(expert_parallel=8), 8, 8),
    (dict(tensor_parallel=2, sequence_parallel=True, expert_parallel=2), 4, 2),
    (dict(pipeline_parallel=2, expert_parallel=2, expert_tensor_parallel=2), 8, 4),
    (dict(context_parallel=2, expert_parallel=2), 4, 2),
])
def test_moe_expert_layouts_that_fit(layout, world, dp):
    assert check_layout(ParallelConfig(**layout), world, MOE) == dp
