"""``megatron-rl analyze RUN_DIR``: the run report, ``RUN_DIR/report/index.html``.

A static page (no server): a summary table, the figures of :mod:`megatron_rl.analysis.figures` and
the live list of suspected wrong labels. plotly's JS is copied beside the page, so it works offline.
The command's last output line is one JSON object: the report's path, the dump overhead (share of
GRPO step time spent writing rollout dumps, from the logged timings) and, when the demo planted
wrong labels, the list's recall and precision.

The page shows what the run directory holds, and anyone may have written that: every value that
reaches the HTML goes through ``html.escape`` (and every text plotly draws through
:func:`megatron_rl.analysis.figures.plot_text`; the figures' data travel as JSON, which plotly
writes with ``<``, ``>`` and ``/`` escaped), so a prompt holding ``<script>`` shows as that text.
Inputs that could not be used are listed on the page; the command then still writes the report,
and ends with one line naming them (``megatron-rl: ...``) and exit status 2.
"""

from __future__ import annotations

import html
import json
import shutil
import time
from pathlib import Path

import plotly
import plotly.io as pio

from megatron_rl.analysis.figures import FIGURES, moe_layers
from megatron_rl.analysis.run_data import RunData, dump_overhead, load_run, wrong_label_scores
from megatron_rl.common.errors import InputError

PLOTLY_JS = Path(plotly.__file__).parent / "package_data" / "plotly.min.js"
TABLE_ROWS = 100

CSS = """
body { font-family: system-ui, -apple-system, "Segoe UI", sans-serif; margin: 0 auto; max-width: 1200px;
       padding: 16px 24px; color: #222; }
h1 { margin-bottom: 4px; } h2 { margin-top: 36px; border-bottom: 1px solid #ddd; padding-bottom: 4px; }
p.what { color: #555; margin-top: 0; }
table { border-collapse: collapse; font-size: 13px; }
td, th { border: 1px solid #ddd; padding: 3px 8px; text-align: left; vertical-align: top; }
th { background: #f4f4f4; }
table.summary td:first-child { font-weight: 600; white-space: nowrap; }
nav a { margin-right: 12px; font-size: 14px; }
.ok { color: #2ca02c; font-weight: 600; } .bad { color: #d62728; font-weight: 600; }
td.text { font-family: ui-monospace, monospace; max-width: 420px; overflow-wrap: anywhere; }
"""


def _fmt(v, digits: int = 3) -> str:
    """A value as text (plain text: escape it for the page)."""
    if v is None:
        return "–"
    if isinstance(v, float):
        return f"{v:.{digits}g}" if abs(v) < 1e4 or v != v or abs(v) == float("inf") else f"{v:,.0f}"
    return str(v)


