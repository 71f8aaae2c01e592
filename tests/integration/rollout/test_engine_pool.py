"""Two vLLM engines in their own processes behind EnginePool sample exactly what one in-process
engine samples for the same weights and seeds (per-prompt seeds follow the global prompt index)."""

from __future__ import annotations

import pytest

pytest.importorskip("vllm")


def test_pool_of_two_remote_engines_equals_one_engine(tiny_llama):
    from megatron_rl.rollout import EnginePool, RolloutConfig, SamplingSpec, make_engine, make_engines

    local_cfg = RolloutConfig(max_prompt_len=16, max_response_len=10, kv_cache_bytes=16 << 20)
    remote_cfg = RolloutConfig.from_dict({**local_cfg.to_dict(), "engine": "vllm_remote", "num_engines": 2})
    remote_cfg.validate()
    one = make_engine(tiny_llama, local_cfg, seed=0)
    tok = one.tokenizer
    prompts = [tok.apply_chat_template([{"role": "user", "content": f"{a}+{a * 7 % 90}="}],
                                       add_generation_prompt=True, tokenize=True)["input_ids"] for a in range(10, 17)]
    spec = SamplingSpec(n=3, temperature=1.0, max_tokens=10, seed=123)
    want = one.generate(prompts, spec)
    one.close()
    pool = EnginePool(make_engines(tiny_llama, remote_cfg, seed=0))
    try:
        got = pool.generate(prompts, spec)
    finally:
        pool.close()
    assert [[c.token_ids for c in g] for g in got] == [[c.token_ids for c in g] for g in want]
    # and prompts are not sampled with the same draws: some prompts' groups differ
    assert len({tuple(tuple(c.token_ids) for c in g) for g in want}) > 1


def test_shares_cover_in_order():
    from megatron_rl.rollout.pool import shares

    for n in range(0, 12):
        for k in range(1, 5):
            s = shares(n, k)
            assert len(s) == k and s[0][0] == 0 and s[-1][1] == n
            assert all(a[1] == b[0] for a, b in zip(s, s[1:]))
            assert max(hi - lo for lo, hi in s) - min(hi - lo for lo, hi in s) <= 1
