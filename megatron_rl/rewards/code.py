"""Code rewards: run the response's program in the sandbox against test cases.

Ground truth is a JSON string or the decoded object, in the shapes verl-format code datasets use
(see :func:`build_cases`): stdin/stdout cases (APPS / TACO / CodeContests), call-based cases with
``fn_name`` (LeetCode: a function or a ``class Solution`` method), ``assert_case`` statements, and
HumanEval-style ``test_code`` + ``entry_point``. Call and assert cases get a prelude of the
imports such solutions assume (``typing``, ``collections``, ...).

Reward: pass rate, or 1/0 for all cases passing (``code.mode``). The program is the last fenced
code block of the response after its closing ``</think>`` (```` ```python ```` preferred).
"""

from __future__ import annotations

import json
import math
import re
import time
from dataclasses import dataclass

from megatron_rl.rewards.base import (CORRECT, ERROR, UNPARSABLE, WRONG, Outcome, RewardItem,
                                      register_reward)
from megatron_rl.rewards.extract import final_part
from megatron_rl.rewards.sandbox import Sandbox, SandboxResult

_FENCE = re.compile(r"```([A-Za-z0-9_+-]*)[ \t]*\n(.*?)```", re.S)

# Names LeetCode-style solutions use without importing them (``List[int]`` in a signature).
PRELUDE = ("from typing import *\nimport math, collections, itertools, heapq, bisect, functools, "
           "string, re\nfrom collections import *\nfrom itertools import *\nfrom functools import *\n"
           "from heapq import *\nfrom bisect import *\n")

_CALL_DRIVER = """
import json as _json, sys as _sys
_args = _json.loads(_sys.stdin.read())
if "Solution" in globals() and hasattr(globals()["Solution"], {name!r}):
    _fn = getattr(Solution(), {name!r})
else:
    _fn = globals()[{name!r}]
_sys.stdout.write("\\n__RESULT__" + _json.dumps(_fn(*_args)))
"""
_RESULT = "__RESULT__"


@dataclass
class Case:
    """One test: the full program text, its stdin, and how to judge the run."""

    source: str
    stdin: str
    kind: str  # "stdio" | "call" | "assert"
    expected: object = None

    def passed(self, res: SandboxResult) -> bool:
        if not res.ok:
            return False
        if self.kind == "stdio":
            return stdout_matches(res.stdout, self.expected)
        if self.kind == "call":
            marker = res.stdout.rfind(_RESULT)
            if marker < 0:
                return False
            try:
                got = json.loads(res.stdout[marker + len(_RESULT):])
            except ValueError:
                return False
            return _call_matches(got, self.expected)
        return True  # "assert": the program ran its assertions to the end


def extract_code(response: str) -> str | None:
    """The last ```python block (after a closing </think>), else the last fenced block, else None."""
    blocks = _FENCE.findall(final_part(response))
    if not blocks:
        return None
    py = [code for lang, code in blocks if lang.lower() in ("python", "py", "python3")]
    return (py or [code for _, code in blocks])[-1]


def _as_text(x) -> str:
    return "\n".join(map(str, x)) if isinstance(x, list) else str(x)


