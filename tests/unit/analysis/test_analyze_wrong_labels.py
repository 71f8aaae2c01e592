"""The difficulty rule with labels, and the live wrong-label monitor built on it."""

from __future__ import annotations

import json

import pytest

from megatron_rl.data.labels import label_prompt
from megatron_rl.tracking.rollouts import read_rollouts
from megatron_rl.data.wrong_labels import FILE_NAME, WrongLabelConfig, WrongLabelMonitor
from tests.unit.analysis.synthetic_run import make_run


def test_analyze_rule_ignores_the_label_as_a_wrong_answer():
    # Six samples gave the label's answer but scored wrong (format): not "agreeing on another answer".
    answers = ["5"] * 6 + ["7", "8"]
    assert label_prompt([False] * 8, answers).label == "suspected_wrong_label"
    assert label_prompt([False] * 8, answers, ground_truth="5.0").label == "unsolved"
    assert label_prompt([False] * 8, answers, ground_truth="6").label == "suspected_wrong_label"


def test_analyze_rule_needs_rarely_right_and_a_competent_policy():
    # 3/8 right with 4 agreeing wrong answers: the label is matched too often to be suspected.
    assert label_prompt([True] * 3 + [False] * 5, ["10"] * 3 + ["3"] * 4 + ["1"], hard_max_pass_rate=0.25,
                        ground_truth="10").label == "mixed"
    assert label_prompt([True] + [False] * 7, ["10"] + ["3"] * 7, ground_truth="10",
                        hard_max_pass_rate=0.125).label == "suspected_wrong_label"
    # The same samples where the policy solves 20% of the source's prompts: no verdict on the label.
    kw = dict(ground_truth="10", hard_max_pass_rate=0.125, min_source_pass_rate=0.5)
    assert label_prompt([True] + [False] * 7, ["10"] + ["3"] * 7, source_pass_rate=0.2, **kw).label == "hard"
    assert label_prompt([False] * 8, ["3"] * 8, source_pass_rate=0.2, **kw).label == "unsolved"
    assert label_prompt([False] * 8, ["3"] * 8, source_pass_rate=0.5, **kw).label == "suspected_wrong_label"
    # "Stuck at 0": one right sample in the window keeps it off the list (then it is hard).
    assert label_prompt([True] + [False] * 7, ["10"] + ["3"] * 7, ground_truth="10",
                        suspect_max_pass_rate=0.0).label == "hard"


def group(uid, correct, answers, gt="10", source="s"):
    return (uid, gt, f"prompt {uid}", source, correct, answers)


def test_analyze_monitor_window_min_samples_and_flag_age():
    m = WrongLabelMonitor(WrongLabelConfig(window=8, min_samples=8, agree_frac=0.5, suspect_max_pass_rate=0.25,
                                           min_source_pass_rate=0.0))
    # Step 1: 4 samples, not yet labelled.
    assert m.observe(1, [group("a", [True] * 4, ["10"] * 4)])["data/prompts_labelled"] == 0
    # Step 2: 4 right + 4 agreeing wrong: 4 vs 4 is "mixed" (the label must be outvoted).
    m.observe(2, [group("a", [False] * 4, ["3"] * 4)])
    assert m.prompts["a"].label == "mixed" and m.suspects() == []
    # Step 3: the right samples leave the window; 8/8 say 3: suspected since step 3.
    out = m.observe(3, [group("a", [False] * 4, ["3"] * 4)])
    assert out["data/suspected_wrong_labels"] == 1
    [e] = m.suspects()
    assert (e["uid"], e["majority_answer"], e["agreement"], e["flagged_since"]) == ("a", "3", 1.0, 3)
    assert (e["samples"], e["visits"], e["pass_rate"], e["recent_pass_rate"]) == (12, 3, 0.3333, 0.0)  # rounded to 4 places
    m.observe(4, [group("a", [False] * 4, ["3", "3", "9", "3"])])
    assert m.suspects()[0]["flagged_since"] == 3  # still listed: the age is kept
    # Scattered answers now: off the list, and the age resets.
    m.observe(5, [group("a", [False] * 8, [str(i) for i in range(8)])])
    assert m.prompts["a"].label == "unsolved" and m.prompts["a"].flagged_since is None
    assert [h["uid"] for h in m.hard_kept_off()] == ["a"]
    # One prompt twice in a step is one visit with both groups' samples.
    m.observe(6, [group("b", [False] * 4, ["4"] * 4), group("b", [False] * 4, ["4"] * 4)])
    assert (m.prompts["b"].visits, m.prompts["b"].samples, m.prompts["b"].label) == (1, 8, "suspected_wrong_label")
    assert m.label_counts["suspected_wrong_label"] == 1 and m.label_counts["unsolved"] == 1


