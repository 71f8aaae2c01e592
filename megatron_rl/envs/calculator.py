"""``calculator``: arithmetic on request (the tool demo's environment).

A model turn that contains ``<<expression>>`` (GSM8K's calculator notation) calls it: the last such
expression is evaluated and its value (``56088``, ``0.75``) is the observation. A turn without one is
the final answer; a turn that opens a call (``<<``) and never closes it gets an error message (a
malformed call is the model's mistake to read about, not its final answer). Expressions: numbers, ``+ - * / // % **``, unary signs and parentheses, at most
200 characters; evaluated from the syntax tree (never ``eval``), with every intermediate integer held
to 4096 bits and exponents to 4096 bits of result, so any input costs microseconds. A bad expression
(a syntax error, a division by zero, a number too large) is an error message to the model.
"""

from __future__ import annotations

import ast
import operator
import re

from megatron_rl.envs.base import Environment, StepResult
from megatron_rl.envs.registry import register_env
from megatron_rl.envs.tools import ERROR, ToolOutput

CALL = re.compile(r"<<([^<>]{0,200})>>")  # bounded: linear in the turn's length
MAX_CHARS = 200
MAX_BITS = 4096

_BINARY = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv,
           ast.FloorDiv: operator.floordiv, ast.Mod: operator.mod, ast.Pow: operator.pow}
_UNARY = {ast.UAdd: operator.pos, ast.USub: operator.neg}


def calculate(expression: str) -> str:
    """The value of ``expression`` as text; ValueError saying why not."""
    text = expression.strip()
    if not text:
        raise ValueError("empty expression")
    if len(text) > MAX_CHARS:
        raise ValueError(f"expression longer than {MAX_CHARS} characters")
    try:
        tree = ast.parse(text, mode="eval")
    except (SyntaxError, ValueError, RecursionError, MemoryError):
        raise ValueError(f"cannot parse {text!r}") from None
    value = _eval(tree.body)
    if isinstance(value, float):
        if value != value or value in (float("inf"), float("-inf")):
            raise ValueError("the result is not a finite number")
        return repr(int(value)) if value.is_integer() and abs(value) < 2**53 else format(value, ".12g")
    return str(value)


def _eval(node):
    if isinstance(node, ast.Constant) and type(node.value) in (int, float):
        return _bounded(node.value)
    if isinstance(node, ast.UnaryOp) and type(node.op) in _UNARY:
        return _bounded(_UNARY[type(node.op)](_eval(node.operand)))
    if isinstance(node, ast.BinOp) and type(node.op) in _BINARY:
        left, right = _eval(node.left), _eval(node.right)
        if isinstance(node.op, ast.Pow):
            _check_power(left, right)
        try:
            return _bounded(_BINARY[type(node.op)](left, right))
        except ZeroDivisionError:
            raise ValueError("division by zero") from None
        except OverflowError:
            raise ValueError("number too large") from None
    raise ValueError("only numbers, + - * / // % ** and parentheses are allowed")


def _check_power(base, exponent) -> None:
    if isinstance(exponent, float) or isinstance(base, float):
        if abs(exponent) > MAX_BITS:
            raise ValueError("exponent too large")
        return
    if exponent < 0:
        return
    if abs(base) > 1 and exponent * max(1, abs(base).bit_length()) > MAX_BITS:
        raise ValueError("number too large")


def _bounded(value):
    if isinstance(value, complex):
        raise ValueError("the result is not a real number")
    if isinstance(value, int) and value.bit_length() > MAX_BITS:
        raise ValueError("number too large")
    return value


@register_env("calculator")
class Calculator(Environment):
    def step(self, turn: str) -> StepResult:
        calls = CALL.findall(turn)
        if calls:
            return self.use_tool("calculator", lambda: self.tools.call(calculate, calls[-1]))
        if "<<" in turn:
            malformed = ToolOutput(f"error: a call is <<expression>>: at most {MAX_CHARS} characters, closed by >>",
                                   ERROR)
            return self.use_tool("calculator", lambda: malformed)
        return StepResult(done=True)
