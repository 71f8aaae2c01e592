"""``python -m megatron_rl.tools.compare_runs``: the tool demo's comparison of two finished runs."""

from __future__ import annotations

import json

from megatron_rl.tools.compare_runs import compare, main


def _run(root, sft, grpo, tool_eval=None, steps=(1.5, 2.5)):
    root.mkdir(parents=True)
    last = {"eval/accuracy": grpo, **(tool_eval or {})}
    (root / "summary.json").write_text(json.dumps({
        "accuracy_after_sft": sft, "accuracy_after_grpo": grpo, "eval_problems": 400, "sft_steps": 100,
        "sft_seconds": 60.0, "per_stage": {"start": {"eval/accuracy": sft}, "grpo_40": last}}))
    (root / "metrics.jsonl").write_text("".join(json.dumps({"timing/step": s}) + "\n" for s in steps))
    return root


def test_tool_demo_comparison_reads_both_runs_and_their_gap(tmp_path, capsys):
    a = _run(tmp_path / "with", 0.8125, 0.8275, {"eval/tool_use_rate": 1.0, "eval/accuracy_with_tool": 0.8275})
    b = _run(tmp_path / "without", 0.0, 0.01)
    out = compare(a, b, ("with_tools", "without_tools"))
    assert out["gain_points"] == {"after_sft": 81.25, "after_grpo": 81.75}
    w = out["runs"]["with_tools"]
    assert w["grpo_steps"] == 2 and w["grpo_seconds"] == 4.0 and w["eval_tool_use_rate"] == 1.0
    assert "eval_tool_use_rate" not in out["runs"]["without_tools"]
    assert main([str(a), str(b), "--out", str(tmp_path / "c.json")]) == 0
    last = capsys.readouterr().out.strip().splitlines()[-1]
    assert json.loads(last) == json.loads((tmp_path / "c.json").read_text())
    assert main([str(a), str(tmp_path / "nothing")]) == 2  # not a finished run: one line, exit 2
    assert "no summary.json" in capsys.readouterr().err
