"""RewardManager with the real process pool: hard timeouts, crashed workers, mixed styles."""

from __future__ import annotations

import json
import os
import time

import pytest

from megatron_rl.rewards import RewardConfig, RewardItem, RewardManager, register_reward
from megatron_rl.rewards import base as reward_base
from megatron_rl.rewards.base import Outcome

# A power tower: math-verify's evaluation sits in one big-int power in C for minutes and SIGALRM
# cannot interrupt it (checked by hand: with its own timeout off it does not return in 15 s).
pytestmark = [pytest.mark.slow, pytest.mark.timeout(180)]

HANG = "\\boxed{9^{9^{9}}}"


@register_reward("test_crash", pooled=True)
def crash_style(item, cfg):
    """A verifier that dies hard (a segfault-like exit) on request."""
    if item.response == "die":
        os._exit(3)
    return Outcome(1.0, "correct", item.response)


@pytest.fixture(scope="module")
def mgr():
    cfg = RewardConfig(num_workers=2)
    cfg.math.timeout_s = 4.0
    cfg.math.verify_timeout_s = 60  # let the pathological case reach the hard timeout
    with RewardManager(cfg) as m:
        yield m
    reward_base.REWARD_STYLES.unregister("test_crash")


def test_pathological_expression_times_out_and_pool_keeps_serving(mgr):
    good = [RewardItem(f"\\boxed{{{i}+1}}", str(i + 1), "math") for i in range(6)]
    t0 = time.monotonic()
    scores, metrics, details = mgr.score([good[0], RewardItem(HANG, "3", "math"), *good[1:]],
                                         return_details=True)
    elapsed = time.monotonic() - t0
    assert scores == [1.0, 0.0, 1.0, 1.0, 1.0, 1.0, 1.0]
    assert details[1]["status"] == "timeout"
    assert metrics["reward/timeouts"] == 1.0 and metrics["reward/worker_restarts"] == 1.0
    # ended by the hard timeout (4 s), not by math-verify's own (60 s) or never: under the latter; the
    # rest of the time is the killed worker's replacement starting (a fresh interpreter and sympy),
    # which a loaded box stretches well past the 30 s this once allowed
    assert elapsed < 60.0, elapsed
    # the pool is whole again: a second batch is served by both workers without timeouts
    scores, metrics = mgr.score(good)
    assert scores == [1.0] * 6 and metrics["reward/timeouts"] == 0.0


def test_dead_worker_is_a_counted_error_and_replaced(mgr):
    items = [RewardItem("ok", None, "test_crash"), RewardItem("die", None, "test_crash"),
             RewardItem("ok", None, "test_crash")]
    scores, metrics, details = mgr.score(items, return_details=True)
    assert scores == [1.0, 0.0, 1.0]
    assert details[1]["status"] == "error" and "worker died" in details[1]["detail"]
    assert metrics["reward/errors"] == 1.0
    assert mgr.score(items[:1])[0] == [1.0]


def test_mixed_styles_keep_order_and_report_per_style(mgr):
    code_gt = json.dumps({"inputs": ["3\n"], "outputs": ["6\n"]})
    items = [
        RewardItem("\\boxed{12}", "12", "exact_boxed"),
        RewardItem("\\boxed{\\frac{1}{2}}", "0.5", "math"),
        RewardItem("```python\nprint(2 * int(input()))\n```", code_gt, "code"),
        RewardItem("no answer", "12", "exact_boxed"),
        RewardItem("\\boxed{13}", "12", "math"),
    ]
    scores, metrics, details = mgr.score(items, return_details=True)
    assert scores == [1.0, 1.0, 1.0, 0.0, 0.0]
    assert [d["style"] for d in details] == ["exact_boxed", "math", "code", "exact_boxed", "math"]
    assert details[4]["extracted"] == "13"
    assert metrics["reward/unparsable"] == 1.0
    assert metrics["reward/math/mean"] == 0.5 and metrics["reward/exact_boxed/mean"] == 0.5
    assert metrics["reward/mean"] == pytest.approx(3 / 5)


def test_style_resolution():
    cfg = RewardConfig(style_map={"rule": "math", "lc": "code"})
    m = RewardManager(cfg)
    assert m.resolve_style("exact_boxed") == "exact_boxed"
    assert m.resolve_style("rule", "openai/gsm8k") == "math"
    assert m.resolve_style("rule", "lc") == "code"  # the data source decides before the style map
    with pytest.raises(KeyError, match="registered"):
        m.resolve_style("nonsense", "nowhere")
    with pytest.raises(KeyError, match="registered"):
        RewardManager(RewardConfig(style_map={"rule": "no_such_style"}))
    m.close()
