"""Whole runs of the real trainer (on the key walk's fakes, ``fake_run.py``: a bigram policy and engine)
with the user's own task from files: a reward function (in the real hard-timeout pool) that raises,
hangs, returns NaN / a string / None or prints megabytes on some responses, and an environment class.

The run completes; each step counts its faulty responses as zeros (the reference: the function itself,
called here on every dumped response, says which responses hit which fault), and says why in the log.
"""

from __future__ import annotations

import json
import logging
import zlib
from pathlib import Path

import pandas as pd
import pytest

from megatron_rl.envs.registry import ENVIRONMENTS
from megatron_rl.rewards.base import REWARD_STYLES
from megatron_rl.trainer.schema import load_run_config
from test_every_key_acts import base_overrides, run_fake

FAULTY = """
import math, sys, time, zlib

def fault(response):
    return ["ok", "ok", "raise", "nan", "str", "none", "print"][zlib.crc32(response.encode()) % 7]

def score(response, ground_truth, extra_info):
    kind = fault(response)
    if zlib.crc32(response.encode()) % 29 == 0:
        time.sleep(3600)
    if kind == "raise":
        raise RuntimeError("verifier bug")
    if kind == "print":
        print("z" * (4 << 20))
    return {"nan": math.nan, "str": "high", "none": None}.get(kind, extra_info["index"] % 3 / 2)
"""

ENV = """
from megatron_rl.envs import Environment, StepResult, ToolOutput

class Count(Environment):
    def step(self, turn):
        if self.calls:
            return StepResult(done=True)
        return self.use_tool("count", lambda: ToolOutput(str(len(turn))))
"""


@pytest.fixture
def task(tmp_path):
    (tmp_path / "faulty.py").write_text(FAULTY)
    (tmp_path / "count_env.py").write_text(ENV)
    yield tmp_path
    REWARD_STYLES.unregister("walk")
    ENVIRONMENTS.unregister("walk")


def test_a_run_with_a_faulty_user_reward_and_a_user_environment_completes(task, caplog, capfd):
    over = base_overrides(task) + [
        "stages=[{name: s1, max_response_len: 40, max_steps: 2}]", f"trainer.run_dir={task / 'run'}",
        "data.style_key=data_source",  # every row's style: its source, "walk": the user function
        f"reward.functions={{walk: '{task / 'faulty.py'}:score'}}", "reward.user.timeout_s=2.0",
        f"envs.classes={{walk: '{task / 'count_env.py'}:Count'}}",  # and its environment
    ]
    cfg = load_run_config(None, over)
    with caplog.at_level(logging.WARNING, logger="megatron_rl"):
        out = run_fake(cfg, task, observed=True)
    assert out["code"] == 0, out["code"]
    root = Path(cfg.trainer.run_dir)
    rows = [json.loads(line) for line in (root / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in rows if "env/trajectories" in r]
    assert len(steps) == 2 and all(r["env/tool_calls"] > 0 for r in steps)

    faulty = {}
    exec(compile(FAULTY, "faulty", "exec"), faulty)
    dumps = pd.concat(pd.read_parquet(p) for p in sorted((root / "rollouts").glob("step_*.parquet")))
    answers = [list(m)[-1]["text"] for m in dumps["messages"]]
    kinds = ["hang" if zlib.crc32(a.encode()) % 29 == 0 else faulty["fault"](a) for a in answers]
    expect = {"ok": "correct|wrong", "print": "correct|wrong", "raise": "error", "nan": "error", "str": "error",
              "none": "error", "hang": "timeout"}
    for kind, outcome, reward in zip(kinds, dumps["outcome"], dumps["reward"]):
        assert outcome in expect[kind].split("|"), (kind, outcome)
        if outcome in ("error", "timeout"):
            assert reward == 0.0
    for step, r in zip(sorted(set(dumps["grpo_step"])), steps):
        ks = [k for k, s in zip(kinds, dumps["grpo_step"]) if s == step]
        assert r["reward/errors"] == sum(k in ("raise", "nan", "str", "none") for k in ks)
        assert r["reward/timeouts"] == sum(k == "hang" for k in ks)
    assert {"raise", "nan", "str", "none", "print"} <= set(kinds), set(kinds)  # every fault was hit
    warned = [r.getMessage() for r in caplog.records if r.getMessage().startswith("rewards: style walk:")]
    assert warned and all("counted zero" in w for w in warned)
    assert len(capfd.readouterr().out) < 1_000_000  # the printed megabytes stayed in the worker


def test_the_example_config_validates_and_finds_its_files_wherever_it_is(tmp_path):
    import shutil

    repo = Path(__file__).resolve().parents[3]
    copy = tmp_path / "elsewhere"
    shutil.copytree(repo / "examples" / "custom_task", copy)
    cfg = load_run_config(copy / "config.yaml")
    assert cfg.data.train_path == f"{copy}/data/train.jsonl" and Path(cfg.data.train_path).exists()
    assert cfg.reward.functions == {"closeness": f"{copy}/reward.py:closeness"}
    assert cfg.envs.classes == {"hint": f"{copy}/env.py:HintEnv"}
