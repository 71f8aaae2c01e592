"""Headless Debian Chromium through Python playwright, for the report tests.

The browser is Debian's ``chromium`` package (installed here with apt-get when missing; the tests
skip, naming the reason, when that fails); playwright's own browser downloads are never used.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import tempfile
from pathlib import Path

import pytest

CHROMIUM = "/usr/bin/chromium"
FLAGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
         "--disable-background-networking", "--disable-component-update", "--disable-sync"]


def ensure_chromium() -> str:
    """Path of Debian's chromium, installed with apt-get if needed (idempotent)."""
    if Path(CHROMIUM).exists():
        return CHROMIUM
    if shutil.which("apt-get") is None:
        pytest.skip("chromium is not installed and there is no apt-get to install it")
    env = dict(os.environ, DEBIAN_FRONTEND="noninteractive")
    sudo = [] if os.geteuid() == 0 else ["sudo", "-n"]
    install = [*sudo, "apt-get", "install", "-y", "--no-install-recommends", "chromium"]
    for attempt in range(2):  # a stale package index: update once, then retry
        out = subprocess.run(install, env=env, capture_output=True, text=True, timeout=900)
        if out.returncode == 0 and Path(CHROMIUM).exists():
            return CHROMIUM
        if attempt == 0:
            subprocess.run([*sudo, "apt-get", "update"], env=env, capture_output=True, text=True, timeout=600)
    pytest.skip(f"could not install Debian's chromium with apt-get: {out.stderr.strip()[-300:]}")


def open_page(url: str, screenshot: Path, *, width: int = 1280, height: int = 900, timeout_s: float = 60):
    """Load ``url``, wait for it to draw, screenshot the full page.

    Returns ``(page facts, console messages, page errors, requests that were not file://)``; the
    browser is closed on return.
    """
    from playwright.sync_api import sync_playwright

    console, errors, remote = [], [], []
    with tempfile.TemporaryDirectory(prefix="mrl-chromium-") as profile, sync_playwright() as pw:
        ctx = pw.chromium.launch_persistent_context(
            profile, executable_path=ensure_chromium(), headless=True, args=FLAGS,
            viewport={"width": width, "height": height}, timeout=timeout_s * 1000)
        try:
            page = ctx.new_page()
            page.on("console", lambda m: console.append((m.type, m.text)))
            page.on("pageerror", lambda e: errors.append(str(e)))
            page.on("request", lambda r: None if r.url.startswith(("file://", "data:", "about:"))
                    else remote.append(r.url))
            # "load": the page is parsed and every inline script (each figure's newPlot) has run;
            # then give plotly's asynchronous drawing time to finish (a plot that never draws
            # shows up below as not rendered).
            page.goto(url, wait_until="load", timeout=timeout_s * 1000)
            page.wait_for_load_state("networkidle", timeout=timeout_s * 1000)
            try:
                page.wait_for_function(
                    "() => [...document.querySelectorAll('.plotly-graph-div')].every("
                    "g => g.querySelector('svg.main-svg'))", timeout=timeout_s * 1000)
            except Exception:  # reported through the facts below
                pass
            facts = page.evaluate("""() => ({
                title: document.title,
                plotly: typeof window.Plotly,
                expected: Number(document.body.dataset.figures),
                figures: [...document.querySelectorAll('div.figure')].map(d => {
                    const g = d.querySelector('.plotly-graph-div');
                    return {id: d.dataset.figure,
                            rendered: !!(g && g.classList.contains('js-plotly-plot') && g.querySelector('svg.main-svg')),
                            traces: g && g.data ? g.data.length : 0,
                            points: g && g.data ? g.data.reduce((n, t) => n + ((t.x || t.values || []).length), 0) : 0,
                            height: g ? g.getBoundingClientRect().height : 0};
                }),
                summaryRows: document.querySelectorAll('table.summary tr').length,
            })""")
            page.screenshot(path=str(screenshot), full_page=True)
        finally:
            ctx.close()
    return facts, console, errors, remote
