"""Reward items, outcomes and the style registry.

A reward style is a function ``fn(item, cfg) -> Outcome`` registered under a name. ``pooled=True``
styles run in the verifier process pool under a hard per-item timeout (math-verify needs SIGALRM,
code runs subprocesses); the others run in the caller's process and must cost microseconds.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable

from megatron_rl.common.registry import Registry

# Outcome statuses. "correct"/"wrong" are verdicts; the rest are counted zeros.
CORRECT, WRONG, UNPARSABLE, ERROR, TIMEOUT = "correct", "wrong", "unparsable", "error", "timeout"
STATUSES = (CORRECT, WRONG, UNPARSABLE, ERROR, TIMEOUT)


@dataclass
class RewardItem:
    """One response to score. ``extra`` may carry ``question`` (the prompt text, for the judge)."""

    response: str
    ground_truth: Any
    style: str
    extra: dict = field(default_factory=dict)


@dataclass
class Outcome:
    """The verdict on one response: a score in [0, 1], a status, and what was extracted (for logs)."""

    score: float
    status: str
    extracted: str | None = None
    detail: str = ""

    def as_dict(self) -> dict:
        return {"score": self.score, "status": self.status, "extracted": self.extracted,
                "detail": self.detail}


@dataclass(frozen=True)
class RewardStyle:
    name: str
    fn: Callable[[RewardItem, Any], Outcome]
    # Runs in the verifier process pool under a hard per-item timeout.
    pooled: bool
    # Name of the RewardConfig section whose ``timeout_s`` bounds one pooled item ("math", "code").
    timeout_section: str
    # Scored by the judge endpoint (``reward.judge``), as concurrent requests for the whole batch.
    judged: bool = False
    # Runs the response's program in the code sandbox (``reward.code.sandbox``): a run whose prompts
    # use it checks at start-up that the sandbox starts here.
    sandboxed: bool = False
    # Further arguments the function is called with after (item, cfg): a user function's target
    # (rewards/user.py), so one module-level function serves every user style.
    bound: tuple = ()


REWARD_STYLES: Registry[RewardStyle] = Registry(
    "reward style", hint="a new style is registered with @register_reward")


def register_reward(name: str, *, pooled: bool = False, timeout_section: str = "math",
                    judged: bool = False, sandboxed: bool = False):
    """Decorator: register ``fn(item, cfg: RewardConfig) -> Outcome`` as reward style ``name``.

    Pooled functions must be importable module-level functions (the pool workers import the
    defining module by name). A duplicate name is refused.
    """

    def deco(fn):
        REWARD_STYLES.add(name, RewardStyle(name, fn, pooled, timeout_section, judged, sandboxed))
        return fn

    return deco


def get_style(name: str) -> RewardStyle:
    return REWARD_STYLES[name]


def registered_styles() -> list[str]:
    return sorted(REWARD_STYLES)
