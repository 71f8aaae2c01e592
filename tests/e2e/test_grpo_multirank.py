"""The disaggregated product path on CPU: `torchrun --nproc-per-node 2` trains at TP=2 while the vLLM
engine runs in its own process and receives weights over a gloo group (bucketed, checksummed).

Reference: the same miniature run in one process at TP=1 with the in-process engine. The SFT cold start
involves no sampling, so its loss trajectory and the weights it ends with must agree (float tolerance:
TP=2 sums partial products in another order); the GRPO steps that follow start from those weights.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parents[2]
MINI = [
    "synthetic.min_digits=1", "synthetic.max_digits=1", "synthetic.train_size=60", "synthetic.eval_size=5",
    "model.tiny.hidden_size=64", "model.tiny.num_heads=2", "model.tiny.num_kv_heads=2",
    "model.tiny.intermediate_size=128", "model.tiny.num_layers=2",
    "sft.max_steps=30", "sft.eval_every=30", "sft.eval_size=8", "sft.stop_accuracy=1.0", "sft.batch_size=32",
    "sft.lr=0.003", "sft.slow_down_at=1.0",
    "rollout.rollout_batch_size=8", "rollout.group_size=4", "rollout.kv_cache_bytes=16777216",
    "stages=[{name: s1, max_response_len: 12, max_steps: 2}]", "eval.every=0", "tracking.wandb_mode=disabled",
]


def _run(cmd: list[str], run_dir: Path, *extra: str) -> None:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "VLLM_ENABLE_V1_MULTIPROCESSING": "0"}
    proc = subprocess.run([*cmd, "train", "--config", str(REPO / "configs/demo_cpu.yaml"), "--run-dir",
                           str(run_dir), *MINI, *extra], env=env, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-6000:]


def _sft_nll(run_dir: Path) -> list[float]:
    rows = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines() if x]
    return [r["sft/nll"] for r in rows if r["stage"] == "sft"]


@pytest.mark.slow
def test_tp2_trainer_with_remote_engine_over_gloo_matches_single_rank(tmp_path):
    ref, tp2 = tmp_path / "tp1", tmp_path / "tp2"
    _run([sys.executable, "-m", "megatron_rl.cli"], ref)
    # Same base model and data for both runs (the tiny model is written with the run's seed anyway).
    tp2.mkdir()
    for d in ("base_model", "data"):
        shutil.copytree(ref / d, tp2 / d)
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                "-m", "megatron_rl.cli"]
    _run(torchrun, tp2, "policy.parallel.tensor_parallel=2", "rollout.engine=vllm_remote",
         "sync.transport=gloo", "sync.bucket_bytes=65536")

    a, b = _sft_nll(ref), _sft_nll(tp2)
    assert len(a) == len(b) == 30
    assert torch.allclose(torch.tensor(a), torch.tensor(b), rtol=1e-4, atol=1e-5), (a, b)

    from safetensors.torch import load_file

    wa = load_file(str(ref / "s1" / "final" / "hf" / "model.safetensors"))
    wb = load_file(str(tp2 / "s1" / "final" / "hf" / "model.safetensors"))
    assert wa.keys() == wb.keys()
    worst = max((wa[k] - wb[k]).abs().max().item() for k in wa)
    assert worst < 1e-3, worst
    rs = json.loads((tp2 / "run_state.json").read_text())
    assert rs["finished_stages"] == ["s1"]
