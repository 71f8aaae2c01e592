"""What a SamplingSpec asks of vLLM: the server's generate request and the in-process engine's
SamplingParams carry the same settings (min_tokens included)."""

from __future__ import annotations

import pytest

from megatron_rl.rollout.base import SamplingSpec
from megatron_rl.rollout.server import generate_body


def test_min_tokens_reaches_the_server_request():
    spec = SamplingSpec(n=2, max_tokens=40, min_tokens=40, seed=3, stop_token_ids=(7,))
    params = generate_body([1, 2, 3], spec, request_id="r1")["sampling_params"]
    assert params["min_tokens"] == 40 and params["max_tokens"] == 40 and params["stop_token_ids"] == [7]
    assert "min_tokens" not in generate_body([1], SamplingSpec())["sampling_params"]  # vLLM's default


def test_min_tokens_reaches_the_in_process_engine():
    pytest.importorskip("vllm")
    from megatron_rl.rollout.vllm_engine import VLLMEngine

    _, params = VLLMEngine.requests([[1, 2], [3]], SamplingSpec(max_tokens=12, min_tokens=5, seed=9))
    assert [p.min_tokens for p in params] == [5, 5] and [p.seed for p in params] == [9, 10]
    _, (plain,) = VLLMEngine.requests([[1]], SamplingSpec())
    assert plain.min_tokens == 0
