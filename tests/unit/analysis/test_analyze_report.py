"""`megatron-rl analyze`: the facts it prints, GRPO steps as the x axis, an offline page."""

from __future__ import annotations

import json
import re

import pytest

from megatron_rl.analysis.figures import FIGURES
from megatron_rl.analysis.run_data import load_run
from megatron_rl.cli import main
from tests.unit.analysis.synthetic_run import make_run


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    root = tmp_path_factory.mktemp("run")
    sim = make_run(root, sft_steps=30)
    # A resumed run re-logs the steps after its last checkpoint: the newer rows must win, once.
    rows = [json.loads(x) for x in (root / "metrics.jsonl").read_text().splitlines()]
    redo = [r for r in rows if r.get("grpo_step") in (23, 24)]
    with (root / "metrics.jsonl").open("a") as f:
        for r in redo:
            f.write(json.dumps(dict(r, **{"timing/step": r["timing/step"] + 1.0})) + "\n")
    return root, sim, rows, redo


def test_analyze_cli_last_line_and_facts(run, capsys):
    root, sim, rows, redo = run
    assert main(["analyze", str(root)]) == 0
    last = capsys.readouterr().out.strip().splitlines()[-1]
    facts = json.loads(last)
    assert {"report", "dump_overhead", "wrong_label_recall", "wrong_label_precision"} <= set(facts)
    assert facts["report"] == str(root / "report" / "index.html")
    # Dump overhead from the logged timings, by hand: newest row per step.
    newest = {r["step"]: r for r in rows if "grpo_step" in r}
    for r in redo:
        newest[r["step"]] = dict(r, **{"timing/step": r["timing/step"] + 1.0})
    expect = sum(r["timing/dump"] for r in newest.values()) / sum(r["timing/step"] for r in newest.values())
    assert facts["dump_overhead"] == pytest.approx(expect, rel=1e-9)
    # Recall / precision against what the simulation planted, by hand from the live list.
    listed = {e["uid"] for e in json.loads((root / "rollouts" / "wrong_labels.json").read_text())["suspects"]}
    planted = {u for u, k in sim["kind"].items() if k == "wrong_label"}
    assert facts["wrong_label_recall"] == pytest.approx(len(listed & planted) / len(planted))
    assert facts["wrong_label_precision"] == pytest.approx(len(listed & planted) / len(listed))
    assert facts["planted_hard_on_list"] == 0 and facts["grpo_steps"] == sim["grpo_steps"] == 24
    assert json.loads((root / "report" / "analysis.json").read_text()) == facts


def test_analyze_x_axis_counts_grpo_steps(run):
    root, *_ = run
    data = load_run(root)
    assert data.sft_steps == 30
    assert data.metrics["grpo_step"].tolist() == list(range(1, 25))  # not the global step (31..54)
    assert [(s.name, s.first, s.last, s.max_response_len) for s in data.stages] == \
           [("stage1_12", 1, 10, 12), ("stage2_16", 11, 18, 16), ("stage3_24", 19, 24, 24)]
    x, _ = data.series("rollout/accuracy")
    assert x[0] == 1 and x[-1] == 24


def test_analyze_page_is_self_contained(run):
    root, *_ = run
    assert main(["analyze", str(root)]) == 0
    page = (root / "report" / "index.html").read_text()
    assert (root / "report" / "plotly.min.js").stat().st_size > 1_000_000
    assert re.findall(r'<script src="([^"]+)"', page) == ["plotly.min.js"]  # no CDN
    assert "cdn.plot.ly" not in page
    for fid, *_ in FIGURES:
        assert f'data-figure="{fid}"' in page
    assert page.count("<tr>") > 20  # summary + wrong-label tables


def _with_moe_metrics(src, dst, layers: int):
    """A copy of run ``src`` whose GRPO rows hold MoE metrics of ``layers`` layers (known values)."""
    import shutil

    shutil.copytree(src, dst)
    rows = [json.loads(x) for x in (dst / "metrics.jsonl").read_text().splitlines()]
    with (dst / "metrics.jsonl").open("w") as f:
        for r in rows:
            r = {k: v for k, v in r.items() if not k.startswith("moe/")}
            if "grpo_step" in r:
                k = r["grpo_step"]
                r["moe/aux_loss"], r["moe/z_loss"] = 1.0 + 1.0 / k, 0.5 / k
                for i in range(layers):
                    r[f"moe/load_max/layer_{i}"] = 0.25 + 0.01 * i + 0.1 / k
                    r[f"moe/load_min/layer_{i}"] = 0.25 - 0.01 * i - 0.1 / k
            f.write(json.dumps(r) + "\n")
    return dst


def test_analyze_plots_moe_expert_load(run, tmp_path, capsys):
    from megatron_rl.analysis.figures import expert_load
    from megatron_rl.analysis.report import expert_load_facts, summary_rows

    root, *_ = run
    moe = load_run(_with_moe_metrics(root, tmp_path / "moe", layers=2))
    fig = expert_load(moe)
    by_name = {t.name: t for t in fig.data}
    steps = moe.metrics["grpo_step"].tolist()
    for i in range(2):
        assert list(by_name[f"layer {i} max"].y) == pytest.approx([0.25 + 0.01 * i + 0.1 / k for k in steps])
        assert list(by_name[f"layer {i} min"].y) == pytest.approx([0.25 - 0.01 * i - 0.1 / k for k in steps])
    assert list(by_name["load-balancing loss (1 = even)"].y) == pytest.approx([1.0 + 1.0 / k for k in steps])
    row = dict(summary_rows(moe, {"dump_overhead": None}))["expert load, last step"]
    assert "most loaded expert 26.4% of its layer's assignments (layer 1)" in row, row
    # a deep model: the extremes and means over its layers
    deep = load_run(_with_moe_metrics(root, tmp_path / "deep", layers=12))
    by_name = {t.name: t for t in expert_load(deep).data}
    assert list(by_name["most loaded expert, worst layer"].y) == pytest.approx([0.36 + 0.1 / k for k in steps])
    assert list(by_name["least loaded expert, worst layer"].y) == pytest.approx([0.14 - 0.1 / k for k in steps])
    # a dense run: the figure says why it is empty
    dense = expert_load(load_run(make_run(tmp_path / "dense_run", moe_layers=0) and tmp_path / "dense_run"))
    assert not dense.data and "dense model" in dense.layout.annotations[-1].text
    assert expert_load_facts(load_run(tmp_path / "dense_run")) is None
    capsys.readouterr()
    assert main(["analyze", str(tmp_path / "moe")]) == 0
    # the command's facts (and a MoE run's summary.json) carry the last step's expert load
    load = json.loads(capsys.readouterr().out.strip().splitlines()[-1])["expert_load"]
    k = steps[-1]
    assert load["load_max"] == pytest.approx({"0": 0.25 + 0.1 / k, "1": 0.26 + 0.1 / k})
    assert load["load_min"] == pytest.approx({"0": 0.25 - 0.1 / k, "1": 0.24 - 0.1 / k})
    assert (load["most_loaded_layer"], load["most_loaded"], load["least_loaded"]) == (1, pytest.approx(0.26 + 0.1 / k),
                                                                                     pytest.approx(0.24 - 0.1 / k))
    assert (load["aux_loss_first"], load["aux_loss_last"]) == pytest.approx((1.0 + 1.0 / steps[0], 1.0 + 1.0 / k))
    page = (tmp_path / "moe" / "report" / "index.html").read_text()
    assert 'data-figure="expert_load"' in page and "expert load, last step" in page
