"""Shared by the multi-turn tests on real engines (in-process vLLM, the streaming engine, the fleet):
a test environment that makes a random tiny model take several turns, its prompts, and the checks
against transformers over the whole interleaved sequence."""

from __future__ import annotations

import torch

from megatron_rl.data.dataset import PromptRecord
from megatron_rl.envs import Environment, StepResult, ToolOutput, register_env

ENV = "test_echo"


@register_env(ENV)
class Echo(Environment):
    """Two tool calls (the tool answers the turn's length, twice over), then the answer: a random
    model's turns become a trajectory of three turns and two observations."""

    def step(self, turn: str) -> StepResult:
        if self.calls >= 2:
            return StepResult(done=True)
        return self.use_tool("echo", lambda: ToolOutput(str(len(turn)) * 2))


def records(tok, n: int, offset: int = 0) -> list[PromptRecord]:
    out = []
    for i in range(offset, offset + n):
        q = f"{17 * i + 3}*{29 * i + 1}="
        ids = tok.apply_chat_template([{"role": "user", "content": q}], add_generation_prompt=True, tokenize=True)
        ids = list(ids["input_ids"] if hasattr(ids, "keys") else ids)
        out.append(PromptRecord(prompt_ids=ids, prompt_text=q, ground_truth="0", style="exact_boxed",
                                data_source="t", uid=f"mt{i}", row=i + 1, env=ENV))
    return out


def stop_ids(tok) -> tuple[int, ...]:
    """Tokens that end a model turn besides EOS (a random model rarely samples EOS): the digits."""
    return tuple(tok.convert_tokens_to_ids(list("0123456789")))


def teacher_forced(hf, prompt: list[int], response: list[int], temperature: float = 1.0) -> torch.Tensor:
    with torch.no_grad():
        logits = hf(torch.tensor([list(prompt) + list(response)])).logits[0].double() / temperature
    lp = torch.log_softmax(logits, -1)[len(prompt) - 1: len(prompt) + len(response) - 1]
    return lp.gather(1, torch.tensor(response)[:, None])[:, 0]


def check_trajectory(c, prompt: list[int], renderer, hf=None, temperature: float = 1.0, atol: float = 2e-4,
                     sent: set | None = None) -> None:
    """A trajectory's layout: each observation is the renderer's tokens for its text (mask 0,
    log-prob 0); each model turn's request was exactly the prompt + the trajectory before it (in
    ``sent``); with ``hf``, every model token's log-prob equals a float64 teacher-forced pass over
    the whole interleaved sequence."""
    ep = c.extra["episode"]
    assert len(c.loss_mask) == len(c.token_ids) == len(c.logprobs)
    for m in ep["messages"]:
        span = slice(m["start"], m["start"] + m["tokens"])
        if m["role"] == "tool":
            assert c.token_ids[span] == renderer.observation_ids(m["text"])
            assert set(c.loss_mask[span]) == {0} and set(c.logprobs[span]) == {0.0}
        else:
            assert set(c.loss_mask[span]) == {1}
            if sent is not None:
                assert tuple(prompt + c.token_ids[:m["start"]]) in sent
    if hf is not None:
        ref = teacher_forced(hf, prompt, c.token_ids, temperature)
        mine = torch.tensor(c.loss_mask, dtype=torch.bool)
        got = torch.tensor(c.logprobs, dtype=torch.float64)
        assert torch.allclose(got[mine], ref[mine], atol=atol), (got[mine] - ref[mine]).abs().max()
