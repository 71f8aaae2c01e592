"""load_prompts on verl-format parquet / jsonl: unchanged fields, HF chat template ids, filtering."""

from __future__ import annotations

import json

import pytest

from megatron_rl.data import DataConfig, DataError, load_prompts

TEMPLATE = ("{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}\n{% endfor %}"
            "{% if add_generation_prompt %}<|assistant|>{% endif %}")


@pytest.fixture(scope="module")
def tok():
    from megatron_rl.demo import build_bpe_tokenizer

    t = build_bpe_tokenizer()
    t.chat_template = TEMPLATE
    return t


def verl_rows(n: int = 6) -> list[dict]:
    rows = []
    for i in range(n):
        msgs = [{"role": "user", "content": f"What is {i} * {i + 1}? " + "think " * i}]
        if i % 2:
            msgs.insert(0, {"role": "system", "content": "Reason step by step."})
        rows.append({"data_source": "openai/gsm8k" if i % 3 else "math_dapo",
                     "prompt": msgs, "ability": "math",
                     "reward_model": {"style": "rule", "ground_truth": str(i * (i + 1))},
                     "extra_info": {"split": "train", "index": i, "answer": f"#### {i * (i + 1)}"}})
    return rows


def write_jsonl(path, rows, raw_lines=()):
    with open(path, "w") as f:
        for r in rows:
            f.write(json.dumps(r) + "\n")
        for line in raw_lines:
            f.write(line + "\n")
    return path


def test_verl_parquet_loads_unchanged(tmp_path, tok):
    import pandas as pd

    rows = verl_rows()
    path = tmp_path / "train.parquet"
    pd.DataFrame(rows).to_parquet(path)  # what verl's preprocessing scripts do
    recs, stats = load_prompts(path, tok, DataConfig())
    assert stats["rows"] == stats["loaded"] == len(rows)
    for row, rec in zip(rows, recs):
        assert rec.ground_truth == row["reward_model"]["ground_truth"]
        assert rec.style == "rule" and rec.data_source == row["data_source"]
        assert rec.extra == row["extra_info"]
        # the reference: HF's own chat-template tokenization of the same messages
        want = tok.apply_chat_template(row["prompt"], tokenize=True, add_generation_prompt=True)
        want = want["input_ids"] if isinstance(want, dict) or hasattr(want, "keys") else want
        assert rec.prompt_ids == list(want)
        assert rec.prompt_text == tok.apply_chat_template(row["prompt"], tokenize=False,
                                                          add_generation_prompt=True)
    assert len({r.uid for r in recs}) == len(recs)


def test_jsonl_and_parquet_agree(tmp_path, tok):
    import pandas as pd

    rows = verl_rows()
    pd.DataFrame(rows).to_parquet(tmp_path / "a.parquet")
    write_jsonl(tmp_path / "a.jsonl", rows)
    a, _ = load_prompts(tmp_path / "a.parquet", tok)
    b, _ = load_prompts(tmp_path / "a.jsonl", tok)
    assert [(r.prompt_ids, r.ground_truth, r.extra) for r in a] == \
           [(r.prompt_ids, r.ground_truth, r.extra) for r in b]


def test_max_prompt_len_filters_and_counts(tmp_path, tok):
    rows = verl_rows(8)
    path = write_jsonl(tmp_path / "d.jsonl", rows)
    lens = [len(tok.apply_chat_template(r["prompt"], tokenize=False, add_generation_prompt=True)
                .encode()) for r in rows]  # byte-level tokenizer without merges: one id per byte
    limit = sorted(lens)[4]
    recs, stats = load_prompts(path, tok, DataConfig(max_prompt_len=limit))
    assert stats["too_long"] == sum(n > limit for n in lens) and stats["loaded"] == len(recs)
    assert all(len(r.prompt_ids) <= limit for r in recs)
    # the keyword overrides the config (the trainer passes rollout.max_prompt_len)
    _, stats2 = load_prompts(path, tok, DataConfig(max_prompt_len=limit), max_prompt_len=0)
    assert stats2["too_long"] == 0


@pytest.mark.parametrize("bad, message", [
    ("{not json", "row 3: invalid JSON"),
    (json.dumps({"prompt": [{"role": "user", "content": "x"}]}), "row 3: missing field 'reward_model.ground_truth'"),
    (json.dumps({"prompt": 5, "reward_model": {"ground_truth": "1"}}), "row 3: field 'prompt'"),
    (json.dumps({"prompt": [{"role": "user"}], "reward_model": {"ground_truth": "1"}}), "row 3: field 'prompt'"),
    (json.dumps([1, 2]), "row 3: expected an object"),
])
def test_malformed_row_names_file_and_row(tmp_path, tok, bad, message):
    path = write_jsonl(tmp_path / "bad.jsonl", verl_rows(2), [bad, json.dumps(verl_rows(1)[0])])
    with pytest.raises(DataError) as exc:
        load_prompts(path, tok)
    assert str(path) in str(exc.value) and message in str(exc.value)
    recs, stats = load_prompts(path, tok, DataConfig(on_bad_row="skip"))
    assert stats["bad_rows"] == 1 and len(recs) == 3 and stats["rows"] == 4


def test_string_prompts_without_template(tmp_path, tok):
    rows = [{"prompt": "12+30=", "reward_model": {"ground_truth": "42", "style": "exact_boxed"}}]
    path = write_jsonl(tmp_path / "s.jsonl", rows)
    recs, _ = load_prompts(path, tok, DataConfig(chat_template="never"))
    assert recs[0].prompt_text == "12+30=" and tok.decode(recs[0].prompt_ids) == "12+30="
    recs, _ = load_prompts(path, tok, DataConfig(system_prompt="Be brief."))
    assert recs[0].prompt_text == "<|system|>Be brief.\n<|user|>12+30=\n<|assistant|>"


def test_template_required_but_missing(tmp_path):
    from megatron_rl.demo import build_bpe_tokenizer

    t = build_bpe_tokenizer()
    t.chat_template = None
    path = write_jsonl(tmp_path / "s.jsonl", verl_rows(1))
    with pytest.raises(DataError, match="no chat template"):
        load_prompts(path, t, DataConfig(chat_template="always"))


def test_difficulty_filter(tmp_path, tok):
    rows = verl_rows(6)
    labels = ["solved", "hard", "suspected_wrong_label", "mixed", "unsolved", None]
    rates = [1.0, 0.125, 0.0, 0.5, 0.0, None]
    for row, label, rate in zip(rows, labels, rates):
        if label:
            row["extra_info"]["difficulty"] = {"label": label, "pass_rate": rate}
    path = write_jsonl(tmp_path / "ann.jsonl", rows)
    recs, stats = load_prompts(path, tok, DataConfig(keep_labels=["hard", "mixed", "solved"],
                                                     pass_rate_max=0.9))
    assert [r.extra["difficulty"]["label"] for r in recs] == ["hard", "mixed"]
    assert stats["filtered_label"] == 2 and stats["filtered_pass_rate"] == 1
    assert stats["filtered_unannotated"] == 1
    recs, _ = load_prompts(path, tok, DataConfig())  # no filter: everything, annotated or not
    assert len(recs) == 6


def test_config_errors_name_the_key():
    from megatron_rl.config.base import ConfigError

    with pytest.raises(ConfigError, match="keep_labels"):
        DataConfig(keep_labels=["easy"]).validate()
    with pytest.raises(ConfigError, match="on_bad_row"):
        DataConfig.from_dict({"on_bad_row": "ignore"}, prefix="data").validate()
