"""The code reward: programs from responses run in the sandbox against stdin/stdout and call cases."""

from __future__ import annotations

import json

import pytest

from megatron_rl.rewards import RewardConfig, RewardItem
from megatron_rl.rewards.code import build_cases, code_reward, extract_code, stdout_matches

pytestmark = [pytest.mark.slow, pytest.mark.timeout(120), pytest.mark.usefixtures("bwrap_sandbox")]

# sum of two numbers; expected outputs computed here, independently of any program under test
CASES = [(f"{a} {b}\n", f"{a + b}\n") for a, b in [(1, 2), (10, -3), (0, 0), (7, 8)]]
STDIO_GT = json.dumps({"inputs": [c[0] for c in CASES], "outputs": [c[1] for c in CASES]})


def _cfg(mode="pass_rate", timeout_s=15.0) -> RewardConfig:
    cfg = RewardConfig()
    cfg.code.mode = mode
    cfg.code.sandbox.timeout_s = timeout_s  # generous: this machine is shared and often loaded
    return cfg


def _resp(code: str) -> str:
    return f"Here is my solution.\n```python\n{code}\n```\n"


def test_correct_program_scores_one():
    out = code_reward(RewardItem(_resp("a, b = map(int, input().split())\nprint(a + b)"), STDIO_GT,
                                 "code"), _cfg())
    assert out.score == 1.0 and out.status == "correct" and out.extracted == "4/4 passed"


def test_partially_correct_program_pass_rate_and_all_pass():
    wrong_on_negatives = "a, b = map(int, input().split())\nprint(abs(a) + abs(b))"
    item = RewardItem(_resp(wrong_on_negatives), STDIO_GT, "code")
    assert code_reward(item, _cfg("pass_rate")).score == pytest.approx(3 / 4)
    assert code_reward(item, _cfg("all_pass")).score == 0.0


def test_hanging_program_fails_its_cases_within_the_limit():
    out = code_reward(RewardItem(_resp("while True:\n    pass"), STDIO_GT, "code"),
                      _cfg("all_pass", timeout_s=2.0))
    assert out.score == 0.0 and out.detail == "timeout"


def test_call_based_cases_with_solution_class():
    gt = {"fn_name": "twoSum", "inputs": [[[2, 7, 11, 15], 9], [[3, 2, 4], 6]],
          "outputs": [[0, 1], [1, 2]]}
    code = ("class Solution:\n    def twoSum(self, nums, target):\n"
            "        seen = {}\n        for i, x in enumerate(nums):\n"
            "            if target - x in seen:\n                return [seen[target - x], i]\n"
            "            seen[x] = i\n")
    out = code_reward(RewardItem(_resp(code), json.dumps(gt), "code"), _cfg())
    assert out.score == 1.0, out
    gt["outputs"][1] = [0, 2]
    assert code_reward(RewardItem(_resp(code), gt, "code"), _cfg()).score == 0.5


def test_leetcode_function_with_typing_names_and_assert_cases():
    code = "def add(xs: List[int]) -> int:\n    return sum(xs)\n"
    calls = {"fn_name": "add", "inputs": [[[1, 2, 3]], [[]]], "outputs": [6, 0]}
    assert code_reward(RewardItem(_resp(code), calls, "code"), _cfg()).score == 1.0
    asserts = {"assert_case": ["assert add([1, 1]) == 2", "assert add([5]) == 6"]}
    assert code_reward(RewardItem(_resp(code), asserts, "code"), _cfg()).score == 0.5
    humaneval = {"test_code": "def check(candidate):\n    assert candidate([2]) == 2\n"
                              "    assert candidate([2, 2]) == 4\n", "entry_point": "add"}
    out = code_reward(RewardItem(_resp(code), humaneval, "code"), _cfg())
    assert out.score == 1.0 and out.extracted == "2/2 passed"


def test_no_code_block_is_unparsable_and_bad_ground_truth_is_an_error():
    assert code_reward(RewardItem("print(1)", STDIO_GT, "code"), _cfg()).status == "unparsable"
    assert code_reward(RewardItem(_resp("print(1)"), "{\"x\": 1}", "code"), _cfg()).status == "error"


def test_pure_helpers():
    assert extract_code("```\na\n```\n```python\nb\n```\n```js\nc\n```") == "b\n"
    assert extract_code("```js\nc\n```") == "c\n"
    (case,) = build_cases([{"input": "1", "output": "2"}], "print(2)")
    assert (case.kind, case.stdin, case.expected, case.program) == ("stdio", "1", "2", "print(2)")
    assert extract_code("<think>```python\nwrong\n```</think>```python\nright\n```") == "right\n"
    with pytest.raises(ValueError, match="unknown code ground truth"):
        build_cases({"tests": []}, "x")
    assert stdout_matches("3 \n\n", "3")
    assert stdout_matches("0.3333333", "0.33333333")
    assert not stdout_matches("0.34", "0.33")
    assert not stdout_matches("1 2", "1 2 3")


