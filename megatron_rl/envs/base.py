"""The environment interface: one episode per trajectory.

``reset(record)`` starts an episode and gives its first turn (the token ids the model sees first: the
record's templated prompt, or that prompt followed by more the environment adds). After every model
turn the rollout loop calls ``step(turn)`` with the turn's text; the result says what the model sees
next (a tool's observation, which the loop appends to the trajectory as the tokenizer's chat template
renders a tool message), whether the episode is done, and what the reward scores (the final answer,
by the data's reward style).

Tools are called through :meth:`Environment.use_tool`, which holds the episode's tool-call budget
(``envs.max_tool_calls``), cuts the output (``envs.max_observation_chars``) and turns a failing,
hanging or flooding tool into an error message to the model: a per-sample fault is counted, never a
dead rollout. The runner (:class:`~megatron_rl.envs.tools.ToolRunner`) enforces the time limit and
runs programs in the code sandbox.

This is the public interface of environments (the user's own, named in ``envs.classes``, subclass
it), versioned by :data:`API_VERSION`: what a subclass may rely on and override is ``__init__(cfg,
tools)``, ``reset(record)``, ``step(turn)``, ``use_tool``, ``self.cfg`` / ``self.tools`` /
``self.record`` / ``self.calls``, :class:`StepResult` and :class:`~megatron_rl.envs.tools.ToolOutput`.
A change to any of them that could break a subclass raises the version; a subclass may pin the one it
was written for (``api_version = 1``) and is refused at start-up by a trainer of another version.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Callable, ClassVar

from megatron_rl.envs.config import EnvConfig
from megatron_rl.envs.tools import ERROR, TIMEOUT, ToolOutput, ToolRunner

# StepResult.error when a call was refused: the trajectory's tool-call budget is spent.
BUDGET = "budget"
# The version of this interface (see the module doc). 1: reset(record) -> token ids, step(turn) ->
# StepResult(observation, done, answer, tool, error, cut), use_tool(tool, run).
API_VERSION = 1


@dataclass
class StepResult:
    """What an environment answers to one model turn."""

    # The tool's message to the model (appended before its next turn); None when the episode is done.
    observation: str | None = None
    # The episode is over: the turn just taken is the final answer.
    done: bool = False
    # What the reward scores when done (None: the model's last turn).
    answer: str | None = None
    # The tool called this step ("" when none was).
    tool: str = ""
    # How the call failed: "" (it did not), "error" (it crashed or refused the input), "timeout",
    # "budget" (not run: the trajectory's budget is spent).
    error: str = ""
    # The tool's output was longer than envs.max_observation_chars and was cut.
    cut: bool = False


class Environment(ABC):
    """One episode's state; a fresh instance per trajectory (``Environments.open``)."""

    name: ClassVar[str] = ""
    # Its tools run programs in the code sandbox: a run with prompts for it checks at start-up that
    # the sandbox can start here (bubblewrap, or reward.code.sandbox.require_isolation: false).
    needs_sandbox: ClassVar[bool] = False
    # The interface version the class was written for (API_VERSION); another one is refused.
    api_version: ClassVar[int] = API_VERSION

    def __init__(self, cfg: EnvConfig, tools: ToolRunner):
        self.cfg = cfg
        self.tools = tools
        self.record = None
        self.calls = 0  # tool calls made (run or refused) in this episode

    def reset(self, record) -> list[int]:
        """Start the episode of ``record`` (a :class:`~megatron_rl.data.PromptRecord`); returns the
        first turn's token ids: the record's prompt, possibly followed by more (which the trainer
        treats as an observation: never trained on)."""
        self.record = record
        return list(record.prompt_ids)

    @abstractmethod
    def step(self, turn: str) -> StepResult:
        """The environment's answer to the model's turn ``turn`` (its text)."""

    def use_tool(self, tool: str, run: Callable[[], ToolOutput]) -> StepResult:
        """Call ``run`` (a tool) within the budget; its output becomes the observation, cut to
        ``envs.max_observation_chars``; a failure is an error message, flagged for the metrics."""
        self.calls += 1
        if self.calls > self.cfg.max_tool_calls:
            return StepResult(observation=f"error: the tool-call budget ({self.cfg.max_tool_calls} calls) is "
                                          f"spent; give the final answer", tool=tool, error=BUDGET)
        try:
            out = run()
        except Exception as exc:  # noqa: BLE001 - a tool that raises is a counted error, not a dead rollout
            out = ToolOutput(f"error: {type(exc).__name__}: {exc}", error=ERROR)
        text, cut = cut_text(out.text, self.cfg.max_observation_chars)
        return StepResult(observation=text, tool=tool, error=out.error, cut=cut)


def cut_text(text: str, limit: int) -> tuple[str, bool]:
    """``text`` within ``limit`` characters (the cut said at its end), and whether it was cut."""
    if len(text) <= limit:
        return text, False
    note = f"...[{len(text) - limit} more characters cut]"
    keep = max(0, limit - len(note))
    return text[:keep] + note[: limit - keep], True


__all__ = ["API_VERSION", "BUDGET", "ERROR", "TIMEOUT", "Environment", "StepResult", "cut_text"]
