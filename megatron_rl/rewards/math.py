"""Math rewards: ``exact_boxed`` (in-process string match) and ``math`` (math-verify in the pool).

Verdicts on known traps (tested in ``tests/unit/rewards/test_math_rewards.py``):

* *4.5 tickets* (a ticket costs 2, how many for 9? the label says 4.5): a response ``\\boxed{4}`` is
  scored **wrong** against the label ``4.5``, and ``\\boxed{4.5 \\text{ tickets}}`` **correct**. The
  reward judges against the label; a wrong label is the data cleaner's job
  (``megatron_rl.tools.difficulty`` flags it as ``suspected_wrong_label``).
* *96 vs 96%*: label ``96``, response ``96\\%`` is **correct** (same number with a percent sign;
  math-verify agrees, and our own rule keeps it so across versions); ``0.96`` against ``96`` is
  **wrong** (another number), ``96\\%`` against ``0.96`` is **correct** (equal values).
* *π vs 3.14*: label ``3.14``, response ``\\pi`` or ``3.1415926`` is **correct**: the label is π
  rounded (or cut) at its own precision (2 decimals). Label ``\\pi``, response ``3.14159`` is **correct**.
  Only π-related values get this tolerance, and only at >= 2 decimals: ``\\frac{\\pi}{6}`` against
  ``0.5`` and ``0.54`` against ``0.5`` stay **wrong**. Plain math-verify says wrong to all of these.
* *3 real roots vs 7 roots*: label ``1, 2, 3``, response ``1, 2, 3, i, -i`` is **wrong**: a superset
  rule would reward padding answers with junk. Again a wrong label, caught by data cleaning.
"""

from __future__ import annotations

import json
import re
from decimal import Decimal
from itertools import product

from megatron_rl.rewards.base import (CORRECT, TIMEOUT, UNPARSABLE, WRONG, Outcome, RewardItem,
                                      register_reward)
from megatron_rl.rewards.extract import extract_answer, final_part, last_boxed, normalize_ws
from megatron_rl.rewards.numbers import equals_approximation, equals_rational, numbers_equal, parse_number

_PLAIN_NUMBER = re.compile(r"^[+-]?(\d+)(?:\.(\d+))?$")
_THOUSANDS = re.compile(r"^[+-]?\d{1,3}(,\d{3})+(\.\d+)?$")
_PERCENT = re.compile(r"(\\?%|\\text\{\s*percent\s*\}|percent)$")
_PI_WORDS = ("圆周率",)
_PI = 3.141592653589793
# Digits to which an irrational constant is evaluated against a large written number, at most.
MAX_EVAL_DIGITS = 10_000


@register_reward("exact_boxed")
def exact_boxed(item: RewardItem, cfg=None) -> Outcome:
    """1 when the last ``\\boxed{}`` (after ``</think>``) equals the ground truth, whitespace removed."""
    answer = last_boxed(final_part(item.response))
    if answer is None:
        return Outcome(0.0, UNPARSABLE)
    ok = normalize_ws(answer) == normalize_ws(str(item.ground_truth))
    return Outcome(1.0 if ok else 0.0, CORRECT if ok else WRONG, answer)


def _number_text(s: str) -> str | None:
    """``s`` without whitespace and thousands separators; ``None`` if a comma separates a list."""
    t = normalize_ws(s).replace("{,}", ",")
    if "," in t:
        if not _THOUSANDS.match(t):
            return None  # "1,2,3" is a list, not 123
        t = t.replace(",", "")
    return t


def _plain_decimal(s: str) -> tuple[float, int] | None:
    """``(value, decimals)`` when ``s`` is a plain decimal number like ``-3.14``, else ``None``."""
    m = _PLAIN_NUMBER.match(_number_text(s) or "")
    if not m:
        return None
    return float(m.group(0)), len(m.group(2) or "")


