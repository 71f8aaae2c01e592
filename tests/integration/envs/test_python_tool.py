"""``python_tool`` through the whole multi-turn loop, with programs in the real code sandbox
(bubblewrap) run by the tool process pool: a program that hangs, one that crashes, one that floods
stdout and ones that try to leave the sandbox are each contained within their limits, counted, and
answered with an error message; the episode goes on to the model's final answer.

The model is scripted (one turn per request, in order) on the byte-level tiny tokenizer, so its turns
hold real Python; the tool's limits: envs.tool_timeout_s, envs.max_observation_chars, the sandbox's.
"""

from __future__ import annotations

import json
import os
import time

import pytest

from megatron_rl.data.dataset import PromptRecord
from megatron_rl.demo.tiny import build_bpe_tokenizer
from megatron_rl.envs import EnvConfig, Environments
from megatron_rl.rewards.config import SandboxConfig
from megatron_rl.rollout import Completion, RolloutEngine, SamplingSpec
from megatron_rl.rollout.multi_turn import generate
from tests.integration.rewards.conftest import bwrap_sandbox  # noqa: F401  (the fixture)

pytestmark = pytest.mark.slow


def _code(src: str) -> str:
    return f"Let me run it.\n```python\n{src}\n```"


def _script(marker: str) -> list[str]:
    return [
        _code("while True:\n    pass"),                                         # hangs
        _code("import sys\nprint('partial')\nraise RuntimeError('boom')"),       # crashes
        _code("print('x' * 10**7)"),                                            # floods stdout
        _code("import socket\n"                                                  # tries to get out
              "try:\n    socket.create_connection(('1.1.1.1', 53), timeout=1)\n    print('net: reached')\n"
              "except OSError as e:\n    print('net:', type(e).__name__)\n"
              f"try:\n    open({marker!r}, 'w').write('escaped')\n    print('file: written')\n"
              "except OSError as e:\n    print('file:', type(e).__name__)\nraise SystemExit(3)"),
        _code("print(open('/etc/hostname').read())"),
        '<tool_call>{"name": "python", "arguments": {"code": "print(6 * 7)"}}</tool_call>',
        "The answer is \\boxed{42}.",
    ]


class Scripted(RolloutEngine):
    """The k-th request of a prompt is answered with the script's k-th turn (+ EOS)."""

    def __init__(self, tok, script):
        self.tok, self.script, self.k = tok, script, 0

    def generate(self, prompt_ids, spec):
        out = []
        for i, _ in enumerate(prompt_ids):
            ids = self.tok(self.script[self.k], add_special_tokens=False)["input_ids"] + [self.tok.eos_token_id]
            self.k += 1
            ids = ids[: spec.prompt_max_tokens(i)]
            out.append([Completion(token_ids=ids, logprobs=[-0.5] * len(ids), finish_reason="stop",
                                   text=self.tok.decode(ids, skip_special_tokens=True), truncated=False)])
        return out

    def reset_prefix_cache(self):
        pass


def test_python_tool_contains_hanging_crashing_flooding_and_escaping_programs(bwrap_sandbox, tmp_path):  # noqa: F811
    tok = build_bpe_tokenizer()
    marker = str(tmp_path / "escaped.txt")
    prompt = tok.apply_chat_template([{"role": "user", "content": "What is 6*7? Use Python."}],
                                     add_generation_prompt=True, tokenize=True)["input_ids"]
    record = PromptRecord(prompt_ids=list(prompt), prompt_text="6*7", ground_truth="42", style="exact_boxed",
                          data_source="t", uid="p", row=1, env="python_tool")
    cfg = EnvConfig(tool_timeout_s=1.5, max_observation_chars=300, max_tool_calls=6, num_workers=2)
    envs = Environments(cfg, tok, max_turns=8, sandbox=SandboxConfig(memory_mb=256, file_size_mb=4), wait_s=60)
    try:
        t0 = time.monotonic()
        ((c,),) = generate(Scripted(tok, _script(marker)), envs, [record],
                           SamplingSpec(n=1, temperature=1.0, max_tokens=4000, seed=1))
        took = time.monotonic() - t0
    finally:
        envs.close()
    ep = c.extra["episode"]
    obs = [m["text"] for m in ep["messages"] if m["role"] == "tool"]
    assert ep["ended"] == "done" and ep["answer"] == "The answer is \\boxed{42}." and ep["turns"] == 7
    assert ep["tool_calls"] == 6 and ep["tool_timeouts"] == 1 and ep["observations_cut"] == 1
    # the hang, the crash, the flood (killed at the sandbox's file-size limit), the escape, the host file
    assert ep["tool_errors"] == 5, obs
    assert "did not finish within 1.5 s" in obs[0]
    assert obs[1].startswith("partial\n") and "RuntimeError: boom" in obs[1] and "exit status 1" in obs[1]
    assert len(obs[2]) == 300 and obs[2].startswith("xxxx") and "characters cut" in obs[2]
    assert obs[3].startswith("net: ") and "file: " in obs[3] and "exit status 3" in obs[3], obs[3]
    assert "reached" not in obs[3] and "written" not in obs[3] and not os.path.exists(marker)
    assert "No such file" in obs[4]
    assert obs[5] == "42\n"
    assert took < 30, took
    # the observations reached the trajectory as the chat template's tool messages, never trained on
    for m in ep["messages"]:
        if m["role"] == "tool":
            span = slice(m["start"], m["start"] + m["tokens"])
            assert c.token_ids[span] == envs.renderer.observation_ids(m["text"]) and set(c.loss_mask[span]) == {0}
    json.dumps(ep)  # the episode record is plain data (the dumps and the checkpoint keep it)
