"""Two runs side by side: held-out greedy accuracy after the cold start and after GRPO, their gap.

    python -m megatron_rl.tools.compare_runs RUN_A RUN_B [--names A B] [--out FILE]

The tool demo (``make demo-tools``) compares the run with the calculator against the same budget
without it. Each run directory must hold ``summary.json`` (a finished run); the multi-turn
evaluation's tool metrics (``eval/tool_use_rate``, ``eval/accuracy_with_tool``, ...) and the time
spent (SFT, GRPO) come along. Prints a short table; the last line is one JSON object (also written to
``--out``): per run its facts, and ``gain_points`` (A minus B, after SFT and after GRPO).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from megatron_rl.common.cli_args import ArgumentParser, run_main
from megatron_rl.common.errors import InputError

TOOL_KEYS = ("tool_use_rate", "tool_calls_mean", "turns_mean", "tool_errors", "accuracy_with_tool",
             "accuracy_without_tool")


class RunsError(InputError):
    """A run directory without a finished run's summary."""


def run_facts(root: str | Path) -> dict:
    """What a finished run says about its held-out accuracy and cost."""
    root = Path(root)
    path = root / "summary.json"
    if not path.is_file():
        raise RunsError(f"{root}: no summary.json (not a finished run directory)")
    try:
        s = json.loads(path.read_text())
    except ValueError as exc:
        raise RunsError(f"{path}: not JSON ({exc})") from None
    stages = [k for k in s.get("per_stage", {}) if k != "start"]
    last = s["per_stage"][stages[-1]] if stages else {}
    grpo_seconds, grpo_steps = 0.0, 0
    metrics = root / "metrics.jsonl"
    if metrics.is_file():
        for line in metrics.read_text().splitlines():
            row = json.loads(line)
            if "timing/step" in row:
                grpo_seconds += row["timing/step"]
                grpo_steps += 1
    facts = {"accuracy_after_sft": s.get("accuracy_after_sft"), "accuracy_after_grpo": s.get("accuracy_after_grpo"),
             "eval_problems": s.get("eval_problems"), "sft_steps": s.get("sft_steps"),
             "sft_seconds": s.get("sft_seconds"), "grpo_steps": grpo_steps, "grpo_seconds": grpo_seconds}
    facts.update({f"eval_{k}": last[f"eval/{k}"] for k in TOOL_KEYS if f"eval/{k}" in last})
    return facts


def _points(a, b):
    return None if a is None or b is None else round(100.0 * (a - b), 2)


def compare(a: str | Path, b: str | Path, names: tuple[str, str] = ("a", "b")) -> dict:
    fa, fb = run_facts(a), run_facts(b)
    return {"runs": {names[0]: {"dir": str(a), **fa}, names[1]: {"dir": str(b), **fb}},
            "gain_points": {"after_sft": _points(fa["accuracy_after_sft"], fb["accuracy_after_sft"]),
                            "after_grpo": _points(fa["accuracy_after_grpo"], fb["accuracy_after_grpo"])}}


def _pct(v) -> str:
    return "-" if v is None else f"{100 * v:5.1f}%"


def main(argv: list[str] | None = None) -> int:
    p = ArgumentParser(prog="python -m megatron_rl.tools.compare_runs", command="compare runs",
                       description=__doc__.split("\n")[0])
    p.add_argument("run_a")
    p.add_argument("run_b")
    p.add_argument("--names", nargs=2, default=["a", "b"])
    p.add_argument("--out", default="", help="also write the JSON result here")

    def go() -> int:
        a = p.parse_args(argv)
        result = compare(a.run_a, a.run_b, tuple(a.names))
        for name, f in result["runs"].items():
            tools = f" (tool use {_pct(f['eval_tool_use_rate'])})" if "eval_tool_use_rate" in f else ""
            print(f"{name:>14}: held-out accuracy {_pct(f['accuracy_after_sft'])} after SFT "
                  f"({f['sft_steps']} steps) -> {_pct(f['accuracy_after_grpo'])} after GRPO "
                  f"({f['grpo_steps']} steps, {f['grpo_seconds']:.0f} s){tools}")
        g = result["gain_points"]
        print(f"{a.names[0]} - {a.names[1]}: {g['after_sft']} points after SFT, {g['after_grpo']} after GRPO")
        if a.out:
            Path(a.out).write_text(json.dumps(result, indent=1))
        print(json.dumps(result))
        return 0

    return run_main(go)


if __name__ == "__main__":
    sys.exit(main())