def test_analyze_monitor_waits_for_the_policy_on_each_source():
    m = WrongLabelMonitor(WrongLabelConfig(window=8, min_samples=8, min_source_pass_rate=0.5, source_window=16))
    solved = [group(f"easy{i}", [True] * 8, ["10"] * 8, source="easy") for i in range(3)]
    m.observe(1, solved + [group("a", [False] * 8, ["7"] * 8, source="easy"),
                           group("b", [False] * 8, ["7"] * 8, source="hard")])
    # "easy": 24 right then 8 wrong; its newest 16 samples are half right. "hard": never right.
    assert m.sources["easy"].rate == 0.5 and m.sources["hard"].rate == 0.0 and len(m.sources["easy"].recent) == 16
    assert [e["uid"] for e in m.suspects()] == ["a"] and m.prompts["b"].label == "unsolved"
    rep = m.report(1)
    assert rep["sources"]["hard"] == {"pass_rate": 0.0, "samples": 8, "prompts": 1}


def test_analyze_monitor_state_round_trip():
    m = WrongLabelMonitor(WrongLabelConfig(window=8, min_samples=4, min_source_pass_rate=0.0))
    m.observe(1, [group("a", [False] * 4, ["3"] * 4), group("b", [True, False, False, False], ["10", "1", "2", "3"])])
    m.observe(2, [group("a", [False] * 6, ["3"] * 6)])
    state = json.loads(json.dumps(m.state_dict()))
    m2 = WrongLabelMonitor(WrongLabelConfig(window=8, min_samples=4, min_source_pass_rate=0.0))
    m2.load_state_dict(state)
    assert m2.report(2) == m.report(2)
    m.observe(3, [group("a", [True] * 4, ["10"] * 4)])
    m2.observe(3, [group("a", [True] * 4, ["10"] * 4)])
    assert m2.report(3) == m.report(3) and len(m2.prompts["a"].recent) == 8


def test_analyze_monitor_config_is_checked():
    with pytest.raises(ValueError, match="window"):
        WrongLabelConfig(window=4, min_samples=8).validate()
    with pytest.raises(ValueError, match="agree_frac"):
        WrongLabelConfig(agree_frac=0.0).validate()


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    root = tmp_path_factory.mktemp("run")
    return root, make_run(root)


def test_analyze_live_list_equals_the_rule_on_the_dumped_samples(run):
    """Reference: rebuild each prompt's newest 32 samples from the parquet dumps and label them."""
    root, sim = run
    df = read_rollouts(root).sort_values(["grpo_step", "group", "sample"])
    expect = set()
    for uid, g in df.groupby("prompt_uid"):
        g = g.tail(32)
        src = df[(df["data_source"] == g["data_source"].iloc[0]) & (df["grpo_step"] <= g["grpo_step"].max())]
        if len(g) >= 16 and label_prompt(g["correct"].tolist(), g["answer"].tolist(),
                                         ground_truth=g["ground_truth"].iloc[0], suspect_max_pass_rate=0.0,
                                         source_pass_rate=src["correct"].tail(4096).mean(),
                                         min_source_pass_rate=0.3).label == "suspected_wrong_label":
            expect.add(uid)
    live = json.loads((root / "rollouts" / FILE_NAME).read_text())
    assert {e["uid"] for e in live["suspects"]} == expect
    assert live["labels"]["suspected_wrong_label"] == len(expect) > 0
    # The simulated planted labels are what the list finds; the simulated hard prompts are not on it.
    planted = {u for u, k in sim["kind"].items() if k == "wrong_label"}
    hard = {u for u, k in sim["kind"].items() if k == "hard"}
    assert len(expect & planted) >= 0.8 * len(planted) and expect <= planted
    assert not expect & hard and hard & {e["uid"] for e in live["hard_kept_off"]}
