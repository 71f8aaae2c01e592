"""The run report in a real browser: Debian's headless Chromium opens RUN_DIR/report/index.html from
disk (no server, no network), every figure draws, nothing is fetched from elsewhere, the console
stays clean; the screenshot is kept for a person to look at."""

from __future__ import annotations

import shutil

from megatron_rl.analysis import analyze
from megatron_rl.analysis.figures import FIGURES
from tests.integration.analysis.browser import open_page
from tests.unit.analysis.synthetic_run import make_run


def test_analyze_report_renders_in_chromium(tmp_path):
    run = tmp_path / "run"
    make_run(run)
    facts = analyze(run)
    shot = tmp_path / "report.png"
    info, console, errors, remote = open_page((run / "report" / "index.html").resolve().as_uri(), shot)
    assert info["title"].startswith("megatron-rl run report") and info["plotly"] == "object"
    assert info["summaryRows"] >= 10
    assert [f["id"] for f in info["figures"]] == [fid for fid, *_ in FIGURES] and info["expected"] == len(FIGURES)
    for f in info["figures"]:
        assert f["rendered"] and f["traces"] > 0 and f["points"] > 0 and f["height"] > 200, f
    assert errors == [] and [m for m in console if m[0] == "error"] == [], (errors, console)
    assert remote == []  # plotly's JS came from the report directory, not a CDN
    assert shot.stat().st_size > 50_000 and shot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert facts["report"].endswith("index.html")


def test_analyze_report_without_dumps_still_renders(tmp_path):
    """A run with dumps off (or none yet): every figure still draws, saying what is missing."""
    run = tmp_path / "run"
    make_run(run)
    shutil.rmtree(run / "rollouts")
    analyze(run)
    info, console, errors, _ = open_page((run / "report" / "index.html").resolve().as_uri(), tmp_path / "r.png")
    assert all(f["rendered"] for f in info["figures"]) and len(info["figures"]) == len(FIGURES)
    assert errors == [] and [m for m in console if m[0] == "error"] == []
