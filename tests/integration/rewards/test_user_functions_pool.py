"""User reward functions in the real hard-timeout pool, and the start-up check in its own process.

A function that raises, hangs, returns NaN / a string / None or prints megabytes: each response a
counted zero with its reason (or, for the printer, its score, with the output dropped), one log line
per style, the good functions' scores equal to the functions called here, nothing printed to this
process's stdout. A function that cannot be imported (a missing module, a hang or a crash at import, a
wrong signature, no such name or file): a RewardFunctionError naming the key, the file and the fault.
"""

from __future__ import annotations

import logging
import textwrap

import pytest

from megatron_rl.common.user_code import load_target
from megatron_rl.rewards import RewardConfig, RewardFunctionError, RewardItem, RewardManager
from megatron_rl.rewards.base import REWARD_STYLES
from megatron_rl.rewards.user import _CHECKED, check_functions

pytestmark = pytest.mark.slow

FUNCTIONS = """
import math, os, sys, time

def good(response, ground_truth, extra_info):
    return {"score": 1.0 / (1 + abs(len(response) - int(ground_truth))) * extra_info["w"],
            "correct": len(response) == int(ground_truth)}

def raises(response, ground_truth, extra_info):
    raise ZeroDivisionError("the verifier's own bug")

def hangs(response, ground_truth, extra_info):
    time.sleep(3600)

def nan(response, ground_truth, extra_info):
    return math.nan

def string(response, ground_truth, extra_info):
    return "0.7"

def none(response, ground_truth, extra_info):
    return None

def prints(response, ground_truth, extra_info):
    print("p" * (8 << 20))  # + a newline
    sys.stderr.write("e" * (2 << 20))
    os.write(1, b"f" * (1 << 20))
    return 0.5

def dies(response, ground_truth, extra_info):
    os._exit(3)
"""


@pytest.fixture
def fns(tmp_path):
    (tmp_path / "faults.py").write_text(FUNCTIONS)
    yield {f"uf_{n}": f"{tmp_path / 'faults.py'}:{n}"
           for n in ("good", "raises", "hangs", "nan", "string", "none", "prints", "dies")}
    for style in [s for s in REWARD_STYLES if s.startswith("uf_")]:
        REWARD_STYLES.unregister(style)


def test_every_fault_is_a_counted_zero_and_good_scores_match_the_function(fns, capfd, caplog):
    cfg = RewardConfig(functions=fns, num_workers=2)
    cfg.user.timeout_s = 4.0
    items = [RewardItem("abc", "3", s, {"extra_info": {"w": 0.5}}) for s in fns]
    items.append(RewardItem("abcde", "3", "uf_good", {"extra_info": {"w": 1.0}}))
    check_functions(cfg)  # all importable and callable: the faults are at call time
    capfd.readouterr()
    with caplog.at_level(logging.WARNING), RewardManager(cfg) as mgr:
        scores, metrics, details = mgr.score(items, return_details=True)
        again, _ = mgr.score(items[:1])  # the pool (its dead and killed workers replaced) goes on
    out, err = capfd.readouterr()
    good = load_target(fns["uf_good"])
    by_style = dict(zip(fns, zip(scores, details)))
    assert scores[0] == again[0] == good("abc", "3", {"w": 0.5})["score"] == 0.5
    assert scores[-1] == good("abcde", "3", {"w": 1.0})["score"] == pytest.approx(1 / 3)
    assert details[0]["status"] == "correct" and details[-1]["status"] == "wrong"
    expect = {"uf_raises": ("error", "raised ZeroDivisionError: the verifier's own bug"),
              "uf_hangs": ("timeout", "hard timeout"),
              "uf_nan": ("error", "returned nan, not a finite number"),
              "uf_string": ("error", "returned str '0.7', not a number"),
              "uf_none": ("error", "returned None"),
              "uf_dies": ("error", "worker died (exit 3)")}
    for style, (status, why) in expect.items():
        score, d = by_style[style]
        assert (score, d["status"]) == (0.0, status) and why in d["detail"], (style, d)
    score, d = by_style["uf_prints"]
    assert (score, d["status"]) == (0.5, "wrong") and "printed 10485761 characters, kept 2000" in d["detail"]
    assert len(out) + len(err) < 100_000, "a user function's output reached the trainer's console"
    assert metrics["reward/errors"] == 5 and metrics["reward/timeouts"] == 1
    warned = [r.getMessage() for r in caplog.records if "rewards: style" in r.getMessage()]
    assert sorted(w.split()[2] for w in warned) == sorted(s + ":" for s in expect)  # one line per style


IMPORT_FAULTS = {
    "missing": ("import no_such_verifier_module\ndef fn(r, g, e):\n    return 1.0\n",
                "No module named 'no_such_verifier_module'"),
    "signature": ("def fn(response):\n    return 1.0\n", "cannot be called as fn(response, ground_truth, extra_info)"),
    "hang": ("import time\ntime.sleep(3600)\ndef fn(r, g, e):\n    return 1.0\n", "did not finish within 3 s"),
    "crash": ("import os\nos._exit(7)\n", "the check's process failed"),
    "noname": ("def other(r, g, e):\n    return 1.0\n", "has no 'fn'"),
    "flood": ("print('x' * (8 << 20))\ndef fn(r, g, e):\n    return 1.0\n", None),
}


@pytest.mark.parametrize("case", sorted(IMPORT_FAULTS))
def test_start_up_check_names_key_file_and_fault(case, tmp_path, capfd):
    source, why = IMPORT_FAULTS[case]
    path = tmp_path / f"{case}.py"
    path.write_text(textwrap.dedent(source))
    cfg = RewardConfig(functions={"mine": f"{path}:fn"}, worker_start_timeout_s=3.0)
    if why is None:
        check_functions(cfg)  # printing at import is no fault, and prints nothing here
        out, _ = capfd.readouterr()
        assert len(out) < 100_000
        return
    with pytest.raises(RewardFunctionError) as exc:
        check_functions(cfg)
    msg = str(exc.value)
    assert msg.startswith(f"reward.functions.mine: {path}:fn: ") and why in msg and "\n" not in msg, msg
    assert ("mine", f"{path}:fn", False) not in _CHECKED


def test_missing_file_and_in_process_check(tmp_path):
    cfg = RewardConfig(functions={"a": f"{tmp_path / 'nope.py'}:fn"})
    with pytest.raises(RewardFunctionError, match=r"reward.functions.a: .*nope.py:fn: .*no such file"):
        check_functions(cfg)
    (tmp_path / "sig.py").write_text("def fn(a, b, c, d):\n    return 1.0\n")
    cfg = RewardConfig(functions={"b": f"{tmp_path / 'sig.py'}:fn"})
    cfg.user.in_process = ["b"]
    with pytest.raises(RewardFunctionError, match=r"reward.functions.b: .*sig.py:fn: it cannot be called"):
        check_functions(cfg)
