"""The report's plots, one function per figure, each ``RunData -> plotly Figure``.

Every x axis counts GRPO steps; dashed lines mark where a stage begins. A figure whose data the run
does not hold (no dumps, no timings) still renders, with a note saying what is missing.

Text from the run directory (stage names, prompt ids, the wrong-label rule's values) goes through
:func:`plot_text` before plotly draws it: plotly reads a small HTML subset in every text it draws
(``<b>``, ``<a href>``, entities), so raw text could change the page's links and formatting; escaped,
it shows as the characters it holds.
"""

from __future__ import annotations

import html

import numpy as np
import plotly.graph_objects as go
from plotly.subplots import make_subplots

from megatron_rl.analysis.run_data import TIMING_PARTS, RunData, pass_rates, sign_split

POS, NEG = "#2ca02c", "#d62728"
STAGE_LINE = dict(color="#888", width=1, dash="dash")
LAYOUT = dict(template="plotly_white", margin=dict(l=60, r=20, t=80, b=45), height=420,
              legend=dict(orientation="h", yanchor="bottom", y=1.06, x=0))


def plot_text(value) -> str:
    """``value`` as text plotly draws literally (its HTML subset escaped: ``<``, ``>``, ``&``)."""
    return html.escape(str(value), quote=False)


def _number(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and v == v


def _single(**layout) -> go.Figure:
    """A one-panel figure on a subplot grid (so stage lines and axes address it like the others)."""
    return make_subplots(rows=1, cols=1).update_layout(**dict(LAYOUT, **layout))


def _note(fig: go.Figure, text: str) -> go.Figure:
    fig.add_annotation(text=text, showarrow=False, xref="paper", yref="paper", x=0.5, y=0.5,
                       font=dict(size=14, color="#666"))
    fig.update_xaxes(visible=False)
    fig.update_yaxes(visible=False)
    return fig


def _stages(fig: go.Figure, data: RunData, rows: int = 1) -> None:
    """Dashed line and a label (name, max response length) where each stage starts."""
    for s in data.stages:
        for r in range(1, rows + 1):
            fig.add_vline(x=s.first - 0.5, line=STAGE_LINE, row=r, col=1)
        label = plot_text(s.name if s.max_response_len is None else f"{s.name} (≤{s.max_response_len} tok)")
        fig.add_annotation(x=s.first - 0.5, y=1.0, xref="x", yref="paper", text=label, showarrow=False,
                           xanchor="left", yanchor="top", font=dict(size=10, color="#555"))


def _xaxis(fig: go.Figure, rows: int = 1) -> None:
    fig.update_xaxes(title_text="GRPO step", row=rows, col=1)


def story(data: RunData) -> go.Figure:
    """The multi-stage story: accuracy, response length and entropy over the stages."""
    fig = make_subplots(rows=3, cols=1, shared_xaxes=True, vertical_spacing=0.06,
                        subplot_titles=("accuracy", "response length (tokens)", "entropy (nats/token)"))
    if not len(data.metrics):
        return _note(fig.update_layout(**LAYOUT), "no GRPO steps in metrics.jsonl")
    for key, name, color in (("rollout/accuracy", "rollout accuracy", "#1f77b4"),
                             ("rollout/accuracy_non_truncated", "accuracy (not truncated)", "#17becf")):
        x, y = data.series(key)
        fig.add_trace(go.Scatter(x=x, y=y, name=name, mode="lines", line=dict(color=color)), row=1, col=1)
    x, y = data.series("eval/accuracy")
    if x:
        fig.add_trace(go.Scatter(x=x, y=y, name="held-out accuracy (greedy)", mode="markers+lines",
                                 line=dict(color="#ff7f0e")), row=1, col=1)
    x, y = data.series("rollout/response_length_mean")
    fig.add_trace(go.Scatter(x=x, y=y, name="mean response length", line=dict(color="#9467bd")), row=2, col=1)
    for s in data.stages:
        if s.max_response_len:
            fig.add_trace(go.Scatter(x=[s.first - 0.5, s.last + 0.5], y=[s.max_response_len] * 2,
                                     mode="lines", line=dict(color="#9467bd", dash="dot"),
                                     name="max response length", showlegend=s is data.stages[0]),
                          row=2, col=1)
    x, y = data.series("actor/entropy")
    fig.add_trace(go.Scatter(x=x, y=y, name="policy entropy", line=dict(color="#8c564b")), row=3, col=1)
    _stages(fig, data, rows=3)
    _xaxis(fig, rows=3)
    return fig.update_layout(**dict(LAYOUT, height=720))


def signature(data: RunData) -> go.Figure:
    """Seed 002's signature: entropy and sampled-token probability, positive vs negative samples."""
    fig = make_subplots(rows=2, cols=1, shared_xaxes=True, vertical_spacing=0.08,
                        subplot_titles=("mean token entropy under the trainer",
                                        "mean sampled-token probability under the engine"))
    fig.update_layout(**dict(LAYOUT, height=600))
    if data.rollouts is None or not len(data.rollouts):
        return _note(fig, "no rollout dumps in RUN_DIR/rollouts/")
    for row, column in ((1, "entropy_mean"), (2, "token_prob_mean")):
        split = sign_split(data.rollouts, column)
        for sign, color in (("positive", POS), ("negative", NEG)):
            if sign in split:
                s = split[sign].dropna()
                fig.add_trace(go.Scatter(x=s.index.tolist(), y=s.tolist(), name=f"{sign} advantage",
                                         line=dict(color=color), legendgroup=sign, showlegend=row == 1),
                              row=row, col=1)
    _stages(fig, data, rows=2)
    _xaxis(fig, rows=2)
    return fig


def trajectories(data: RunData, per_kind: int = 25) -> go.Figure:
    """Per-prompt pass rate at each visit: prompts that went from hard to solved, suspected wrong
    labels (stuck at 0), and prompts still hard at their last visit."""
    fig = _single(height=480)
    if data.rollouts is None or not len(data.rollouts):
        return _note(fig, "no rollout dumps in RUN_DIR/rollouts/")
    pr = pass_rates(data.rollouts)
    visits = pr.groupby("prompt_uid")["grpo_step"].count()
    multi = pr[pr["prompt_uid"].isin(visits[visits >= 2].index)]
    if not len(multi):
        return _note(fig, "no prompt was sampled twice: trajectories need prompts seen over several steps")
    ends = multi.sort_values("grpo_step").groupby("prompt_uid")["pass_rate"].agg(["first", "last"])
    suspects = {e["uid"] for e in (data.wrong_labels or {}).get("suspects", [])}
    kinds = [
        ("went from hard to solved", "#2ca02c",
         ends[(ends["first"] <= 0.25) & (ends["last"] >= 0.75)].assign(g=lambda d: d["last"] - d["first"])
         .sort_values("g", ascending=False).index[:per_kind]),
        ("suspected wrong label", NEG, [u for u in ends.index if u in suspects][:per_kind]),
        ("still hard at its last visit", "#ff7f0e",
         [u for u in ends[(ends["last"] <= 0.25) & (ends["last"] > 0)].index if u not in suspects][:per_kind]),
    ]
    by_uid = {u: g.sort_values("grpo_step") for u, g in multi.groupby("prompt_uid")}
    for name, color, uids in kinds:
        for i, u in enumerate(uids):
            g = by_uid[u]
            fig.add_trace(go.Scatter(x=g["grpo_step"].tolist(), y=g["pass_rate"].tolist(), mode="lines+markers",
                                     line=dict(color=color, width=1), marker=dict(size=4), opacity=0.6,
                                     name=name, legendgroup=name, showlegend=i == 0, hovertext=plot_text(u)))
    fig.update_yaxes(title_text="pass rate of the prompt's group", range=[-0.05, 1.05])
    _stages(fig, data)
    _xaxis(fig)
    return fig


def rule_map(data: RunData) -> go.Figure:
    """The live rule's view of every labelled prompt: pass rate vs agreement of the top wrong answer."""
    fig = _single(height=480)
    wl = data.wrong_labels
    if not wl or not wl.get("points"):
        return _note(fig, "no live wrong-label list (RUN_DIR/rollouts/wrong_labels.json)")
    planted = set((data.planted or {}).get("wrong_label", []))
    hard = set((data.planted or {}).get("hard", []))
    groups: dict[str, list] = {}
    for uid, label, pass_rate, agreement in wl["points"]:
        kind = ("planted wrong label" if uid in planted else "planted hard prompt" if uid in hard
                else "other prompt")
        groups.setdefault((kind, label == "suspected_wrong_label"), []).append((uid, pass_rate, agreement))
    style = {"planted wrong label": ("#d62728", "x"), "planted hard prompt": ("#ff7f0e", "diamond"),
             "other prompt": ("#1f77b4", "circle")}
    for (kind, listed), pts in sorted(groups.items()):
        color, symbol = style[kind]
        fig.add_trace(go.Scatter(
            x=[p[1] for p in pts], y=[p[2] for p in pts], mode="markers", hovertext=[plot_text(p[0]) for p in pts],
            name=f"{kind}, {'on the list' if listed else 'not listed'} ({len(pts)})",
            marker=dict(color=color, symbol=symbol, size=7 if listed else 5, opacity=0.8 if listed else 0.35,
                        line=dict(width=1, color="black") if listed else dict(width=0))))
    rule = wl.get("rule", {})
    if _number(rule.get("agree_frac")):
        fig.add_hline(y=rule["agree_frac"], line=STAGE_LINE,
                      annotation_text=f"agree_frac {rule['agree_frac']:g}", annotation_position="top right")
    if _number(rule.get("hard_max_pass_rate")) and rule["hard_max_pass_rate"]:
        fig.add_vline(x=rule["hard_max_pass_rate"], line=STAGE_LINE,
                      annotation_text=f"hard_max_pass_rate {rule['hard_max_pass_rate']:g}",
                      annotation_position="top right")
    fig.update_xaxes(title_text="pass rate of the newest samples", range=[-0.03, 1.03])
    fig.update_yaxes(title_text="share of samples giving the top wrong answer", range=[-0.03, 1.03])
    return fig


def lengths(data: RunData) -> go.Figure:
    """Response-length distribution per stage."""
    fig = _single(barmode="overlay")
    if data.rollouts is None or not len(data.rollouts):
        return _note(fig, "no rollout dumps in RUN_DIR/rollouts/")
    for s in data.stages:
        r = data.rollouts.loc[data.rollouts["stage"] == s.name, "response_len"]
        if len(r):  # binned here (one bar per length), so the page carries counts, not samples
            share = r.value_counts(normalize=True).sort_index()
            fig.add_trace(go.Bar(x=share.index.tolist(), y=share.tolist(), name=plot_text(s.name), opacity=0.55,
                                 width=1))
    fig.update_xaxes(title_text="response length (tokens)")
    fig.update_yaxes(title_text="share of the stage's samples")
    return fig


def truncation(data: RunData) -> go.Figure:
    """Truncation ratio per step, and accuracy among the responses that were not truncated."""
    fig = _single()
    x, y = data.series("rollout/truncation_ratio")
    if not x:
        return _note(fig, "no truncation metrics in metrics.jsonl")
    fig.add_trace(go.Scatter(x=x, y=y, name="truncated share of responses", line=dict(color="#e377c2")))
    x2, y2 = data.series("rollout/accuracy_non_truncated")
    fig.add_trace(go.Scatter(x=x2, y=y2, name="accuracy of the non-truncated", line=dict(color="#17becf")))
    fig.update_yaxes(range=[-0.03, 1.03])
    _stages(fig, data)
    _xaxis(fig)
    return fig


def logp_gap(data: RunData) -> go.Figure:
    """Histogram of the per-sample mean |trainer - engine| log-prob of the sampled tokens."""
    fig = _single(barmode="overlay")
    r = None if data.rollouts is None else data.rollouts[data.rollouts["logp_gap_mean"].notna()]
    if r is None or not len(r):
        return _note(fig, "no train-inference log-prob gaps in the dumps")
    edges = np.histogram_bin_edges(r["logp_gap_mean"].to_numpy(), bins=60)
    centers = ((edges[:-1] + edges[1:]) / 2).tolist()
    for s in data.stages:
        v = r.loc[r["stage"] == s.name, "logp_gap_mean"].to_numpy()
        if len(v):
            counts, _ = np.histogram(v, bins=edges)
            fig.add_trace(go.Bar(x=centers, y=counts.tolist(), name=plot_text(s.name), opacity=0.55,
                                 width=float(edges[1] - edges[0])))
    fig.update_xaxes(title_text="mean |log π_trainer − log π_engine| over the response's tokens")
    fig.update_yaxes(title_text="samples", type="log")
    return fig


def step_time(data: RunData) -> go.Figure:
    """Where each step's wall time goes (stacked)."""
    fig = _single(barmode="stack", bargap=0)
    parts = [p for p in TIMING_PARTS if f"timing/{p}" in data.metrics]
    if not parts:
        return _note(fig, "no timing/* metrics in metrics.jsonl")
    for p in parts:
        x, y = data.series(f"timing/{p}")
        fig.add_trace(go.Bar(x=x, y=y, name=p))
    fig.update_yaxes(title_text="seconds")
    _stages(fig, data)
    _xaxis(fig)
    return fig


def moe_layers(data: RunData) -> list[int]:
    """The MoE layers with load metrics (``moe/load_max/layer_<i>``), in order."""
    prefix = "moe/load_max/layer_"
    return sorted(int(k[len(prefix):]) for k in data.metrics.columns if k.startswith(prefix))


# Layers drawn one by one; deeper models are drawn as their extremes and mean over the layers.
MAX_LAYER_LINES = 8


def expert_load(data: RunData) -> go.Figure:
    """Mixture-of-Experts routing per step: the most and least loaded expert's share of each layer's
    (token, expert) assignments, and the load-balancing / z-losses."""
    fig = make_subplots(rows=2, cols=1, shared_xaxes=True, vertical_spacing=0.08, row_heights=[0.65, 0.35],
                        subplot_titles=("expert load: share of the layer's token assignments",
                                        "router losses (per layer, mean over micro-batches)"))
    fig.update_layout(**dict(LAYOUT, height=640))
    layers = moe_layers(data)
    if not layers:
        return _note(fig, "no expert load metrics in metrics.jsonl (a dense model)")
    colors = ["#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#9467bd", "#8c564b", "#e377c2", "#17becf"]
    if len(layers) <= MAX_LAYER_LINES:
        for n, i in enumerate(layers):
            for kind, dash in (("max", "solid"), ("min", "dot")):
                x, y = data.series(f"moe/load_{kind}/layer_{i}")
                fig.add_trace(go.Scatter(x=x, y=y, name=f"layer {i} {kind}", legendgroup=f"layer {i}",
                                         line=dict(color=colors[n % len(colors)], dash=dash)), row=1, col=1)
    else:
        m = data.metrics
        top = m[[f"moe/load_max/layer_{i}" for i in layers]]
        low = m[[f"moe/load_min/layer_{i}" for i in layers]]
        x = m["grpo_step"].tolist()
        for name, y, color, dash in (("most loaded expert, worst layer", top.max(axis=1), NEG, "solid"),
                                     ("most loaded expert, mean over layers", top.mean(axis=1), NEG, "dash"),
                                     ("least loaded expert, mean over layers", low.mean(axis=1), POS, "dash"),
                                     ("least loaded expert, worst layer", low.min(axis=1), POS, "solid")):
            fig.add_trace(go.Scatter(x=x, y=y.tolist(), name=name, line=dict(color=color, dash=dash)),
                          row=1, col=1)
    for key, name, color in (("moe/aux_loss", "load-balancing loss (1 = even)", "#7f7f7f"),
                             ("moe/z_loss", "z-loss", "#bcbd22")):
        x, y = data.series(key)
        if x:
            fig.add_trace(go.Scatter(x=x, y=y, name=name, line=dict(color=color)), row=2, col=1)
    fig.update_yaxes(rangemode="tozero", row=1, col=1)
    _stages(fig, data, rows=2)
    _xaxis(fig, rows=2)
    return fig
def routing(data: RunData) -> go.Figure:
    """MoE routing replay: how often the trainer's routers agree with the engine's, and the
    train-inference log-prob gap with and without replaying the engine's routes."""
    fig = make_subplots(rows=2, cols=1, shared_xaxes=True, vertical_spacing=0.08,
                        subplot_titles=("(token, layer) top-k sets the trainer's routers choose as the engine did",
                                        "mean |log π_trainer − log π_engine| of the response tokens"))
    keys = ("moe/router_agreement", "moe/train_infer_logp_gap_free", "moe/train_infer_logp_gap_replay")
    if not any(k in data.metrics for k in keys):
        return _note(fig.update_layout(**LAYOUT), "no routing-replay metrics (a dense model, or algo.routing_replay "
                                                  "off and algo.router_agreement false)")
    x, y = data.series("moe/router_agreement")
    if x:
        fig.add_trace(go.Scatter(x=x, y=y, name="router agreement", line=dict(color="#1f77b4")), row=1, col=1)
    for key, name, color in (("moe/train_infer_logp_gap_free", "gap, trainer's own routes", NEG),
                             ("moe/train_infer_logp_gap_replay", "gap, engine's routes replayed (r3)", POS)):
        x, y = data.series(key)
        if x:
            fig.add_trace(go.Scatter(x=x, y=y, name=name, line=dict(color=color)), row=2, col=1)
    fig.update_yaxes(title_text="share", row=1, col=1)
    fig.update_yaxes(title_text="nats", type="log", row=2, col=1)
    _stages(fig, data, rows=2)
    _xaxis(fig, rows=2)
    return fig.update_layout(**dict(LAYOUT, height=560))


# (id, title, what it shows, builder). The report renders them in this order.
FIGURES = [
    ("story", "The multi-stage story",
     "Rollout and held-out accuracy, response length against each stage's limit, and policy entropy.", story),
    ("signature", "Entropy and sampled-token probability: positive vs negative samples",
     "Seed 002's signature. Entropy rising means high-probability tokens are being pushed down as "
     "negatives (or low-probability ones up as positives); entropy falling fast means poor rollout "
     "diversity.", signature),
    ("trajectories", "Per-prompt pass-rate trajectories",
     "Each line is one prompt, one point per time it was sampled.", trajectories),
    ("rule_map", "The wrong-label rule's view of every prompt",
     "Live labels at the end of the run: a prompt that is rarely right while its wrong samples mostly agree "
     "on one answer (upper left) is a suspected wrong label where the policy is competent on its data "
     "source; one whose wrong answers scatter (lower left) is hard.", rule_map),
    ("lengths", "Response length per stage", "Share of each stage's samples by response length.", lengths),
    ("truncation", "Truncation", "Responses that hit the stage's max length without an end-of-sequence "
     "token.", truncation),
    ("logp_gap", "Train-inference log-prob gap",
     "Per sample, the mean absolute difference between the trainer's and the engine's log-prob of the "
     "sampled tokens (before the update).", logp_gap),
    ("step_time", "Step-time breakdown", "Wall-clock split of each GRPO step.", step_time),
    ("expert_load", "Expert load (Mixture of Experts)",
     "Per MoE layer and training step, the share of the layer's (token, expert) assignments that went "
     "to its most loaded (solid) and least loaded (dotted) expert: 1 / number of experts when even. "
     "Below, the load-balancing loss (1 when even) and the z-loss the objective holds.", expert_load),
    ("routing", "MoE routing: trainer vs engine",
     "Routing replay (algo.routing_replay, algo.router_agreement): the share of (token, layer) top-k expert "
     "sets the trainer's own routers choose as the rollout engine did, and the train-inference log-prob gap "
     "without replay and with the engine's routes replayed.", routing),
]
