"""What a run directory holds, read into tables: metrics, rollout dumps, the wrong-label list.

GRPO steps are the x axis everywhere: a metrics row is a GRPO step when it carries rollout metrics
(SFT rows do not); ``grpo_step`` counts them over all stages from 1. A step logged twice (a resumed
run redoes the steps after its last checkpoint) counts once, with the newer row.

Everything read here came from files anyone could have written: values are checked for the type
the report uses them as (a metric is a number, a prompt id a string, ...). What cannot be used (a
dump that is no parquet, a metrics line that is no JSON object, a wrong-label list of another
shape) is left out and named in ``RunData.skipped`` (file, and line), and the report is made from
the rest; a file that cannot be read at all (a directory, no permission) raises :class:`RunDirError`.
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
    # Inputs left out, each naming its file (and line) and why; the report lists them.
    skipped: list[str] = field(default_factory=list)
    # Left out as expected, not a fault: the last metrics line of a run cut mid-write.
    notes: list[str] = field(default_factory=list)

    def series(self, key: str) -> tuple[list, list]:
        """(grpo steps, values) of a metric, where logged."""
        if key not in self.metrics:
            return [], []
        m = self.metrics[["grpo_step", key]].dropna()
        return m["grpo_step"].tolist(), m[key].tolist()


def read_metrics(path: Path, skipped: list[str] | None = None,
                 notes: list[str] | None = None) -> tuple[pd.DataFrame, int]:
    """GRPO rows of metrics.jsonl (deduplicated by global step) and the count of SFT steps.

    A line that is no JSON object with an integer ``step`` is left out and named in ``skipped``
    (the last line, when the file does not end with a newline, in ``notes``: a write cut by a
    crash); metric values that are not numbers are read as missing, ``stage`` as text."""
    skipped = [] if skipped is None else skipped
    rows, bad = [], []
    raw = _read_bytes(path) if path.exists() else b""
    lines = raw.split(b"\n")
    for i, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line.decode("utf-8"))
        except (UnicodeDecodeError, json.JSONDecodeError):
            row = None
        if isinstance(row, dict) and _is_int(row.get("step")):
            rows.append(row)
        elif i == len(lines) and notes is not None:  # no newline after it: cut mid-write
            notes.append(f"{path}: line {i} was cut short (the run stopped while writing it): left out")
        else:
            bad.append(i)
    if bad:
        skipped.append(f"{path}: line{'s' if len(bad) > 1 else ''} {_numbers(bad)}: not a JSON object with "
                       f"an integer 'step', left out")
    grpo = {}
    sft = set()
    for r in rows:
        if "rollout/accuracy" in r or "grpo_step" in r:
            grpo[r["step"]] = r  # the newer row of a redone step wins
        elif str(r.get("stage", "")).startswith("sft"):
            sft.add((str(r.get("stage")), r["step"]))
    df = pd.DataFrame([grpo[k] for k in sorted(grpo)])
    if len(df):
        for col in df.columns:  # numbers are data; anything else in a metric's place is missing
            df[col] = df[col].astype(str) if col == "stage" else pd.to_numeric(df[col], errors="coerce")
        if "stage" not in df:
            df["stage"] = ""
        if "grpo_step" not in df:
            df["grpo_step"] = range(1, len(df) + 1)
        df["grpo_step"] = df["grpo_step"].fillna(pd.Series(range(1, len(df) + 1))).astype(int)
    else:
        df = pd.DataFrame({"grpo_step": pd.Series(dtype=int), "stage": pd.Series(dtype=str)})
    return df.reset_index(drop=True), len({s for s in sft if s[0] == "sft"})


def _read_bytes(path: Path) -> bytes:
    try:
        return path.read_bytes()
    except OSError as exc:
        raise RunDirError(f"{path}: cannot read it ({exc.strerror or exc})") from None


def _is_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_number(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and v == v


def _numbers(lines: list[int], most: int = 8) -> str:
    return ", ".join(map(str, lines[:most])) + (f" and {len(lines) - most} more" if len(lines) > most else "")


def stage_spans(metrics: pd.DataFrame, rollouts: pd.DataFrame | None) -> list[StageSpan]:
    spans: list[StageSpan] = []
    lens = {}
    if rollouts is not None and len(rollouts):
        lens = rollouts.groupby("stage")["max_response_len"].max().to_dict()
    for name, g in metrics.groupby("stage", sort=False):
        length = lens.get(name)
        spans.append(StageSpan(str(name), int(g["grpo_step"].min()), int(g["grpo_step"].max()),
                               int(length) if _is_number(length) else None))
    return sorted(spans, key=lambda s: s.first)


def _json(path: Path, skipped: list[str], check=None):
    """The JSON in ``path`` (None when absent), through ``check`` (which raises ValueError saying
    what is wrong); one that cannot be used is left out and named in ``skipped``."""
    if not path.exists():
        return None
    try:
        obj = json.loads(_read_bytes(path).decode("utf-8"))
        return check(obj) if check else obj
    except (UnicodeDecodeError, json.JSONDecodeError, ValueError) as exc:
        skipped.append(f"{path}: {str(exc)[:200]}: left out")
        return None


class RunDirError(InputError):
    """The path given as a run directory is none, or a file in it cannot be read."""


def _dict(obj, what: str) -> dict:
    if not isinstance(obj, dict):
        raise ValueError(f"{what} is a {type(obj).__name__}, not a JSON object")
    return obj


def _entries(obj, what: str) -> list[dict]:
    """A list of objects, each with a string ``uid`` (the prompt's id)."""
    if not isinstance(obj, list):
        raise ValueError(f"{what} is a {type(obj).__name__}, not a list")
    for i, e in enumerate(obj):
        if not isinstance(e, dict) or not isinstance(e.get("uid"), str):
            raise ValueError(f"{what}[{i}] is not an object with a string 'uid'")
    return obj


def check_wrong_labels(obj) -> dict:
    """The live wrong-label list (``data.wrong_labels.WrongLabelMonitor.report``) as the report uses it."""
    wl = _dict(obj, "the list")
    _entries(wl.setdefault("suspects", []), "suspects")
    _entries(wl.setdefault("hard_kept_off", []), "hard_kept_off")
    _dict(wl.setdefault("rule", {}), "rule")
    for name, v in _dict(wl.setdefault("sources", {}), "sources").items():
        _dict(v, f"sources[{name!r}]")
    points = wl.setdefault("points", [])
    if not isinstance(points, list):
        raise ValueError("points is not a list")
    for i, p in enumerate(points):
        if not (isinstance(p, list) and len(p) == 4 and isinstance(p[0], str) and _is_number(p[2])
                and _is_number(p[3])):
            raise ValueError(f"points[{i}] is not [uid, label, pass rate, agreement]")
    return wl


def check_planted(obj) -> dict:
    planted = _dict(obj, "the planted labels")
    for key in ("wrong_label", "hard"):
        ids = planted.setdefault(key, [])
        if not isinstance(ids, list) or not all(isinstance(u, str) for u in ids):
            raise ValueError(f"{key} is not a list of prompt ids (strings)")
    return planted


def check_summary(obj) -> dict:
    summary = _dict(obj, "the summary")
    for name, v in _dict(summary.setdefault("per_stage", {}), "per_stage").items():
        _dict(v, f"per_stage[{name!r}]")
    return summary


def load_run(run_dir: str | Path) -> RunData:
    root = Path(run_dir)
    if not root.is_dir():
        raise RunDirError(f"{root}: no such run directory")
    if not any((root / m).exists() for m in RUN_MARKERS):
        raise RunDirError(f"{root}: not a run directory (it has none of {', '.join(RUN_MARKERS)})")
    skipped, notes = [], []
    metrics, sft_steps = read_metrics(root / "metrics.jsonl", skipped, notes)
    rollouts = read_rollouts(root, skipped=skipped)
    if rollouts is not None:
        rollouts = rollouts.drop_duplicates(["global_step", "group", "sample"], keep="last")
        for flag in ("correct", "in_batch", "truncated"):  # (a null is no)
            rollouts[flag] = rollouts[flag].fillna(False).astype(bool)
    return RunData(root=root, metrics=metrics, sft_steps=sft_steps,
                   stages=stage_spans(metrics, rollouts), rollouts=rollouts,
                   wrong_labels=_json(root / "rollouts" / WRONG_LABELS_FILE, skipped, check_wrong_labels),
                   planted=_json(root / PLANTED_FILE, skipped, check_planted),
                   summary=_json(root / "summary.json", skipped, check_summary) or {},
                   skipped=skipped, notes=notes)


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
