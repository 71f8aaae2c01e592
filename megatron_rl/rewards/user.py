"""Reward functions from the user's own code (``reward.functions``), as reward styles of the registry.

A user function is ``fn(response: str, ground_truth, extra_info: dict) -> float | dict``: the response
(a multi-turn trajectory's final answer), the row's ``reward_model.ground_truth`` and its
``extra_info`` (a copy), returning the score, or ``{"score": float, "correct": bool, "extracted": str}``
(only ``score`` required; ``correct`` defaults to ``score >= 1``). Each becomes a style registered
with :func:`score_user` and its target bound (``RewardStyle.bound``): pooled (a spawned worker of the
hard-timeout pool, ``reward.user.timeout_s``), or in the trainer's process for the styles listed in
``reward.user.in_process``.

A function that raises, returns something else than a finite number (NaN, a string, None), or runs
past its timeout scores a counted zero (``reward/errors``, ``reward/timeouts``) with the reason in the
outcome's detail, logged by the manager; what it prints is kept up to ``reward.user.max_output_chars``
and the rest dropped. :func:`check_functions` (start-up) imports each function in a spawned process
under ``reward.worker_start_timeout_s`` and checks it is callable as ``fn(response, ground_truth,
extra_info)``: a failure is one line naming the key, the file and what is wrong.
"""

from __future__ import annotations

import copy
import inspect
import io
import math
import numbers
import os

from megatron_rl.common.errors import InputError
from megatron_rl.common.user_code import UserCodeError, absolute, describe, load_target
from megatron_rl.rewards.base import CORRECT, ERROR, REWARD_STYLES, WRONG, Outcome, RewardItem, RewardStyle
from megatron_rl.rewards.config import RewardConfig

# target -> the loaded function, or why it could not be loaded (in this process)
_LOADED: dict[str, object] = {}
# (style, target, in process) that passed the start-up check in this process (checked once per run)
_CHECKED: set[tuple[str, str, bool]] = set()


class RewardFunctionError(InputError, ValueError):
    """A user reward function cannot be used: not importable, not callable, a wrong signature."""


class _BadValue(Exception):
    pass


def register_functions(cfg: RewardConfig) -> None:
    """Register ``cfg.functions`` as reward styles (importing none of them here, except those
    declared in-process, at their first call). A name taken by another style is a config error."""
    from megatron_rl.config.base import ConfigError

    for style, target in cfg.functions.items():
        entry = RewardStyle(style, score_user, pooled=style not in cfg.user.in_process, timeout_section="user",
                            bound=(absolute(target),))
        try:
            REWARD_STYLES.add(style, entry)
        except ValueError as exc:
            raise ConfigError(f"reward.functions.{style}", f"{exc}; give the function another style name") from None


def pooled_targets(cfg: RewardConfig) -> tuple[str, ...]:
    """The targets the pool's workers load before they report ready."""
    return tuple(sorted(absolute(t) for s, t in cfg.functions.items() if s not in cfg.user.in_process))


# -- in the process that calls the functions ---------------------------------------------------------
class _Capped(io.TextIOBase):
    """A text sink that keeps the first ``limit`` characters and counts the rest."""

    def __init__(self, limit: int):
        self.limit, self.kept, self.total = limit, [], 0

    def write(self, s: str) -> int:
        room = self.limit - min(self.total, self.limit)
        if room > 0:
            self.kept.append(s[:room])
        self.total += len(s)
        return len(s)

    def text(self) -> str:
        return "".join(self.kept)


def _silence_fd1() -> None:
    """Point this process's fd 1 at /dev/null: what C code or ``os.write(1, ...)`` prints from a user
    function never reaches the trainer's console (pool workers inherit it)."""
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, 1)
    os.close(devnull)


def load_function(target: str):
    """The function ``target`` names, checked; UserCodeError saying what is wrong."""
    fn = load_target(target)
    problem = signature_problem(fn)
    if problem:
        raise UserCodeError(problem)
    return fn


def load_targets(targets: tuple[str, ...]) -> None:
    """Pool-worker set-up: load every target once (a failure is kept and reported per call; the
    worker still starts)."""
    _silence_fd1()
    for target in targets:
        _cached(target, limit=0)


def _cached(target: str, limit: int):
    if target not in _LOADED:
        sink = _Capped(limit)
        import contextlib

        with contextlib.redirect_stdout(sink), contextlib.redirect_stderr(sink):
            try:
                _LOADED[target] = load_function(target)
            except UserCodeError as exc:
                _LOADED[target] = f"{describe(target)}: {exc}"
    return _LOADED[target]


