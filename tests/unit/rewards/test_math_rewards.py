"""Math reward verdicts, including known traps (verdicts documented in rewards/math.py)."""

from __future__ import annotations

import pytest

from megatron_rl.rewards import RewardConfig, RewardItem
from megatron_rl.rewards.extract import extract_answer, last_boxed, last_number
from megatron_rl.rewards.math import exact_boxed, math_reward

CFG = RewardConfig()


def verdict(gt: str, response: str) -> tuple[float, str]:
    out = math_reward(RewardItem(response, gt, "math"), CFG)
    return out.score, out.status


@pytest.mark.parametrize("text, want", [
    ("so \\boxed{42}.", "42"),
    ("\\boxed{1} then \\boxed{\\frac{1}{2}}", "\\frac{1}{2}"),
    ("\\boxed{\\{1, 2\\}}", "\\{1, 2\\}"),
    ("\\fbox{7} and nothing else", "7"),
    ("a \\boxed 5 b", "5"),
    ("truncated \\boxed{12", None),
    ("no box", None),
])
def test_last_boxed(text, want):
    assert last_boxed(text) == want


def test_extract_fallbacks():
    assert extract_answer("The answer is 17.") == "17"
    assert extract_answer("we get 3 then 1,234 apples") is None
    assert extract_answer("we get 3 then 1,234 apples", fallback_last_number=True) == "1234"
    assert last_number("x = -0.5") == "-0.5"


# (ground truth, response, expected score): the seed's traps and their neighbours
TRAPS = [
    # 4.5 tickets: the label is wrong (2 yuan each, 9 yuan buys 4); we score against the label and
    # leave the wrong label to data cleaning.
    ("4.5", "Each ticket costs 2, so \\boxed{4}", 0.0),
    ("4.5", "\\boxed{4.5}", 1.0),
    ("4.5", "\\boxed{4.5 \\text{ tickets}}", 1.0),
    # 96 vs 96%: the same number with a percent sign is right; another number is not.
    ("96", "盈利 \\boxed{96\\%}", 1.0),
    ("96", "\\boxed{96 percent}", 1.0),
    ("96", "\\boxed{96}", 1.0),
    ("96", "\\boxed{0.96}", 0.0),
    ("0.96", "\\boxed{96\\%}", 1.0),
    ("96", "\\boxed{97\\%}", 0.0),
    # pi vs 3.14: pi (or a longer rounding of it) for a label that rounds pi at >= 2 decimals.
    ("3.14", "\\boxed{\\pi}", 1.0),
    ("3.14", "\\boxed{3.1415926}", 1.0),
    ("3.14", "\\boxed{圆周率}", 1.0),
    ("\\pi", "\\boxed{3.14159}", 1.0),
    ("6.28", "\\boxed{2\\pi}", 1.0),
    ("3.15", "\\boxed{\\pi}", 0.0),
    ("3.14", "\\boxed{3.1}", 0.0),
    ("3.1416", "\\boxed{3.14}", 0.0),
    ("0.5", "\\boxed{\\frac{\\pi}{6}}", 0.0),   # one decimal is too coarse to call it pi/6
    ("0.5", "\\boxed{0.54}", 0.0),              # no general "close enough"
    # 3 real roots vs 7 roots: a superset is not the answer.
    ("1, 2, 3", "\\boxed{1, 2, 3, i, -i, 2i, -2i}", 0.0),
    ("1, 2, 3", "\\boxed{3, 1, 2}", 1.0),
    # plain numbers (the fast path): thousands separators, trailing zeros, lists are not numbers
    ("1234", "\\boxed{1,234}", 1.0),
    ("4.50", "\\boxed{4.5}", 1.0),
    ("12", "\\boxed{13}", 0.0),
    ("1,2", "\\boxed{12}", 0.0),
    # ordinary equivalences
    ("\\frac{1}{2}", "\\boxed{0.5}", 1.0),
    ("x=2", "\\boxed{2}", 1.0),
    ("10", "\\boxed{10\\text{ cm}}", 1.0),
]


