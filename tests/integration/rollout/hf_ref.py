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


def hf_logprobs(hf, prompt: list[int], response: list[int]) -> torch.Tensor:
    """float64 log-probs of ``response`` tokens given ``prompt`` (temperature 1)."""
    with torch.no_grad():
        logits = hf(torch.tensor([prompt + response])).logits[0].double()
    logp = torch.log_softmax(logits[len(prompt) - 1:-1], dim=-1)
    return logp.gather(1, torch.tensor(response)[:, None])[:, 0]