def signature_problem(fn) -> str:
    """Why ``fn`` cannot be called as ``fn(response, ground_truth, extra_info)`` ("" if it can)."""
    if inspect.isclass(fn):
        return f"{fn.__name__} is a class, not a function"
    if not callable(fn):
        return f"it is a {type(fn).__name__}, not a function"
    if inspect.iscoroutinefunction(fn) or inspect.iscoroutinefunction(getattr(fn, "__call__", None)):
        return "it is async; a reward function is a plain function"
    try:
        sig = inspect.signature(fn)
    except (TypeError, ValueError):
        return ""  # a builtin without a signature: the call will tell
    try:
        sig.bind("response", "ground truth", {})
    except TypeError as exc:
        return f"it cannot be called as fn(response, ground_truth, extra_info): {exc}"
    return ""


def check_target(target: str) -> str:
    """The start-up check of one target, in a throwaway process: "" or what is wrong."""
    _silence_fd1()
    fn = _cached(target, limit=0)
    return fn if isinstance(fn, str) else ""


def as_outcome(value) -> Outcome:
    """A user function's return value as an outcome; _BadValue saying what is wrong with it."""
    correct, extracted = None, None
    score = value
    if isinstance(value, dict):
        if "score" not in value:
            raise _BadValue(f"returned a dict without 'score' (keys {sorted(map(str, value))[:8]})")
        score, correct, extracted = value["score"], value.get("correct"), value.get("extracted")
    if isinstance(score, bool):
        score = float(score)
    if score is None:
        raise _BadValue("returned None, not a number (return a float or {'score': float, ...})")
    if not isinstance(score, numbers.Real):
        raise _BadValue(f"returned {type(score).__name__} {str(score)[:80]!r}, not a number "
                        f"(return a float or {{'score': float, ...}})")
    score = float(score)
    if not math.isfinite(score):
        raise _BadValue(f"returned {score}, not a finite number")
    ok = bool(correct) if correct is not None else score >= 1.0
    return Outcome(score, CORRECT if ok else WRONG, None if extracted is None else str(extracted)[:200])


def score_user(item: RewardItem, cfg: RewardConfig, target: str) -> Outcome:
    """The reward style of a user function: call it on ``item`` and check what it returned."""
    fn = _cached(target, cfg.user.max_output_chars)
    if isinstance(fn, str):
        return Outcome(0.0, ERROR, detail=fn)
    extra_info = copy.deepcopy(item.extra.get("extra_info") or {})
    sink = _Capped(cfg.user.max_output_chars)
    import contextlib

    try:
        with contextlib.redirect_stdout(sink), contextlib.redirect_stderr(sink):
            value = fn(item.response, item.ground_truth, extra_info)
        out = as_outcome(value)
    except _BadValue as exc:
        out = Outcome(0.0, ERROR, detail=f"{describe(target)}: {exc}")
    except (Exception, SystemExit) as exc:  # noqa: BLE001 - the function's failure is a counted zero
        out = Outcome(0.0, ERROR, detail=f"{describe(target)}: raised {type(exc).__name__}: {exc}"[:500])
    if sink.total > sink.limit:
        out.detail = (out.detail + f" (printed {sink.total} characters, kept {sink.limit})").strip()
    return out


# -- start-up ------------------------------------------------------------------------------------------
def check_functions(cfg: RewardConfig) -> None:
    """Every ``reward.functions`` target importable and callable as ``fn(response, ground_truth,
    extra_info)``: the pooled ones checked in a spawned process (an import that hangs, crashes or
    prints megabytes never touches the trainer), the in-process ones here. RewardFunctionError: one
    line naming the key, the file and what is wrong."""
    from megatron_rl.rewards.pool import HardTimeoutPool

    todo = {(s, absolute(t), s in cfg.user.in_process) for s, t in cfg.functions.items()} - _CHECKED
    if not todo:
        return
    problems: dict[str, str] = {}
    for style in cfg.user.in_process:
        try:
            load_function(absolute(cfg.functions[style]))
        except UserCodeError as exc:
            problems[style] = f"{describe(cfg.functions[style])}: {exc}"
    pooled = [(s, absolute(t)) for s, t in cfg.functions.items() if s not in cfg.user.in_process]
    if pooled:
        limit = cfg.worker_start_timeout_s
        with HardTimeoutPool(1, start_timeout_s=limit) as pool:
            results = pool.run([(check_target, (t,), limit) for _, t in pooled])
        for (style, target), res in zip(pooled, results):
            if res.status == "timeout":
                problems[style] = (f"{describe(target)}: importing and checking it did not finish within {limit:g} s "
                                   f"(reward.worker_start_timeout_s)")
            elif res.status != "ok":
                problems[style] = f"{describe(target)}: the check's process failed: {res.error}"
            elif res.value:
                problems[style] = res.value
    _CHECKED.update(k for k in todo if k[0] not in problems)
    if problems:
        style = sorted(problems)[0]
        more = f" (and {len(problems) - 1} more)" if len(problems) > 1 else ""
        raise RewardFunctionError(f"reward.functions.{style}: {problems[style]}{more}")
