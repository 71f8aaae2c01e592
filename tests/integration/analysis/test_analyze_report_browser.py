"""The run report in a real browser: Debian's headless Chromium (started once for the module) opens
RUN_DIR/report/index.html from disk (no server, no network): every figure draws, nothing is
fetched from elsewhere, the console stays clean; the screenshots are kept for a person to look at.

Markup planted in every field of a run directory the report shows (stage names, prompt ids,
prompts, labels, the samples' answers, data sources, the wrong-label rule's values, the summary's
stages and values, metric names, the run directory's own name) must show as the text it is: no
script runs (no dialog opens), no element gets an event handler, a javascript: link, an image or a
frame, and the page's text and plotly's drawn text hold the planted strings character for character.
"""

from __future__ import annotations

import json
import shutil

import pytest

from megatron_rl.analysis import analyze
from megatron_rl.analysis.figures import FIGURES, plot_text
from tests.integration.analysis.browser import MARKUP_PROBE, PAGE_FACTS, open_pages
from tests.unit.analysis.synthetic_run import make_run

# Each would run (or navigate) if it reached the page as markup; each says which one did.
PAYLOADS = [
    "<script>alert('script')</script>",
    "<img src=x onerror=alert('img')>",
    "</script><script>alert('close-script')</script>",
    "\"><svg onload=alert('double-quote')>",
    "'><svg onload=alert('single-quote')>",
    "<a href=\"javascript:alert('js-link')\">click</a>",
    "<iframe src=\"javascript:alert('iframe')\"></iframe>",
    "<b>bold</b> &amp; &lt;i&gt;",
]
MARK = " ".join(PAYLOADS)
# A directory name cannot hold "/": the payloads without one.
DIR_MARK = "<img src=x onerror=alert('dir')> \"'><svg onload=alert('dir-quote')>"
FIELDS = ("stage", "uid", "source", "prompt", "label", "response", "answer")


def _plant(field: str, value: str) -> str:
    return f"{value} {field}:{MARK}"


def _markup_run(root):
    """A run whose every text carries the payloads, plus the files' other values replaced by them."""
    make_run(root, prompts=60, batch=20, group=4, planted=4, hard=4, sft_steps=3, text=_plant)
    wl_path = root / "rollouts" / "wrong_labels.json"
    wl = json.loads(wl_path.read_text())
    assert wl["suspects"] and wl["sources"], "the simulation must list suspects for the tables to show"
    wl["rule"] = {k: f"rule.{k}:{MARK}" for k in wl["rule"]}
    wl["prompts_seen"] = f"prompts_seen:{MARK}"
    wl["step"] = f"step:{MARK}"
    wl_path.write_text(json.dumps(wl))
    shown = wl["suspects"][0]  # as the list holds them (the prompt shortened, the answer canonical)
    rows = [json.loads(x) for x in (root / "metrics.jsonl").read_text().splitlines()]
    with (root / "metrics.jsonl").open("w") as f:
        for r in rows:
            f.write(json.dumps({**r, f"metric:{MARK}": 1.0, "rollout/accuracy_non_truncated": f"value:{MARK}"}
                               if "grpo_step" in r else r) + "\n")
    (root / "summary.json").write_text(json.dumps({"per_stage": {f"summary-stage:{MARK}": {
        "eval/accuracy": f"summary-value:{MARK}"}}}))
    return {"uid": shown["uid"], "prompt": shown["prompt"], "label": shown["ground_truth"],
            "answer": shown["majority_answer"], "source": next(iter(wl["sources"]))}


