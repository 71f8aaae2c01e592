"""The task's environment: one hint, then the final answer.

An environment subclasses ``megatron_rl.envs.Environment`` (the public interface, version
``megatron_rl.envs.API_VERSION``) and implements ``step(turn)``: the model's turn (its text) in, a
``StepResult`` out. A fresh instance serves each trajectory; ``self.record`` is the prompt's row
(``ground_truth``, ``extra``: its ``extra_info``). ``use_tool`` runs a tool within the episode's budget
(``envs.max_tool_calls``) and turns its output into what the model reads next.
"""

import re

from megatron_rl.envs import Environment, StepResult, ToolOutput

_NUMBER = re.compile(r"\d+")


class HintEnv(Environment):
    api_version = 1  # the interface this class was written for

    def step(self, turn):
        if self.calls:  # the hint was given: this turn is the final answer
            return StepResult(done=True)
        match = _NUMBER.search(turn)
        target = int(self.record.ground_truth)
        if match is None or int(match.group()) == target:
            return StepResult(done=True)
        hint = ">" if int(match.group()) < target else "<"  # the answer is more / less
        return self.use_tool("hint", lambda: ToolOutput(hint))
