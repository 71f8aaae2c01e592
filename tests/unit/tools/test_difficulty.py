"""The difficulty labeller: hard questions vs wrong labels on a synthetic set where the truth is known."""

from __future__ import annotations

import json
import random

import pytest

from megatron_rl.data import DataConfig, load_prompts
from megatron_rl.tools.difficulty import DifficultyConfig, canonical_answer, label_prompt, run


def lab(correct, answers, **kw):
    return label_prompt([bool(c) for c in correct], answers, **kw).label


def test_small_cases():
    assert lab([1] * 8, ["5"] * 8) == "solved"
    assert lab([0] * 8, [str(x) for x in range(8)]) == "unsolved"
    assert lab([0] * 8, ["4"] * 6 + ["7", None]) == "suspected_wrong_label"  # 0/k with consensus
    assert lab([1] + [0] * 7, ["4.5"] + [str(x) for x in range(7)]) == "hard"
    assert lab([1] + [0] * 7, ["4.5"] + ["4"] * 5 + ["1", "2"]) == "suspected_wrong_label"
    assert lab([1] * 4 + [0] * 4, ["9"] * 4 + ["1", "2", "3", "4"]) == "mixed"
    # unparsable answers never form a consensus; 4.0 and 4 are one vote
    assert lab([0] * 8, [None] * 8) == "unsolved"
    assert lab([0] * 8, ["4.0", "4", " 4 ", "$4$", "1", "2", "3", "5"]) == "suspected_wrong_label"
    # the label must be outvoted: 4 right vs 4 agreeing wrong is not a wrong label
    assert lab([1] * 4 + [0] * 4, ["9"] * 4 + ["3"] * 4) == "mixed"
    assert canonical_answer("1,000") == canonical_answer("1000.0") == "1000"


def simulate(seed: int = 0, n: int = 400, k: int = 16):
    """Prompts with known true answers; 10% carry a planted wrong label (seed 002's 4.5 tickets).

    The model answers right with its per-prompt skill, else a scattered wrong answer. Wrong-label
    prompts are ones the model mostly solves, so its answer disagrees with the label, except by
    coincidence (5%: it happens to write the label).
    """
    rng = random.Random(seed)
    out = []
    for i in range(n):
        truth = str(100 + i)
        planted = i % 10 == 3
        label = truth + ".5" if planted else truth
        if planted:
            skill = rng.uniform(0.7, 1.0)
        else:
            skill = rng.choice([rng.uniform(0.9, 1.0), rng.uniform(0.3, 0.8),
                                rng.uniform(0.02, 0.2), 0.0])
        answers = []
        for _ in range(k):
            if planted and rng.random() < 0.05:
                answers.append(label)
            elif rng.random() < skill:
                answers.append(truth)
            else:
                answers.append(str(rng.randrange(10_000, 10_000_000)))  # scattered mistakes
        out.append((planted, skill, label, answers))
    return out


def test_planted_wrong_labels_are_found_and_hard_questions_are_not_flagged():
    data = simulate()
    labels = [label_prompt([a == gt for a in answers], answers) for _, _, gt, answers in data]
    planted = [lbl.label for (p, *_), lbl in zip(data, labels) if p]
    clean = [(skill, lbl.label) for (p, skill, *_), lbl in zip(data, labels) if not p]
    recall = planted.count("suspected_wrong_label") / len(planted)
    assert recall >= 0.9
    assert [s for s, l in clean if l == "suspected_wrong_label"] == []  # no clean prompt flagged
    # rarely-right clean prompts come out hard (or unsolved when no sample hit)
    rare = [l for s, l in clean if 0 < s <= 0.2]
    assert set(rare) <= {"hard", "unsolved", "mixed"} and rare.count("hard") > len(rare) / 2
    assert all(l == "unsolved" for s, l in clean if s == 0.0)


def _scripted_engine():
    """Answers ``a+b=`` prompts by a script: the planted-label prompt gets the true sum."""
    from megatron_rl.rollout.base import Completion

    class Scripted:
        def generate(self, prompt_ids, sampling):
            from megatron_rl.demo import build_bpe_tokenizer

            tok = build_bpe_tokenizer()
            out = []
            for ids in prompt_ids:
                q = tok.decode(ids).split("Q:")[-1].split("=")[0]
                a, b = map(int, q.split("+"))
                answers = [a + b] * sampling.n if a < 50 else [a + b + j for j in range(sampling.n)]
                out.append([Completion(token_ids=[1], logprobs=[0.0], text=f"\\boxed{{{x}}}",
                                       finish_reason="stop", truncated=False) for x in answers])
            return out

        def close(self):
            pass

    return Scripted()


