"""Answer extraction: agrees with readable references, and costs linear time on degenerate input.

The in-process reward styles (``exact_boxed``, ``boxed_final``) and the judge's prompt run these
parsers in the trainer's process with no timeout. The references below state each rule one
character at a time; hypothesis checks the fast versions against them on inputs built from the
fragments that matter. The cost check never asserts an absolute time: it compares one call on a
16x longer input with 16 calls on the short one (the same work if the parser is linear, 16x more if
it is quadratic) and allows a generous factor of 4 for timer noise on a loaded machine.
"""

from __future__ import annotations

import time

import pytest
from hypothesis import given, settings, strategies as st

from megatron_rl.rewards import RewardConfig, RewardItem, get_style, registered_styles
from megatron_rl.rewards.code import extract_code
from megatron_rl.rewards.extract import (MAX_BOXED_BRACES, answer_phrase, extract_answer, last_boxed,
                                         last_number)
from megatron_rl.rewards.judge import judge_messages, parse_verdict

OPENERS = ("\\boxed", "\\fbox")


# ---- references: one character at a time -------------------------------------------------------
def ref_last_boxed(text: str) -> str | None:
    starts = [(i, op) for i in range(len(text)) for op in OPENERS if text.startswith(op, i)]
    for i, op in reversed(starts):
        j = i + len(op)
        if j < len(text) and text[j] == "{":
            depth, braces = 0, -1  # (the opening brace is not counted)
            for k in range(j, len(text)):
                if text[k] in "{}":
                    braces += 1
                    if braces > MAX_BOXED_BRACES:
                        return None
                depth += {"{": 1, "}": -1}.get(text[k], 0)
                if depth == 0:
                    return text[j + 1:k]
            return None
        if j < len(text) and text[j] == " " and text[j:].split():
            return text[j:].split()[0].rstrip("$.")
    return None


def ref_answer_phrase(text: str) -> str | None:
    low = text.lower()
    ends = []
    for i in range(len(text)):
        if low.startswith("answer", i):
            j = i + len("answer")
            while j < len(text) and text[j] in " \t":
                j += 1
            if low.startswith("is", j):
                ends.append(j + 2 + text.startswith(":", j + 2))
            elif text.startswith(":", j):
                ends.append(j + 1)
    for j in reversed(ends):
        while j < len(text) and text[j].isspace():
            j += 1
        if j < len(text) and text[j] == "$":
            j += 1
        k = j
        while k < len(text) and text[k] not in "\n$" and not (
                text[k] == "." and (k + 1 == len(text) or text[k + 1].isspace())):
            k += 1
        if text[j:k].rstrip():
            return text[j:k].rstrip()
    return None


def ref_last_number(text: str) -> str | None:
    found, i = None, 0
    while i < len(text):
        j = i + (text[i] == "-")
        if j < len(text) and text[j].isdigit():
            k = j
            while k < len(text) and (text[k].isdigit() or text[k] == ","):
                k += 1
            if k + 1 < len(text) and text[k] == "." and text[k + 1].isdigit():
                k += 1
                while k < len(text) and text[k].isdigit():
                    k += 1
            found, i = text[i:k], k
        elif j + 1 < len(text) and text[j] == "." and text[j + 1].isdigit():
            k = j + 1
            while k < len(text) and text[k].isdigit():
                k += 1
            found, i = text[i:k], k
        else:
            i += 1
    return found.replace(",", "") if found is not None else None


FRAGMENTS = ["\\boxed", "\\fbox", "{", "}", " ", "  ", "\n", "\t", "x", "5", "3.5", "-", ",", "$",
             ".", ". ", "answer", "Answer", "final answer", " is ", "is", ":", "</think>", "ed"]
texts = st.lists(st.sampled_from(FRAGMENTS), max_size=30).map("".join)


@settings(max_examples=600, deadline=None)
@given(texts)
def test_parsers_agree_with_the_references(text):
    assert last_boxed(text) == ref_last_boxed(text)
    assert answer_phrase(text) == ref_answer_phrase(text)
    assert last_number(text) == ref_last_number(text)


