"""Transformers references for the sync tests: greedy continuation and teacher-forced log-probs."""

from __future__ import annotations

import torch


def hf_greedy(hf, prompt: list[int], n: int) -> list[int]:
    """Greedy tokens after ``prompt`` (stops after EOS), by repeated full forward passes."""
    ids = list(prompt)
    with torch.no_grad():
        for _ in range(n):
            ids.append(int(hf(torch.tensor([ids])).logits[0, -1].argmax()))
            if ids[-1] == hf.config.eos_token_id:
                break
    return ids[len(prompt):]


def hf_logprobs(hf, prompt: list[int], response: list[int], min_tokens: int = 0) -> torch.Tensor:
    """float64 log-probs of ``response`` tokens given ``prompt`` (temperature 1). ``min_tokens``:
    the sampling's (vLLM's min_tokens), under which end-of-sequence could not be sampled for the
    first ``min_tokens`` tokens: the engine's processed log-probs are over the other tokens there."""
    with torch.no_grad():
        logits = hf(torch.tensor([prompt + response])).logits[0].double()
    logits = logits[len(prompt) - 1:-1]
    logits[:min_tokens, hf.config.eos_token_id] = float("-inf")
    logp = torch.log_softmax(logits, dim=-1)
    return logp.gather(1, torch.tensor(response)[:, None])[:, 0]
