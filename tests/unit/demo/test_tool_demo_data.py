"""The tool demo's data: multiplication rows that name the calculator, and their SFT demonstrations
laid out as the rollout lays out a trajectory (the chat template's whole conversation, token for
token; the tool's message untrained)."""

from __future__ import annotations

import json

from megatron_rl.data import load_prompts
from megatron_rl.demo.config import SyntheticConfig
from megatron_rl.demo.inputs import write_synthetic
from megatron_rl.demo.tiny import build_char_tokenizer
from megatron_rl.models.batch import LOSS_MASK
from megatron_rl.trainer.phases import sft_batch


def test_tool_demo_rows_and_sft_demonstrations_are_the_conversation_with_the_tool_untrained(tmp_path):
    tok = build_char_tokenizer()
    write_synthetic(tmp_path, SyntheticConfig(enabled=True, task="multiplication", env="calculator",
                                              train_size=20, eval_size=5, min_digits=3, max_digits=3), seed=3)
    rows = [json.loads(line) for line in (tmp_path / "train.jsonl").read_text().splitlines()]
    assert {r["data_source"] for r in rows} == {"synthetic/multiplication"}
    assert {r["extra_info"]["env"] for r in rows} == {"calculator"}
    records, _ = load_prompts(tmp_path / "train.jsonl", tok)
    assert {r.env for r in records} == {"calculator"}
    batch = sft_batch(records, tok)
    for r, seq, plen, mask in zip(records, batch.sequences, batch.prompt_lens, batch.token_fields[LOSS_MASK]):
        a, b = map(int, r.prompt_text.split("Q:")[-1].split("=")[0].split("*"))
        assert r.ground_truth == str(a * b) and 100 <= a <= 999 and 100 <= b <= 999
        conversation = [{"role": "user", "content": f"{a}*{b}="}, *r.extra["solution"]]
        assert seq == list(tok.apply_chat_template(conversation, tokenize=True)["input_ids"])
        text = tok.decode(seq[plen:])
        assert text == f"<<{a}*{b}>></s>={a * b}\nA:\\boxed{{{a * b}}}</s>"
        untrained = tok.decode([t for t, m in zip(seq[plen:], mask.tolist()) if not m])
        assert untrained == f"={a * b}\nA:"
    # without the environment: the same problems, single-turn, the product boxed directly
    write_synthetic(tmp_path / "plain", SyntheticConfig(enabled=True, task="multiplication", train_size=20,
                                                        eval_size=5, min_digits=3, max_digits=3), seed=3)
    plain, _ = load_prompts(tmp_path / "plain" / "train.jsonl", tok)
    assert [r.prompt_ids for r in plain] == [r.prompt_ids for r in records] and {r.env for r in plain} == {""}
    assert LOSS_MASK not in sft_batch(plain, tok).token_fields
    assert all(r.extra["solution"] == f"\\boxed{{{r.ground_truth}}}" for r in plain)
