"""Pure pieces of the trainer: the plateau rule, the optimizer steps' mini-batches, sampling seeds, the timer."""

import torch

from megatron_rl.algo import AlgoConfig, sgd_schedule
from megatron_rl.models.batch import SequenceBatch
from megatron_rl.trainer import phases
from megatron_rl.trainer.config import PlateauConfig, StageConfig
from megatron_rl.trainer.grpo import StepTimer, plateaued, update_policy
from megatron_rl.trainer.state import TrainerState


def test_plateau_rule_counts_evaluations_without_improvement():
    stage = StageConfig(name="s", max_response_len=8, max_steps=100,
                        plateau=PlateauConfig(patience=2, min_delta=0.01))
    st = TrainerState()
    seq = [0.30, 0.35, 0.355, 0.36, 0.40, 0.405, 0.41]
    # 0.355 and 0.36 do not beat 0.35 by > 0.01 -> the second of them ends the stage
    out = [plateaued(st, stage, a) for a in seq[:4]]
    assert out == [False, False, False, True]
    assert plateaued(st, stage, None) is False  # steps without an evaluation never count
    off = StageConfig(name="s", max_response_len=8, max_steps=1)
    st2 = TrainerState()
    assert not any(plateaued(st2, off, 0.5) for _ in range(10))


def _batch(n):
    return SequenceBatch(sequences=[[i] * (i + 2) for i in range(n)], prompt_lens=[1] * n,
                         token_fields={"x": [torch.full((i + 1,), float(i)) for i in range(n)]},
                         seq_fields={"advantages": torch.arange(float(n))})


class _RecordingPolicy:
    """Stands in for MegatronPolicy.train_step: records which sequences each optimizer step got."""

    def __init__(self):
        self.steps = []

    def train_step(self, mb, loss_fn, temperature, with_entropy, per_sequence=None, routes=None):
        assert [t[0].item() for t in mb.token_fields["x"]] == mb.seq_fields["advantages"].tolist()
        self.steps.append([s[0] for s in mb.sequences])
        if per_sequence is not None:  # a per-sample value: the sequence's own number
            per_sequence.values = {k: torch.tensor([float(s[0]) for s in mb.sequences])
                                   for k in per_sequence.names}
        return {"actor/ratio_min": 1.0, "actor/ratio_max": 1.0, "actor/pg_loss": 0.0}


def test_update_passes_follow_the_seeded_shuffling_schedule():
    a = AlgoConfig(n_sgd=2, mini_batches=3)
    policy = _RecordingPolicy()
    _, per_sample = update_policy(policy, _batch(7), a, 1.0, alpha=0.0, max_response_len=8, seed=5)
    assert [len(s) for s in policy.steps] == [3, 2, 2, 3, 2, 2]
    # the first pass's per-sample values come back in batch order, whatever the shuffle
    assert per_sample["entropy_mean"].tolist() == [float(i) for i in range(7)]
    first, second = sum(policy.steps[:3], []), sum(policy.steps[3:], [])
    assert sorted(first) == sorted(second) == list(range(7))  # each pass uses every sample once
    assert first != second  # ... in a fresh order (the same order each pass was the bug)
    want = [t.tolist() for t in sgd_schedule(7, a, seed=5)]
    assert policy.steps == want
    again = _RecordingPolicy()  # the step's seed fixes the schedule (a resumed run replays it)
    update_policy(again, _batch(7), a, 1.0, alpha=0.0, max_response_len=8, seed=5)
    assert again.steps == policy.steps


def test_on_policy_is_one_step_in_order_and_mini_batches_clamp_to_the_batch():
    policy = _RecordingPolicy()
    update_policy(policy, _batch(5), AlgoConfig(), 1.0, alpha=0.0, max_response_len=8, seed=0)
    assert policy.steps == [list(range(5))]
    few = _RecordingPolicy()  # zero-variance filtering left fewer sequences than mini-batches
    update_policy(few, _batch(2), AlgoConfig(mini_batches=4), 1.0, alpha=0.0, max_response_len=8,
                  seed=0)
    assert sorted(sum(few.steps, [])) == [0, 1] and len(few.steps) == 2


def test_sampling_seed_depends_on_step_and_run_seed():
    seeds = {phases.sampling_seed(s, g) for s in (1, 2) for g in range(100)}
    assert len(seeds) == 200 and all(0 <= x < 2**31 - 1 for x in seeds)


def test_step_timer_parts_add_up():
    t = StepTimer()
    with t("gen"):
        sum(range(10000))
    m = t.metrics()
    assert abs(m["timing/gen"] + m["timing/other"] - m["timing/step"]) < 1e-9
