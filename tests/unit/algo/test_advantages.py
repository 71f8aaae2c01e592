"""GRPO / Dr.GRPO advantages and the truncation strategies, against hand-computed numbers, the
float64 loop reference, and verl's formula ((r - mean) / (unbiased std + 1e-6))."""

import math
import statistics

import pytest
import torch
from hypothesis import given, settings, strategies as st

from megatron_rl.algo import AlgoConfig, compute_advantages, grpo_advantages_reference

T, F = True, False


def advantages(rewards, groups, truncated=None, **cfg_kwargs):
    cfg = AlgoConfig(**cfg_kwargs)
    cfg.validate()
    truncated = [F] * len(rewards) if truncated is None else truncated
    adv, metrics = compute_advantages(torch.tensor(rewards, dtype=torch.float64),
                                      torch.tensor(groups), torch.tensor(truncated), cfg)
    return adv.tolist(), metrics


def test_grpo_hand_computed():
    # group 0: mean 0.5, unbiased std sqrt(1/3); group 1: mean 0.5, std 0.5; group 2: singleton.
    adv, metrics = advantages([1, 0, 0, 1, 1, 0.5, 0, 0.7], [0, 0, 0, 0, 5, 5, 5, 9])
    s = math.sqrt(1 / 3)
    assert adv == pytest.approx([0.5 / s, -0.5 / s, -0.5 / s, 0.5 / s, 1, 0, -1, 0], rel=1e-5)
    assert metrics["adv/groups"] == 3 and metrics["adv/groups_without_baseline"] == 1


def test_grpo_matches_verl_formula_for_groups_of_two_or_more():
    rewards, groups = [0.3, 0.9, 0.1, 1.0, 0.0, 0.25], [0, 0, 0, 1, 1, 1]
    adv, _ = advantages(rewards, groups)
    for g in (0, 1):
        members = [r for r, gg in zip(rewards, groups) if gg == g]
        mean, std = statistics.fmean(members), statistics.stdev(members)
        expected = [(r - mean) / (std + 1e-6) for r, gg in zip(rewards, groups) if gg == g]
        assert [a for a, gg in zip(adv, groups) if gg == g] == pytest.approx(expected, abs=1e-12)


def test_zero_variance_group_gets_zero_not_nan():
    adv, _ = advantages([1, 1, 1, 0.5, 0.5], [0, 0, 0, 1, 1])
    assert adv == [0.0] * 5


@pytest.mark.parametrize("kwargs", [{"norm_adv_by_std": False}, {"adv_estimator": "dr_grpo"}])
def test_dr_grpo_subtracts_the_mean_only(kwargs):
    adv, _ = advantages([1, 0, 0, 0, 0.5, 0.5, 1], [0, 0, 0, 0, 1, 1, 1], **kwargs)
    assert adv == pytest.approx([0.75, -0.25, -0.25, -0.25, -1 / 6, -1 / 6, 1 / 3], abs=1e-12)


# Crafted group: one correct, one wrong, two truncated (reward 0) responses.
CRAFTED = dict(rewards=[1, 0, 0, 0], groups=[0, 0, 0, 0], truncated=[F, F, T, T])


def test_truncation_none_treats_truncated_as_ordinary_negatives():
    adv, _ = advantages(**CRAFTED, truncation_mask="none")  # mean 0.25, std 0.5
    assert adv == pytest.approx([1.5, -0.5, -0.5, -0.5], rel=1e-5)


def test_truncation_before_excludes_truncated_from_statistics():
    adv, metrics = advantages(**CRAFTED, truncation_mask="before")  # stats of [1, 0]
    assert adv == pytest.approx([1 / math.sqrt(2), -1 / math.sqrt(2), 0, 0], rel=1e-5)
    assert metrics["adv/truncation_zeroed"] == 2


def test_truncation_after_keeps_statistics_then_zeroes():
    adv, _ = advantages(**CRAFTED, truncation_mask="after")  # stats of all four
    assert adv == pytest.approx([1.5, -0.5, 0, 0], rel=1e-5)


