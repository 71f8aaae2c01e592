"""The GPU weight-sync paths through vLLM's own backends (prepared; skips without CUDA or vLLM).

- ``ipc`` (colocated): a vLLM server on the trainer's GPU receives CUDA IPC handles (NCCL refuses two
  processes on one GPU).
- ``nccl``: a vLLM server on a second GPU receives packed NCCL broadcasts.

Reference: transformers with the same new weights (greedy tokens equal, sampled-token log-probs to
2e-4 in fp32).
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

sys.path.insert(0, str(Path(__file__).parents[1] / "integration" / "rollout"))


def _server(tmp_path, transport: str, gpu: int):
    from megatron_rl.demo import TinySpec, write_tiny_model
    from megatron_rl.rollout.config import RolloutConfig
    from megatron_rl.rollout.launcher import EngineLauncher, node_specs
    from megatron_rl.sync import SyncConfig
    from megatron_rl.sync.base import server_args

    path = str(write_tiny_model(tmp_path / "tiny", TinySpec(seed=0)))
    cfg = RolloutConfig(engine="vllm_server", placement="external", server_urls=["http://x"], kv_cache_bytes=0,
                        gpu_memory_utilization=0.15, max_num_seqs=8, max_prompt_len=16, max_response_len=16,
                        timeout_s=120.0)
    args, env = server_args(SyncConfig(transport=transport))
    specs = node_specs(node="g", host="127.0.0.1", count=1, model=path, rollout=cfg, max_model_len=64,
                       extra_args=args, env={**env, "CUDA_VISIBLE_DEVICES": str(gpu)}, log_dir=str(tmp_path))
    return path, cfg, EngineLauncher(specs, start_timeout_s=600).start()


def _sync_and_check(tmp_path, transport: str, gpu: int) -> None:
    pytest.importorskip("vllm")
    from hf_ref import hf_greedy, hf_logprobs
    from transformers import AutoModelForCausalLM

    from megatron_rl.rollout import SamplingSpec
    from megatron_rl.rollout.fleet import EngineFleet
    from megatron_rl.rollout.server import VLLMServer
    from megatron_rl.sync import SyncConfig, build_weight_sync

    path, cfg, launcher = _server(tmp_path, transport, gpu)
    try:
        fleet = EngineFleet([VLLMServer(launcher.servers[0].spec.url(), cfg, name="g-0").connect()], cfg)
        hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).cuda().eval()
        g = torch.Generator(device="cuda").manual_seed(1)
        with torch.no_grad():
            for p in hf.parameters():
                p.add_(torch.randn(p.shape, generator=g, device="cuda") * 0.5 * p.std())
        meta = [(n, p.dtype, tuple(p.shape)) for n, p in hf.named_parameters()]
        sync = build_weight_sync(SyncConfig(transport=transport, bucket_bytes=1 << 20, timeout_s=120.0), fleet,
                                 metadata=meta)
        m = sync.sync(((n, p.detach()) for n, p in hf.named_parameters()), version=1)
        assert m.complete and m.engines == 1
        cpu = hf.cpu()
        prompts = [[1, 5, 9, 12, 7], [1, 20, 21, 22]]
        for prompt, (c,) in zip(prompts, fleet.generate(prompts, SamplingSpec(temperature=0.0, max_tokens=10))):
            assert c.token_ids == hf_greedy(cpu, prompt, 10) and c.weight_version == 1
        for prompt, group in zip(prompts, fleet.generate(prompts, SamplingSpec(n=2, max_tokens=8, seed=1))):
            for c in group:
                ref = hf_logprobs(cpu, prompt, c.token_ids)
                assert torch.allclose(torch.tensor(c.logprobs, dtype=torch.float64), ref, atol=2e-4)
        sync.close()
        fleet.close()
    finally:
        launcher.stop()


def test_ipc_colocated_sync_matches_transformers(tmp_path):
    _sync_and_check(tmp_path, "ipc", gpu=0)


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs a second GPU for the server")
def test_nccl_sync_matches_transformers(tmp_path):
    _sync_and_check(tmp_path, "nccl", gpu=1)
