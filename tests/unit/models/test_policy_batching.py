"""Micro-batch formation (token budget, DP balance) and SequenceBatch validation: pure logic."""

from __future__ import annotations

import random

import pytest
import torch

from megatron_rl.models.batch import SequenceBatch, pad_token_fields
from megatron_rl.models.packing import pack_micro_batches, shard_for_dp


def _lengths(seed: int, n: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.choice([rng.randint(3, 20), rng.randint(50, 200)]) for _ in range(n)]


@pytest.mark.parametrize("seed", range(5))
@pytest.mark.parametrize("dp", [1, 2, 3, 4])
def test_dp_shards_cover_everything_and_balance_tokens(seed, dp):
    lengths = _lengths(seed, 37)
    shards = shard_for_dp(lengths, dp)
    assert sorted(i for s in shards for i in s) == list(range(len(lengths)))
    loads = [sum(lengths[i] for i in s) for s in shards]
    # longest-first greedy: no rank exceeds the lightest by more than one sequence
    assert max(loads) - min(loads) <= max(lengths)
    assert all(shards)


def test_fewer_sequences_than_ranks_leaves_ranks_empty():
    shards = shard_for_dp([5, 6, 7], 4)
    assert sorted(len(s) for s in shards) == [0, 1, 1, 1]


@pytest.mark.parametrize("seed", range(5))
@pytest.mark.parametrize("budget", [16, 100, 400, 10_000])
def test_micro_batches_respect_the_token_budget(seed, budget):
    lengths = _lengths(seed, 41)
    idx = list(range(0, 41, 2))
    batches = pack_micro_batches(lengths, idx, budget)
    assert sorted(i for b in batches for i in b) == idx
    for b in batches:
        padded = len(b) * max(lengths[i] for i in b)
        assert padded <= budget or len(b) == 1
    # packing is not wasteful: merging any two neighbours would break the budget
    for a, b in zip(batches, batches[1:]):
        assert (len(a) + len(b)) * max(lengths[i] for i in a + b) > budget


def test_micro_batch_count_made_a_multiple_for_the_interleaved_schedule():
    lengths = [10] * 12
    batches = pack_micro_batches(lengths, list(range(12)), token_budget=1000, multiple_of=4)
    assert len(batches) % 4 == 0
    assert sorted(i for b in batches for i in b) == list(range(12))
    # cannot split single sequences: stops instead of looping
    assert len(pack_micro_batches([10, 10, 10], [0, 1, 2], 10, multiple_of=4)) == 3


def test_sequence_batch_errors_name_field_and_row():
    seqs = [[1, 2, 3, 4], [5, 6, 7]]
    with pytest.raises(ValueError, match="row 1: prompt_len 0"):
        SequenceBatch(sequences=seqs, prompt_lens=[2, 0])
    with pytest.raises(ValueError, match=r"token_fields\['adv'\] row 1: shape \(2,\), expected \(1,\)"):
        SequenceBatch(sequences=seqs, prompt_lens=[2, 2],
                      token_fields={"adv": [torch.zeros(2), torch.zeros(2)]})
    with pytest.raises(ValueError, match=r"seq_fields\['w'\]"):
        SequenceBatch(sequences=seqs, prompt_lens=[2, 2], seq_fields={"w": torch.zeros(3)})


def test_padded_fields_are_zero_outside_the_response():
    batch = SequenceBatch(sequences=[[1, 2, 3, 4], [5, 6, 7]], prompt_lens=[1, 2],
                          token_fields={"adv": [torch.tensor([1.0, 2.0, 3.0]), torch.tensor([4.0])]},
                          seq_fields={"w": torch.tensor([0.5, 0.25])})
    fields = pad_token_fields(batch, [1, 0], width=3)
    assert torch.equal(fields["adv"], torch.tensor([[4.0, 0.0, 0.0], [1.0, 2.0, 3.0]]))
    assert torch.equal(fields["w"], torch.tensor([0.25, 0.5]))
