"""What the async rollout scheduler reports of each step: the ``async/*`` metrics, the reward
metrics of several reward calls as one, and the sample log (RUN_DIR/async_samples.jsonl).

Owns: :class:`StepTally` (what one step's collection saw), :data:`SAMPLE_LOG`.
May call: :mod:`megatron_rl.trainer.rollout_group` (nothing else).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

from megatron_rl.trainer.rollout_group import Group

# RUN_DIR/async_samples.jsonl: per step, the prompts trained on (their uids, in training order) and the
# weight versions of every response.
SAMPLE_LOG = "async_samples.jsonl"


@dataclass
class StepTally:
    """What one step's collection saw (its metrics)."""

    reward_calls: list[tuple[dict, list[dict]]] = field(default_factory=list)
    generated: int = 0  # groups of this step's waves that finished (and were scored)
    dropped_stale: int = 0
    dropped_zero_variance: int = 0
    aborted: int = 0
    drawn: int = 0
    wait_s: float = 0.0


def merge_reward_metrics(calls: list[tuple[dict, list[dict]]]) -> dict:
    """One step's reward metrics from several reward calls: counts add up, means are recomputed
    from the per-sample details (one call: its metrics unchanged)."""
    if len(calls) == 1:
        return dict(calls[0][0])
    out: dict = {}
    for metrics, _ in calls:
        for k, v in metrics.items():
            out[k] = out.get(k, 0.0) + v
    details = [d for _, ds in calls for d in ds]
    out["reward/mean"] = sum(d["score"] for d in details) / max(len(details), 1)
    for style in {d["style"] for d in details}:
        vals = [d["score"] for d in details if d["style"] == style]
        out[f"reward/{style}/mean"] = sum(vals) / len(vals)
    return out


def async_metrics(st: StepTally, taken: list[Group], version: int, max_staleness: int, in_flight: int,
                  buffered: int, engine_idle_s: float) -> dict:
    """The ``async/*`` metrics of a step that trains on ``taken`` at weight ``version``."""
    s = max_staleness
    comps = [c for g in taken for c in g.completions]
    stale = [version - c.weight_version for c in comps]
    m = {
        "async/staleness_mean": sum(stale) / max(len(stale), 1),
        "async/staleness_max": float(max(stale, default=0)),
        "async/partial_frac": sum(c.partial for c in comps) / max(len(comps), 1),
        "async/groups_generated": float(st.generated),
        "async/groups_trained": float(len(taken)),
        "async/groups_dropped_stale": float(st.dropped_stale),
        "async/groups_dropped_zero_variance": float(st.dropped_zero_variance),
        "async/groups_aborted": float(st.aborted),
        "async/prompts_drawn": float(st.drawn),
        "async/groups_in_flight": float(in_flight),
        "async/groups_buffered": float(buffered),
        "async/trainer_wait_s": st.wait_s,
        "async/engine_idle_s": engine_idle_s,
    }
    for d in range(s + 1):
        m[f"async/staleness_{d}"] = sum(x == d for x in stale) / max(len(stale), 1)
    return m


def log_versions(path: Path | None, row: dict, taken: list[Group], uid_of) -> None:
    """One line of the sample log: ``row`` (stage, step, trainer version) with the prompts trained on
    (``uid_of(group)``, in training order) and every response's (oldest, newest) weight version."""
    if path is None:
        return
    taken = sorted(taken, key=lambda g: g.tag)  # (the order they are trained in)
    row = {**row, "prompts": [uid_of(g) for g in taken],
           "versions": [[c.weight_version, c.newest_version] for g in taken for c in g.completions]}
    with open(path, "a") as f:
        f.write(json.dumps(row) + "\n")
