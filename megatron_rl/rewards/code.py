"""Code rewards: run the response's program in the sandbox against test cases.

Ground truth (a JSON string or the decoded object), the shapes verl-format code datasets use:

* ``{"inputs": [...], "outputs": [...]}``: stdin/stdout cases (APPS / TACO / Skywork-OR1 style);
  with ``"fn_name"`` the cases are call-based: ``inputs[i]`` is the argument list of
  ``fn_name`` (a function, or a method of ``class Solution``), ``outputs[i]`` its return value;
* ``[{"input": ..., "output": ...}, ...]``: stdin/stdout cases.

Reward: pass rate, or 1/0 for all cases passing (``code.mode``). The program is the last fenced
code block of the response (```` ```python ```` preferred).
"""

from __future__ import annotations

import json
import math
import re
import time

from megatron_rl.rewards.base import (CORRECT, ERROR, UNPARSABLE, WRONG, Outcome, RewardItem,
                                      register_reward)
from megatron_rl.rewards.sandbox import Sandbox

_FENCE = re.compile(r"```([A-Za-z0-9_+-]*)[ \t]*\n(.*?)```", re.S)

_CALL_DRIVER = """
import json as _json, sys as _sys
_args = _json.loads(_sys.stdin.read())
if "Solution" in globals() and hasattr(globals()["Solution"], {name!r}):
    _fn = getattr(Solution(), {name!r})
else:
    _fn = globals()[{name!r}]
_sys.stdout.write("\\n__RESULT__" + _json.dumps(_fn(*_args)))
"""


def extract_code(response: str) -> str | None:
    """The last ```python block, else the last fenced block of any language, else ``None``."""
    blocks = _FENCE.findall(response)
    if not blocks:
        return None
    py = [code for lang, code in blocks if lang.lower() in ("python", "py", "python3")]
    return (py or [code for _, code in blocks])[-1]


def parse_cases(ground_truth) -> tuple[list[tuple[object, object]], str | None]:
    """``([(input, expected), ...], fn_name or None)``; raises ValueError on an unknown shape."""
    gt = json.loads(ground_truth) if isinstance(ground_truth, str) else ground_truth
    if isinstance(gt, dict) and "inputs" in gt and "outputs" in gt:
        if len(gt["inputs"]) != len(gt["outputs"]):
            raise ValueError("ground truth has different numbers of inputs and outputs")
        return list(zip(gt["inputs"], gt["outputs"])), gt.get("fn_name") or None
    if isinstance(gt, list) and all(isinstance(c, dict) and "input" in c and "output" in c
                                    for c in gt):
        return [(c["input"], c["output"]) for c in gt], None
    raise ValueError("code ground truth must be {'inputs', 'outputs'[, 'fn_name']} or a list of "
                     "{'input', 'output'}")


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
        cases, fn_name = parse_cases(item.ground_truth)
    except (ValueError, TypeError) as exc:
        return Outcome(0.0, ERROR, detail=f"bad ground truth: {exc}")
    if not cases:
        return Outcome(0.0, ERROR, detail="no test cases")
    sandbox = Sandbox(ccfg.sandbox)
    source = program + (_CALL_DRIVER.format(name=fn_name) if fn_name else "")
    stop_early = ccfg.mode == "all_pass" and ccfg.stop_on_first_failure
    passed, first_failure = 0, ""
    # stop before the pool's hard timeout would kill us (and lose the cases that did pass)
    deadline = time.monotonic() + 0.9 * ccfg.timeout_s
    for inp, want in cases[: ccfg.max_cases]:
        if time.monotonic() + ccfg.sandbox.timeout_s > deadline:
            first_failure = first_failure or "time budget for this response exhausted"
            break
        stdin = json.dumps(inp) if fn_name else ("\n".join(inp) if isinstance(inp, list) else inp)
        res = sandbox.run_python(source, stdin=str(stdin))
        if fn_name:
            marker = res.stdout.rfind("__RESULT__")
            ok = res.ok and marker >= 0
            if ok:
                try:
                    ok = _call_matches(json.loads(res.stdout[marker + len("__RESULT__"):]), want)
                except ValueError:
                    ok = False
        else:
            ok = res.ok and stdout_matches(res.stdout, want)
        passed += ok
        if not ok and not first_failure:
            first_failure = ("timeout" if res.timed_out else
                             f"rc={res.returncode} {res.stderr[-200:]}".strip())
        if not ok and stop_early:
            break
    rate = passed / len(cases)
    score = rate if ccfg.mode == "pass_rate" else float(passed == len(cases))
    status = CORRECT if passed == len(cases) else WRONG
    return Outcome(score, status, f"{passed}/{len(cases)} passed", first_failure)
