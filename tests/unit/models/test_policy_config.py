"""Policy config validation and layout checks: errors name the key and the values."""

from __future__ import annotations

import pytest

from megatron_rl.config.base import ConfigError
from megatron_rl.models.config import PolicyConfig
from megatron_rl.models.parallel import ModelShape, check_layout

SHAPE = ModelShape(num_layers=4, num_heads=4, num_kv_heads=2, vocab_size=61)


def _cfg(**parallel):
    return PolicyConfig.from_dict({"parallel": parallel}, prefix="policy")


@pytest.mark.parametrize("parallel, world, key, text", [
    ({"tensor_parallel": 3}, 3, "policy.parallel.tensor_parallel",
     r"num_attention_heads \(4\) is not divisible by tensor_parallel \(3\)"),
    ({"tensor_parallel": 4}, 4, "policy.parallel.tensor_parallel",
     r"num_key_value_heads \(2\) is not divisible by tensor_parallel \(4\)"),
    ({"pipeline_parallel": 3}, 3, "policy.parallel.pipeline_parallel",
     r"num_hidden_layers \(4\) is not divisible by pipeline_parallel \(3\)"),
    ({"pipeline_parallel": 2, "virtual_pipeline": 4}, 2, "policy.parallel.virtual_pipeline",
     r"num_hidden_layers \(4\) is not divisible by pipeline_parallel \(2\) x virtual_pipeline "
     r"\(4\) = 8"),
    ({"tensor_parallel": 2, "pipeline_parallel": 2}, 2, "policy.parallel.tensor_parallel",
     r"= 4 ranks needed but only 2 processes"),
    ({"tensor_parallel": 2}, 3, "policy.parallel.tensor_parallel",
     r"does not divide the world size 3"),
    ({"sequence_parallel": True}, 1, "policy.parallel.sequence_parallel", "needs tensor_parallel"),
    ({"tensor_parallel": 2, "context_parallel": 2}, 2, "policy.parallel.tensor_parallel",
     r"x context_parallel \(2\) = 4 ranks needed but only 2 processes"),
    ({"context_parallel": 4}, 6, "policy.parallel.tensor_parallel",
     r"context_parallel \(4\) = 4 does not divide the world size 6"),
    ({"context_parallel": 0}, 1, "policy.parallel.context_parallel", ">= 1"),
    ({"context_parallel": 4, "cp_comm_type": "a2a"}, 4, "policy.parallel.cp_comm_type",
     r"num_key_value_heads \(2\) / tensor_parallel \(1\) = 2 is not divisible"),
    ({"context_parallel": 2, "tensor_parallel": 2, "cp_comm_type": "a2a"}, 4, "policy.parallel.cp_comm_type",
     r"num_key_value_heads \(2\) / tensor_parallel \(2\) = 1 is not divisible"),
])
def test_impossible_layouts_name_key_and_values(parallel, world, key, text):
    cfg = _cfg(**parallel)
    with pytest.raises(ConfigError, match=text) as err:
        check_layout(cfg.parallel, world, SHAPE)
    assert err.value.key == key


def test_possible_layout_gives_data_parallel_size():
    cfg = _cfg(tensor_parallel=2, pipeline_parallel=2, virtual_pipeline=2)
    assert check_layout(cfg.parallel, 8, SHAPE) == 2
    cfg = _cfg(tensor_parallel=2, context_parallel=2)  # CP ranks share a batch shard
    assert check_layout(cfg.parallel, 8, SHAPE) == 2
    assert check_layout(_cfg(context_parallel=2, cp_comm_type="a2a").parallel, 4, SHAPE) == 2  # heads split
    assert cfg.parallel.model_parallel == 4


def test_recompute_options_map_to_megatron_and_are_checked():
    from megatron_rl.models.config import RecomputeConfig

    assert RecomputeConfig().megatron_kwargs() == {}
    full = RecomputeConfig(granularity="full", method="block", num_layers=2)
    assert full.megatron_kwargs() == {"recompute_granularity": "full", "recompute_method": "block",
                                      "recompute_num_layers": 2}
    sel = RecomputeConfig(granularity="selective", modules=["mlp", "core_attn"])
    assert sel.megatron_kwargs() == {"recompute_granularity": "selective",
                                     "recompute_modules": ["mlp", "core_attn"]}
    bad = [({"granularity": "selective", "modules": ["moe"]}, "policy.recompute.modules",
            "unknown module"),
           ({"granularity": "selective", "modules": []}, "policy.recompute.modules",
            "at least one"),
           ({"granularity": "full", "num_layers": 0}, "policy.recompute.num_layers", ">= 1"),
           ({"granularity": "sometimes"}, "policy.recompute.granularity", "must be one of")]
    for recompute, key, text in bad:
        with pytest.raises(ConfigError, match=text) as err:
            PolicyConfig.from_dict({"recompute": recompute}, prefix="policy").validate()
        assert err.value.key == key


def test_layer_spec_resolves_where_it_can_run():
    import torch

    from megatron_rl.models.layers import resolve_layer_spec, te_available

    assert resolve_layer_spec("local") == "local"
    assert resolve_layer_spec("auto") == ("te" if te_available() else "local")
    if not torch.cuda.is_available():
        with pytest.raises(ConfigError, match="te needs CUDA and transformer-engine") as err:
            resolve_layer_spec("te")
        assert err.value.key == "policy.layer_spec"
    with pytest.raises(ConfigError, match="policy.layer_spec"):
        PolicyConfig.from_dict({"layer_spec": "apex"}, prefix="policy")


def test_optim_and_policy_values_are_checked():
    with pytest.raises(ConfigError, match="policy.optim.lr_decay_steps"):
        PolicyConfig.from_dict({"optim": {"lr_decay_style": "cosine"}}, prefix="policy").validate()
    with pytest.raises(ConfigError, match="policy.optim.min_lr"):
        PolicyConfig.from_dict({"optim": {"lr": 1e-6, "min_lr": 1e-5}}, prefix="policy").validate()
    with pytest.raises(ConfigError, match="policy.params_dtype"):
        PolicyConfig.from_dict({"params_dtype": "fp16"}, prefix="policy")
    with pytest.raises(ConfigError, match="policy.parallel.tensor_paralel"):
        PolicyConfig.from_dict({"parallel": {"tensor_paralel": 2}}, prefix="policy")
