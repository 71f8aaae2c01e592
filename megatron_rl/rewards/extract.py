"""Answer extraction from a response: the last ``\\boxed{...}`` (balanced braces), with fallbacks.

Every function here is linear in the length of the response and bounded: they run in the trainer's
process (``exact_boxed``, ``boxed_final``, the judge's prompt) with no timeout, so a degenerate
response (a megabyte of ``\\boxedx``, of ``{``, of spaces after "answer is") must cost what reading
it costs. The scans are single regular-expression passes whose patterns cannot backtrack more than
a constant per character; the only Python-level loop (brace matching) stops after
``MAX_BOXED_BRACES`` braces. Readable character-by-character references of the same rules are in
``tests/unit/rewards/test_extract_linear.py``, which checks both agreement and linear cost.
"""

from __future__ import annotations

import collections
import itertools
import re

#: A ``\\boxed{`` whose closing brace does not come within this many braces counts as unclosed (no
#: answer); this bounds the one Python-level loop here. The box's length itself is not bounded: a
#: boxed number of a million digits is an answer, judged by its value (``rewards/numbers.py``).
MAX_BOXED_BRACES = 10_000

THINK_END = "</think>"

# An opener that really opens a box: followed by "{", or by a space and (after any white space) a
# token. "\boxedfoo" is not a box, nor is "\boxed" followed by white space only.
_BOX = re.compile(r"\\(?:boxed|fbox)(?:(\{)| (?=\s*\S))")
_BRACE = re.compile(r"[{}]")
_TOKEN = re.compile(r"\S+")
_NUMBER = re.compile(r"-?\d[\d,]*(?:\.\d+)?|-?\.\d+")
_ANSWER_IS = re.compile(r"(?:final answer|answer)[ \t]*(?:is:?|:)", re.I)
# After the phrase: white space, an optional "$", then the answer up to the end of the line, a "$", or a
# sentence-ending period (a "." followed by white space or the end of the text; "3.5" keeps its dot).
_PHRASE_TAIL = re.compile(r"\s*\$?([^\n$]*?)(?=\n|\$|\.(?:\s|$)|$)")


def final_part(text: str) -> str:
    """The text after the last ``</think>`` (a reasoning model's answer), or all of it."""
    i = text.rfind(THINK_END)
    return text if i < 0 else text[i + len(THINK_END):]


def _last(it):
    """The last item of an iterator (consumed in C), or ``None``."""
    d = collections.deque(it, maxlen=1)
    return d[0] if d else None


def last_boxed(text: str) -> str | None:
    """Content of the last ``\\boxed{...}`` / ``\\fbox{...}`` (nested braces kept), or ``None``.

    ``\\boxed 5`` (no braces) yields the next token. An unclosed box (or one holding more than
    ``MAX_BOXED_BRACES`` braces) yields ``None``: the response was probably truncated.
    """
    m = _last(_BOX.finditer(text))
    if m is None:
        return None
    start = m.end()
    if m.group(1) is None:  # "\boxed 5": the next token
        return _TOKEN.search(text, start).group().rstrip("$.")
    depth = 1
    for b in itertools.islice(_BRACE.finditer(text, start), MAX_BOXED_BRACES):
        depth += 1 if b.group() == "{" else -1
        if depth == 0:
            return text[start:b.start()]
    return None


def normalize_ws(s: str) -> str:
    """Collapse all whitespace (also inside the answer): ``' 1 2 '`` and ``'12'`` compare equal."""
    return "".join(s.split())


def last_number(text: str) -> str | None:
    """The last number in ``text`` (thousands separators removed), or ``None``."""
    m = _last(_NUMBER.finditer(text))
    return m.group().replace(",", "") if m else None


def answer_phrase(text: str) -> str | None:
    """The answer after the last "answer is" / "answer:" phrase that states one, or ``None``.

    The answer starts after white space (also line breaks) and an optional ``$``, and runs to the
    end of its line, a ``$`` or a sentence-ending period (trailing spaces dropped); a phrase
    followed by nothing counts as none and an earlier one is used.
    """
    phrases = [m.end() for m in _ANSWER_IS.finditer(text)]
    for end in reversed(phrases):
        answer = _PHRASE_TAIL.match(text, end).group(1).rstrip()
        if answer:
            return answer
    return None


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