def _plain_numbers_verdict(gold: str, pred: str) -> bool | None:
    """Fast path (math-verify's LaTeX parse costs milliseconds): two plain numbers that are equal
    are right; two unequal integers are wrong; anything else (decimals that math-verify might
    round together, expressions) returns ``None`` and goes through the full check."""
    g, p = _plain_decimal(gold), _plain_decimal(pred)
    if g is None or p is None:
        return None
    gd, pd = Decimal(_number_text(gold)), Decimal(_number_text(pred))
    if gd == pd:
        return True
    if g[1] == 0 and p[1] == 0:
        return False
    return None


def _strip_percent(s: str) -> tuple[str, bool]:
    t = normalize_ws(s).rstrip(".")
    m = _PERCENT.search(t)
    return (t[: m.start()], True) if m else (t, False)


def _percent_equal(gold: str, pred: str) -> bool:
    """'96' vs '96%' (either side): the same number, one side with a percent sign."""
    g, g_pct = _strip_percent(gold)
    p, p_pct = _strip_percent(pred)
    if g_pct == p_pct:
        return False
    gv, pv = _plain_decimal(g), _plain_decimal(p)
    return gv is not None and pv is not None and gv[0] == pv[0]


def _rounds_to(value: float, decimal: tuple[float, int]) -> bool:
    """``decimal`` (value, n decimals) is ``value`` rounded or truncated at n >= 2 decimals."""
    target, places = decimal
    if places < 2:
        return False
    scale = 10**places
    want = round(abs(target) * scale)
    return (value < 0) == (target < 0) and want in (round(abs(value) * scale),
                                                     int(abs(value) * scale))


def _pi_value(parsed) -> float | None:
    """Numeric value of a parsed expression that involves π and no free symbols, else ``None``."""
    import sympy

    for expr in parsed:
        if isinstance(expr, sympy.Basic) and expr.has(sympy.pi) and not expr.free_symbols:
            try:
                return float(expr.evalf())
            except (TypeError, ValueError):
                return None
    return None


def _pi_equal(gold: str, pred: str, gold_parsed, pred_parsed) -> bool:
    """π vs a decimal rounding of it, in either direction, or two roundings of π."""
    g_dec, p_dec = _plain_decimal(gold), _plain_decimal(pred)
    if g_dec is not None and p_dec is None:
        v = _pi_value(pred_parsed)
        return v is not None and _rounds_to(v, g_dec)
    if p_dec is not None and g_dec is None:
        v = _pi_value(gold_parsed)
        return v is not None and _rounds_to(v, p_dec)
    if g_dec is not None and p_dec is not None:
        # 3.1415926 for 3.14: both round π, the prediction at least as precisely as the label
        return (_rounds_to(_PI, g_dec) and _rounds_to(_PI, p_dec) and p_dec[1] >= g_dec[1])
    return False


def _latex(s: str) -> str:
    for word in _PI_WORDS:
        s = s.replace(word, "\\pi")
    s = s.strip()
    return s if s.startswith("$") or "\\boxed" in s else f"${s}$"


def warmup() -> None:
    """Called once by each pool worker: the first math-verify call loads its grammar (~1 s)."""
    from math_verify import parse, verify

    verify(parse("$1$"), parse("$\\frac{2}{2}$"))


def gold_answers(ground_truth) -> list[str]:
    """Acceptable answers: a list, a JSON list of strings (Skywork-OR1 writes '["34"]'), or one
    value. A JSON list of numbers such as "[1, 2]" stays one answer (an interval or a list)."""
    if isinstance(ground_truth, (list, tuple)):
        return [str(g) for g in ground_truth] or [""]
    text = str(ground_truth)
    if text.startswith("[") and text.endswith("]"):
        try:
            decoded = json.loads(text)
        except ValueError:
            return [text]
        if isinstance(decoded, list) and decoded and all(isinstance(g, str) for g in decoded):
            return decoded
    return [text]


@register_reward("math", pooled=True, timeout_section="math")
def math_reward(item: RewardItem, cfg) -> Outcome:
    """math-verify on the extracted answer, plus the percent and π rules (see the module doc).

    With several acceptable answers, the response is right when it matches any of them."""
    mcfg = cfg.math
    answer = extract_answer(item.response, fallback_last_number=mcfg.fallback_last_number)
    if answer is None or not answer.strip():
        return Outcome(0.0, UNPARSABLE)
    outcomes = [_check_one(gold, answer, mcfg) for gold in gold_answers(item.ground_truth)]
    best = max(outcomes, key=lambda o: (o.score, o.status == WRONG))
    return best


