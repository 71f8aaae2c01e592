"""PromptLoader: epochs are permutations, roll over inside a batch, and resume exactly."""

from __future__ import annotations

import json

import pytest

from megatron_rl.data import PromptLoader

RECORDS = [f"r{i}" for i in range(10)]


def take(loader, n):
    return [loader.next_batch() for _ in range(n)]


def test_epochs_are_permutations_and_roll_over_inside_a_batch():
    loader = PromptLoader(RECORDS, batch_size=4, seed=3)
    flat = [r for b in take(loader, 5) for r in b]  # 20 records = exactly two epochs
    assert all(len(b) == 4 for b in take(PromptLoader(RECORDS, 4, seed=3), 5))
    assert sorted(flat[:10]) == sorted(RECORDS) and sorted(flat[10:]) == sorted(RECORDS)
    assert flat[:10] != flat[10:]  # reshuffled per epoch
    assert loader.epoch == 1 and loader.pos == 10


def test_deterministic_by_seed_and_file_order_without_shuffle():
    assert take(PromptLoader(RECORDS, 3, seed=1), 4) == take(PromptLoader(RECORDS, 3, seed=1), 4)
    assert take(PromptLoader(RECORDS, 3, seed=1), 4) != take(PromptLoader(RECORDS, 3, seed=2), 4)
    plain = [r for b in take(PromptLoader(RECORDS, 3, shuffle=False), 4) for r in b]
    assert plain == RECORDS + RECORDS[:2]


@pytest.mark.parametrize("consumed", [0, 1, 2, 3, 7])
def test_resume_sees_exactly_the_same_next_batches(consumed):
    ref = PromptLoader(RECORDS, batch_size=4, seed=9)
    take(ref, consumed)
    state = json.loads(json.dumps(ref.state_dict()))  # checkpoints store it as JSON
    resumed = PromptLoader(RECORDS, batch_size=4, seed=9)
    resumed.load_state_dict(state)
    assert take(resumed, 6) == take(ref, 6)


def test_resume_refuses_another_dataset_or_seed():
    state = PromptLoader(RECORDS, 4, seed=9).state_dict()
    with pytest.raises(ValueError, match="num_records"):
        PromptLoader(RECORDS[:-1], 4, seed=9).load_state_dict(state)
    with pytest.raises(ValueError, match="seed"):
        PromptLoader(RECORDS, 4, seed=8).load_state_dict(state)


def test_batch_larger_than_dataset():
    batch = PromptLoader(RECORDS[:3], batch_size=7, seed=0).next_batch()
    assert len(batch) == 7 and set(batch) == set(RECORDS[:3])
