"""Rollout dumps: the parquet files round-trip, sample whole groups of fixed prompts, stop at the cap."""

from __future__ import annotations

import pyarrow.parquet as pq
import pytest

from megatron_rl.tracking.rollouts import (COLUMNS, SCHEMA, RolloutDumpConfig, RolloutDumper, keep_prompt,
                                           read_rollouts, step_path, table_rows, TABLE_COLUMNS)


def columns(step: int, prompts: int = 20, group: int = 4) -> dict[str, list]:
    n = prompts * group
    cols = {name: [None] * n for name in COLUMNS}
    for i in range(n):
        g, s = divmod(i, group)
        cols["grpo_step"][i], cols["global_step"][i], cols["stage"][i] = step, 100 + step, "stage1"
        cols["stage_step"][i], cols["max_response_len"][i], cols["group"][i], cols["sample"][i] = step, 12, g, s
        cols["prompt_uid"][i], cols["prompt"][i], cols["ground_truth"][i] = f"p{g}", f"{g}+1=", str(g + 1)
        cols["data_source"][i] = "toy"
        cols["response"][i], cols["prompt_ids"][i], cols["response_ids"][i] = f"r{s}", [1, 2, g], [3] * s
        cols["reward"][i], cols["outcome"][i], cols["answer"][i] = float(s % 2), "wrong", None if s == 3 else str(s)
        cols["correct"][i], cols["response_len"][i], cols["truncated"][i] = s % 2 == 1, s, s == 0
        cols["finish_reason"][i], cols["weight_version"][i], cols["advantage"][i] = "stop", step, s - 1.5
        cols["in_batch"][i] = g % 2 == 0
        for k in ("rollout_logp_mean", "rollout_logp_min", "token_prob_mean"):
            cols[k][i] = -0.5 * s
        for k in ("entropy_mean", "entropy_max", "train_logp_mean", "logp_gap_mean", "logp_gap_max"):
            cols[k][i] = 0.25 * s if g % 2 == 0 else None
    return cols


def test_analyze_dump_round_trip(tmp_path):
    d = RolloutDumper(RolloutDumpConfig(), tmp_path)
    cols = columns(1)
    m = d.write(101, cols)
    path = step_path(tmp_path, 101)
    assert path.exists() and not list(path.parent.glob("*.tmp"))
    table = pq.read_table(path)
    assert table.schema.equals(SCHEMA)
    assert table.to_pydict() == cols  # every value as written (floats chosen exact in float32)
    assert m["dump/rows"] == 80 and m["dump/bytes"] == path.stat().st_size == d.bytes
    # A redone step (resume after a crash) replaces its file; the byte count follows.
    d.write(101, columns(1, prompts=10))
    assert pq.read_table(path).num_rows == 40 and d.bytes == path.stat().st_size
    d.write(102, columns(2))
    df = read_rollouts(tmp_path)
    assert len(df) == 120 and sorted(df["global_step"].unique()) == [101, 102]
    # A resume from step 101's checkpoint: the dumps of later steps go (they run again), and a dumper
    # opened on the directory counts what is left
    again = RolloutDumper(RolloutDumpConfig(), tmp_path)
    assert again.forget_after(101) == 1 and not step_path(tmp_path, 102).exists()
    assert again.bytes == path.stat().st_size == RolloutDumper(RolloutDumpConfig(), tmp_path).bytes


def test_analyze_dump_sampling_keeps_whole_groups_of_the_same_prompts(tmp_path):
    d = RolloutDumper(RolloutDumpConfig(sample_rate=0.3), tmp_path)
    for step in (1, 2, 3):
        d.write(100 + step, columns(step, prompts=200))
    df = read_rollouts(tmp_path)
    per_step = [set(df[df["grpo_step"] == s]["prompt_uid"]) for s in (1, 2, 3)]
    assert per_step[0] == per_step[1] == per_step[2]  # the same prompts every step
    assert 0.2 < len(per_step[0]) / 200 < 0.4
    assert (df.groupby(["grpo_step", "prompt_uid"]).size() == 4).all()  # whole groups
    assert per_step[0] == {f"p{g}" for g in range(200) if keep_prompt(f"p{g}", 0.3)}


def test_analyze_dump_size_cap_and_token_ids_off(tmp_path):
    d = RolloutDumper(RolloutDumpConfig(max_gb=1e-9, token_ids=False), tmp_path)  # ~1 byte
    assert d.write(101, columns(1))["dump/capped"] == 0.0  # under the cap before the first file
    assert d.write(102, columns(2)) == {"dump/capped": 1.0, "dump/rows": 0.0}
    assert not step_path(tmp_path, 102).exists()
    df = read_rollouts(tmp_path)
    assert all(len(x) == 0 for x in df["prompt_ids"]) and all(len(x) == 0 for x in df["response_ids"])
    # A restarted writer counts what is already there.
    assert RolloutDumper(RolloutDumpConfig(max_gb=1e-9), tmp_path).write(103, columns(3))["dump/capped"] == 1.0


def test_analyze_dump_checks_its_input_and_picks_table_rows(tmp_path):
    cols = columns(1)
    with pytest.raises(ValueError, match="entropy_mean"):
        RolloutDumper(RolloutDumpConfig(), tmp_path).write(1, {k: v for k, v in cols.items() if k != "entropy_mean"})
    with pytest.raises(ValueError, match="sample_rate"):
        RolloutDumpConfig(sample_rate=0.0).validate()
    rows = table_rows(cols, 4)
    assert len(rows) == 4 and len(rows[0]) == len(TABLE_COLUMNS)
    uid = TABLE_COLUMNS.index("prompt_uid")
    assert len({r[uid] for r in rows}) == 4  # four different prompts
    assert table_rows(cols, 0) == []