def _check_one(gold: str, answer: str, mcfg) -> Outcome:
    from math_verify import parse

    fast = _plain_numbers_verdict(gold, answer)
    if fast is not None:
        return Outcome(1.0 if fast else 0.0, CORRECT if fast else WRONG, answer)
    large = _large_number_verdict(gold, answer, mcfg)
    if large is not None:
        return Outcome(1.0 if large else 0.0, CORRECT if large else WRONG, answer, "large number")
    gold_parsed = parse(_latex(gold), parsing_timeout=mcfg.parse_timeout_s)
    pred_parsed = parse(_latex(answer), parsing_timeout=mcfg.parse_timeout_s)
    if not pred_parsed:
        if mcfg.percent_equivalence and _percent_equal(gold, answer):
            return Outcome(1.0, CORRECT, answer, "percent")
        return Outcome(0.0, UNPARSABLE, answer)
    verdict = _verify(gold_parsed, pred_parsed, mcfg.verify_timeout_s)
    if verdict is True:
        return Outcome(1.0, CORRECT, answer)
    if mcfg.percent_equivalence and _percent_equal(gold, answer):
        return Outcome(1.0, CORRECT, answer, "percent")
    if mcfg.pi_tolerance and _pi_equal(gold, _latex(answer).strip("$"), gold_parsed, pred_parsed):
        return Outcome(1.0, CORRECT, answer, "pi")
    if verdict is None:
        return Outcome(0.0, TIMEOUT, answer, "math-verify comparison timed out")
    return Outcome(0.0, WRONG, answer)


def _large_number_verdict(gold: str, answer: str, mcfg) -> bool | None:
    """A side that is a large written number (``rewards/numbers.py``), which math-verify cannot be
    trusted with, is judged by value here: against the other side's number, or against the value of
    its expression (parsed by math-verify: the gold is a dataset's short answer). ``None``: no large
    number, math-verify judges."""
    g, p = parse_number(gold), parse_number(answer)
    if not ((g is not None and g.large) or (p is not None and p.large)):
        return None
    if g is not None and p is not None:
        return numbers_equal(g, p)
    from math_verify import parse

    number, other = (g, answer) if p is None else (p, gold)
    return any(_equals_expression(number, e) for e in parse(_latex(other), parsing_timeout=mcfg.parse_timeout_s))


def _equals_expression(number, expr) -> bool:
    """A large written number against a parsed expression: equal only to a constant of the same
    value (an exact rational, or an irrational one the number rounds as at 6 decimals)."""
    import sympy

    if not isinstance(expr, sympy.Expr) or not expr.is_number or expr.is_real is not True:
        return False  # a set, an equation, a symbol, a complex number, text: no real number equals it
    if expr.is_rational:  # math-verify keeps 2^{13000} unevaluated: its value is the dataset's own size
        value = sympy.Rational(expr.doit())
        return bool(equals_rational(number, int(value.p), int(value.q)))
    digits = max((number.num.magnitude - number.den.magnitude) + 20 if number.num.digits else 0, 20)
    if digits > MAX_EVAL_DIGITS:
        return False  # an irrational constant with so many integer digits is no dataset's answer
    return equals_approximation(number, format(Decimal(str(sympy.N(expr, digits))), "f"))


def _verify(gold_parsed, pred_parsed, timeout_s: int) -> bool | None:
    """math-verify's any-pair comparison, except that a timeout is reported (``None``), not
    silently scored as a mismatch. Other comparison errors count as a mismatch, as in math-verify."""
    from math_verify import verify
    from math_verify.errors import TimeoutException

    for g, p in product(gold_parsed, pred_parsed):
        try:
            if verify(g, p, timeout_seconds=timeout_s, raise_on_error=True):
                return True
        except TimeoutException:
            return None  # one timeout is enough: the budget is per response, not per pair
        except Exception:  # noqa: BLE001 (math-verify's own behaviour: an error is "not equal")
            continue
    return False
