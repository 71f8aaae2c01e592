"""User reward functions (``reward.functions``): the target's form, the signature check, what a return
value means, and in-process scoring (``reward.user.in_process``), against the functions called
directly. The pooled path and the start-up check's process: tests/integration/rewards/test_user_functions_pool.py."""

from __future__ import annotations

import math
import os
import textwrap

import pytest

from megatron_rl.common.user_code import UserCodeError, load_target, parse_target
from megatron_rl.config.base import ConfigError
from megatron_rl.rewards import RewardConfig, RewardItem, RewardManager
from megatron_rl.rewards.base import REWARD_STYLES
from megatron_rl.rewards.user import _BadValue, as_outcome, signature_problem
from megatron_rl.trainer.schema import load_run_config


@pytest.fixture
def user_file(tmp_path):
    path = tmp_path / "my_reward.py"
    path.write_text(textwrap.dedent("""
        import os
        PID = []
        def partial(response, ground_truth, extra_info):
            PID.append(os.getpid())
            return len(response) / (len(response) + int(ground_truth)) * extra_info.get("w", 1.0)
        def verdict(response, ground_truth, extra_info):
            return {"score": 0.5, "correct": response == ground_truth, "extracted": response[:4]}
        def mutates(response, ground_truth, extra_info):
            extra_info["w"] = 99.0
            return 0.0
        def raises(response, ground_truth, extra_info):
            raise KeyError("no such field")
        def two_args(response, ground_truth):
            return 1.0
        async def coroutine(response, ground_truth, extra_info):
            return 1.0
        NOT_CALLABLE = 3
    """))
    yield path
    for style in [s for s in REWARD_STYLES if s.startswith("u_")]:
        REWARD_STYLES.unregister(style)


def test_target_forms_are_checked_without_importing():
    assert parse_target("pkg.mod:fn") == ("pkg.mod", "fn")
    assert parse_target("a/b-c/file.py:Cls.method") == ("a/b-c/file.py", "Cls.method")
    for bad in ("pkg.mod", ":fn", "pkg.mod:", "pkg mod:fn", "my-file.txt:fn", "pkg.mod:1fn"):
        with pytest.raises(UserCodeError):
            parse_target(bad)


def test_config_refuses_a_malformed_target_and_an_unknown_in_process_style():
    with pytest.raises(ConfigError, match=r"reward.functions.mine.*not of the form"):
        load_run_config(None, ["model.path=m", "reward.functions={mine: my_reward}"])
    with pytest.raises(ConfigError, match=r"reward.user.in_process.*'other' is not a style"):
        load_run_config(None, ["model.path=m", "reward.functions={mine: 'my_reward.py:fn'}",
                               "reward.user.in_process=[other]"])


def test_signature_problems_name_what_is_wrong(user_file):
    def fn(name):
        return load_target(f"{user_file}:{name}")

    assert signature_problem(fn("partial")) == ""
    assert "cannot be called as fn(response, ground_truth, extra_info)" in signature_problem(fn("two_args"))
    assert "async" in signature_problem(fn("coroutine"))
    assert "not a function" in signature_problem(fn("NOT_CALLABLE"))
    assert "is a class" in signature_problem(RewardConfig)
    with pytest.raises(UserCodeError, match="has no 'nope'"):
        fn("nope")
    with pytest.raises(UserCodeError, match="no such file"):
        load_target(f"{user_file.parent / 'missing.py'}:fn")


@pytest.mark.parametrize("value,score,status", [
    (0.25, 0.25, "wrong"), (1, 1.0, "correct"), (True, 1.0, "correct"), (-2.5, -2.5, "wrong"),
    ({"score": 0.5, "correct": True}, 0.5, "correct"), ({"score": 1.0, "correct": False}, 1.0, "wrong"),
])
def test_return_values_as_outcomes(value, score, status):
    out = as_outcome(value)
    assert (out.score, out.status) == (score, status)


@pytest.mark.parametrize("value,why", [
    (math.nan, "returned nan"), (math.inf, "returned inf"), ("1.0", "returned str '1.0'"),
    (None, "returned None"), ({"value": 1}, "without 'score'"), ({"score": "x"}, "returned str"),
])
def test_bad_return_values_say_why(value, why):
    with pytest.raises(_BadValue, match=why):
        as_outcome(value)


def test_in_process_functions_score_here_as_called_directly(user_file):
    """``reward.user.in_process``: the scores are the function's own (called here on the same
    inputs), computed in this process; a raise is a counted zero naming the file."""
    fns = {f"u_{n}": f"{user_file}:{n}" for n in ("partial", "verdict", "mutates", "raises")}
    cfg = RewardConfig(functions=fns)
    cfg.user.in_process = list(fns)
    items = [RewardItem("abcd", "4", s, {"extra_info": {"w": 0.5}}) for s in fns]
    with RewardManager(cfg) as mgr:
        scores, metrics, details = mgr.score(items, return_details=True)
        assert mgr._pool is None  # nothing left this process
    module = load_target(f"{user_file}:partial").__globals__
    assert module["PID"] == [os.getpid()]
    assert scores[0] == pytest.approx(module["partial"]("abcd", "4", {"w": 0.5})) == pytest.approx(0.25)
    assert (scores[1], details[1]["status"], details[1]["extracted"]) == (0.5, "wrong", "abcd")
    assert items[2].extra["extra_info"] == {"w": 0.5}  # the function got a copy
    assert details[3]["status"] == "error" and "raised KeyError" in details[3]["detail"]
    assert str(user_file) in details[3]["detail"]
    assert metrics["reward/errors"] == 1 and metrics["reward/u_partial/mean"] == pytest.approx(0.25)


def test_a_style_name_taken_by_a_built_in_is_refused(user_file):
    with pytest.raises(ConfigError, match="reward.functions.math.*already registered"):
        RewardManager(RewardConfig(functions={"math": f"{user_file}:partial"}))


def test_the_trainer_gives_functions_the_rows_extra_info():
    from megatron_rl.data.dataset import PromptRecord
    from megatron_rl.trainer.phases import reward_item

    record = PromptRecord([1], "2+2=", "4", "u_style", "src", extra={"scale": 7, "env": "hint"}, row=3)
    item = reward_item(record, "4")
    assert (item.response, item.ground_truth, item.style) == ("4", "4", "u_style")
    assert item.extra["extra_info"] == {"scale": 7, "env": "hint"}
