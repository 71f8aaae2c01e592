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
import secrets
import time
from dataclasses import dataclass, field
from pathlib import Path

from megatron_rl.rewards.base import (CORRECT, ERROR, UNPARSABLE, WRONG, Outcome, RewardItem,
                                      register_reward)
from megatron_rl.rewards.extract import final_part
from megatron_rl.rewards.sandbox import Sandbox

_FENCE = re.compile(r"```([A-Za-z0-9_+-]*)[ \t]*\n(.*?)```", re.S)

# Names LeetCode-style solutions use without importing them (``List[int]`` in a signature).
PRELUDE = ("from typing import *\nimport math, collections, itertools, heapq, bisect, functools, "
           "string, re\nfrom collections import *\nfrom itertools import *\nfrom functools import *\n"
           "from heapq import *\nfrom bisect import *\n")

HARNESS = (Path(__file__).with_name("harness.py")).read_text()


@dataclass
class Case:
    """One test of a program.

    ``stdio``: the program runs as ``main.py`` with ``stdin``; it passes when it exits 0 and its
    stdout matches ``expected``. ``assert`` / ``call``: the harness (``rewards/harness.py``)
    imports the program and runs ``tests`` (assert statements) or calls ``fn_name(*args)``; only
    the harness's report decides (``call``: its result is compared with ``expected`` here, outside
    the sandbox), never the exit status.
    """

    kind: str  # "stdio" | "call" | "assert"
    program: str
    stdin: str = ""
    expected: object = None
    prelude: str = ""
    tests: str = ""
    fn_name: str = ""
    args: list = field(default_factory=list)


@dataclass
class CaseResult:
    passed: bool
    detail: str  # why it failed ("" when it passed)


def harness_report(channel: bytes, token: bytes) -> dict | None:
    """The harness's report: exactly one line ``<token> <json object>``, else ``None``."""
    prefix = token + b" "
    if not channel.startswith(prefix) or not channel.endswith(b"\n") or channel.count(b"\n") != 1:
        return None
    try:
        report = json.loads(channel[len(prefix):].decode("utf-8"))
    except ValueError:
        return None
    return report if isinstance(report, dict) else None


def run_case(sandbox: Sandbox, case: Case) -> CaseResult:
    """Run one case in the sandbox and judge it."""
    if case.kind == "stdio":
        res = sandbox.run_python(case.program, stdin=case.stdin)
        if res.timed_out:
            return CaseResult(False, "timeout")
        if res.returncode != 0:
            return CaseResult(False, f"rc={res.returncode} {res.stderr[-200:]}".strip())
        ok = stdout_matches(res.stdout, case.expected)
        return CaseResult(ok, "" if ok else "wrong output")
    token = secrets.token_hex(16).encode()
    spec = {"prelude": case.prelude, "tests": case.tests, "fn_name": case.fn_name, "args": case.args}
    res = sandbox.run({"harness.py": HARNESS, "solution.py": case.program, "spec.json": json.dumps(spec)},
                      [sandbox.python, "-I", "-B", "harness.py", case.kind], secret=token)
    if res.timed_out:
        return CaseResult(False, "timeout")
    report = harness_report(res.channel, token)
    if report is None:  # the process ended before the harness reported: the tests did not run
        return CaseResult(False, f"no harness report (the program ended early, rc="
                                        f"{res.returncode}) {res.stderr[-200:]}".strip())
    if report.get("status") != "pass":
        return CaseResult(False, f"{report.get('status')} in {report.get('stage')}: "
                                        f"{report.get('error', '')}"[:300])
    if case.kind == "assert":
        return CaseResult(True, "")
    try:
        got = json.loads(report["result"])
    except (KeyError, TypeError, ValueError):
        return CaseResult(False, "unreadable result")
    ok = _call_matches(got, case.expected)
    return CaseResult(ok, "" if ok else "wrong result")


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
            return [Case("call", program, prelude=PRELUDE, fn_name=str(name), args=list(i), expected=o)
                    for i, o in zip(gt["inputs"], gt["outputs"])]
        return [Case("stdio", program, _as_text(i), o) for i, o in zip(gt["inputs"], gt["outputs"])]
    if isinstance(gt, list) and gt and all(isinstance(c, dict) and "input" in c and "output" in c
                                           for c in gt):
        return [Case("stdio", program, _as_text(c["input"]), c["output"]) for c in gt]
    if isinstance(gt, dict) and isinstance(gt.get("assert_case"), list):
        return [Case("assert", program, prelude=PRELUDE, tests=str(stmt) + "\n")
                for stmt in gt["assert_case"]]
    if isinstance(gt, dict) and "test_code" in gt and "entry_point" in gt:
        lines = [ln for ln in str(gt["test_code"]).split("\n") if ln.strip()]
        if len(lines) < 2:
            raise ValueError("test_code needs a check() header and at least one assert line")
        prefix = str(gt.get("import_prefix") or PRELUDE)
        return [Case("assert", program, prelude=prefix,
                     tests=f"{lines[0]}\n{line}\ncheck({gt['entry_point']})\n") for line in lines[1:]]
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


@register_reward("code", pooled=True, timeout_section="code", sandboxed=True)
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
        res = run_case(sandbox, case)
        passed += res.passed
        if not res.passed and not first_failure:
            first_failure = res.detail
        if not res.passed and stop_early:
            break
    score = passed / len(cases) if ccfg.mode == "pass_rate" else float(passed == len(cases))
    status = CORRECT if passed == len(cases) else WRONG
    return Outcome(score, status, f"{passed}/{len(cases)} passed", first_failure)
