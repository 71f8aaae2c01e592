"""Whole runs of the real trainer with multi-turn prompts, on the key walk's fakes (``fake_run.py``: a
bigram policy and engine): the loop, the async scheduler (one-step-off, oversampling, a checkpoint
taken with trajectories generated ahead and resumed), the dumps and the run report.

References: the run's own records (what was trained on must be each trajectory's model tokens only:
the fake policy's loss sees the batch's mask), and HTML escaping of what a tool printed.
"""

from __future__ import annotations

import json
from pathlib import Path

import pandas as pd
import torch

from megatron_rl.envs import Environment, StepResult, ToolOutput, register_env
from megatron_rl.trainer.schema import load_run_config
from test_every_key_acts import base_overrides, run_fake

HOSTILE = "<script>alert('x')</script>&"


@register_env("test_hostile_tool")
class HostileTool(Environment):
    """One tool call whose output is HTML, then the answer."""

    def step(self, turn: str) -> StepResult:
        if self.calls:
            return StepResult(done=True)
        return self.use_tool("hostile", lambda: ToolOutput(HOSTILE))


def _cfg(tmp: Path, *extra: str):
    over = base_overrides(tmp) + ["stages=[{name: s1, max_response_len: 100, max_steps: 3}]",
                                  f"trainer.run_dir={tmp / 'run'}", *extra]
    return load_run_config(None, over)


def _rows(root: Path) -> list[dict]:
    return [json.loads(line) for line in (root / "metrics.jsonl").read_text().splitlines()]


def test_multi_turn_run_trains_logs_dumps_and_reports_trajectories(tmp_path):
    """A synchronous run: env/* metrics, multi-turn evaluations, the dumps' turns, the report (a
    tool's HTML escaped); the batch each step trains on is masked to each trajectory's model tokens,
    so the policy's loss denominator counts model tokens only (the fake policy computes the same mask)."""
    from megatron_rl.analysis import analyze
    from megatron_rl.models.batch import LOSS_MASK
    from megatron_rl.trainer import phases

    seen = []
    real = phases.make_batch

    def spy(ro, algo, *args):
        batch, m = real(ro, algo, *args)
        seen.append((ro, batch))
        return batch, m

    cfg = _cfg(tmp_path, "envs.default_env=test_hostile_tool")
    phases.make_batch = spy
    try:
        out = run_fake(cfg, tmp_path, observed=True)
    finally:
        phases.make_batch = real
    assert out["code"] == 0, out["code"]
    assert len([b for _, b in seen if b is not None]) >= 2
    for ro, batch in seen:
        if batch is None:
            continue
        comps = [ro.completions[i] for i in ro.batch_index]
        for mask, c in zip(batch.token_fields[LOSS_MASK], comps):
            assert mask.tolist() == c.model_tokens()
        assert phases.response_tokens(batch) == sum(sum(c.loss_mask) for c in comps)
        assert phases.response_tokens(batch) < sum(len(c.token_ids) for c in comps)
    root = Path(cfg.trainer.run_dir)
    steps = [r for r in _rows(root) if "env/trajectories" in r]
    assert len(steps) == 3 and all(r["env/trajectories"] == 12 for r in steps)
    assert all(r["env/tool_calls"] > 0 and 0 < r["env/observation_token_share"] < 1 for r in steps)
    evals = json.loads((root / "run_state.json").read_text())["eval"]  # the greedy evaluations: multi-turn
    assert set(evals) == {"start", "s1"} and all(e["eval/trajectories"] == 3 for e in evals.values())
    # what the policy trained on: each sequence's model tokens only (the fake's loss honours the mask)
    dumps = pd.concat(pd.read_parquet(p) for p in sorted((root / "rollouts").glob("step_*.parquet")))
    assert set(dumps["env"]) == {"test_hostile_tool"}
    tool_msgs = [m for ms in dumps["messages"] for m in ms if m["role"] == "tool"]
    assert tool_msgs and {m["text"] for m in tool_msgs} == {HOSTILE}
    # (a first turn that runs to the length limit ends its trajectory before any tool call)
    assert (dumps["observation_tokens"] > 0).mean() > 0.5 and (dumps["turns"] >= 1).all()
    facts = analyze(root)
    page = Path(facts["report"]).read_text()
    assert page.count('id="multi_turn"') == 1 and "tool calls per trajectory" in page
    assert "<script>alert" not in page and "&lt;script&gt;alert(&#x27;x&#x27;)&lt;/script&gt;&amp;" in page


def test_multi_turn_async_runs_one_step_off_oversampled_and_resume_from_a_checkpoint(tmp_path):
    """Async GRPO per trajectory on the fakes: one-step-off, and oversampled (the streaming fake:
    leftovers aborted) both finish; a run stopped mid-stage with trajectories generated ahead saves
    them (loss masks and episodes included) and the resumed run trains on them."""
    env = ["envs.default_env=test_hostile_tool"]
    for i, extra in enumerate((["rollout.async.max_staleness=1"],
                               ["rollout.async.max_staleness=2", "rollout.async.oversample=0.5"])):
        cfg = _cfg(tmp_path / f"a{i}", *env, *extra)
        out = run_fake(cfg, tmp_path / f"a{i}")
        assert out["code"] == 0, out["code"]
        assert [r["env/trajectories"] for r in _rows(Path(cfg.trainer.run_dir)) if "env/trajectories" in r]
    cfg = _cfg(tmp_path / "r", *env, "rollout.async.max_staleness=1", "trainer.save_every=1")
    out = run_fake(cfg, tmp_path / "r", preempt_after=1)
    assert out["code"] == 99, out["code"]
    root = Path(cfg.trainer.run_dir)
    saved = torch.load(next(root.glob("s1/checkpoints/step_*/rollouts.pt")), weights_only=True)
    done = [g for g in saved["groups"] if g["completions"]]
    assert done, "nothing generated ahead was saved"
    comps = [c for g in done for c in g["completions"]]
    assert all(len(c["loss_mask"]) == len(c["token_ids"]) and "episode" in c["extra"] for c in comps)
    called = [c for c in comps if c["extra"]["episode"]["tool_calls"]]
    assert called and any(0 in c["loss_mask"] for c in called)  # (an observation may find no room)
    out = run_fake(cfg, tmp_path / "r")
    assert out["code"] == 0, out["code"]
    assert len([r for r in _rows(root) if "env/trajectories" in r]) == 3
