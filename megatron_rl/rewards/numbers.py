"""Exact values of written numbers of any size: integers, decimals, LaTeX scientific notation,
fractions, percentages, with their signs.

math-verify turns an answer into sympy, which turns each literal into a Python int or float: past
4,300 digits Python refuses the conversion, past ~15 significant digits a float rounds, ``10^{n}``
builds an integer of n digits, and a long literal runs into the parse timeout. A response that boxes
a number of a million digits came back "unparsable" or "timeout" (or "wrong", depending on the
clock) although it is a well-formed number with a value. Here a written number is read as text into
``(sign, digits, exponent)`` (:class:`Exact`: the digits a string, the exponent a small int) and
compared with ``decimal.Decimal`` arithmetic (libmpdec: linear parsing, fast products): no int is
ever built from a long string and no float is involved, so a comparison costs about what reading
the numbers costs.

What is read (white space removed first): ``[sign] mantissa [\\times 10^{e} | \\cdot 10^{e}] [%]``
or ``[sign] 10^{e}``, the mantissa digits with an optional ``.`` and thousands separators in groups
of three (``1,234,567``; ``{,}`` too), the exponent a signed integer literal; ``\\frac{a}{b}``
(``\\dfrac``, ``\\tfrac``) or ``a/b`` of two such numbers, a sign in front or in either part;
surrounding ``$``. ``1.5e3`` is not read: math-verify reads the ``e`` as Euler's number.

How two numbers compare (:func:`numbers_equal`), as math-verify compares small ones: exactly for
integers and fractions; when either side is written with a decimal point (math-verify's Float) both
are rounded to 6 decimal places first (math-verify's ``float_rounding``), so ``0.333…3`` equals
``1/3`` however many 3s; a percentage equals the other number as written or divided by 100 (the
percent rule of ``rewards/math.py``).
"""

from __future__ import annotations

import decimal
import re
from dataclasses import dataclass
from decimal import Decimal

from megatron_rl.rewards.extract import normalize_ws

# A written number is "large" (math-verify cannot be trusted with it) past this many digits, or
# with a power of ten past this exponent.
LARGE_DIGITS = 100
# Exponent literals longer than this are not read (10^{10^18} has no place in an answer).
MAX_EXP_DIGITS = 15
# Rounding a fraction at 6 decimals computes a quotient of this many digits at most (else undecided).
MAX_QUOTIENT_DIGITS = 4_000_000

_MANTISSA = r"(?P<int>\d{1,3}(?:,\d{3})+|\d+)?(?:\.(?P<frac>\d*))?"
_TIMES = r"(?:\\times|\\cdot|\*|×|·)"


def _power(tag: str) -> str:  # 10^{-12}, 10^3
    return rf"10\^(?:\{{(?P<exp{tag}>[+-]?\d+)\}}|(?P<digit{tag}>\d))"


_REAL = re.compile(rf"(?P<sign>[+-]?)(?:{_MANTISSA}(?:{_TIMES}{_power('')})?|(?P<bare>{_power('_bare')}))")
_FRAC = re.compile(r"(?P<sign>[+-]?)\\[dt]?frac(?:\{(?P<a>[^{}]*)\}\{(?P<b>[^{}]*)\}|(?P<a1>\d)(?P<b1>\d))")
_PERCENT = re.compile(r"(\\?%)$")


@dataclass(frozen=True)
class Exact:
    """``(-1)**neg * int(digits) * 10**exp``, canonical: no leading or trailing zeros in ``digits``
    (zero: ``digits == ""``, ``exp == 0``, not negative), so equal values are equal objects."""

    neg: bool
    digits: str
    exp: int

    @staticmethod
    def of(neg: bool, digits: str, exp: int) -> Exact:
        d = digits.lstrip("0")
        if not d:
            return ZERO
        t = d.rstrip("0")
        return Exact(neg, t, exp + len(d) - len(t))

    @property
    def magnitude(self) -> int:
        """``floor(log10(|x|))`` (the position of the leading digit); not for zero."""
        return len(self.digits) - 1 + self.exp


ZERO = Exact(False, "", 0)
ONE = Exact(False, "1", 0)


@dataclass(frozen=True)
class Number:
    """A written number: the fraction ``num / den`` (``den`` never zero), whether it was written with
    a decimal point (compared at 6 decimals), whether it ends in a percent sign, and whether it is
    large (past ``LARGE_DIGITS`` digits or exponent)."""

    num: Exact
    den: Exact
    decimal: bool
    percent: bool
    large: bool


def _context(digits: int) -> decimal.Context:
    """Exact integer arithmetic on results of up to ``digits`` digits (an inexact one raises)."""
    return decimal.Context(prec=max(digits, 1), Emax=decimal.MAX_EMAX, Emin=decimal.MIN_EMIN,
                           traps=[decimal.Inexact, decimal.InvalidOperation, decimal.DivisionByZero])


def _mul(a: Exact, b: Exact) -> Exact:
    if not a.digits or not b.digits:
        return ZERO
    product = _context(len(a.digits) + len(b.digits)).multiply(Decimal(a.digits), Decimal(b.digits))
    return Exact.of(a.neg != b.neg, f"{product:f}", a.exp + b.exp)