@pytest.mark.parametrize("text, want", [
    ("The answer is 3.5.", "3.5"),            # the number keeps its decimal point
    ("Final answer: $\\frac{1}{2}$.", "\\frac{1}{2}"),
    ("The answer is:\n 42", "42"),
    ("so the answer is 7. Check: the answer is", "7"),  # a phrase with nothing after it is skipped
    ("answer is x   y", "x   y"),
])
def test_answer_phrase_examples(text, want):
    assert answer_phrase(text) == want == ref_answer_phrase(text)


def test_a_box_with_more_braces_than_the_bound_is_no_answer():
    inner = "{}" * ((MAX_BOXED_BRACES - 1) // 2)  # with the closing brace: MAX_BOXED_BRACES braces
    assert last_boxed("\\boxed{" + inner + "}") == inner == ref_last_boxed("\\boxed{" + inner + "}")
    assert last_boxed("\\boxed{" + inner + "{}}") is None is ref_last_boxed("\\boxed{" + inner + "{}}")


def test_a_long_box_without_braces_is_an_answer():
    """A boxed number of a million digits is an answer (its value is judged: rewards/numbers.py)."""
    digits = "7" * 1_000_000
    assert last_boxed("so \\boxed{" + digits + "}.") == digits


# ---- cost: linear on degenerate inputs of several shapes ---------------------------------------
N = 4_000  # characters of the short input; the long one has 16x as many
SHAPES = {
    "boxedx": lambda n: "\\boxedx" * (n // 7),             # many openers that are not boxes
    "fbox_boxed": lambda n: "\\fbox\\boxed" * (n // 11),
    "boxed_ws": lambda n: "\\boxed{1} " + "\\boxed " * (n // 7) + " " * 7,
    "open_braces": lambda n: "\\boxed{" + "{" * n,
    "nested_open": lambda n: "\\boxed{" * (n // 7),
    "answer_spaces": lambda n: "answer is x" + " " * n + "y$$",
    "answer_dollars": lambda n: "answer is " + "$" * n,
    "answer_repeat": lambda n: "answer:" * (n // 7),
    "answer_dots": lambda n: "the answer is " + "1." * (n // 2),
    "digits": lambda n: "1," * (n // 2),
    "think": lambda n: "</think>" * (n // 8),
    "fences": lambda n: "```python\n" * (n // 10),
    "backticks": lambda n: "```py" + "`" * n,
    "verdict": lambda n: "VERDICT: " * (n // 9),
}


def _in_process_styles():
    """Every registered style that scores in the caller's process (no pool, no HTTP)."""
    names = [s for s in registered_styles() if not get_style(s).pooled and s != "llm_judge"]
    assert {"exact_boxed", "boxed_final"} <= set(names)
    return names


CFG = RewardConfig()


def _parse_everything(text: str) -> None:
    for style in _in_process_styles():
        get_style(style).fn(RewardItem(text, "12", style), CFG)
    extract_answer(text, fallback_last_number=True)  # the math style's parsing (pool side)
    extract_code(text)                                # the code style's parsing (pool side)
    judge_messages(RewardItem(text, "12", "math"))    # the judge's prompt (trainer side)
    parse_verdict(text)


def _seconds(fn) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


@pytest.mark.timeout(60)  # a quadratic parser takes minutes here (a linear one milliseconds)
@pytest.mark.parametrize("shape", sorted(SHAPES))
def test_parsing_cost_is_linear(shape):
    small, big = SHAPES[shape](N), SHAPES[shape](16 * N)
    assert len(big) >= 15 * len(small)
    t_small16 = min(_seconds(lambda: [_parse_everything(small) for _ in range(16)]) for _ in range(5))
    # The best of up to 5 runs on the long input; a run far over the bound ends the test at once.
    t_big = float("inf")
    for _ in range(5):
        t_big = min(t_big, _seconds(lambda: _parse_everything(big)))
        if t_big < 4 * t_small16 or t_big > 40 * t_small16:
            break
    assert t_big < 4 * t_small16, (
        f"{shape}: one call on {len(big)} chars took {t_big / t_small16:.1f}x the time of 16 calls on "
        f"{len(small)} chars (linear: about 1x; quadratic: 16x)")
