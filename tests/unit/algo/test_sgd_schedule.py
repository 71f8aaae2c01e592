"""Off-policy control: n_sgd passes x mini_batches optimizer steps over a rollout batch."""

import pytest
import torch

from megatron_rl.algo import AlgoConfig, sgd_schedule


def test_on_policy_default_is_one_step_on_everything():
    steps = sgd_schedule(10, AlgoConfig())
    assert len(steps) == 1 and steps[0].tolist() == list(range(10))


@pytest.mark.parametrize("n_sgd, mini_batches, n", [(1, 4, 10), (3, 2, 7), (2, 1, 5), (2, 5, 5)])
def test_every_pass_uses_every_sample_once(n_sgd, mini_batches, n):
    steps = sgd_schedule(n, AlgoConfig(n_sgd=n_sgd, mini_batches=mini_batches), seed=4)
    assert len(steps) == n_sgd * mini_batches
    for p in range(n_sgd):
        chunk = steps[p * mini_batches:(p + 1) * mini_batches]
        assert sorted(torch.cat(chunk).tolist()) == list(range(n))
        sizes = [len(s) for s in chunk]
        assert max(sizes) - min(sizes) <= 1


def test_seeded_and_reshuffled_per_pass():
    cfg = AlgoConfig(n_sgd=2, mini_batches=1)
    a, b = sgd_schedule(50, cfg, seed=1), sgd_schedule(50, cfg, seed=1)
    assert all(torch.equal(x, y) for x, y in zip(a, b))
    assert not torch.equal(a[0], a[1])


def test_too_few_samples_named():
    with pytest.raises(ValueError, match="^algo.mini_batches:"):
        sgd_schedule(3, AlgoConfig(mini_batches=4))
