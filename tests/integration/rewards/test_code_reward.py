"""The code reward: programs from responses run in the sandbox against stdin/stdout and call cases."""

from __future__ import annotations

import json

import pytest

from megatron_rl.rewards import RewardConfig, RewardItem
from megatron_rl.rewards.code import build_cases, code_reward, extract_code, stdout_matches
from megatron_rl.rewards.sandbox import isolation_mode

pytestmark = [pytest.mark.slow, pytest.mark.timeout(120),
              pytest.mark.skipif(isolation_mode() == "none", reason="no namespaces here")]

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
    assert (case.kind, case.stdin, case.expected) == ("stdio", "1", "2")
    assert extract_code("<think>```python\nwrong\n```</think>```python\nright\n```") == "right\n"
    with pytest.raises(ValueError, match="unknown code ground truth"):
        build_cases({"tests": []}, "x")
    assert stdout_matches("3 \n\n", "3")
    assert stdout_matches("0.3333333", "0.33333333")
    assert not stdout_matches("0.34", "0.33")
    assert not stdout_matches("1 2", "1 2 3")