@pytest.fixture(scope="module")
def pages(tmp_path_factory):
    """Three reports, opened in one browser: a full run, one without dumps, one full of markup."""
    base = tmp_path_factory.mktemp("report")
    full, no_dumps, marked = base / "run", base / "no_dumps", base / f"run {DIR_MARK}"
    make_run(full)
    make_run(no_dumps, prompts=40, batch=10)
    shutil.rmtree(no_dumps / "rollouts")
    listed = _markup_run(marked)
    facts = [analyze(r) for r in (full, no_dumps, marked)]
    urls = [(r / "report" / "index.html").resolve().as_uri() for r in (full, no_dumps, marked)]
    shots = [base / f"{name}.png" for name in ("report", "no_dumps", "markup")]
    opened = open_pages(urls, shots, probe=f"() => ({{page: ({PAGE_FACTS})(), markup: ({MARKUP_PROBE})()}})")
    return {"full": (facts[0], opened[0], shots[0]), "no_dumps": (facts[1], opened[1], shots[1]),
            "markup": (facts[2], opened[2], shots[2], marked, listed)}


def _clean(opened):
    assert opened["errors"] == [] and [m for m in opened["console"] if m[0] == "error"] == [], opened
    assert opened["remote"] == []  # plotly's JS came from the report directory, not a CDN


def test_analyze_report_renders_in_chromium(pages):
    facts, opened, shot = pages["full"]
    info = opened["facts"]["page"]
    assert info["title"].startswith("megatron-rl run report") and info["plotly"] == "object"
    assert info["summaryRows"] >= 10
    assert [f["id"] for f in info["figures"]] == [fid for fid, *_ in FIGURES] and info["expected"] == len(FIGURES)
    for f in info["figures"]:
        assert f["rendered"] and f["traces"] > 0 and f["points"] > 0 and f["height"] > 200, f
    _clean(opened)
    assert shot.stat().st_size > 50_000 and shot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert facts["report"].endswith("index.html") and facts["skipped"] == []


def test_analyze_report_without_dumps_still_renders(pages):
    """A run with dumps off (or none yet): every figure still draws, saying what is missing."""
    _, opened, _ = pages["no_dumps"]
    info = opened["facts"]["page"]
    assert all(f["rendered"] for f in info["figures"]) and len(info["figures"]) == len(FIGURES)
    _clean(opened)


def test_analyze_report_markup_from_the_run_dir_shows_as_text(pages):
    facts, opened, _, root, listed = pages["markup"]
    m, info = opened["facts"]["markup"], opened["facts"]["page"]
    # Nothing ran, nothing can run or load.
    assert opened["dialogs"] == [] and m["pwned"] == [], opened["dialogs"]
    assert m["handlers"] == [] and m["jsLinks"] == [] and m["embedded"] == [], m
    assert m["scripts"] == ["src:plotly.min.js"] + ["inline"] * len(FIGURES), m["scripts"]
    assert all(f["rendered"] for f in info["figures"]), info["figures"]
    _clean(opened)
    # Every planted text shows as itself: the tables, the summary, the rule's values, the title...
    text = m["text"]
    shown = {
        "stage": _plant("stage", "stage1_12"), **listed, "summary stage": f"summary-stage:{MARK}",
        "summary value": f"summary-value:{MARK}", "prompts seen": f"prompts_seen:{MARK}",
        "list's step": f"step:{MARK}", "run dir": root.name,
        **{f"rule.{k}": f"rule.{k}:{MARK}" for k in ("window", "min_samples", "agree_frac",
                                                     "suspect_max_pass_rate", "min_source_pass_rate")},
    }
    missing = [what for what, value in shown.items() if value not in text]
    assert not missing, (missing, text[:3000])
    assert all(MARK in listed[k] for k in ("uid", "label", "source")) and "<script>" in listed["prompt"]
    # ... and in plotly's drawing: stage names on the figures (legends, stage lines) ...
    assert _plant("stage", "stage2_16") in m["plotText"], m["plotText"][:2000]
    # ... and the prompt ids plotly shows on hover, given to it escaped (it reads HTML in them).
    assert any(h.endswith(plot_text(f"uid:{MARK}")) for h in m["hoverText"]), m["hoverText"][:3]
    assert facts["skipped"] == []
