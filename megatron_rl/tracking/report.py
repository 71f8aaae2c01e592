"""The run report: accuracy, truncation ratio and entropy per step, from metrics.jsonl, as a PNG."""

from __future__ import annotations

import json
from pathlib import Path

PANELS = [
    ("accuracy", ["rollout/accuracy", "rollout/accuracy_non_truncated", "eval/accuracy"]),
    ("truncation ratio", ["rollout/truncation_ratio"]),
    ("entropy (nats/token)", ["actor/entropy"]),
    ("response length", ["rollout/response_length_mean"]),
]


def load_metrics(path: str | Path) -> list[dict]:
    rows = []
    for line in Path(path).read_text().splitlines():
        if line.strip():
            rows.append(json.loads(line))
    return rows


def plot_run(metrics_path: str | Path, out_png: str | Path) -> Path | None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    if not Path(metrics_path).exists():
        return None
    rows = [r for r in load_metrics(metrics_path) if r.get("stage") != "sft"]
    fig, axes = plt.subplots(len(PANELS), 1, figsize=(8, 2.6 * len(PANELS)), sharex=True)
    stage_starts = {}
    for r in rows:
        stage_starts.setdefault(r["stage"], r["step"])
    for ax, (title, keys) in zip(axes, PANELS):
        for k in keys:
            pts = [(r["step"], r[k]) for r in rows if r.get(k) is not None]
            if pts:
                xs, ys = zip(*pts)
                ax.plot(xs, ys, marker="o" if k.startswith("eval/") else None, ms=3, label=k)
        for name, x in stage_starts.items():
            ax.axvline(x, color="grey", lw=0.6, ls="--")
            ax.text(x, ax.get_ylim()[1], f" {name}", va="top", fontsize=7, color="grey")
        ax.set_title(title, fontsize=9)
        ax.legend(fontsize=7, loc="best")
        ax.grid(alpha=0.3)
    axes[-1].set_xlabel("GRPO step")
    fig.tight_layout()
    fig.savefig(out_png, dpi=110)
    plt.close(fig)
    return Path(out_png)
