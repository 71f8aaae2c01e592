"""Every data read that drops rows (train, SFT, held-out) counts the drops and says so: a warning
naming the file and the counts by reason, and an error naming the file when nothing is left."""

from __future__ import annotations

import json
import logging

import pytest
import yaml

from megatron_rl.data import DataConfig, DataError, load_prompts
from megatron_rl.trainer.schema import load_run_config

LIMIT = 16  # rollout.max_prompt_len; the char tokenizer: one token per character (+ BOS)


@pytest.fixture(scope="module")
def tok():
    from megatron_rl.demo import build_char_tokenizer

    return build_char_tokenizer()


def _write(path, prompts, bad=()):
    with path.open("w") as f:
        for i, p in enumerate(prompts):
            f.write(json.dumps({"prompt": p, "reward_model": {"ground_truth": str(i), "style": "math"},
                                "extra_info": {"solution": str(i)}}) + "\n")
        for line in bad:
            f.write(line + "\n")
    return str(path)


def _cfg(tmp_path, train, held_out, *over):
    p = tmp_path / "run.yaml"
    p.write_text(yaml.safe_dump({
        "model": {"tiny": {}}, "data": {"train_path": train, "chat_template": "never"},
        "rollout": {"max_prompt_len": LIMIT}, "eval": {"path": held_out, "size": 4},
        "stages": [{"name": "s1", "max_response_len": 8, "max_steps": 1}]}))
    return load_run_config(p, list(over))


def _drops(caplog, path):
    return [r.getMessage() for r in caplog.records
            if r.levelno == logging.WARNING and r.getMessage().startswith(f"{path}:")]


SHORT = ["1+1=", "2+2=", "3+3=", "4+4="]
LONG = ["9" * 40 + "+1=", "8" * 40 + "+1="]


def test_held_out_prompts_over_the_limit_are_counted_and_logged(tmp_path, tok, caplog):
    from megatron_rl.trainer.context import load_run_data

    train = _write(tmp_path / "train.jsonl", SHORT)
    held = _write(tmp_path / "held.jsonl", SHORT[:3] + LONG)
    caplog.set_level(logging.INFO, logger="megatron_rl")
    _, _, held_out = load_run_data(_cfg(tmp_path, train, held), tok)
    assert len(held_out) == 3
    said = _drops(caplog, held)
    assert any(f"2 of 5 rows dropped: 2 longer than the {LIMIT}-token prompt limit" in m for m in said), said
    assert any("eval.size=4, but 3 held-out prompts are usable" in m for m in said), said
    assert not _drops(caplog, train)  # nothing dropped there: nothing said


def test_train_and_sft_drops_are_logged_too(tmp_path, tok, caplog):
    from megatron_rl.trainer.context import load_run_data

    train = _write(tmp_path / "train.jsonl", SHORT + LONG[:1])
    sft = _write(tmp_path / "sft.jsonl", SHORT + LONG, bad=["{not json"])
    held = _write(tmp_path / "held.jsonl", SHORT)
    caplog.set_level(logging.WARNING, logger="megatron_rl")
    load_run_data(_cfg(tmp_path, train, held, f"sft.data_path={sft}", "sft.enabled=true", "sft.eval_size=1",
                       "data.on_bad_row=skip"), tok, 64)
    assert any("1 of 5 rows dropped: 1 longer than" in m for m in _drops(caplog, train))
    said = _drops(caplog, sft)
    assert any("3 of 7 rows dropped: 2 longer than" in m and "1 malformed and skipped" in m for m in said), said


def test_a_held_out_file_with_every_prompt_too_long_names_the_file(tmp_path, tok):
    from megatron_rl.trainer.context import load_run_data

    train = _write(tmp_path / "train.jsonl", SHORT)
    held = _write(tmp_path / "held.jsonl", LONG)
    with pytest.raises(DataError) as e:
        load_run_data(_cfg(tmp_path, train, held), tok)
    assert str(e.value).startswith(f"{held}: no usable prompt: 2 rows read, 2 longer than the {LIMIT}-token")


def test_difficulty_filter_drops_are_counted(tmp_path, tok, caplog):
    p = tmp_path / "d.jsonl"
    with p.open("w") as f:
        for i, label in enumerate(["hard", "solved", "hard"]):
            f.write(json.dumps({"prompt": f"{i}+{i}=", "reward_model": {"ground_truth": "0", "style": "math"},
                                "extra_info": {"difficulty": {"label": label, "pass_rate": 0.5}}}) + "\n")
    caplog.set_level(logging.WARNING, logger="megatron_rl")
    recs, stats = load_prompts(p, tok, DataConfig(keep_labels=["hard"], chat_template="never"))
    assert len(recs) == 2 and stats["dropped"] == 1 == stats["filtered_label"]
    said = _drops(caplog, p)
    assert any("1 of 3 rows dropped: 1 dropped by the difficulty filter" in m for m in said), said
