"""Colocated sync on one GPU: a vLLM engine in its own process on the trainer's GPU receives the
weights as CUDA IPC handles (NCCL refuses two processes on one GPU). Skips without CUDA.

Reference: transformers on the GPU with the same new weights (greedy tokens equal, sampled-token
log-probs to 2e-4 in fp32).
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

sys.path.insert(0, str(Path(__file__).parents[1] / "integration" / "sync"))


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    pytest.importorskip("vllm")
    from transformers import AutoModelForCausalLM

    from megatron_rl.demo import TinySpec, write_tiny_model
    from megatron_rl.rollout.config import RolloutConfig
    from megatron_rl.rollout.remote import RemoteEngine

    path = write_tiny_model(tmp_path_factory.mktemp("tiny"), TinySpec(seed=0))
    cfg = RolloutConfig(kv_cache_bytes=64 * 1024 * 1024, gpu_memory_utilization=0.1,
                        max_num_seqs=8, max_prompt_len=16, max_response_len=16, timeout_s=120.0)
    engine = RemoteEngine(str(path), cfg, name="colocated0")
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).cuda().eval()
    yield engine, hf
    engine.close()


def _check(engine, hf, version):
    from hf_ref import hf_greedy, hf_logprobs

    from megatron_rl.rollout.base import SamplingSpec

    prompts = [[1, 5, 9, 12, 7], [1, 20, 21, 22]]
    cpu_hf = hf.to("cpu")
    try:
        for prompt, (c,) in zip(prompts, engine.generate(prompts, SamplingSpec(temperature=0.0, max_tokens=10))):
            assert c.token_ids == hf_greedy(cpu_hf, prompt, 10) and c.weight_version == version
        sampled = engine.generate(prompts, SamplingSpec(n=2, temperature=1.0, max_tokens=8, seed=1))
        for prompt, group in zip(prompts, sampled):
            for c in group:
                ref = hf_logprobs(cpu_hf, prompt, c.token_ids)
                assert torch.allclose(torch.tensor(c.logprobs, dtype=torch.float64), ref, atol=2e-4)
    finally:
        hf.to("cuda")


def _retrain(hf, seed):
    g = torch.Generator(device="cuda").manual_seed(seed)
    with torch.no_grad():
        for p in hf.parameters():
            p.add_(torch.randn(p.shape, generator=g, device="cuda") * 0.5 * p.std())


def test_cuda_ipc_sync_matches_transformers(setup):
    from megatron_rl.sync import SyncConfig, build_weight_sync

    engine, hf = setup
    cfg = SyncConfig(transport="cuda_ipc", bucket_bytes=64 * 1024, timeout_s=60.0)
    with build_weight_sync(cfg, [engine]) as sync:
        _retrain(hf, 1)
        metrics = sync.sync(((n, p.detach()) for n, p in hf.named_parameters()), version=1)
        assert metrics.tensors == sum(1 for _ in hf.parameters()) and metrics.buckets > 3
        _check(engine, hf, 1)


def test_sleep_then_sync_wakes_the_engine(setup):
    """Needs vLLM's sleep mode enabled in the engine (enable_sleep_mode=True on GPUs)."""
    from megatron_rl.sync import SyncConfig, build_weight_sync

    engine, hf = setup
    with build_weight_sync(SyncConfig(transport="cuda_ipc", bucket_bytes=1 << 20), [engine]) as sync:
        sync.sleep_engines()
        _retrain(hf, 2)
        sync.sync(((n, p.detach()) for n, p in hf.named_parameters()), version=2)
        _check(engine, hf, 2)
