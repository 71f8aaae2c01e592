"""AlgoConfig: recipe defaults validate; bad values raise errors naming the dotted key."""

import pytest

from megatron_rl.algo import AlgoConfig
from megatron_rl.config.base import ConfigError


def load(data: dict) -> AlgoConfig:
    cfg = AlgoConfig.from_dict(data, prefix="algo")
    cfg.validate()
    return cfg


def test_defaults_are_the_recipe():
    cfg = load({})
    assert (cfg.adv_estimator, cfg.loss_agg, cfg.truncation_mask) == ("grpo", "token-mean", "none")
    assert (cfg.clip.eps_low, cfg.clip.eps_high, cfg.clip.dual_clip_c) == (0.2, 0.28, None)
    assert not cfg.kl.enabled and cfg.entropy.mode == "off" and cfg.mismatch.mode == "none"
    assert (cfg.n_sgd, cfg.mini_batches) == (1, 1)


def test_nested_values_load():
    cfg = load({"clip": {"eps_high": 0.25, "dual_clip_c": 3}, "entropy": {"mode": "adaptive"},
                "kl": {"enabled": True, "estimator": "k2"}, "mismatch": {"mode": "icepop"}})
    assert cfg.clip.dual_clip_c == 3.0 and cfg.kl.estimator == "k2"


@pytest.mark.parametrize("data, key", [
    ({"clip": {"eps_low": 0.3, "eps_high": 0.2}}, "algo.clip.eps_high"),
    ({"clip": {"dual_clip_c": 1.0}}, "algo.clip.dual_clip_c"),
    ({"adv_estimator": "ppo_gae"}, "algo.adv_estimator"),
    ({"policy_loss": "nope"}, "algo.policy_loss"),
    ({"loss_agg": "seq-mean"}, "algo.loss_agg"),
    ({"truncation_mask": "sometimes"}, "algo.truncation_mask"),
    ({"entropy": {"mode": "auto"}}, "algo.entropy.mode"),
    ({"entropy": {"estimator": "topk"}}, "algo.entropy.estimator"),
    ({"entropy": {"coef_min": 0.1, "coef_max": 0.01}}, "algo.entropy.coef_max"),
    ({"entropy": {"mode": "adaptive", "coef": 1.0}}, "algo.entropy.coef"),
    ({"entropy": {"delta": -0.1}}, "algo.entropy.delta"),
    ({"kl": {"estimator": "k4"}}, "algo.kl.estimator"),
    ({"mismatch": {"mode": "tis"}}, "algo.mismatch.mode"),
    ({"mismatch": {"tis_cap": 0}}, "algo.mismatch.tis_cap"),
    ({"mismatch": {"icepop_low": 2.0, "icepop_high": 1.0}}, "algo.mismatch.icepop_high"),
    ({"n_sgd": 0}, "algo.n_sgd"),
    ({"mini_batches": 0}, "algo.mini_batches"),
    ({"wrong_reward": 1.0}, "algo.wrong_reward"),
    ({"clip": {"eps_hgih": 0.3}}, "algo.clip.eps_hgih"),
])
def test_bad_values_name_the_key(data, key):
    with pytest.raises(ConfigError) as err:
        load(data)
    assert err.value.key == key


def test_unknown_estimator_lists_valid_names():
    with pytest.raises(ConfigError, match=r"valid names are \['dr_grpo', 'grpo'"):
        load({"adv_estimator": "ppo_gae"})


def test_directly_built_config_is_checked_too():
    cfg = AlgoConfig(loss_agg="token-sum")  # no coercion on direct construction: validate() checks
    with pytest.raises(ConfigError, match="loss_agg"):
        cfg.validate()