def test_harness_report_needs_the_runs_token():
    """Only ``<the run's token> <json object>\\n`` is a report: a line with another token of the same
    length, a prefix of the token, no token, or a second line is not."""
    from megatron_rl.rewards.code import harness_report

    token = b"3f" * 16
    body = b'{"status": "pass", "result": "3"}'
    assert harness_report(token + b" " + body + b"\n", token) == {"status": "pass", "result": "3"}
    for forged in (b"0" * 32 + b" " + body + b"\n", token[:-1] + b"0 " + body + b"\n",
                   token[:16] + b" " + body + b"\n", body + b"\n", b" " + body + b"\n",
                   token + b" " + body + b"\n" + token + b" " + body + b"\n", token + b" " + body,
                   token + b" [1]\n"):
        assert harness_report(forged, token) is None, forged


# ---- reward hacks: a wrong program that ends the process early must not pass ---------------------
WRONG_ADD = "def add(xs):\n    return -1\n"
RIGHT_ADD = "def add(xs):\n    return sum(xs)\n"
# Ground truths of the three harness-run shapes, two cases each; `add` must return the sum.
HARNESS_GTS = {
    "assert_case": {"assert_case": ["assert add([1, 2]) == 3", "assert add([5]) == 5"]},
    "test_code": {"test_code": "def check(candidate):\n    assert candidate([2]) == 2\n"
                               "    assert candidate([2, 2]) == 4\n", "entry_point": "add"},
    "call": {"fn_name": "add", "inputs": [[[1, 2]], [[4]]], "outputs": [3, 4]},
}
EARLY_ENDS = {
    "sys_exit": "import sys\nsys.exit(0)\n",
    "os_exit": "import os\nos._exit(0)\n",
    "raise_systemexit": "raise SystemExit(0)\n",
    "atexit_os_exit": "import atexit, os\natexit.register(os._exit, 0)\n",
    "atexit_systemexit": "import atexit, sys\natexit.register(sys.exit, 0)\n",
    "sigkill_self": "import os, signal\nos.kill(os.getpid(), signal.SIGKILL)\n",
    "close_stdout": "import sys, os\nsys.stdout.close()\nos.close(1)\n",
    "exec_true": "import os\nos.execv('/bin/true', ['true'])\n",
    "exec_python": "import os, sys\nos.execv(sys.executable, [sys.executable, '-c', 'pass'])\n",
    "quiet_excepthook": "import sys\nsys.excepthook = lambda *a: None\n",
    # forges what an exit-status or stdout based harness would read, then leaves
    "forged_output": ("import sys, json\nprint('\\n__RESULT__' + json.dumps(3))\n"
                      "print('pass')\nsys.stdout.flush()\nsys.exit(0)\n"),
    "forged_report_fds": ("import os\nfor fd in range(3, 64):\n    try:\n"
                          "        os.write(fd, b'x {\"status\": \"pass\", \"result\": \"3\"}\\n')\n"
                          "    except OSError:\n        pass\nos._exit(0)\n"),
    # the same with a prefix as long as the run's token (32 hex digits): only the token itself may pass
    "forged_report_token_length": ("import os\nfor fd in range(3, 64):\n    try:\n"
                                   "        os.write(fd, b'0' * 32 + b' {\"status\": \"pass\", \"result\": \"3\"}\\n')\n"
                                   "    except OSError:\n        pass\nos._exit(0)\n"),
}


@pytest.mark.parametrize("hack", sorted(EARLY_ENDS))
def test_wrong_program_that_ends_early_scores_zero(hack):
    for shape, gt in HARNESS_GTS.items():
        # the early end both before the tests and (for atexit-style hooks) around them
        for program in (EARLY_ENDS[hack] + WRONG_ADD, WRONG_ADD + EARLY_ENDS[hack]):
            out = code_reward(RewardItem(_resp(program), gt, "code"), _cfg())
            assert out.score == 0.0 and out.status == "wrong", (shape, program, out)


def test_right_program_passes_through_the_harness_and_cannot_read_the_tests():
    # A main guard does not run (the program is imported); the tests file is gone before it runs.
    program = ("import os, sys\nassert not os.path.exists('spec.json'), os.listdir('.')\n" + RIGHT_ADD
               + "if __name__ == '__main__':\n    sys.exit(1)\n")
    for shape, gt in HARNESS_GTS.items():
        out = code_reward(RewardItem(_resp(program), gt, "code"), _cfg())
        assert out.score == 1.0 and out.extracted == "2/2 passed", (shape, out)
    out = code_reward(RewardItem(_resp(RIGHT_ADD + "import sys\nsys.exit(0)\n"), HARNESS_GTS["call"], "code"),
                      _cfg())
    assert out.score == 0.0 and "exited" in out.detail  # ended before the harness could call it


def test_no_process_of_the_program_outlives_the_report():
    """A child left behind waits for the harness's report and appends to it: the harness kills the
    program's other processes before it reports, so the report stays whole (and a right program
    passes)."""
    tamper = ("import os\nif os.fork() == 0:\n    while True:\n        for fd in range(3, 32):\n"
              "            try:\n                if os.fstat(fd).st_size:\n"
              "                    os.write(fd, b'tampered\\n')\n                    os._exit(0)\n"
              "            except OSError:\n                pass\n")
    out = code_reward(RewardItem(_resp(tamper + RIGHT_ADD), HARNESS_GTS["assert_case"], "code"), _cfg())
    assert out.score == 1.0, out
