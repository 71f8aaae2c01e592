"""Registries: a new variant is one decorated function; duplicates and unknown names are refused."""

import pytest
import torch

from megatron_rl.algo import (ADV_ESTIMATORS, POLICY_LOSSES, AlgoConfig, compute_advantages,
                              register_adv_estimator, register_policy_loss)
from megatron_rl.common import Registry


@register_adv_estimator("test_raw_reward")
def _raw(rewards, groups, cfg):
    return rewards.clone()


def test_registered_estimator_is_used_by_name():
    cfg = AlgoConfig(adv_estimator="test_raw_reward", truncation_mask="after")
    cfg.validate()
    adv, _ = compute_advantages(torch.tensor([0.5, 2.0, 3.0]), torch.tensor([7, 7, 9]),
                                torch.tensor([False, True, False]), cfg)
    assert adv.tolist() == [0.5, 0.0, 3.0]


def test_duplicate_name_refused():
    with pytest.raises(ValueError, match="'grpo' is already registered"):
        register_adv_estimator("grpo")(_raw)
    with pytest.raises(ValueError, match="'ppo_clip' is already registered"):
        register_policy_loss("ppo_clip")(_raw)


def test_unknown_name_lists_valid_names():
    with pytest.raises(KeyError, match=r"unknown policy loss 'ppo'; valid names are \['cispo', 'decoupled_ppo', 'gspo', 'ppo_clip'"):
        POLICY_LOSSES["ppo"]
    with pytest.raises(KeyError, match="'dr_grpo', 'grpo'"):
        ADV_ESTIMATORS["loo"]


def test_registry_is_a_read_only_mapping():
    reg = Registry("thing")
    reg.register("a")(len)
    assert dict(reg) == {"a": len} and "a" in reg and len(reg) == 1
    with pytest.raises(TypeError):
        reg["b"] = len
    with pytest.raises(ValueError, match="non-empty string"):
        reg.register("")