def test_truncation_with_a_single_untruncated_response():
    groups, rewards, truncated = [3, 3, 3, 4, 4], [1, 0, 0, 0, 0], [F, T, T, T, T]
    before, _ = advantages(rewards, groups, truncated, truncation_mask="before")
    assert before == [0.0] * 5  # one response left: no baseline; all-truncated group: nothing
    after, _ = advantages(rewards, groups, truncated, truncation_mask="after")
    s = math.sqrt(1 / 3)  # [1, 0, 0]: mean 1/3, unbiased std sqrt(1/3)
    assert after == pytest.approx([(2 / 3) / s, 0, 0, 0, 0], rel=1e-5)


def test_metrics_track_non_truncated_reward():
    _, metrics = advantages(**CRAFTED)
    assert metrics["reward/mean"] == 0.25 and metrics["reward/mean_non_truncated"] == 0.5
    assert metrics["reward/truncated_frac"] == 0.5


def test_output_dtype_follows_rewards():
    cfg = AlgoConfig()
    adv, _ = compute_advantages(torch.tensor([1.0, 0.0]), torch.tensor([0, 0]),
                                torch.tensor([F, F]), cfg)
    assert adv.dtype == torch.float32


batches = st.integers(1, 24).flatmap(lambda n: st.tuples(
    st.lists(st.sampled_from([0.0, 1.0, 0.5, 0.25, 0.8]), min_size=n, max_size=n),
    st.lists(st.integers(-3, 5), min_size=n, max_size=n),
    st.lists(st.booleans(), min_size=n, max_size=n)))


@settings(max_examples=100, deadline=None)
@given(batch=batches, mode=st.sampled_from(["none", "before", "after"]),
       estimator=st.sampled_from(["grpo", "dr_grpo"]), norm=st.booleans())
def test_vectorised_matches_loop_reference(batch, mode, estimator, norm):
    rewards, groups, truncated = batch
    adv, _ = advantages(rewards, groups, truncated, truncation_mask=mode,
                        adv_estimator=estimator, norm_adv_by_std=norm)
    in_stats = [not t for t in truncated] if mode == "before" else [True] * len(rewards)
    expected = grpo_advantages_reference(rewards, groups, in_stats,
                                         norm_by_std=norm and estimator == "grpo", eps=1e-6)
    if mode != "none":
        expected = [0.0 if t else a for a, t in zip(expected, truncated)]
    assert adv == pytest.approx(expected, abs=1e-9)


@pytest.mark.parametrize("args, name", [
    (([1.0, 0.0], [0], [F, F]), "group_ids"),
    (([1.0, 0.0], [0, 0], [F]), "truncated"),
    (([1.0, float("nan")], [0, 0], [F, F]), "rewards"),
    (([], [], []), "rewards"),
])
def test_bad_inputs_name_the_argument(args, name):
    rewards, groups, truncated = args
    with pytest.raises(ValueError, match=f"^{name}:"):
        compute_advantages(torch.tensor(rewards), torch.tensor(groups, dtype=torch.long),
                           torch.tensor(truncated, dtype=torch.bool), AlgoConfig())


def test_non_bool_truncated_and_float_group_ids_refused():
    with pytest.raises(ValueError, match="^truncated: expected a bool"):
        compute_advantages(torch.tensor([1.0, 0.0]), torch.tensor([0, 0]), torch.tensor([0, 1]),
                           AlgoConfig())
    with pytest.raises(ValueError, match="^group_ids: expected an integer"):
        compute_advantages(torch.tensor([1.0, 0.0]), torch.tensor([0.0, 0.0]),
                           torch.tensor([F, F]), AlgoConfig())


def test_nan_reward_error_names_the_row():
    with pytest.raises(ValueError, match="at row 1"):
        advantages([1.0, float("nan"), 0.0], [0, 0, 0])


@pytest.mark.parametrize("kwargs, name", [({"adv_estimator": "loo"}, "algo.adv_estimator"),
                                          ({"truncation_mask": "later"}, "algo.truncation_mask")])
def test_unknown_modes_in_an_unvalidated_config_named(kwargs, name):
    with pytest.raises(ValueError, match=f"^{name}: unknown"):
        compute_advantages(torch.tensor([1.0, 0.0]), torch.tensor([0, 0]), torch.tensor([F, F]),
                           AlgoConfig(**kwargs))
