"""Every prompt's reward style is resolved when the data is read, as scoring will resolve it: a
style that maps to nothing is a one-line error naming the file and row (scoring raised it at the
first step, after the models and engines were built), and prompts scored by a style that runs
programs need the code sandbox to start here (else each would be a counted zero)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from megatron_rl.rewards import RewardConfig, RewardDataError, RewardManager, check_reward_styles


def _rec(row: int, style: str = "", source: str = ""):
    return SimpleNamespace(row=row, style=style, data_source=source)


def test_reward_styles_resolve_as_scoring_does_and_are_counted():
    cfg = RewardConfig(style_map={"rule": "math", "apps": "code"}, default_style="exact_boxed")
    recs = [_rec(1, "rule"), _rec(2, "math"), _rec(3, "", "apps"), _rec(4, "weird", "elsewhere"), _rec(5, "exact_boxed")]
    manager = RewardManager(cfg)
    want: dict[str, int] = {}
    for r in recs:  # the manager's own resolution is the reference
        s = manager.resolve_style(r.style, r.data_source)
        want[s] = want.get(s, 0) + 1
    cfg.code.sandbox.require_isolation = False  # the sandbox is not what this test is about
    assert check_reward_styles(cfg, recs, "t.jsonl") == want == {"math": 2, "code": 1, "exact_boxed": 2}


def test_reward_style_that_resolves_to_nothing_names_file_row_and_fix():
    recs = [_rec(1, "math"), _rec(2, "math"), _rec(7, "rule", "my_source")]
    with pytest.raises(RewardDataError) as e:
        check_reward_styles(RewardConfig(), recs, "/data/train.jsonl")
    msg = str(e.value)
    for text in ("/data/train.jsonl: row 7:", "style='rule'", "data_source='my_source'", "'math'", "'code'",
                 "reward.style_map", "reward.default_style"):
        assert text in msg, msg


@pytest.mark.parametrize("required", [True, False])
def test_reward_style_code_needs_the_sandbox_to_start_when_isolation_is_required(tmp_path, required):
    """An interpreter that cannot run under bwrap stands for a machine without the sandbox."""
    cfg = RewardConfig()
    cfg.code.sandbox.python = str(tmp_path / "no_such_python")
    cfg.code.sandbox.require_isolation = required
    recs = [_rec(1, "code"), _rec(2, "math"), _rec(3, "code")]
    if not required:  # the explicit opt-in runs programs without isolation: accepted
        assert check_reward_styles(cfg, recs, "c.jsonl") == {"code": 2, "math": 1}
        return
    with pytest.raises(RewardDataError) as e:
        check_reward_styles(cfg, recs, "c.jsonl")
    msg = str(e.value)
    for text in ("c.jsonl: 2 prompts are scored by reward style code", "sandbox", "bubblewrap",
                 "require_isolation: false"):
        assert text in msg, msg
    # prompts without a sandboxed style never probe it
    assert check_reward_styles(cfg, [_rec(1, "math")], "m.jsonl") == {"math": 1}