@pytest.mark.parametrize("gt, response, want", TRAPS)
def test_trap_verdicts(gt, response, want):
    score, _ = verdict(gt, response)
    assert score == want


def test_pi_and_percent_rules_can_be_switched_off():
    cfg = RewardConfig()
    cfg.math.pi_tolerance = False
    out = math_reward(RewardItem("\\boxed{\\pi}", "3.14", "math"), cfg)
    assert out.score == 0.0 and out.status == "wrong"


def test_unparsable_is_counted_as_such():
    assert verdict("5", "I do not know") == (0.0, "unparsable")
    assert verdict("5", "\\boxed{}") == (0.0, "unparsable")


@pytest.mark.parametrize("gt, response, want", [
    ("940", "Q:585+355=\nA:\\boxed{940}", (1.0, "correct")),
    ("940", "\\boxed{ 9 4 0 }", (1.0, "correct")),
    ("940", "\\boxed{941}", (0.0, "wrong")),
    ("940", "\\boxed{940.0}", (0.0, "wrong")),  # a string match, deliberately strict
    ("940", "940", (0.0, "unparsable")),
])
def test_exact_boxed(gt, response, want):
    out = exact_boxed(RewardItem(response, gt, "exact_boxed"))
    assert (out.score, out.status) == want


def test_plain_number_fast_path_agrees_with_math_verify():
    """The fast path must give math-verify's own verdict on plain numbers."""
    import random

    from math_verify import parse, verify

    rng = random.Random(0)
    pairs = [("7", "7"), ("7", "8"), ("-3", "-3"), ("0.5", ".5"), ("1.000", "1"), ("2.5", "2.50"),
             ("0.1234567", "0.1234568"), ("10", "10.0"), ("1,000", "1000")]
    for _ in range(20):
        a = rng.choice([str(rng.randrange(-999, 999)), f"{rng.uniform(-50, 50):.{rng.randrange(1, 4)}f}"])
        b = rng.choice([a, str(rng.randrange(-999, 999)), a + "0" if "." in a else a + ".0"])
        pairs.append((a, b))
    for gt, pred in pairs:
        want = verify(parse(f"${gt}$"), parse(f"${pred}$"))
        assert verdict(gt, f"\\boxed{{{pred}}}")[0] == float(want), (gt, pred)


def test_soft_timeout_is_reported_as_timeout():
    cfg = RewardConfig()
    cfg.math.verify_timeout_s = 1  # math-verify's SIGALRM (we are in the main thread here)
    out = math_reward(RewardItem("\\boxed{9^{9^{9}}}", "3", "math"), cfg)
    assert (out.score, out.status) == (0.0, "timeout")


def test_answers_inside_the_reasoning_do_not_count():
    thought = "<think>maybe \\boxed{7}?</think>"
    assert exact_boxed(RewardItem(thought + " so \\boxed{8}", "8", "exact_boxed")).score == 1.0
    assert exact_boxed(RewardItem(thought + " no final box", "7", "exact_boxed")).status == "unparsable"
    assert verdict("7", thought + " The answer is 8.") == (0.0, "wrong")
    assert verdict("7", "no think tags \\boxed{7}") == (1.0, "correct")


def test_several_acceptable_answers():
    assert verdict('["\\\\frac{1}{2}", "0.5"]', "\\boxed{1/2}")[0] == 1.0  # Skywork-OR1's JSON list
    assert verdict(["34", "thirty-four"], "\\boxed{34}")[0] == 1.0
    assert verdict('["34"]', "\\boxed{35}") == (0.0, "wrong")
    assert verdict("[1, 2]", "\\boxed{[1, 2]}")[0] == 1.0  # an interval stays one answer
    assert verdict("[1, 2]", "\\boxed{1}")[0] == 0.0
