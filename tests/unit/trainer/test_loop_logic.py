"""Pure pieces of the trainer: the plateau rule, mini-batch splitting, sampling seeds, the timer."""

import torch

from megatron_rl.models.batch import SequenceBatch
from megatron_rl.trainer import phases
from megatron_rl.trainer.config import PlateauConfig, StageConfig
from megatron_rl.trainer.grpo import StepTimer, plateaued
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


def test_split_keeps_order_and_fields():
    b = SequenceBatch(sequences=[[i] * (i + 2) for i in range(7)], prompt_lens=[1] * 7,
                      token_fields={"x": [torch.full((i + 1,), float(i)) for i in range(7)]},
                      seq_fields={"advantages": torch.arange(7.0)})
    parts = phases.split(b, 3)
    assert [len(p.sequences) for p in parts] == [2, 3, 2]
    assert sum((p.sequences for p in parts), []) == b.sequences
    assert torch.cat([p.seq_fields["advantages"] for p in parts]).tolist() == list(range(7))
    assert [t[0].item() for p in parts for t in p.token_fields["x"]] == list(range(7))


def test_sampling_seed_depends_on_step_and_run_seed():
    seeds = {phases.sampling_seed(s, g) for s in (1, 2) for g in range(100)}
    assert len(seeds) == 200 and all(0 <= x < 2**31 - 1 for x in seeds)


def test_step_timer_parts_add_up():
    t = StepTimer()
    with t("gen"):
        sum(range(10000))
    m = t.metrics()
    assert abs(m["timing/gen"] + m["timing/other"] - m["timing/step"]) < 1e-9
