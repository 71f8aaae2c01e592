"""Answer extraction from a response: the last ``\\boxed{...}`` (balanced braces), with fallbacks."""

from __future__ import annotations

import re

_BOX_OPENERS = ("\\boxed", "\\fbox")
_NUMBER = re.compile(r"-?\d[\d,]*(?:\.\d+)?|-?\.\d+")
_ANSWER_IS = re.compile(r"(?:final answer|answer)\s*(?:is|:)\s*\$?([^\n$]+?)\$?\s*(?:\.|$)", re.I | re.M)


THINK_END = "</think>"


def final_part(text: str) -> str:
    """The text after the last ``</think>`` (a reasoning model's answer), or all of it."""
    i = text.rfind(THINK_END)
    return text if i < 0 else text[i + len(THINK_END):]


def last_boxed(text: str) -> str | None:
    """Content of the last ``\\boxed{...}`` / ``\\fbox{...}`` (nested braces kept), or ``None``.

    ``\\boxed 5`` (no braces) yields the next token. An unclosed box yields ``None``.
    """
    best = -1
    opener = ""
    for op in _BOX_OPENERS:
        i = text.rfind(op)
        if i > best:
            best, opener = i, op
    while best >= 0:
        j = best + len(opener)
        rest = text[j:]
        if rest.startswith("{"):
            depth = 0
            for k, ch in enumerate(rest):
                if ch == "{":
                    depth += 1
                elif ch == "}":
                    depth -= 1
                    if depth == 0:
                        return rest[1:k]
            return None  # unclosed: the response was probably truncated
        if rest.startswith(" "):
            token = rest.strip().split()
            if token:
                return token[0].rstrip("$.")
        # "\boxedfoo" is not a box: look for an earlier one
        prev = max(text.rfind(op, 0, best) for op in _BOX_OPENERS)
        best = prev
        if best >= 0:
            opener = next(op for op in _BOX_OPENERS if text.startswith(op, best))
    return None


def normalize_ws(s: str) -> str:
    """Collapse all whitespace (also inside the answer): ``' 1 2 '`` and ``'12'`` compare equal."""
    return "".join(s.split())


def last_number(text: str) -> str | None:
    """The last number in ``text`` (thousands separators removed), or ``None``."""
    found = _NUMBER.findall(text)
    return found[-1].replace(",", "") if found else None


def answer_phrase(text: str) -> str | None:
    """The text after the last "answer is" / "answer:" phrase, or ``None``."""
    found = _ANSWER_IS.findall(text)
    return found[-1].strip() if found else None


def extract_answer(text: str, fallback_last_number: bool = False) -> str | None:
    """After ``</think>``: the last box; else "the answer is X"; else (optionally) the last number."""
    text = final_part(text)
    boxed = last_boxed(text)
    if boxed is not None:
        return boxed
    phrase = answer_phrase(text)
    if phrase is not None:
        return phrase
    return last_number(text) if fallback_last_number else None
