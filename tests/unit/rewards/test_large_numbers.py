"""Large written numbers are judged by their value (rewards/numbers.py), not "unparsable" or "timeout".

References: Python's own exact arithmetic (``fractions.Fraction`` on ints, with the 4,300-digit
conversion limit lifted inside the test) for numbers of thousands of digits, math-verify itself for
small numbers (the rules must agree with it where it is reliable), and the real reward pool, whose
hard timeout is the time bound a verdict must come within.
"""

from __future__ import annotations

import random
import sys
from fractions import Fraction

import pytest
from hypothesis import example, given, settings, strategies as st

from megatron_rl.rewards import RewardConfig, RewardItem
from megatron_rl.rewards.base import CORRECT, WRONG
from megatron_rl.rewards.manager import RewardManager
from megatron_rl.rewards.math import _check_one, math_reward
from megatron_rl.rewards.numbers import LARGE_DIGITS, numbers_equal, parse_number

CFG = RewardConfig()


@pytest.fixture
def long_ints():
    """Python's exact ints for the reference values (the limit only guards str <-> int)."""
    old = sys.get_int_max_str_digits()
    sys.set_int_max_str_digits(0)
    yield
    sys.set_int_max_str_digits(old)


def _round6(x: Fraction) -> int:
    return round(x * 10**6)  # Fraction.__round__ rounds half to even


def _same(a: Fraction, b: Fraction, decimal: bool) -> bool:
    """The reference rule: exact, or at 6 decimals when a side is written with a decimal point."""
    return _round6(a) == _round6(b) if decimal else a == b


def _written(rng: random.Random, n_digits: int) -> tuple[str, Fraction, bool]:
    """A random written number of about ``n_digits`` digits in one of the forms, with its value."""
    digits = str(rng.randint(1, 9)) + "".join(rng.choice("0123456789") for _ in range(n_digits - 1))
    sign = rng.choice(["", "-"])
    form = rng.choice(["int", "decimal", "sci", "frac", "frac_decimal", "power"])
    if form == "int":
        return sign + digits, Fraction(int(sign + digits)), False
    if form == "decimal":
        k = rng.randint(1, n_digits - 1)
        return f"{sign}{digits[:-k]}.{digits[-k:]}", Fraction(int(sign + digits), 10**k), True
    if form == "sci":
        e = rng.randint(-2 * n_digits, 2 * n_digits)
        value = Fraction(int(sign + digits)) / 10**(len(digits) - 1) * Fraction(10)**e
        return f"{sign}{digits[0]}.{digits[1:]}\\times 10^{{{e}}}", value, True
    if form == "power":
        e = rng.randint(LARGE_DIGITS + 1, 3 * n_digits)
        return f"{sign}10^{{{e}}}", Fraction(int(sign + "1")) * 10**e, False
    cut = rng.randint(1, n_digits - 1)
    num, den = digits[:cut], digits[cut:].lstrip("0") or "7"
    if form == "frac":  # the sign in front, or on the denominator
        if rng.random() < 0.5:
            return f"\\frac{{{num}}}{{{sign}{den}}}", Fraction(int(num), int(sign + den)), False
        return f"{sign}\\frac{{{num}}}{{{den}}}", Fraction(int(sign + num), int(den)), False
    return f"\\frac{{{sign}{num}.5}}{{{den}}}", Fraction(int(sign + num + "5"), 10 * int(den)), True


@pytest.mark.parametrize("seed", range(6))
def test_large_numbers_compare_as_python_arithmetic_says(seed, long_ints):
    rng = random.Random(seed)
    for _ in range(25):
        a_text, a, a_dec = _written(rng, rng.randint(LARGE_DIGITS + 1, 3000))
        # the other side: the same value written another way, a neighbour, or another number
        choice = rng.random()
        if choice < 0.3:
            b_text, b, b_dec = f"\\frac{{{a.numerator}}}{{{a.denominator}}}", a, False
        elif choice < 0.6:
            b = a + Fraction(rng.choice([1, -1]), rng.choice([1, 10**7, 10**5]))
            b_text, b_dec = f"\\frac{{{b.numerator}}}{{{b.denominator}}}", False
        else:
            b_text, b, b_dec = _written(rng, rng.randint(LARGE_DIGITS + 1, 3000))
        want = _same(a, b, a_dec or b_dec)
        got = numbers_equal(parse_number(a_text), parse_number(b_text))
        assert got is want, (a_text[:80], b_text[:80], want)


BIG = "1" + "0" * (LARGE_DIGITS + 20)  # a large integer part


@pytest.mark.parametrize("a_text, b_text", [
    # ties at the 6th decimal round to the even neighbour
    (f"{BIG}.0000005", BIG), (f"{BIG}.0000015", f"{BIG}.000002"), (f"{BIG}.0000025", f"{BIG}.000002"),
    (f"-{BIG}.0000035", f"-{BIG}.000004"), (f"{BIG}.00000050001", f"{BIG}.000001"),
    # signs on either part of a fraction
    (f"\\frac{{{BIG}}}{{-3}}", f"-\\frac{{{BIG}}}{{3}}"), (f"\\frac{{-{BIG}}}{{-3}}", f"\\frac{{{BIG}}}{{3}}"),
    (f"-\\frac{{-{BIG}}}{{3}}", f"{BIG}/3"), (f"{BIG}/-3", f"{BIG}/3"),
])
def test_ties_and_signs_as_python_arithmetic_says(a_text, b_text, long_ints):
    def value(t):
        t = t.replace("\\frac{", "").replace("}{", "/").replace("}", "")
        sign = -1 if t.startswith("-") else 1  # (a sign in front; the parts may have their own)
        num, _, den = t.removeprefix("-").partition("/")
        return sign * Fraction(num) / Fraction(den or "1")

    a, b = value(a_text), value(b_text)
    want = _same(a, b, "." in a_text + b_text)
    assert numbers_equal(parse_number(a_text), parse_number(b_text)) is want, (a_text[-20:], b_text[-20:], want)