def test_run_writes_annotated_dataset_and_summary(tmp_path):
    from megatron_rl.demo import build_bpe_tokenizer

    model = tmp_path / "model"
    build_bpe_tokenizer().save_pretrained(model)
    rows = []
    for i, (a, b, gt) in enumerate([(1, 2, "3"), (3, 4, "8"), (60, 1, "61"), (70, 2, "99")]):
        rows.append({"data_source": "toy", "prompt": [{"role": "user", "content": f"{a}+{b}="}],
                     "reward_model": {"style": "exact_boxed", "ground_truth": gt},
                     "extra_info": {"index": i}})
    src = tmp_path / "toy.jsonl"
    src.write_text("".join(json.dumps(r) + "\n" for r in rows))
    cfg = DifficultyConfig(k=4)
    summary = run(str(src), str(model), str(tmp_path / "out.jsonl"), None, cfg,
                  engine=_scripted_engine())
    # (1,2): all 3 = label -> solved; (3,4): all 7 != label 8 -> wrong label;
    # (60,1): 61..64, one right -> 1/4 = hard; (70,2): 72..75, never 99 -> unsolved
    assert summary["labels"] == {"solved": 1, "mixed": 0, "hard": 1, "unsolved": 1,
                                 "suspected_wrong_label": 1}
    assert summary["suspected_wrong_label_examples"][0]["majority_answer"] == "7"
    assert json.loads((tmp_path / "out.summary.json").read_text())["prompts"] == 4
    out_rows = [json.loads(line) for line in (tmp_path / "out.jsonl").read_text().splitlines()]
    assert [r["extra_info"]["difficulty"]["label"] for r in out_rows] == \
           ["solved", "suspected_wrong_label", "hard", "unsolved"]
    assert [{k: v for k, v in r.items() if k != "extra_info"} for r in out_rows] == \
           [{k: v for k, v in r.items() if k != "extra_info"} for r in rows]
    # training-side filter (Skywork's offline filtering): drop solved/unsolved and wrong labels
    tok = build_bpe_tokenizer()
    kept, stats = load_prompts(tmp_path / "out.jsonl", tok,
                               DataConfig(keep_labels=["hard", "mixed"], pass_rate_max=0.9))
    assert [r.ground_truth for r in kept] == ["61"] and stats["filtered_label"] == 3
    # the same through parquet (a verl user's format), source rows 2..4 only so one is unlabelled
    import pandas as pd

    pd.DataFrame(rows[1:]).to_parquet(tmp_path / "toy.parquet")
    recs, _ = load_prompts(tmp_path / "toy.parquet", tok)
    from megatron_rl.tools.difficulty import label_prompt, write_annotated

    labels = [label_prompt([True, False], ["1", "2"]) for _ in recs[:2]]  # row 3 left unlabelled
    write_annotated(tmp_path / "toy.parquet", tmp_path / "ann.parquet", recs[:2], labels)
    kept, stats = load_prompts(tmp_path / "ann.parquet", tok, DataConfig(keep_labels=["mixed"]))
    assert [r.ground_truth for r in kept] == ["8", "61"] and stats["filtered_unannotated"] == 1
    assert kept[0].extra["index"] == 1


def test_config_is_validated():
    from megatron_rl.config.base import ConfigError

    with pytest.raises(ConfigError, match="agree_frac"):
        DifficultyConfig.from_dict({"agree_frac": 0.0}).validate()
    with pytest.raises(ConfigError, match="unknown key"):
        DifficultyConfig.from_dict({"kk": 3})


def test_difficulty_refuses_a_row_whose_reward_style_resolves_to_nothing_before_the_engine(tmp_path):
    """Each row is scored, so each style is resolved before the engine starts (the model directory
    here has a tokenizer only: reaching the engine would fail on its missing config instead)."""
    from megatron_rl.demo import build_bpe_tokenizer
    from megatron_rl.rewards import RewardDataError

    model = tmp_path / "model"
    build_bpe_tokenizer().save_pretrained(model)
    rows = [{"data_source": "toy", "prompt": "1+2=", "reward_model": {"style": "exact_boxed", "ground_truth": "3"}},
            {"data_source": "toy", "prompt": "3+4=", "reward_model": {"style": "numbers", "ground_truth": "7"}}]
    src = tmp_path / "toy.jsonl"
    src.write_text("".join(json.dumps(r) + "\n" for r in rows))
    with pytest.raises(RewardDataError) as e:
        run(str(src), str(model), str(tmp_path / "out.jsonl"), None, DifficultyConfig(k=2))
    assert f"{src}: row 2:" in str(e.value) and "style='numbers'" in str(e.value), str(e.value)
    assert not (tmp_path / "out.jsonl").exists()