def build_cases(ground_truth, program: str) -> list[Case]:
    """Test cases for ``program``; raises ValueError on a ground truth of unknown shape.

    Shapes: ``{"inputs", "outputs"}`` (stdin/stdout; call-based with ``"fn_name"``), a list of
    ``{"input", "output"}``, ``{"assert_case": [statements]}``, and HumanEval-style
    ``{"test_code": "def check(candidate):\\n    assert ...", "entry_point": name,
    "import_prefix": "..."}`` (one case per assert line).
    """
    gt = json.loads(ground_truth) if isinstance(ground_truth, str) else ground_truth
    if isinstance(gt, dict) and "inputs" in gt and "outputs" in gt:
        if len(gt["inputs"]) != len(gt["outputs"]):
            raise ValueError("ground truth has different numbers of inputs and outputs")
        name = gt.get("fn_name")
        if name:
            source = PRELUDE + program + _CALL_DRIVER.format(name=name)
            return [Case(source, json.dumps(i), "call", o) for i, o in zip(gt["inputs"], gt["outputs"])]
        return [Case(program, _as_text(i), "stdio", o) for i, o in zip(gt["inputs"], gt["outputs"])]
    if isinstance(gt, list) and gt and all(isinstance(c, dict) and "input" in c and "output" in c
                                           for c in gt):
        return [Case(program, _as_text(c["input"]), "stdio", c["output"]) for c in gt]
    if isinstance(gt, dict) and isinstance(gt.get("assert_case"), list):
        return [Case(PRELUDE + program + "\n" + str(stmt) + "\n", "", "assert")
                for stmt in gt["assert_case"]]
    if isinstance(gt, dict) and "test_code" in gt and "entry_point" in gt:
        lines = [ln for ln in str(gt["test_code"]).split("\n") if ln.strip()]
        if len(lines) < 2:
            raise ValueError("test_code needs a check() header and at least one assert line")
        prefix = str(gt.get("import_prefix") or PRELUDE)
        return [Case(f"{prefix}{program}\n{lines[0]}\n{line}\ncheck({gt['entry_point']})\n", "",
                     "assert") for line in lines[1:]]
    raise ValueError("unknown code ground truth: expected {'inputs','outputs'[,'fn_name']}, a list "
                     "of {'input','output'}, {'assert_case'} or {'test_code','entry_point'}")


def _tokens_match(a: str, b: str) -> bool:
    ta, tb = a.split(), b.split()
    if len(ta) != len(tb):
        return False
    for x, y in zip(ta, tb):
        if x == y:
            continue
        try:
            fx, fy = float(x), float(y)
        except ValueError:
            return False
        if not math.isclose(fx, fy, rel_tol=1e-6, abs_tol=1e-6):
            return False
    return True


def stdout_matches(got: str, want) -> bool:
    """Line-wise equal ignoring trailing spaces and blank lines; else token-wise, floats to 1e-6."""
    want = "\n".join(want) if isinstance(want, list) else str(want)
    norm = lambda s: "\n".join(line.rstrip() for line in s.strip().splitlines())  # noqa: E731
    return norm(got) == norm(want) or _tokens_match(got, want)


def _call_matches(got, want) -> bool:
    if got == want:
        return True
    # APPS wraps call-based expected values in a one-element list
    return isinstance(want, list) and len(want) == 1 and got == want[0]


@register_reward("code", pooled=True, timeout_section="code")
def code_reward(item: RewardItem, cfg) -> Outcome:
    ccfg = cfg.code
    program = extract_code(item.response)
    if program is None:
        return Outcome(0.0, UNPARSABLE)
    try:
        cases = build_cases(item.ground_truth, program)
    except (ValueError, TypeError, KeyError) as exc:
        return Outcome(0.0, ERROR, detail=f"bad ground truth: {exc}")
    if not cases:
        return Outcome(0.0, ERROR, detail="no test cases")
    sandbox = Sandbox(ccfg.sandbox)
    stop_early = ccfg.mode == "all_pass" and ccfg.stop_on_first_failure
    passed, first_failure = 0, ""
    # stop before the pool's hard timeout would kill us (and lose the cases that did pass)
    deadline = time.monotonic() + 0.9 * ccfg.timeout_s
    for case in cases[: ccfg.max_cases]:
        if time.monotonic() + ccfg.sandbox.timeout_s > deadline:
            first_failure = first_failure or "time budget for this response exhausted"
            break
        res = sandbox.run_python(case.source, stdin=case.stdin)
        ok = case.passed(res)
        passed += ok
        if not ok and not first_failure:
            first_failure = ("timeout" if res.timed_out else
                             f"rc={res.returncode} {res.stderr[-200:]}".strip())
        if not ok and stop_early:
            break
    score = passed / len(cases) if ccfg.mode == "pass_rate" else float(passed == len(cases))
    status = CORRECT if passed == len(cases) else WRONG
    return Outcome(score, status, f"{passed}/{len(cases)} passed", first_failure)
