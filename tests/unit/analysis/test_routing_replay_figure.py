"""The report's routing-replay figure: router agreement and the train-inference gap with and without
replay, from metrics.jsonl; a note when the run logged none."""

from __future__ import annotations

from megatron_rl.analysis.figures import routing
from megatron_rl.analysis.run_data import load_run
from megatron_rl.tracking import Tracker
from megatron_rl.tracking.config import TrackingConfig


def _run(root, rows):
    tracker = Tracker(TrackingConfig(wandb_mode="disabled", console=False), root, {})
    for i, row in enumerate(rows, start=1):
        tracker.log({"grpo_step": i, "timing/step": 1.0, **row}, step=i, stage="s1")
    tracker.close()
    return load_run(root)


def test_routing_replay_figure_plots_agreement_and_both_gaps(tmp_path):
    rows = [{"moe/router_agreement": (80 + i) / 100, "moe/train_infer_logp_gap_free": 0.3,
             "moe/train_infer_logp_gap_replay": [1e-5, 2e-5, 3e-5][i]} for i in range(3)]
    fig = routing(_run(tmp_path / "a", rows))
    traces = {t.name: list(t.y) for t in fig.data}
    assert traces["router agreement"] == [0.8, 0.81, 0.82]
    assert traces["gap, trainer's own routes"] == [0.3] * 3
    assert traces["gap, engine's routes replayed (r3)"] == [1e-5, 2e-5, 3e-5]


def test_routing_replay_figure_notes_a_run_without_routing_metrics(tmp_path):
    fig = routing(_run(tmp_path / "b", [{"rollout/accuracy": 0.5}]))
    assert not fig.data and "no routing-replay metrics" in fig.layout.annotations[-1].text
