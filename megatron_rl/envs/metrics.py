"""The step's multi-turn metrics (``env/*``), from the trajectories' episode records."""

from __future__ import annotations

import logging

log = logging.getLogger("megatron_rl")


def episode_metrics(completions, correct: list[bool]) -> dict[str, float]:
    """Over the completions that are multi-turn trajectories (``extra["episode"]``, written by
    ``rollout/multi_turn.py``); {} when there are none. ``correct``: each completion's verdict.
    Failed tool calls (crashes, timeouts, bad input) are logged too: one line per call of this."""
    eps = [(c, c.extra["episode"], ok) for c, ok in zip(completions, correct) if "episode" in c.extra]
    if not eps:
        return {}
    n = len(eps)
    calls = [e["tool_calls"] for _, e, _ in eps]
    with_tool = [ok for _, e, ok in eps if e["tool_calls"]]
    without = [ok for _, e, ok in eps if not e["tool_calls"]]
    tokens = sum(len(c.token_ids) for c, _, _ in eps)
    out = {
        "env/trajectories": float(n),
        "env/turns_mean": sum(e["turns"] for _, e, _ in eps) / n,
        "env/turns_max": float(max(e["turns"] for _, e, _ in eps)),
        "env/tool_calls": float(sum(calls)),
        "env/tool_calls_mean": sum(calls) / n,
        "env/tool_use_rate": len(with_tool) / n,
        "env/tool_errors": float(sum(e["tool_errors"] for _, e, _ in eps)),
        "env/tool_timeouts": float(sum(e["tool_timeouts"] for _, e, _ in eps)),
        "env/tool_budget_exhausted": float(sum(e["budget_refused"] for _, e, _ in eps)),
        "env/observations_cut": float(sum(e["observations_cut"] for _, e, _ in eps)),
        "env/max_turns_reached": float(sum(e["ended"] == "max_turns" for _, e, _ in eps)),
        "env/observation_token_share": sum(e["observation_tokens"] for _, e, _ in eps) / max(tokens, 1),
    }
    if out["env/tool_errors"]:
        log.warning("tools: %d errors (%d timeouts) in %d calls of %d trajectories; the model read an error "
                    "message for each, the episodes went on (env/tool_errors, env/tool_timeouts)",
                    out["env/tool_errors"], out["env/tool_timeouts"], out["env/tool_calls"], n)
    if with_tool:
        out["env/accuracy_with_tool"] = sum(with_tool) / len(with_tool)
    if without:
        out["env/accuracy_without_tool"] = sum(without) / len(without)
    return out
