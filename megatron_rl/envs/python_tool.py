"""``python_tool``: the model runs Python programs in the code sandbox and reads their output.

A model turn calls the tool with a tool call ``<tool_call>{"name": "python", "arguments": {"code":
"..."}}</tool_call>`` (the Hermes / Qwen format; the name may also be ``python_tool`` or
``code_interpreter``) or, without one, a fenced code block (```` ```python ````, the last one after a
closing ``</think>``): the program runs in the sandbox of ``rewards/sandbox.py`` (bubblewrap: no
network, no host files; ``reward.code.sandbox``'s CPU, memory, process, file-size, disk and output
limits), for at most ``envs.tool_timeout_s``; its stdout (and on failure its stderr), cut to
``envs.max_observation_chars``, is the observation. A turn without code is the final answer, scored
by the data's reward style. A malformed call (not JSON of that form, another tool's name, no closing
tag) is an error message to the model, counted as a failed call.
"""

from __future__ import annotations

import json
import re

from megatron_rl.envs.base import Environment, StepResult
from megatron_rl.envs.registry import register_env
from megatron_rl.envs.tools import ERROR, ToolOutput
from megatron_rl.rewards.code import extract_code

TOOL_CALL = re.compile(r"<tool_call>(.*?)</tool_call>", re.S)
NAMES = ("python", "python_tool", "code_interpreter")


def tool_call_code(turn: str) -> tuple[str | None, str]:
    """The program a turn asks to run (None: none), or ('' , why) for a malformed tool call."""
    calls = TOOL_CALL.findall(turn)
    if not calls and "<tool_call>" in turn:
        return "", "the tool call is not closed by </tool_call>"
    if calls:
        try:
            call = json.loads(calls[-1])
            args = call.get("arguments", {})
            args = json.loads(args) if isinstance(args, str) else args
            code = args.get("code") if call.get("name") in NAMES else None
        except (ValueError, AttributeError, TypeError):
            return "", "the tool call is not JSON of the form {\"name\": \"python\", \"arguments\": {\"code\": ...}}"
        if not isinstance(code, str):
            return "", f"unknown tool {call.get('name')!r} or no code (tools: {list(NAMES)})"
        return code, ""
    return extract_code(turn), ""


@register_env("python_tool")
class PythonTool(Environment):
    needs_sandbox = True

    def step(self, turn: str) -> StepResult:
        code, problem = tool_call_code(turn)
        if code is None:
            return StepResult(done=True)
        if problem:
            return self.use_tool("python", lambda: ToolOutput(f"error: {problem}", ERROR))
        return self.use_tool("python", lambda: self.tools.run_python(code))
