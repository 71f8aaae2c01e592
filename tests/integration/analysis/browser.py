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


# What the markup tests read from a page: anything that could run or navigate (elements with an on*
# attribute, javascript: links, scripts and embedded documents), and the text a reader sees (the
# page's, and every text plotly drew into its SVGs).
MARKUP_PROBE = """() => ({
    handlers: [...document.querySelectorAll('*')].flatMap(e => [...e.attributes]
        .filter(a => a.name.toLowerCase().startsWith('on')).map(a => e.tagName + ' ' + a.name)),
    jsLinks: [...document.querySelectorAll('*')].flatMap(e => [...e.attributes]
        .filter(a => a.value.toLowerCase().replace(/[\\s\\x00-\\x1f]/g, '').startsWith('javascript:'))
        .map(a => e.tagName + ' ' + a.name)),
    scripts: [...document.querySelectorAll('script')].map(s => s.src ? 'src:' + s.getAttribute('src') : 'inline'),
    embedded: [...document.querySelectorAll('img, iframe, object, embed, svg foreignObject, svg script, frame')]
        .map(e => e.tagName),
    pwned: window.__pwned || [],
    text: document.body.innerText,
    plotText: [...document.querySelectorAll('svg text')].map(t => t.textContent).join('\\n'),
    hoverText: [...document.querySelectorAll('.plotly-graph-div')].flatMap(g => (g.data || [])
        .flatMap(t => [].concat(t.hovertext || []))),
})"""

PAGE_FACTS = """() => ({
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
})"""


def open_pages(urls: list[str], screenshots: list[Path] | None = None, *, probe: str = PAGE_FACTS,
               width: int = 1280, height: int = 900, timeout_s: float = 60) -> list[dict]:
    """Load each of ``urls`` in one browser (started once), wait for it to draw, evaluate ``probe``
    on it and (when given) screenshot the full page.

    Per page: ``{"facts": probe's result, "console": messages, "errors": page errors, "remote":
    requests that were not file://, "dialogs": alert/confirm/prompt messages}``. A script that runs
    and opens a dialog is recorded and dismissed; the browser is closed on return."""
    from playwright.sync_api import sync_playwright

    out = []
    with tempfile.TemporaryDirectory(prefix="mrl-chromium-") as profile, sync_playwright() as pw:
        ctx = pw.chromium.launch_persistent_context(
            profile, executable_path=ensure_chromium(), headless=True, args=FLAGS,
            viewport={"width": width, "height": height}, timeout=timeout_s * 1000)
        try:
            for i, url in enumerate(urls):
                console, errors, remote, dialogs = [], [], [], []
                page = ctx.new_page()
                page.on("console", lambda m, c=console: c.append((m.type, m.text)))
                page.on("pageerror", lambda e, c=errors: c.append(str(e)))
                page.on("request", lambda r, c=remote: None if r.url.startswith(("file://", "data:", "about:"))
                        else c.append(r.url))
                page.on("dialog", lambda d, c=dialogs: (c.append(d.message), d.dismiss()))
                # "load": the page is parsed and every inline script (each figure's newPlot) has run;
                # then give plotly's asynchronous drawing time to finish (a plot that never draws
                # shows up below as not rendered).
                page.goto(url, wait_until="load", timeout=timeout_s * 1000)
                try:  # (a page that keeps loading, e.g. planted frames, is judged by its facts)
                    page.wait_for_load_state("networkidle", timeout=timeout_s * 1000 / 4)
                except Exception:
                    pass
                try:
                    page.wait_for_function(
                        "() => [...document.querySelectorAll('.plotly-graph-div')].every("
                        "g => g.querySelector('svg.main-svg'))", timeout=timeout_s * 1000)
                except Exception:  # reported through the facts
                    pass
                facts = page.evaluate(probe)
                if screenshots:
                    page.screenshot(path=str(screenshots[i]), full_page=True)
                page.close()
                out.append({"facts": facts, "console": console, "errors": errors, "remote": remote,
                            "dialogs": dialogs})
        finally:
            ctx.close()
    return out


def open_page(url: str, screenshot: Path, *, width: int = 1280, height: int = 900, timeout_s: float = 60):
    """One page (:func:`open_pages`): ``(page facts, console messages, page errors, requests that
    were not file://)``."""
    r = open_pages([url], [screenshot], width=width, height=height, timeout_s=timeout_s)[0]
    return r["facts"], r["console"], r["errors"], r["remote"]