def _number(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def _pct(v) -> str:
    return f"{100 * v:.1f}%" if _number(v) else _fmt(v)


def _count(v) -> str:
    return f"{v:,}" if isinstance(v, int) and not isinstance(v, bool) else _fmt(v)


def _e(v) -> str:
    """``v`` as escaped HTML text."""
    return html.escape(_fmt(v))


class ReportWriteError(InputError):
    """The report cannot be written where it was asked to go."""


def _first_last(data: RunData, key: str) -> str:
    x, y = data.series(key)
    return f"{_fmt(y[0])} → {_fmt(y[-1])}" if y else "–"


def _float(v) -> float | None:
    v = float(v)
    return None if v != v else v


def expert_load_facts(data: RunData) -> dict | None:
    """A Mixture-of-Experts run's expert load at its last GRPO step: per MoE layer the most and least
    loaded expert's share of the layer's (token, expert) assignments (``load_max`` / ``load_min``,
    keyed by layer), the layer whose top expert is most loaded, and the load-balancing loss at the
    first and last step; ``most_loaded`` / ``least_loaded``: the extremes over the layers. None for a
    dense run."""
    layers = moe_layers(data)
    if not layers:
        return None
    last = data.metrics.iloc[-1]
    _, aux = data.series("moe/aux_loss")
    top = max(layers, key=lambda i: last[f"moe/load_max/layer_{i}"])
    return {"load_max": {str(i): _float(last[f"moe/load_max/layer_{i}"]) for i in layers},
            "load_min": {str(i): _float(last[f"moe/load_min/layer_{i}"]) for i in layers},
            "most_loaded_layer": top, "most_loaded": _float(last[f"moe/load_max/layer_{top}"]),
            "least_loaded": _float(min(last[f"moe/load_min/layer_{i}"] for i in layers)),
            "aux_loss_first": _float(aux[0]) if aux else None, "aux_loss_last": _float(aux[-1]) if aux else None}


def summary_rows(data: RunData, facts: dict) -> list[tuple[str, str]]:
    m = data.metrics
    rows = [("run directory", str(data.root.resolve()))]
    rows.append(("steps", f"{len(m)} GRPO steps after {data.sft_steps} SFT steps"))
    rows.append(("stages", "; ".join(
        f"{s.name}: GRPO steps {s.first}–{s.last}" + (f" (≤{s.max_response_len} tokens)" if s.max_response_len else "")
        for s in data.stages) or "–"))
    per_stage = data.summary.get("per_stage", {})
    if per_stage:
        rows.append(("held-out accuracy (greedy)", " → ".join(
            f"{k}: {_pct(v.get('eval/accuracy'))}" for k, v in per_stage.items())))
    rows.append(("rollout accuracy, first → last step", _first_last(data, "rollout/accuracy")))
    rows.append(("truncation ratio, first → last step", _first_last(data, "rollout/truncation_ratio")))
    rows.append(("policy entropy, first → last step", _first_last(data, "actor/entropy")))
    if "timing/step" in m:
        rows.append(("step time", f"mean {m['timing/step'].mean():.2f} s, total {m['timing/step'].sum():.0f} s"))
    rows.append(("rollout dump overhead", f"{_pct(facts['dump_overhead'])} of GRPO step time"
                 if facts["dump_overhead"] is not None else "– (no timing/dump logged)"))
    if data.rollouts is not None:
        rows.append(("samples dumped", f"{len(data.rollouts):,} from {data.rollouts['prompt_uid'].nunique():,} prompts"))
        gap = data.rollouts["logp_gap_mean"].dropna()
        if len(gap):
            rows.append(("train-inference log-prob gap", f"median {gap.median():.2e}, max {gap.max():.2e} per sample"))
    load = expert_load_facts(data)
    if load is not None:
        top = load["most_loaded_layer"]
        rows.append(("expert load, last step", f"most loaded expert {_pct(load['most_loaded'])} "
                     f"of its layer's assignments (layer {top}); least loaded "
                     f"{_pct(load['least_loaded'])}; load-balancing loss "
                     f"{_first_last(data, 'moe/aux_loss')} (first → last)"))
    rows += episode_rows(data)
    wl = data.wrong_labels
    if wl is not None:
        rows.append(("suspected wrong labels (live)",
                     f"{len(wl.get('suspects', []))} of {_count(wl.get('prompts_seen', 0))} prompts seen, "
                     f"as of step {wl.get('step')}"))
    if facts.get("wrong_label_recall") is not None or facts.get("wrong_label_precision") is not None:
        rows.append(("planted wrong labels found",
                     f"recall {_pct(facts['wrong_label_recall'])} of the {facts['planted_seen']} planted "
                     f"prompts sampled, precision {_pct(facts['wrong_label_precision'])}; planted hard "
                     f"prompts on the list: {facts['planted_hard_on_list']} of {facts['planted_hard_seen']} sampled"))
    return rows


def episode_rows(data: RunData) -> list[tuple[str, str]]:
    """Multi-turn rollouts (prompts with an environment): turns, tool calls and faults, first → last step."""
    m = data.metrics
    if "env/trajectories" not in m:
        return []
    rows = [("turns per trajectory, first → last step", _first_last(data, "env/turns_mean")),
            ("tool calls per trajectory, first → last step", _first_last(data, "env/tool_calls_mean")),
            ("tool errors / timeouts / refused (budget), all steps",
             " / ".join(f"{int(m[k].sum()) if k in m else 0}" for k in
                        ("env/tool_errors", "env/tool_timeouts", "env/tool_budget_exhausted"))),
            ("observation tokens (never trained on), first → last step",
             _first_last(data, "env/observation_token_share"))]
    for key, what in (("env/accuracy_with_tool", "with"), ("env/accuracy_without_tool", "without")):
        if key in m:
            rows.append((f"rollout accuracy {what} a tool call, first → last step", _first_last(data, key)))
    return rows


def episodes_section(data: RunData, n: int = 12) -> str:
    """A few multi-turn trajectories of the last dumped step, turn by turn ('' without any)."""
    r = data.rollouts
    if r is None or "messages" not in r or "env" not in r or not r["env"].notna().any():
        return ""
    last = r[r["env"].notna()]
    last = last[last["grpo_step"] == last["grpo_step"].max()].head(n)
    rows = [{"prompt": row["prompt"], "uid": row["prompt_uid"], "reward": row["reward"],
             "turns": row["turns"], "tool_calls": row["tool_calls"],
             "messages": " ‖ ".join(f"{m['role']}: {m['text']}" for m in row["messages"])}
            for _, row in last.iterrows()]
    return ("<p class=what>The last dumped step's first trajectories, turn by turn (assistant turns and the "
            "tools' observations, which are never trained on).</p>"
            + _table(rows, [("uid", "prompt id"), ("prompt", "prompt"), ("messages", "turns"),
                            ("turns", "model turns"), ("tool_calls", "tool calls"), ("reward", "reward")]))


def _table(rows: list[dict], columns: list[tuple[str, str]], marks: dict | None = None) -> str:
    if not rows:
        return "<p><em>none</em></p>"
    head = "".join(f"<th>{html.escape(title)}</th>" for _, title in columns)
    body = []
    for r in rows[:TABLE_ROWS]:
        cells = []
        for key, _ in columns:
            if key == "_mark":
                ok = (marks or {}).get(r["uid"])
                cells.append("<td></td>" if ok is None else f"<td class={'ok' if ok else 'bad'}>"
                             f"{'planted' if ok else 'not planted'}</td>")
            else:
                cls = " class=text" if key in ("prompt", "uid", "messages") else ""
                cells.append(f"<td{cls}>{html.escape(_fmt(r.get(key)))}</td>")
        body.append("<tr>" + "".join(cells) + "</tr>")
    more = f"<p>… and {len(rows) - TABLE_ROWS} more (RUN_DIR/rollouts/wrong_labels.json)</p>" if len(rows) > TABLE_ROWS else ""
    return f"<table><tr>{head}</tr>{''.join(body)}</table>{more}"


def wrong_label_section(data: RunData) -> str:
    wl = data.wrong_labels
    if wl is None:
        return "<p>No live list: the run wrote no RUN_DIR/rollouts/wrong_labels.json.</p>"
    planted = set((data.planted or {}).get("wrong_label", []))
    marks = {e["uid"]: e["uid"] in planted for e in wl["suspects"]} if data.planted else None
    cols = [("uid", "prompt id"), ("prompt", "prompt"), ("ground_truth", "label"),
            ("majority_answer", "samples' answer"), ("agreement", "agreement"),
            ("recent_pass_rate", "recent pass rate"), ("samples", "samples"), ("visits", "visits"),
            ("flagged_since", "listed since step")]
    rule = wl.get("rule", {})
    intro = (f"<p class=what>Found live during training: after each step every prompt's newest "
             f"{_e(rule.get('window') or 'all')} samples go through the difficulty rule (at least "
             f"{_e(rule.get('min_samples'))} samples; the same rule as <code>megatron-rl data difficulty</code>). "
             f"Listed: right at most {_e(rule.get('suspect_max_pass_rate', rule.get('hard_max_pass_rate')))} of "
             f"the time (0: never, stuck at 0) while at least "
             f"{_e(rule.get('agree_frac'))} of the samples give one answer that is not the label, on a data "
             f"source the policy solves at least {_e(rule.get('min_source_pass_rate'))} of the time.</p>")
    sources = [{"uid": name, **v} for name, v in wl.get("sources", {}).items()]
    intro += ("<h3>The policy per data source</h3>" + _table(
        sources, [("uid", "data source"), ("pass_rate", "pass rate (newest samples)"), ("samples", "samples"),
                  ("prompts", "prompts seen")]) if sources else "")
    hard_cols = [c for c in cols if c[0] != "flagged_since"]
    return (intro + "<h3>Suspected wrong labels</h3>"
            + _table(wl["suspects"], cols + ([("_mark", "planted?")] if marks is not None else []), marks)
            + "<h3>Hard prompts kept off the list</h3><p class=what>Rarely or never right, wrong answers "
              "scattered: hard, not mislabelled.</p>" + _table(wl.get("hard_kept_off", []), hard_cols))


def render(data: RunData, facts: dict, out_dir: Path) -> Path:
    out_dir.mkdir(parents=True, exist_ok=True)
    js = out_dir / "plotly.min.js"
    if not js.exists() or js.stat().st_size != PLOTLY_JS.stat().st_size:
        shutil.copyfile(PLOTLY_JS, js)
    sections, nav = [], []
    for fid, title, what, build in FIGURES:
        fig = build(data)
        div = pio.to_html(fig, full_html=False, include_plotlyjs=False, div_id=f"fig-{fid}",
                          config={"displaylogo": False, "responsive": True})
        nav.append(f'<a href="#{fid}">{html.escape(title)}</a>')
        sections.append(f'<section id="{fid}"><h2>{html.escape(title)}</h2><p class=what>{html.escape(what)}</p>'
                        f'<div class="figure" data-figure="{fid}">{div}</div></section>')
        if fid == "rule_map":
            sections.append(f'<section id="wrong_labels"><h2>Suspected wrong labels</h2>{wrong_label_section(data)}</section>')
            nav.append('<a href="#wrong_labels">Suspected wrong labels</a>')
    episodes = episodes_section(data)
    if episodes:
        sections.append(f'<section id="multi_turn"><h2>Multi-turn trajectories</h2>{episodes}</section>')
        nav.append('<a href="#multi_turn">Multi-turn trajectories</a>')
    summary = "".join(f"<tr><td>{html.escape(k)}</td><td>{html.escape(v)}</td></tr>"
                      for k, v in summary_rows(data, facts))
    if data.skipped or data.notes:
        items = "".join(f"<li>{html.escape(line)}</li>" for line in [*data.skipped, *data.notes])
        sections.insert(0, '<section id="skipped"><h2>Inputs left out</h2><p class=what>The report was '
                           f'made without these:</p><ul class="skipped">{items}</ul></section>')
        nav.insert(0, '<a href="#skipped">Inputs left out</a>')
    name = html.escape(data.root.resolve().name)
    page = f"""<!doctype html>
<html lang="en"><head><meta charset="utf-8"><title>megatron-rl run report: {name}</title>
<script src="plotly.min.js"></script><style>{CSS}</style></head>
<body data-figures="{len(FIGURES)}">
<h1>Run report: {name}</h1>
<p class=what>Written by <code>megatron-rl analyze</code> at {time.strftime('%Y-%m-%d %H:%M:%S')}. Every x axis counts GRPO steps (SFT steps are not counted); dashed lines mark where a stage begins.</p>
<section id="summary"><table class="summary">{summary}</table></section>
<nav>{''.join(nav)}</nav>
{''.join(sections)}
</body></html>
"""
    index = out_dir / "index.html"
    tmp = index.with_suffix(".tmp")
    tmp.write_text(page, encoding="utf-8")
    tmp.replace(index)
    return index


def analyze(run_dir: str | Path, out_dir: str | Path | None = None) -> dict:
    """Write the report; returns the facts (what the command prints as its last line)."""
    data = load_run(run_dir)
    facts = {"dump_overhead": dump_overhead(data.metrics), **wrong_label_scores(data)}
    if "timing/dump" in data.metrics and "timing/step" in data.metrics:
        facts["dump_seconds_per_step"] = float(data.metrics["timing/dump"].mean())
        facts["step_seconds"] = float(data.metrics["timing/step"].mean())
    facts.setdefault("wrong_label_recall", None)
    facts.setdefault("wrong_label_precision", None)
    if data.wrong_labels is not None:
        facts["suspected_wrong_labels"] = len(data.wrong_labels.get("suspects", []))
    facts["grpo_steps"] = len(data.metrics)
    if (load := expert_load_facts(data)) is not None:
        facts["expert_load"] = load
    facts["skipped"] = list(data.skipped)
    out = Path(out_dir) if out_dir else data.root / "report"
    try:
        index = render(data, facts, out)
        facts = {"report": str(index), **facts}
        (index.parent / "analysis.json").write_text(json.dumps(facts, indent=1))
    except OSError as exc:  # a read-only run directory, a file where the directory goes, a full disk
        where = exc.filename or out
        hint = "" if out_dir else " (give another report directory with --out DIR)"
        raise ReportWriteError(f"{where}: cannot write the report there: {exc.strerror or exc}{hint}") from None
    return facts


def main(run_dir: str, out_dir: str | None = None) -> int:
    """``megatron-rl analyze RUN_DIR [--out DIR]``: write the report, print its figures; the last
    line is the facts as one JSON object. A path that is no run directory raises
    :class:`~megatron_rl.analysis.run_data.RunDirError`, a report directory that cannot be written
    :class:`ReportWriteError`; inputs left out (a damaged dump, metrics lines that are no JSON) are
    raised as one :class:`InputError` naming them once the report is written (``megatron-rl``
    prints each as one line, exit 2)."""
    facts = analyze(run_dir, out_dir)
    if facts["dump_overhead"] is not None:
        print(f"rollout dumps: {100 * facts['dump_overhead']:.2f}% of GRPO step time "
              f"({1000 * facts.get('dump_seconds_per_step', 0):.1f} ms of {facts.get('step_seconds', 0):.2f} s per step)")
    if facts.get("wrong_label_recall") is not None:
        print(f"suspected wrong labels: recall {100 * facts['wrong_label_recall']:.1f}% "
              f"({facts['planted_seen']} planted prompts sampled), precision "
              f"{_pct(facts['wrong_label_precision'])}, planted hard prompts on the list: "
              f"{facts['planted_hard_on_list']}")
    print(f"report: {facts['report']}")
    print(json.dumps(facts))
    if facts["skipped"]:  # the report is written; the inputs it could not use are named
        first = facts["skipped"][0]
        more = f" (and {len(facts['skipped']) - 1} more, listed in the report)" if len(facts["skipped"]) > 1 else ""
        raise InputError(f"{first}{more}; the report was made from the rest: {facts['report']}")
    return 0
