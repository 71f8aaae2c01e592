"""`megatron-rl train` through its real entry point (world, CPU shim, tokenizer): an unusable data
file or a length too long for the model is one line naming file / key and numbers, exit 2,
before the policy or an engine is built. The model's weights file is garbage: reaching the policy
(or an engine) first would fail on it instead."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

import pytest
import yaml

pytestmark = pytest.mark.slow


def _train(tmp_path, cfg: dict) -> tuple[int, str]:
    p = tmp_path / "c.yaml"
    p.write_text(yaml.safe_dump(cfg))
    env = {**os.environ, "OMP_NUM_THREADS": "1", "WANDB_MODE": "disabled"}
    proc = subprocess.run([sys.executable, "-m", "megatron_rl.cli", "train", "--config", str(p),
                           "--run-dir", str(tmp_path / "run")], capture_output=True, text=True,
                          timeout=300, env=env)
    return proc.returncode, proc.stderr


def _config(model: str, data: str, max_response_len: int = 8) -> dict:
    return {"model": {"path": model}, "data": {"train_path": data},
            "rollout": {"max_prompt_len": 64, "rollout_batch_size": 2, "group_size": 2},
            "tracking": {"wandb_mode": "disabled"},
            "stages": [{"name": "s1", "max_response_len": 8, "max_steps": 1},
                       {"name": "s2", "max_response_len": max_response_len, "max_steps": 1}]}


@pytest.fixture
def model(tmp_path, tiny_llama):
    """The tiny model with its config and tokenizer intact and its weights unreadable."""
    m = tmp_path / "model"
    shutil.copytree(tiny_llama, m)
    (m / "model.safetensors").write_bytes(b"not a safetensors file")
    return str(m)


def _one_line(stderr: str) -> str:
    assert "Traceback" not in stderr, stderr[-3000:]
    lines = [line for line in stderr.splitlines() if line.startswith("megatron-rl: ")]
    assert len(lines) == 1, stderr[-3000:]
    return lines[0]


def test_bad_data_file_is_one_line_before_anything_is_built(tmp_path, model):
    data = tmp_path / "train.jsonl"
    good = {"prompt": "1+1?", "reward_model": {"ground_truth": "2"}}
    data.write_bytes((json.dumps(good) + "\n").encode() + b'{"prompt": "\xff\xfe"}\n')
    code, err = _train(tmp_path, _config(model, str(data)))
    assert code == 2, err[-3000:]
    line = _one_line(err)
    assert str(data) in line and "row 2" in line and "UTF-8" in line, line


def test_evaluation_too_long_for_the_model_names_key_and_numbers(tmp_path, model):
    """The same check covers every stage's length (tests/unit/trainer/test_lengths.py walks them
    in process); this one goes through the real entry point with the evaluation's."""
    data = tmp_path / "train.jsonl"
    data.write_text(json.dumps({"prompt": "1+1?", "reward_model": {"ground_truth": "2"}}) + "\n")
    cfg = _config(model, str(data))
    cfg["rollout"]["eval_max_tokens"] = 300
    code, err = _train(tmp_path, cfg)
    assert code == 2, err[-3000:]
    line = _one_line(err)
    for text in ("rollout.eval_max_tokens", "evaluation", "64", "300", "364", "256",
                 os.path.join(model, "config.json")):
        assert text in line, line


def test_reward_style_that_resolves_to_nothing_is_one_line_before_anything_is_built(tmp_path, model):
    """Scoring resolves each prompt's style; one that maps to no registered style failed the run at
    its first reward, after the policy and the engines were built."""
    data = tmp_path / "train.jsonl"
    rows = [{"prompt": "1+1?", "reward_model": {"ground_truth": "2", "style": "math"}},
            {"prompt": "2+2?", "data_source": "my_set", "reward_model": {"ground_truth": "4", "style": "rule"}}]
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    code, err = _train(tmp_path, _config(model, str(data)))
    assert code == 2, err[-3000:]
    line = _one_line(err)
    for text in (str(data), "row 2", "style='rule'", "data_source='my_set'", "reward.style_map",
                 "reward.default_style"):
        assert text in line, line
