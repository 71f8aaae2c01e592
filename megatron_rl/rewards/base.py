"""Reward items, outcomes and the style registry.

A reward style is a function ``fn(item, cfg) -> Outcome`` registered under a name. ``pooled=True``
styles run in the verifier process pool under a hard per-item timeout (math-verify needs SIGALRM,
code runs subprocesses); the others run in the caller's process and must cost microseconds.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable

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
    pooled: bool
    # Name of the RewardConfig section whose ``timeout_s`` bounds one pooled item ("math", "code").
    timeout_section: str


_REGISTRY: dict[str, RewardStyle] = {}


def register_reward(name: str, *, pooled: bool = False, timeout_section: str = "math"):
    """Decorator: register ``fn(item, cfg: RewardConfig) -> Outcome`` as reward style ``name``.

    Pooled functions must be importable module-level functions (the pool workers import the
    defining module by name). A duplicate name is refused.
    """

    def deco(fn):
        if name in _REGISTRY and _REGISTRY[name].fn is not fn:
            raise ValueError(f"reward style {name!r} is already registered ({_REGISTRY[name].fn})")
        _REGISTRY[name] = RewardStyle(name, fn, pooled, timeout_section)
        return fn

    return deco


def get_style(name: str) -> RewardStyle:
    try:
        return _REGISTRY[name]
    except KeyError:
        raise KeyError(f"unknown reward style {name!r}; registered: {sorted(_REGISTRY)}") from None


def registered_styles() -> list[str]:
    return sorted(_REGISTRY)
