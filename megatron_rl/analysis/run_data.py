"""What a run directory holds, read into tables: metrics, rollout dumps, the wrong-label list.

GRPO steps are the x axis everywhere: a metrics row is a GRPO step when it carries rollout metrics
(SFT rows do not); ``grpo_step`` counts them over all stages from 1. A step logged twice (a resumed
run redoes the steps after its last checkpoint) counts once, with the newer row.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

import pandas as pd

from megatron_rl.common.errors import InputError
from megatron_rl.tracking.rollouts import read_rollouts
from megatron_rl.data.wrong_labels import FILE_NAME as WRONG_LABELS_FILE
from megatron_rl.data.wrong_labels import PLANTED_FILE

# What every run writes early (the log routing's directory, the tracker's metrics, the dumps, the
# summary): a directory with none of them is not a run directory.
RUN_MARKERS = ("metrics.jsonl", "logs", "rollouts", "summary.json")
TIMING_PARTS = ("gen", "reward", "logprob", "update", "sync", "dump", "other")


@dataclass
class StageSpan:
    name: str
    first: int  # first GRPO step
    last: int
    max_response_len: int | None


@dataclass
class RunData:
    root: Path
    metrics: pd.DataFrame  # one row per GRPO step, indexed 0..n-1, column grpo_step
    sft_steps: int
    stages: list[StageSpan]
    rollouts: pd.DataFrame | None = None
    wrong_labels: dict | None = None
    planted: dict | None = None
    summary: dict = field(default_factory=dict)

    def series(self, key: str) -> tuple[list, list]:
        """(grpo steps, values) of a metric, where logged."""
        if key not in self.metrics:
            return [], []
        m = self.metrics[["grpo_step", key]].dropna()
        return m["grpo_step"].tolist(), m[key].tolist()


def read_metrics(path: Path) -> tuple[pd.DataFrame, int]:
    """GRPO rows of metrics.jsonl (deduplicated by global step) and the count of SFT steps."""
    rows = []
    if path.exists():
        for line in path.read_text().splitlines():
            line = line.strip()
            if line:
                try:
                    rows.append(json.loads(line))
                except json.JSONDecodeError:  # a line cut by a crash mid-write
                    continue
    grpo = {}
    sft = set()
    for r in rows:
        if "rollout/accuracy" in r or "grpo_step" in r:
            grpo[r["step"]] = r  # the newer row of a redone step wins
        elif str(r.get("stage", "")).startswith("sft"):
            sft.add((r.get("stage"), r["step"]))
    df = pd.DataFrame([grpo[k] for k in sorted(grpo)])
    if len(df):
        if "grpo_step" not in df:
            df["grpo_step"] = range(1, len(df) + 1)
        df["grpo_step"] = df["grpo_step"].fillna(pd.Series(range(1, len(df) + 1))).astype(int)
    else:
        df = pd.DataFrame({"grpo_step": pd.Series(dtype=int), "stage": pd.Series(dtype=str)})
    return df.reset_index(drop=True), len({s for s in sft if s[0] == "sft"})


def stage_spans(metrics: pd.DataFrame, rollouts: pd.DataFrame | None) -> list[StageSpan]:
    spans: list[StageSpan] = []
    lens = {}
    if rollouts is not None and len(rollouts):
        lens = rollouts.groupby("stage")["max_response_len"].max().to_dict()
    for name, g in metrics.groupby("stage", sort=False):
        spans.append(StageSpan(str(name), int(g["grpo_step"].min()), int(g["grpo_step"].max()),
                               int(lens[name]) if name in lens else None))
    return sorted(spans, key=lambda s: s.first)


def _json(path: Path):
    return json.loads(path.read_text()) if path.exists() else None


class RunDirError(InputError):
    """The path given as a run directory is none."""


def load_run(run_dir: str | Path) -> RunData:
    root = Path(run_dir)
    if not root.is_dir():
        raise RunDirError(f"{root}: no such run directory")
    if not any((root / m).exists() for m in RUN_MARKERS):
        raise RunDirError(f"{root}: not a run directory (it has none of {', '.join(RUN_MARKERS)})")
    metrics, sft_steps = read_metrics(root / "metrics.jsonl")
    rollouts = read_rollouts(root)
    if rollouts is not None:
        rollouts = rollouts.drop_duplicates(["global_step", "group", "sample"], keep="last")
    return RunData(root=root, metrics=metrics, sft_steps=sft_steps,
                   stages=stage_spans(metrics, rollouts), rollouts=rollouts,
                   wrong_labels=_json(root / "rollouts" / WRONG_LABELS_FILE),
                   planted=_json(root / PLANTED_FILE), summary=_json(root / "summary.json") or {})


# --------------------------------------------------------------------------- derived figures' data
def dump_overhead(metrics: pd.DataFrame) -> float | None:
    """Share of GRPO step time spent writing the dumps (timing/dump over timing/step)."""
    if "timing/dump" not in metrics or "timing/step" not in metrics:
        return None
    m = metrics[["timing/dump", "timing/step"]].dropna()
    total = m["timing/step"].sum()
    return float(m["timing/dump"].sum() / total) if total > 0 else None


def sign_split(rollouts: pd.DataFrame, column: str) -> pd.DataFrame:
    """Per GRPO step, the mean of ``column`` over positive- and negative-advantage samples trained on."""
    r = rollouts[rollouts["in_batch"] & rollouts[column].notna()]
    r = r.assign(sign=["positive" if a > 0 else "negative" if a < 0 else "zero" for a in r["advantage"]])
    r = r[r["sign"] != "zero"]
    return r.groupby(["grpo_step", "sign"])[column].mean().unstack("sign").sort_index()


def pass_rates(rollouts: pd.DataFrame) -> pd.DataFrame:
    """One row per (prompt, step it was sampled at): pass rate, samples."""
    g = rollouts.groupby(["prompt_uid", "grpo_step"])["correct"]
    return pd.DataFrame({"pass_rate": g.mean(), "samples": g.size()}).reset_index()


def wrong_label_scores(data: RunData) -> dict:
    """Recall / precision of the live list against the planted labels, and planted hard prompts on it.

    Recall counts the planted prompts the run sampled at least once (from the dumps when they hold
    every prompt; a prompt never sampled cannot be judged), and is also given over all planted.
    """
    if not data.planted or data.wrong_labels is None:
        return {}
    planted = set(data.planted.get("wrong_label", []))
    hard = set(data.planted.get("hard", []))
    listed = {e["uid"] for e in data.wrong_labels.get("suspects", [])}
    seen = planted
    if data.rollouts is not None and len(data.rollouts):
        seen = planted & set(data.rollouts["prompt_uid"].unique())
    hit = listed & planted
    hard_seen = hard & set(data.rollouts["prompt_uid"].unique()) if data.rollouts is not None else hard
    return {
        "wrong_label_recall": len(hit & seen) / len(seen) if seen else None,
        "wrong_label_precision": len(hit) / len(listed) if listed else None,
        "wrong_label_recall_all_planted": len(hit) / len(planted) if planted else None,
        "planted_wrong_labels": len(planted), "planted_seen": len(seen), "suspected": len(listed),
        "planted_hard": len(hard), "planted_hard_seen": len(hard_seen),
        "planted_hard_on_list": len(listed & hard),
    }
