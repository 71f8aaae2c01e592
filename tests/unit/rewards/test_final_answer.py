"""boxed_final: right only when the response ends with the matching boxed answer."""

import pytest

from megatron_rl.rewards import RewardItem, get_style


@pytest.mark.parametrize("response,score,status", [
    ("\\boxed{168}", 1.0, "correct"),
    ("so 12+156 = \\boxed{ 168 }  \n", 1.0, "correct"),
    ("\\boxed{167}", 0.0, "wrong"),
    ("\\boxed{168}}3+", 0.0, "unparsable"),          # ran on past its answer (truncated ramble)
    ("\\boxed{16", 0.0, "unparsable"),               # cut inside the answer
    ("\\boxed{1}\\boxed{168}", 1.0, "correct"),      # the final answer counts
    ("168", 0.0, "unparsable"),
])
def test_boxed_final(response, score, status):
    out = get_style("boxed_final").fn(RewardItem(response=response, ground_truth="168", style="boxed_final"))
    assert (out.score, out.status) == (score, status)