# Small numbers: where math-verify is reliable, the rules agree with it. (Not at exact ties of the
# 6-decimal rounding, such as 0.0000005: math-verify rounds the binary float, which lies on either side.)
SMALL = st.one_of(
    st.integers(-10**6, 10**6).map(str),
    st.builds(lambda i, f: f"{i}.{f}", st.integers(-999, 999), st.sampled_from(["5", "25", "333333", "3333333",
                                                                                 "0000004", "0000006", "75"])),
    st.builds(lambda a, b: f"\\frac{{{a}}}{{{b}}}", st.integers(-50, 50), st.integers(1, 12)),
    st.builds(lambda m, e: f"{m}\\times 10^{{{e}}}", st.sampled_from(["1.5", "2", "3.25"]), st.integers(-3, 4)),
    st.builds(lambda i: f"{i}\\%", st.integers(0, 200)),
)


@settings(max_examples=150, deadline=None)
@given(SMALL, SMALL)
@example("\\frac{1}{3}", "0.3333333").via("equal at 6 decimals")
@example("\\frac{-2}{3}", "-0.666667").via("equal at 6 decimals")
@example("50\\%", "0.5").via("a percentage")
@example("1.5\\times 10^{3}", "1500").via("scientific notation")
def test_small_numbers_agree_with_math_verify(gold, pred):
    from math_verify import parse, verify

    mv = verify(parse(f"${gold}$"), parse(f"${pred}$"))
    mine = numbers_equal(parse_number(gold), parse_number(pred))
    if {gold, pred} & {"-0", "0"} or mine is mv:
        return
    # math-verify's one known difference: sympy's Integer never equals a Float that rounds to it
    # (2 vs 2.0000001 is wrong there, 2 vs 2.0 right by another path); here they are equal at 6 decimals
    g, p = parse_number(gold), parse_number(pred)
    assert g.decimal != p.decimal and mine and not mv, (gold, pred, mine, mv)


MILLION = "7" * 1_000_000
POWER = str(2**13000)


@pytest.mark.parametrize("gold, answer, status", [
    ("42", MILLION, WRONG),
    ("42", "-" + MILLION, WRONG),
    (MILLION, MILLION, CORRECT),
    (MILLION, MILLION[:-1] + "8", WRONG),
    ("42", f"\\frac{{{MILLION}}}{{3}}", WRONG),
    (f"\\frac{{{MILLION}}}{{7}}", "1" + "1" * 999_999, CORRECT),   # 777...7 / 7 = 111...1
    ("\\frac{1}{3}", "0." + "3" * 1_000_000, CORRECT),            # equal at math-verify's 6 decimals
    ("0.5", "0." + "3" * 1_000_000, WRONG),
    ("42", "1.5 \\times 10^{1000000}", WRONG),
    ("15" + "0" * 999_999, "1.5 \\times 10^{1000000}", CORRECT),
    ("-10^{1000000}", "-1\\times10^{1000000}", CORRECT),
    ("10^{-1000000}", "0", WRONG),                                # exact (no decimal point): not 0
    ("10^{-1000000}", "0.0", CORRECT),                            # at 6 decimals (a decimal point): 0
    ("2\\sqrt{3}", MILLION, WRONG),                               # an irrational gold
    ("x + 1", MILLION, WRONG),                                    # a gold with a symbol
    ("2^{13000}", POWER, CORRECT),                                # a gold expression of the same value
    ("2^{13000}", POWER[:-1] + str(int(POWER[-1]) + 1), WRONG),
    ("\\sqrt{2}", "1.4142135623730950488016887242096980785696718753769480731766797379907324784621" + "3" * 100, CORRECT),
])
def test_large_answers_are_judged_by_value(gold, answer, status):
    out = _check_one(gold, answer, CFG.math)
    assert out.status == status, (gold[:40], answer[:40], out)


def test_a_boxed_million_digits_is_judged_within_the_pool_timeout():
    """Through the real reward pool with its hard timeout (reward.math.timeout_s): a verdict, never
    "unparsable" or "timeout"."""
    cases = [(f"The answer is \\boxed{{{MILLION}}}", "42", WRONG),
             (f"\\boxed{{-{MILLION}}}", f"-{MILLION}", CORRECT),
             ("\\boxed{1.5\\times10^{1000000}}", "42", WRONG),
             (f"\\boxed{{\\frac{{{MILLION}}}{{3}}}}", "\\frac{1}{3}", WRONG)]
    mgr = RewardManager(CFG)
    try:
        _, _, details = mgr.score([RewardItem(r, g, "math") for r, g, _ in cases], return_details=True)
    finally:
        mgr.close()
    assert [d["status"] for d in details] == [s for _, _, s in cases], [d["detail"] for d in details]


def test_math_reward_reads_the_box_of_a_million_digits():
    out = math_reward(RewardItem(f"so \\boxed{{{MILLION}}}.", MILLION, "math"), CFG)
    assert out.status == CORRECT and out.score == 1.0
