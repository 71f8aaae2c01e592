"""KL estimators: hand values, and exact expectations under the policy equal KL(pi || ref)."""

import math

import pytest
import torch

from megatron_rl.algo import AlgoConfig, kl_estimate, kl_reward_penalty


def test_hand_values():
    logp, ref = torch.tensor([math.log(0.5)]), torch.tensor([math.log(0.25)])
    l2 = math.log(2)
    expected = {"k1": l2, "k2": l2 * l2 / 2, "k3_unclamped": 0.5 - 1 + l2, "low_var_kl": 0.5 - 1 + l2}
    for name, value in expected.items():
        assert kl_estimate(logp, ref, name).item() == pytest.approx(value, rel=1e-6), name


@pytest.mark.parametrize("name", ["k1", "k3_unclamped"])
def test_unbiased_under_the_policy(name):
    g = torch.Generator().manual_seed(1)
    logp = torch.log_softmax(torch.randn(12, generator=g, dtype=torch.float64), -1)
    ref = torch.log_softmax(torch.randn(12, generator=g, dtype=torch.float64), -1)
    exact = (logp.exp() * (logp - ref)).sum()
    expectation = (logp.exp() * kl_estimate(logp, ref, name)).sum()
    assert expectation.item() == pytest.approx(exact.item(), rel=1e-12)


def test_low_var_kl_is_clamped():
    assert kl_estimate(torch.tensor([-30.0]), torch.tensor([0.0]), "low_var_kl").item() == 10.0


def test_reward_penalty_sums_over_valid_tokens():
    cfg = AlgoConfig.from_dict({"kl": {"enabled": True, "as_reward": True, "estimator": "k1",
                                       "coef": 0.5}})
    old = torch.tensor([[0.0, -1.0, 7.0], [-2.0, 0.0, 0.0]])
    ref = torch.tensor([[-1.0, -1.5, 0.0], [-1.0, 0.0, 0.0]])
    mask = torch.tensor([[True, True, False], [True, False, False]])
    penalty, metrics = kl_reward_penalty(old, ref, mask, cfg)
    assert penalty.tolist() == pytest.approx([0.5 * 1.5, 0.5 * -1.0])
    assert metrics["kl/token_mean"] == pytest.approx(0.5 / 3)
    off, _ = kl_reward_penalty(old, ref, mask, AlgoConfig())
    assert off.tolist() == [0.0, 0.0]


def test_unknown_estimator_named():
    with pytest.raises(ValueError, match="^algo.kl.estimator:.*valid estimators"):
        kl_estimate(torch.zeros(1), torch.zeros(1), "k9")


def test_bare_k3_is_refused_naming_both_meanings():
    with pytest.raises(ValueError, match="algo.kl.estimator.*ambiguous.*low_var_kl.*k3_unclamped"):
        AlgoConfig.from_dict({"kl": {"estimator": "k3"}}, prefix="algo").validate()