def _real(text: str) -> tuple[Exact, bool, bool] | None:
    """``text`` as ``(value, written with a decimal point, large)``, or ``None``."""
    m = _REAL.fullmatch(text)
    if m is None or not (m["int"] or m["frac"] or m["bare"]):
        return None
    exp_text = m["exp"] or m["digit"] or m["exp_bare"] or m["digit_bare"] or "0"
    if len(exp_text.lstrip("+-")) > MAX_EXP_DIGITS:
        return None
    exp = int(exp_text)
    if m["bare"]:
        return Exact.of(m["sign"] == "-", "1", exp), False, abs(exp) > LARGE_DIGITS
    whole, frac = (m["int"] or "").replace(",", ""), m["frac"] or ""
    value = Exact.of(m["sign"] == "-", whole + frac, exp - len(frac))
    large = len(whole) + len(frac) > LARGE_DIGITS or abs(exp) > LARGE_DIGITS
    return value, m["frac"] is not None, large


def parse_number(text: str) -> Number | None:
    """The value of ``text`` when it is one written number (the module doc says which forms)."""
    t = normalize_ws(text).replace("{,}", ",").strip("$").rstrip(".")
    percent = _PERCENT.search(t)
    if percent:
        t = t[:percent.start()]
    frac = _FRAC.fullmatch(t)
    if frac:
        sign, parts = frac["sign"], (frac["a"] or frac["a1"], frac["b"] or frac["b1"])
    elif t.count("/") == 1:
        sign, parts = "", tuple(t.split("/"))
    else:
        sign, parts = "", (t, "1")
    read = [_real(p) for p in parts]
    if None in read or not read[1][0].digits:
        return None
    (num, num_dec, num_large), (den, den_dec, den_large) = read
    if sign == "-" and num.digits:
        num = Exact(not num.neg, num.digits, num.exp)
    return Number(num, den, num_dec or den_dec, percent is not None, num_large or den_large)


def _round6(num: Exact, den: Exact) -> Exact | None:
    """``num / den`` rounded half-even at 6 decimals, times 10**6 (an integer); ``None`` when the
    quotient would be longer than ``MAX_QUOTIENT_DIGITS``."""
    if not num.digits:
        return ZERO
    size = num.magnitude - den.magnitude + 7  # the quotient's digits, give or take one
    if size <= -1:
        return ZERO  # |x| * 10**6 < 0.1
    if size > MAX_QUOTIENT_DIGITS:
        return None
    shift = num.exp + 6 - den.exp
    n_text, d_text = num.digits + "0" * max(shift, 0), den.digits + "0" * max(-shift, 0)
    n, d = Decimal(n_text), Decimal(d_text)
    ctx = _context(size + len(n_text) + len(d_text) + 4)
    q, r = ctx.divmod(n, d)
    twice = ctx.multiply(r, 2)
    if twice > d or (twice == d and f"{q:f}"[-1] in "13579"):
        q = ctx.add(q, 1)
    return Exact.of(num.neg != den.neg, f"{q:f}", 0)


def _equal(a: tuple[Exact, Exact], b: tuple[Exact, Exact], rounded: bool) -> bool | None:
    if not rounded:
        return _mul(a[0], b[1]) == _mul(b[0], a[1])
    ra, rb = _round6(*a), _round6(*b)
    return None if ra is None or rb is None else ra == rb


def _values(n: Number, other_percent: bool) -> list[tuple[Exact, Exact]]:
    """The values a number may stand for: a percentage as written or divided by 100 (when the other
    side has no percent sign)."""
    if not n.percent or other_percent:
        return [(n.num, n.den)]
    return [(n.num, n.den), (n.num, _mul(n.den, Exact.of(False, "1", 2)))]


def numbers_equal(a: Number, b: Number) -> bool | None:
    """Whether two written numbers have the same value (``None``: too long to decide here)."""
    rounded = a.decimal or b.decimal
    answers = [_equal(x, y, rounded) for x in _values(a, b.percent) for y in _values(b, a.percent)]
    if True in answers:
        return True
    return None if None in answers else False


def equals_rational(n: Number, p: int, q: int) -> bool | None:
    """Whether ``n`` equals the fraction ``p / q`` of Python ints (an expression's exact value); the
    magnitudes are compared first, so a huge ``n`` and a small ``p / q`` cost nothing."""
    bits = abs(p).bit_length() - q.bit_length()
    if n.num.digits and p and abs((n.num.magnitude - n.den.magnitude) - bits * 0.30103) > 3:
        return False
    value = _exact_int(p), _exact_int(q)
    return numbers_equal(n, Number(value[0], value[1], False, False, True))


def equals_approximation(n: Number, text: str) -> bool:
    """Whether a number written with a decimal point rounds, at 6 decimals, as the decimal expansion
    ``text`` of an irrational constant does (an integer or fraction never equals one)."""
    approx = parse_number(text)
    return bool(n.decimal and approx is not None and numbers_equal(n, Number(approx.num, approx.den, True, False, True)))


def _exact_int(i: int) -> Exact:
    d = Decimal(i)  # no string: not subject to Python's 4,300-digit limit
    return Exact.of(i < 0, f"{d.copy_abs():f}", 0)
