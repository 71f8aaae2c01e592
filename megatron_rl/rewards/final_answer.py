"""``boxed_final``: the response must END with ``\\boxed{answer}``, and the answer must match.

In real math data the final answer closes the solution, so a response cut at the length limit has no
answer and scores 0. In a task whose answer comes first (the CPU demo's addition), the same rule is
what keeps truncation meaningful: a response that runs on past its answer until the limit never
stated a final answer. Without it, "answer, then ramble to the limit" is rewarded, and the policy
learns to stop emitting EOS (seen in the demo: truncation ratio climbing to 1 with no mask).
"""

from __future__ import annotations

from megatron_rl.rewards.base import CORRECT, UNPARSABLE, WRONG, Outcome, RewardItem, register_reward
from megatron_rl.rewards.extract import last_boxed, normalize_ws


@register_reward("boxed_final")
def boxed_final(item: RewardItem, cfg=None) -> Outcome:
    answer = last_boxed(item.response)
    if answer is None or not item.response.rstrip().endswith("\\boxed{" + answer + "}"):
        return Outcome(0.0, UNPARSABLE, answer, "no final \\boxed{} answer at the end")
    ok = normalize_ws(answer) == normalize_ws(str(item.ground_truth))
    return Outcome(1.0 if ok else 0.0, CORRECT if ok else WRONG, answer)
